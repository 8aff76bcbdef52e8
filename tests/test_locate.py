"""Models found where users keep them (gguf/locate.py): fake Hugging Face cache, Ollama store and LM Studio
folder built here, names resolved to their files, `flashtree models` listing them, and the errors."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.errors import FlashtreeError
from flashtree.gguf.locate import find_models, gguf_header, resolve_model, size_text
from flashtree.gguf.writer import write_gguf
from flashtree.quant.formats import QT
from flashtree.quant.recipe import FILE_TYPES
from flashtree.settings import model_stores
from tests.tiny import tiny_gguf


def small_gguf(path: Path, arch: str = "llama", type: str = "q4_k_m") -> Path:
    """A GGUF whose header says `arch` and `type`, with a token list to skip before general.file_type."""
    metadata = {"tokenizer.ggml.tokens": [f"t{i}" for i in range(300)], "general.file_type": FILE_TYPES[type]}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(path, arch, metadata, [("x.weight", np.ones((2, 32), np.float32), QT.F32)], progress=False)
    return path


def hf_file(hub: Path, repo: str, label: str, source: Path, commit: str = "c0ffee") -> Path:
    """`source` stored as huggingface_hub stores a download: a blob, a snapshot link to it, refs/main."""
    root = hub / f"models--{repo.replace('/', '--')}"
    data = source.read_bytes()
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = root / "snapshots" / commit / label
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return link


def ollama_model(models: Path, name: str, tag: str, source: Path, namespace: str = "library") -> Path:
    data = source.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blob = models / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    layers = [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)},
    ]
    manifest = models / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """A home with all three stores; HOME, HF_HOME and OLLAMA_MODELS point at them, as a user's would."""
    home, src = tmp_path / "home", tmp_path / "src"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    hub = tmp_path / "hf" / "hub"
    q4, q8 = small_gguf(src / "m-Q4_K_M.gguf"), small_gguf(src / "m-Q8_0.gguf", "qwen3", "q8_0")
    files = {
        "hf_q4": hf_file(hub, "bartowski/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf", q4),
        "hf_q8": hf_file(hub, "bartowski/Qwen3-8B-GGUF", "Qwen3-8B-Q8_0.gguf", q8),
        "hf_one": hf_file(hub, "someone/tiny-GGUF", "tiny.Q4_K_M.gguf", q4),
        "ollama": ollama_model(tmp_path / "ollama", "qwen3", "8b", q8),
        "ollama_latest": ollama_model(tmp_path / "ollama", "qwen3", "latest", q4),
        "lms": small_gguf(home / ".lmstudio/models/lmstudio-community/Qwen3-8B-GGUF/Qwen3-8B-Q4_K_M.gguf"),
        "lms_old": small_gguf(
            home / ".cache/lm-studio/models/TheBloke/Llama-GGUF/llama.Q8_0.gguf", "llama", "q8_0"
        ),
    }
    small_gguf(
        home / ".lmstudio/models/lmstudio-community/Qwen3-8B-GGUF/mmproj-Qwen3-8B-F16.gguf", "clip", "f16"
    )
    draft = tmp_path / "zlab"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps({"architectures": ["DFlashDraftModel"], "dtype": "bfloat16"})
    )
    (draft / "model.safetensors").write_bytes(b"\0" * 16)
    for name in ("config.json", "model.safetensors"):
        files["hf_draft"] = hf_file(hub, "z-lab/Qwen3-8B-DFlash-b16", name, draft / name).parent
    return files


def test_the_stores_come_from_the_tools_own_variables(tmp_path):
    stores = model_stores({"HOME": "/h"})
    assert stores.hf_hub == Path("/h/.cache/huggingface/hub")
    assert stores.ollama == (Path("/h/.ollama/models"), Path("/usr/share/ollama/.ollama/models"))
    assert stores.lmstudio == (Path("/h/.lmstudio/models"), Path("/h/.cache/lm-studio/models"))
    assert model_stores({"HOME": "/h", "XDG_CACHE_HOME": "/x"}).hf_hub == Path("/x/huggingface/hub")
    assert model_stores({"HOME": "/h", "HF_HOME": "/hf"}).hf_hub == Path("/hf/hub")
    assert model_stores({"HOME": "/h", "HF_HOME": "/hf", "HF_HUB_CACHE": "/c"}).hf_hub == Path("/c")
    assert model_stores({"HOME": "/h", "OLLAMA_MODELS": "/o"}).ollama == (Path("/o"),)


def test_names_resolve_to_their_files(stores, tmp_path):
    assert resolve_model("bartowski/Qwen3-8B-GGUF:Q4_K_M") == stores["hf_q4"]
    assert resolve_model("bartowski/qwen3-8b-gguf:q8_0") == stores["hf_q8"]  # hub ids ignore case
    assert resolve_model("bartowski/Qwen3-8B-GGUF:Qwen3-8B-Q8_0.gguf") == stores["hf_q8"]
    assert resolve_model("someone/tiny-GGUF") == stores["hf_one"]  # a repo's only GGUF needs no selector
    assert resolve_model("z-lab/Qwen3-8B-DFlash-b16") == stores["hf_draft"]  # a safetensors draft: its dir
    assert resolve_model("ollama:qwen3:8b") == stores["ollama"]
    assert resolve_model("ollama:qwen3") == stores["ollama_latest"]
    assert resolve_model("lmstudio:lmstudio-community/Qwen3-8B-GGUF") == stores["lms"]  # mmproj aside
    assert resolve_model("lmstudio:TheBloke/Llama-GGUF:Q8_0") == stores["lms_old"]
    assert resolve_model(stores["lms"]) == stores["lms"]  # a path is itself
    assert resolve_model(tmp_path / "missing.gguf") == tmp_path / "missing.gguf"  # the loader says no file


@pytest.mark.parametrize(
    "name, message",
    [
        ("bartowski/Qwen3-8B-GGUF", r"ambiguous: 2 files; name one: bartowski/Qwen3-8B-GGUF:Qwen3-8B-Q4_K_M"),
        ("bartowski/Qwen3-8B-GGUF:Q4_K", r"no file of bartowski/Qwen3-8B-GGUF matches 'Q4_K' \(it has: "),
        ("nobody/Nothing-GGUF", r"no such file, and the Hugging Face cache \(.*hub\) has no nobody/Nothing"),
        (
            "ollama:llama3:8b",
            r"no such model in Ollama's store .*it has: ollama:qwen3:8b, ollama:qwen3:latest",
        ),
        ("ollama:qwen3:4b", r"it has: ollama:qwen3:8b, ollama:qwen3:latest\)"),
        ("lmstudio:x/y", r"LM Studio's models folder .* has no x/y \(it has: lmstudio:TheBloke/Llama-GGUF, "),
    ],
)
def test_a_name_that_finds_nothing_or_several_lists_the_candidates(stores, name, message):
    with pytest.raises(FlashtreeError, match=message):
        resolve_model(name)


def test_an_ollama_manifest_without_its_blob_is_named(stores, tmp_path):
    stores["ollama"].unlink()
    with pytest.raises(
        FlashtreeError, match=r"manifests/registry.ollama.ai/library/qwen3/8b: its model layer"
    ):
        resolve_model("ollama:qwen3:8b")


def test_the_header_is_read_only_up_to_the_keys(tmp_path):
    path = small_gguf(tmp_path / "a.gguf", "qwen3", "q8_0")
    assert gguf_header(path) == {"general.architecture": "qwen3", "general.file_type": FILE_TYPES["q8_0"]}
    (tmp_path / "b.gguf").write_bytes(b"not a gguf at all, just text")
    assert gguf_header(tmp_path / "b.gguf") == {}
    (tmp_path / "c.gguf").write_bytes(path.read_bytes()[:100])  # cut inside the metadata
    assert gguf_header(tmp_path / "c.gguf") == {"general.architecture": "qwen3"}


def test_flashtree_models_lists_every_store(stores):
    listed = {m.name: m for m in find_models()}
    assert set(listed) == {
        "bartowski/Qwen3-8B-GGUF:Qwen3-8B-Q4_K_M.gguf",
        "bartowski/Qwen3-8B-GGUF:Qwen3-8B-Q8_0.gguf",
        "someone/tiny-GGUF",
        "z-lab/Qwen3-8B-DFlash-b16",
        "ollama:qwen3:8b",
        "ollama:qwen3:latest",
        "lmstudio:lmstudio-community/Qwen3-8B-GGUF:Qwen3-8B-Q4_K_M.gguf",
        "lmstudio:lmstudio-community/Qwen3-8B-GGUF:mmproj-Qwen3-8B-F16.gguf",
        "lmstudio:TheBloke/Llama-GGUF",
    }
    for name, m in listed.items():
        assert resolve_model(name) == m.path  # every listed name is one --target takes
    q8 = listed["ollama:qwen3:8b"]
    assert (q8.arch, q8.quant, q8.size) == ("qwen3", "Q8_0", q8.path.stat().st_size)
    assert (listed["z-lab/Qwen3-8B-DFlash-b16"].arch, listed["z-lab/Qwen3-8B-DFlash-b16"].quant) == (
        "DFlashDraftModel",
        "bfloat16",
    )

    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["someone/tiny-GGUF"] == {
        "name": "someone/tiny-GGUF", "arch": "llama", "size": stores["hf_one"].stat().st_size,
        "quant": "Q4_K_M", "path": str(stores["hf_one"]),
    }  # fmt: skip
    table = CliRunner().invoke(app, ["models"])
    assert table.exit_code == 0, table.output
    line = next(line for line in table.output.splitlines() if line.split()[:1] == ["ollama:qwen3:8b"])
    assert line.split() == ["ollama:qwen3:8b", "qwen3", *size_text(q8.size).split(), "Q8_0", str(q8.path)]


def test_flashtree_models_with_no_stores_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0 and result.output.startswith(f"no models found in {tmp_path / 'hub'}, ")


def test_flashtree_run_takes_an_ollama_name(stores, tiny_root, tmp_path):
    """End to end: the name a user knows from `ollama list` runs, and a wrong one fails before a load."""
    gguf = tiny_gguf("llama", 0, tiny_root)
    shutil.copy(gguf, stores["ollama"])  # the blob is the GGUF
    argv = ["run", "-p", "Hi", "--target", "ollama:qwen3:8b", "--draft", "none", "-n", "3", "--json"]
    result = CliRunner().invoke(app, [*argv, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["token_ids"]) > 0
    wrong = CliRunner().invoke(app, ["run", "-p", "Hi", "--target", "ollama:qwen9", "--device", "cpu"])
    assert wrong.exit_code == 1 and wrong.output.startswith("error: ollama:qwen9: no such model")
