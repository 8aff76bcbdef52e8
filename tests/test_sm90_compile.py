"""Every decode-path Triton kernel, as decode steps launch it, compiled for an H200 (sm_90) on the CPU.

Under TRITON_INTERPRET=1 the kernels run their CPU form: no PDL wait or prefetch (GDC false) and the
integer emulations instead of inline PTX (ASM false). Their GPU form compiles only on the device, where a
mistake costs device time. So the launches of a packed tiny qwen35's prefill, AR steps and tree steps
(with a draft), of the dense fp32 kernel and of the quantized matmuls of every type and arithmetic are
recorded under the interpreter, and each distinct
kernel configuration is compiled for sm_90 with its GPU switches on (GDC, ASM) in a process without the
interpreter (ptxas ships with Triton)."""

import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from spec_util import generate, random_draft
from triton.runtime.interpreter import InterpretedFunction

from flashtree import kernels
from flashtree.convert.synth import synth_model
from flashtree.kernels import dense_matmul, fp8, qmatmul
from flashtree.kernels.tree_deltanet import tree_gated_delta_rule
from flashtree.models.loader import load_target
from flashtree.quant.pack import random_blocks

POINTEE = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip
GPU_SWITCHES = ("GDC", "ASM")  # constexprs the interpreter runs false and the device true
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def launch_record(fn, args: tuple, kwargs: dict) -> dict:
    """A launch as the compiler takes it: argument types, constexpr values, compile options."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    constexprs = {n: bound[n] for n, p in params.items() if "constexpr" in str(p.annotation)}
    return {
        "module": fn.__module__, "name": fn.__name__,
        "signature": {n: arg_type(v) for n, v in bound.items() if n not in constexprs},
        "constexprs": constexprs, "options": {k: kwargs[k] for k in OPTIONS if k in kwargs},
    }  # fmt: skip


# Compiles each record (JSON on stdin) with the switches in argv[1] on, and reports what its PTX does
# before and after griddepcontrol.wait, or why it did not compile.
COMPILE = """
import importlib, inspect, json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

report = []
for rec in json.load(sys.stdin):
    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    names = list(inspect.signature(fn.fn).parameters)
    const = rec["constexprs"] | {k: True for k in json.loads(sys.argv[1]) if k in names}
    sig = rec["signature"] | {k: "constexpr" for k in const}
    try:
        src = ASTSource(fn, sig, {(names.index(k),): v for k, v in const.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rec["options"]).asm["ptx"]
    except Exception:
        report.append({"name": rec["name"], "failure": traceback.format_exc(limit=3)[-1500:]})
        continue
    before, wait, after = ptx.partition("griddepcontrol.wait")
    prefetch = "prefetch.global.L2"
    report.append({
        "name": rec["name"], "failure": None, "waits": bool(wait), "loads_before": before.count("ld.global"),
        "prefetch_before": before.count(prefetch), "prefetch_after": after.count(prefetch),
    })
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def decode_launches(tmp_path_factory, tiny_root) -> list[dict]:
    """Every distinct launch of prefill, AR and tree decoding of a packed tiny qwen35 (DeltaNet and gated
    attention layers) with a random draft, and of the dense kernel, with every decode kernel on."""
    records: dict[str, dict] = {}
    real_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        record = launch_record(self.fn, args, kwargs)
        records.setdefault(json.dumps(record, sort_keys=True), record)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    path = tmp_path_factory.mktemp("sm90") / "tiny-qwen35.gguf"
    synth_model("tiny-qwen35", "q4_k_m", path, seed=5)
    target, _ = load_target(path, device="cpu", quantized=True)
    draft = random_draft(path, target, tiny_root, layers=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(InterpretedFunction, "run", recording_run)
        mp.setattr(kernels, "triton_kernels_for", lambda x: True)
        prompt = torch.randint(
            0, target.config.vocab, (3,), generator=torch.Generator().manual_seed(5)
        ).tolist()
        for mode in ("ar", "tree"):
            generate(target, draft if mode == "tree" else None, prompt, 2, mode=mode, block_size=4, budget=6)
        for rows in (1, 5):
            dense_matmul.dense_linear(torch.randn(rows, 96), torch.randn(80, 96))
        for qtype in sorted(qmatmul.KERNEL_TYPES):  # the types a q4_k_m model does not have too
            raw = torch.from_numpy(random_blocks(qtype, 16, 256, np.random.default_rng(qtype)))
            fields = qmatmul.repack(raw, qtype, 256)
            for rows, arithmetic in ((1, "int8"), (3, "int8"), (1, "bf16")):
                qmatmul.quant_matmul(torch.randn(rows, 256), fields, qtype, 16, 256, arithmetic)
        fp8.quantize_rows(torch.randn(3, 96).bfloat16())  # an fp8 draft's activations
        for tile in ((16, 2), (8, 1)):  # FLASHTREE_DELTA_TILE choices
            nk, nv, kd, vd = 1, 2, 16, 16
            x, ab, state = (
                torch.randn(2, 2 * nk * kd + nv * vd),
                torch.randn(2, 2 * nv),
                torch.randn(nv, kd, vd),
            )
            parents = torch.tensor([-1, 0], dtype=torch.int32)
            tree_gated_delta_rule(
                x, ab[:, :nv], ab[:, nv:], torch.randn(nv), -torch.rand(nv), state, parents, nk, tile=tile
            )
    return list(records.values())


@pytest.fixture(scope="module")
def sm90(decode_launches) -> list[dict]:
    """Each recorded launch compiled for sm_90 with GDC and ASM on: its PTX facts, or its failure."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, json.dumps(GPU_SWITCHES)], input=json.dumps(decode_launches), env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_decode_kernel_compiles_for_sm90(decode_launches, sm90):
    names = {r["name"] for r in decode_launches}
    # the kernels of a qwen35 decode step and a tree step, at least
    assert {
        "_matvec_kernel",
        "_matmul_kernel",
        "_dense_kernel",
        "_rms_norm_kernel",
        "_ddtree_kernel",
        "_quantize_rows_kernel",
        "_tree_gated_delta_rule_kernel",
    } <= names
    failures = [f"{r['name']}:\n{r['failure']}" for r in sm90 if r["failure"]]
    assert not failures, "\n".join(failures)


def test_under_pdl_nothing_is_read_before_the_wait(sm90):
    """PDL lets a kernel start before the one ahead of it has finished (kernels/launch.py): every decode
    kernel waits, and loads nothing before it waits. Only the weight-streaming kernels (the M = 1
    quantized matvec, the dense fp32 kernel) touch memory before, with prefetches of their constant
    weights, and with none after (FLASHTREE_PREFETCH)."""
    for r in sm90:
        assert r["waits"] and r["loads_before"] == 0, r
        streams_weights = r["name"] in ("_matvec_kernel", "_dense_kernel")
        assert (r["prefetch_before"] > 0) == streams_weights and r["prefetch_after"] == 0, r
