"""Our Triton kernels compiled for an H200 (sm_90) on a machine without a GPU: the tests' check that every
decode kernel compiles and waits before it reads (tests/test_sm90_compile.py), and
benchmarks/sm90_registers.py's registers and spills per tile.

Under TRITON_INTERPRET=1 a kernel runs its CPU form (GDC and ASM false). `recording` notes each launch the
interpreter runs (argument types, constexprs, compile options, the JIT's specializations: integers of 1,
16-divisible integers and addresses); `compile_for_sm90` compiles the records in processes without the
interpreter (one a CPU), with the GPU switches on, and reports what each PTX does around griddepcontrol.wait
and, with `registers`, what Triton's own ptxas says of registers and spills.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from flashtree import settings

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


def launch_record(fn, args: tuple, kwargs: dict, unspecialized: tuple = ()) -> dict:
    """A launch as the compiler takes it: argument types, constexpr values, compile options, and what
    the JIT would specialize on a GPU (all but the `unspecialized` arguments, names or indices): an
    integer 1 becomes the constant 1, and integers and tensor addresses divisible by 16 are compiled
    with that divisibility ("aligned"; without it vector loads compile to byte and word loads)."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    constexprs = {n: bound[n] for n, p in params.items() if "constexpr" in str(p.annotation)}
    names = list(params)
    kept = {names[u] if isinstance(u, int) else u for u in unspecialized}
    free = {n for n in bound if n not in constexprs} - kept
    integers = {n for n in free if isinstance(bound[n], int) and not isinstance(bound[n], bool)}
    constexprs |= {n: 1 for n in integers if bound[n] == 1}
    aligned = [
        n for n in sorted(free - set(constexprs))
        if (n in integers and bound[n] % 16 == 0)
        or (isinstance(bound[n], torch.Tensor) and bound[n].data_ptr() % 16 == 0)
    ]  # fmt: skip
    return {
        "module": fn.__module__, "name": fn.__name__,
        "signature": {n: arg_type(v) for n, v in bound.items() if n not in constexprs},
        "constexprs": constexprs, "aligned": aligned,
        "options": {k: kwargs[k] for k in OPTIONS if k in kwargs},
    }  # fmt: skip


@contextlib.contextmanager
def recording() -> Iterator[list[dict]]:
    """Inside: every distinct kernel launch the interpreter runs is appended to the yielded list."""
    from triton.runtime.interpreter import InterpretedFunction

    records: dict[str, dict] = {}
    found: list[dict] = []
    real_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        record = launch_record(self.fn, args, kwargs, tuple(self.kwargs.get("do_not_specialize") or ()))
        key = json.dumps(record, sort_keys=True)
        if key not in records:
            records[key] = record
            found.append(record)
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield found
    finally:
        InterpretedFunction.run = real_run


# Compiles each record (JSON on stdin) with the switches in argv[1] on; reports what its PTX does before
# and after griddepcontrol.wait, or why it did not compile; with "registers" among argv[2]'s words (comma-
# separated), ptxas -v's registers and spill bytes too; with "sass", its SASS instructions per opcode.
_COMPILE = """
import collections, importlib, inspect, json, pathlib, re, subprocess, sys, tempfile, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def ptxas_facts(ptx):
    bin_dir = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin"
    out = ""
    for tool in sorted(bin_dir.glob("ptxas*")):  # Triton's own; the one that reads this PTX version
        with tempfile.TemporaryDirectory() as tmp:
            src = pathlib.Path(tmp) / "k.ptx"
            src.write_text(ptx)
            args = [str(tool), "--gpu-name", "sm_90a", "-v", str(src), "-o", str(src) + ".cubin"]
            out = subprocess.run(args, capture_output=True, text=True).stderr
        if "Used" in out:
            break
    regs = re.search(r"Used (\\d+) registers", out)
    spills = re.search(r"(\\d+) bytes spill stores", out)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) if spills else None}

def sass_opcodes(cubin):
    # instructions per opcode (its first word; PRMT also by its selector) in the whole kernel, in its
    # longest loop (a label and the last branch back to it) and in its longest loop that issues cp.async
    # copies (LDGSTS: a software-pipelined loop; {} if none), by Triton's nvdisasm
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        nvdisasm = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
        sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True).stdout
    ops, labels, loops = [], {}, [(0, 0)]
    for line in sass.splitlines():
        label = re.match(r"^(\\.L_x_\\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
        found = re.match(r"^\\s+/\\*[0-9a-f]+\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_]*)\\S*\\s*(.*)", line)
        if not found:
            continue
        op, rest = found.group(1), found.group(2)
        if op == "PRMT":
            op += " " + rest.split(",")[2].strip()
        ops.append(op)
        back = re.search(r"BRA `\\((\\.L_x_\\d+)\\)", line)
        if back and back.group(1) in labels:
            loops.append((labels[back.group(1)], len(ops)))
    loops.sort(key=lambda span: span[0] - span[1])  # longest first
    copying = [(a, z) for a, z in loops if "LDGSTS" in ops[a:z]] + [(0, 0)]
    return {"kernel": collections.Counter(ops), "loop": collections.Counter(ops[slice(*loops[0])]),
            "pipelined_loop": collections.Counter(ops[slice(*copying[0])])}

report = []
for rec in json.load(sys.stdin):
    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    names = list(inspect.signature(fn.fn).parameters)
    const = rec["constexprs"] | {k: True for k in json.loads(sys.argv[1]) if k in names}
    sig = rec["signature"] | {k: "constexpr" for k in const}
    try:
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in rec["aligned"]}
        if fn.is_gluon():  # a Gluon kernel (explicit layouts) has its own source type
            from triton.experimental.gluon._runtime import GluonASTSource as source
        else:
            source = ASTSource
        src = source(fn, sig, {(names.index(k),): v for k, v in const.items()}, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rec["options"])
        ptx = kernel.asm["ptx"]
    except Exception:
        report.append({"name": rec["name"], "failure": traceback.format_exc(limit=3)[-1500:]})
        continue
    before, wait, _ = ptx.partition("griddepcontrol.wait")
    facts = {
        "name": rec["name"], "failure": None, "waits": bool(wait), "loads_before": before.count("ld.global"),
        "shared_bytes": kernel.metadata.shared, "triton": triton.__version__,
    }
    if "registers" in sys.argv[2].split(","):
        facts |= ptxas_facts(ptx)
    if "sass" in sys.argv[2].split(","):
        facts["opcodes"] = sass_opcodes(kernel.asm["cubin"])
    report.append(facts)
print(json.dumps(report))
"""


def compile_for_sm90(records: list[dict], also: str = "-") -> list[dict]:
    """Each record compiled for sm_90 with GDC and ASM on: its PTX facts, or its failure, in the records'
    order; also="registers": ptxas's registers and spill bytes too; also="sass": its SASS instructions
    per opcode, in the whole kernel and in its longest loop; "registers,sass": both."""
    env = settings.environment_without("TRITON_INTERPRET")  # the children compile for the GPU
    workers = max(1, min(os.cpu_count() or 1, len(records)))  # a child a CPU, each an interleaved share

    def compile_share(share: list[dict]) -> list[dict]:
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE, json.dumps(GPU_SWITCHES), also],
            input=json.dumps(share), env=env, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"compiling for sm_90 failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.splitlines()[-1])

    with ThreadPoolExecutor(workers) as pool:
        reports = list(pool.map(compile_share, [records[i::workers] for i in range(workers)]))
    merged: list[dict] = [{}] * len(records)
    for i, report in enumerate(reports):
        merged[i::workers] = report
    return merged
