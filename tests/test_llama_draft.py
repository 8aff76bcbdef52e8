"""DFlash drafts in llama.cpp's GGUF layout (arch `dflash`), checked against llama.cpp's own gguf-py.

llama.cpp's gguf-py (constants, tensor map, writer) comes from the llama-cpp-python 0.3.36 sdist, the
commit whose `--spec-type draft-dflash` runs these files, and runs in a subprocess (it is the `gguf`
package there; the installed one lacks the dflash arch). Its writer, driven as its convert_hf_to_gguf.py
DFlashModel drives it, writes a draft independently of flashtree's writer; flashtree must load that file
and its own conversion as the z-lab safetensors directory, tensors bit for bit and proposals exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flashtree.cli import app
from flashtree.convert.hf import convert_checkpoint
from flashtree.defaults import cache_dir, default_draft_path
from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import open_gguf
from flashtree.gguf.writer import write_gguf
from flashtree.models.config import DRAFT_ARCH
from flashtree.models.dflash import _gguf_tensors, _zlab_tensors, load_draft
from flashtree.models.loader import load_target
from tests.pypi_files import LLAMA_CPP_SDIST, pypi_file
from tests.spec_util import random_draft_dir, sliding_draft_dir
from tests.tiny import tiny_gguf

# What llama.cpp's converter does for a z-lab draft (conversion/qwen.py DFlashModel over Qwen3Model and
# base.py TextModel.set_gguf_parameters), with the target's tokenizer passed in as JSON.
LLAMA_CPP_WRITER = r"""
import json, sys
import gguf
from safetensors.torch import load_file

spec = json.loads(sys.argv[1])
src = spec["src"]
cfg = json.load(open(src + "/config.json"))
dflash = cfg["dflash_config"]
n = cfg["num_hidden_layers"]
w = gguf.GGUFWriter(spec["out"], gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DFLASH])
w.add_block_count(n)
w.add_context_length(cfg["max_position_embeddings"])
w.add_embedding_length(cfg["hidden_size"])
w.add_feed_forward_length(cfg["intermediate_size"])
w.add_head_count(cfg["num_attention_heads"])
w.add_head_count_kv(cfg["num_key_value_heads"])
w.add_rope_freq_base(cfg["rope_theta"])
w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
w.add_key_length(cfg["head_dim"])
w.add_value_length(cfg["head_dim"])
w.add_file_type(gguf.LlamaFileType.ALL_F32)
w.add_block_size(cfg["block_size"])
w.add_target_layers([i + 1 for i in dflash["target_layer_ids"]])
if cfg.get("use_sliding_window"):
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
w.add_tokenizer_model("gpt2")
w.add_token_list(spec["tokens"])
w.add_token_types(spec["token_types"])
w.add_token_merges(spec["merges"])
w.add_mask_token_id(dflash["mask_token_id"])
names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DFLASH, n)
for name, t in load_file(src + "/model.safetensors").items():
    w.add_tensor(names.get_name("model." + name, try_suffixes=(".weight", ".bias")), t.float().numpy())
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
"""

# llama.cpp's names for what flashtree writes: its gguf-py constants for arch dflash.
LLAMA_CPP_NAMES = r"""
import json
import gguf

arch = gguf.MODEL_ARCH.DFLASH
name = gguf.MODEL_ARCH_NAMES[arch]
keys = set()
for group in [g for g in vars(gguf.Keys).values() if isinstance(g, type)]:
    for key in vars(group).values():
        if isinstance(key, str) and "{arch}" in key and key.count("{") == 1:
            keys.add(key.format(arch=name))
tensors = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}  # blk.{bid}.attn_q, fc, ...
print(json.dumps({"arch": name, "keys": sorted(keys), "mask": gguf.Keys.Tokenizer.MASK_ID,
                  "tensors": sorted(tensors)}))
"""


@functools.cache
def llama_cpp_gguf_py() -> Path:
    """The folder holding llama.cpp's `gguf` package, extracted once from the sdist."""
    out = cache_dir() / "llama-cpp-gguf-py-0.3.36"
    if not (out / "gguf" / "constants.py").is_file():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        with tarfile.open(pypi_file(*LLAMA_CPP_SDIST)) as tar:
            for member in tar:
                parts = Path(member.name).parts
                if member.isfile() and parts[-3:-1] == ("gguf-py", "gguf") and member.name.endswith(".py"):
                    dest = tmp / "gguf" / parts[-1]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(tar.extractfile(member).read())
        os.replace(tmp, out)
    return out


def run_llama_cpp_python(code: str, *args: str) -> str:
    env = os.environ | {"PYTHONPATH": str(llama_cpp_gguf_py())}
    cmd = [sys.executable, "-c", code, *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def qwen3(tiny_root):
    gguf = tiny_gguf("qwen3", 0, tiny_root)
    target, _ = load_target(gguf, device="cpu", dtype=torch.float32)
    return gguf, target


def draft_dir(gguf, tiny_root, sliding: bool) -> Path:
    return sliding_draft_dir(gguf, tiny_root) if sliding else random_draft_dir(gguf, tiny_root, layers=2)


def check_same_draft(src: Path, path: Path, target) -> None:
    """The GGUF `path` holds the z-lab draft `src`: the same config (less the target depth llama.cpp's
    layout does not record), the same tensors bit for bit, and the same logits and draft tokens, exactly."""
    zlab, gguf = _zlab_tensors(src), _gguf_tensors(path)
    assert gguf.config == dataclasses.replace(zlab.config, n_target_layers=None)
    a, b = zlab.read(), gguf.read()
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert b[name].dtype == torch.float32 and torch.equal(b[name], t.float()), name
    drafts = [load_draft(p, target) for p in (src, path)]
    ids = torch.randint(0, target.config.vocab, (40,), generator=torch.Generator().manual_seed(1))
    feats = target(ids, target.new_state(256), logits="none", capture=zlab.config.target_layer_ids).features
    logits = []
    for draft in drafts:
        ctx = draft.new_context(4096)
        draft.append_context(ctx, feats[:-1])
        logits.append(draft.propose(ctx, ids[-1], 16))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_converted_draft_is_the_safetensors_draft(qwen3, tiny_root, sliding):
    gguf, target = qwen3
    src = draft_dir(gguf, tiny_root, sliding)
    out = tiny_root / f"converted-{sliding}.gguf"
    convert_checkpoint(src, out, "f32", target=gguf)
    with open_gguf(out) as g, open_gguf(gguf) as t:
        assert g.arch == "dflash"
        assert g.get("tokenizer.ggml.tokens") == t.get("tokenizer.ggml.tokens")  # llama.cpp needs it
    check_same_draft(src, out, target)


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_llama_cpp_written_draft_loads_as_the_safetensors_draft(qwen3, tiny_root, sliding):
    gguf, target = qwen3
    src = draft_dir(gguf, tiny_root, sliding)
    out = tiny_root / f"llama-cpp-{sliding}.gguf"
    with open_gguf(gguf) as t:
        tokenizer = {k: t.get(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type", "merges")}
    spec = dict(src=str(src), out=str(out), tokens=tokenizer["tokens"], merges=tokenizer["merges"])
    run_llama_cpp_python(LLAMA_CPP_WRITER, json.dumps(spec | {"token_types": tokenizer["token_type"]}))
    check_same_draft(src, out, target)


def test_written_names_are_llama_cpp_constants(qwen3, tiny_root):
    """Every key and tensor name flashtree writes for a draft is llama.cpp's for arch dflash."""
    gguf, _ = qwen3
    out = tiny_root / "names.gguf"
    convert_checkpoint(sliding_draft_dir(gguf, tiny_root), out, "f32", target=gguf)
    names = json.loads(run_llama_cpp_python(LLAMA_CPP_NAMES))
    with open_gguf(out) as g:
        assert g.arch == names["arch"]
        keys = {k for k in g.metadata if not k.startswith(("general.", "tokenizer."))}
        tensors = {re.sub(r"^blk\.\d+\.", "blk.{bid}.", n).removesuffix(".weight") for n in g.tensors}
    assert keys <= set(names["keys"]), keys - set(names["keys"])
    for key in ("dflash.block_size", "dflash.target_layers", "dflash.attention.sliding_window_pattern"):
        assert key in keys
    assert names["mask"] == "tokenizer.ggml.mask_token_id"
    assert tensors <= set(names["tensors"]), tensors - set(names["tensors"])
    assert {"fc", "enc.output_norm", "output_norm"} <= tensors


def test_older_layout_still_loads(qwen3, tiny_root):
    """flashtree's earlier `dflash-draft` GGUFs: read as before, and `convert` rewrites one byte for byte."""
    gguf, target = qwen3
    src = sliding_draft_dir(gguf, tiny_root)
    draft = _zlab_tensors(src)
    old = tiny_root / "old-layout.gguf"
    cfg = draft.config
    tensors = ((name, t, 0) for name, t in draft.read().items())
    write_gguf(old, DRAFT_ARCH, {"general.name": "old"} | cfg.gguf_metadata(), tensors, progress=False)
    assert _gguf_tensors(old).config == cfg  # the old layout records the target's depth
    new = tiny_root / "old-rewritten.gguf"
    convert_checkpoint(old, new, "f32", target=gguf)
    check_same_draft(src, new, target)
    with open_gguf(old) as a, open_gguf(new) as b:
        renamed = {"hidden_norm.weight": "enc.output_norm.weight"}
        for name in a.tensors:
            assert bytes(a.raw(name)) == bytes(b.raw(renamed.get(name, name))), name


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dflash.attention.causal": True}, "dflash.attention.causal"),
        ({"dflash.logit_scale": 2.0}, "dflash.logit_scale"),
        ({"dflash.hidden_activation": "gelu"}, "dflash.hidden_activation"),
        ({"dflash.target_layers": [0, 2]}, "token embeddings"),
        ({"tokenizer.ggml.mask_token_id": None}, "tokenizer.ggml.mask_token_id"),
    ],
    ids=["causal", "logit-scale", "gelu", "embedding-layer", "no-mask"],
)
def test_llama_cpp_variants_flashtree_does_not_run_are_refused(qwen3, tiny_root, change, message):
    gguf, target = qwen3
    good = tiny_root / "variant-base.gguf"
    if not good.exists():
        convert_checkpoint(random_draft_dir(gguf, tiny_root, layers=2), good, "f32", target=gguf)
    bad = tiny_root / f"variant-{message.replace(' ', '_')}.gguf"
    with open_gguf(good) as g:
        metadata = {k: v for k, v in g.metadata.items() if k != "general.architecture"} | change
        metadata = {k: v for k, v in metadata.items() if v is not None}
        tensors = [(n, g.raw(n).reshape(*t.shape[:-1], -1), t.qtype) for n, t in g.tensors.items()]
        write_gguf(bad, "dflash", metadata, tensors, progress=False)
    with pytest.raises(FlashtreeError, match=message) as info:
        load_draft(bad, target)
    assert "\n" not in str(info.value)


def test_shipped_draft_is_in_llama_cpp_layout():
    """What llama.cpp's draft-dflash reads of the shipped draft: arch, block size, the target layers'
    inputs (z-lab's 1, 8, 14, 20, 27 + 1), the mask token and the SmolLM2 tokenizer it reads it through."""
    with open_gguf(default_draft_path()) as g:
        assert g.arch == "dflash"
        assert g.get("dflash.block_size") == 16
        assert g.get("dflash.target_layers") == [2, 9, 15, 21, 28]
        assert g.get("tokenizer.ggml.mask_token_id") == 49151
        assert g.get("tokenizer.ggml.model") == "gpt2" and len(g.get("tokenizer.ggml.tokens")) == 49152
        assert g.has("enc.output_norm.weight") and not g.has("hidden_norm.weight")


def test_synth_draft_for_writes_llama_cpp_layout(qwen3, tiny_root):
    """`synth --draft-for T OUT.gguf`: the random draft of the z-lab directory the same seed writes, in
    llama.cpp's layout with the target's tokenizer."""
    gguf, target = qwen3
    out = tiny_root / "synth-draft.gguf"
    result = CliRunner().invoke(app, ["synth", "--draft-for", str(gguf), "--layers", "2", str(out)])
    assert result.exit_code == 0 and f"{out} (" in result.output, result.output
    with open_gguf(out) as g, open_gguf(gguf) as t:
        assert g.arch == "dflash" and g.get("tokenizer.ggml.tokens") == t.get("tokenizer.ggml.tokens")
    check_same_draft(random_draft_dir(gguf, tiny_root, layers=2), out, target)
