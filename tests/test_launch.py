"""Programmatic dependent launch (kernels/launch.py): a kernel launched with PDL may start before the
kernel ahead of it has finished, so every decode-path kernel must wait for its inputs before it touches
memory, and every launch of one must say whether PDL is on. Checked on the source here and on the
kernels' sm_90 PTX by test_sm90_compile, since the CPU interpreter runs no PDL; on the H200,
`bench/gpu_step.sh pdl-checks` checks the bits."""

import ast
import inspect

import pytest
import torch

from flashtree.kernels import (
    accept,
    attention,
    ddtree,
    dense_matmul,
    fused,
    launch,
    qmatmul,
    rotary,
    tree_conv,
    tree_deltanet,
)
from flashtree.quant.formats import QT

# every module whose kernels run in decode steps (cross_entropy's run in draft training only)
DECODE_MODULES = [accept, attention, ddtree, dense_matmul, fused, qmatmul, rotary, tree_conv, tree_deltanet]


def kernels_and_launches(module) -> tuple[list[ast.FunctionDef], list[ast.Call]]:
    tree = ast.parse(inspect.getsource(module))
    kernels = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("triton.jit" in ast.unparse(d) for d in node.decorator_list)
        and node.name.endswith("_kernel")
    ]
    launches = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and ast.unparse(node.func.value).endswith("_kernel")
    ]
    return kernels, launches


# What a kernel may call before its wait: index arithmetic, and the prefetch of weights (constants that
# no kernel writes) into L2, which reads nothing into a register and writes nothing
BEFORE_THE_WAIT = {
    "tl.program_id", "tl.arange", "tl.minimum", "tl.cdiv", "rows.to", "range", "tl.static_range",
    "prefetch_l2", "_prefetch_unit",
}  # fmt: skip


@pytest.mark.parametrize("module", DECODE_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_decode_kernel_waits_for_its_inputs_first(module):
    kernels, launches = kernels_and_launches(module)
    assert kernels and launches
    for kernel in kernels:
        body = kernel.body[1:] if isinstance(kernel.body[0].value, ast.Constant) else kernel.body
        statements = [ast.unparse(s) for s in body]
        assert "wait_for_inputs(GDC)" in statements, kernel.name
        before = body[: statements.index("wait_for_inputs(GDC)")]
        called = {ast.unparse(c.func) for s in before for c in ast.walk(s) if isinstance(c, ast.Call)}
        assert called <= BEFORE_THE_WAIT, (kernel.name, called - BEFORE_THE_WAIT)
        assert kernel.args.args[-1].arg == "GDC", kernel.name
    for call in launches:
        unpacked = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
        assert any(u.startswith("pdl_options(") for u in unpacked), ast.unparse(call.func)


def test_the_prefetch_only_prefetches():
    """prefetch_l2 is one inline PTX prefetch whose output nothing reads; qmatmul's per-type helpers only
    call it."""
    source = inspect.getsource(launch.prefetch_l2.fn)
    assert "prefetch.global.L2" in source and "ld." not in source and "st." not in source
    for helper in (qmatmul._prefetch_unit, qmatmul._prefetch_field):
        called = {ast.unparse(c.func) for c in ast.walk(ast.parse(inspect.getsource(helper.fn).lstrip()))
                  if isinstance(c, ast.Call)}  # fmt: skip
        assert called <= {"_prefetch_field", "prefetch_l2", "_at", "tl.static_range"}, called


def test_prefetch_units_fit_half_the_l2(monkeypatch):
    """Under PDL with FLASHTREE_PREFETCH=1 a program prefetches as many units of its split as fit in half
    the L2 over all programs (the 27B's matrices on an H200's 50 MiB), at most the cap and never more than
    its split has; off, without PDL or off CUDA, none."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(launch, "_l2_bytes", lambda index: 50 << 20)
    monkeypatch.setattr(launch, "_supports_pdl", lambda index: True)
    monkeypatch.setattr(launch, "PREFETCH", True)
    monkeypatch.setattr(launch, "ENABLED", True)
    q4k, q6k = qmatmul.layout(QT.Q4_K, 6144), qmatmul.layout(QT.Q6_K, 5120)
    assert qmatmul.prefetch_units(q4k, 5120, 24, 1, cuda) == 1  # a 17.7 MB output projection: whole
    assert qmatmul.prefetch_units(q4k, 1024, 6, 4, cuda) == 4  # small: up to MAX_PREFETCH units a split
    assert qmatmul.prefetch_units(q4k, 1024, 6, 9, cuda) == qmatmul.MAX_PREFETCH.value
    assert qmatmul.prefetch_units(q4k, 34816, 3, 7, cuda) == 1  # 100 MB gate/up: the first unit of each
    assert qmatmul.prefetch_units(q6k, 248320, 1, 20, cuda) == 0  # the 1 GB LM head: one unit overflows
    assert launch.units_to_prefetch(3072 * 9 * 64 * 4, 3, 3, cuda) == 3  # the pair's fp32 gate/up: whole
    assert launch.units_to_prefetch(1 << 20, 5, 5, torch.device("cpu")) == 0
    monkeypatch.setattr(launch, "ENABLED", False)
    assert launch.units_to_prefetch(1 << 20, 5, 5, cuda) == 0
    monkeypatch.setattr(launch, "ENABLED", True)
    monkeypatch.setattr(launch, "PREFETCH", False)
    assert launch.units_to_prefetch(1 << 20, 5, 5, cuda) == 0


def test_prefetch_is_off_unless_turned_on(monkeypatch):
    monkeypatch.delenv("FLASHTREE_PREFETCH", raising=False)
    assert not launch.prefetch_from_env()
    monkeypatch.setenv("FLASHTREE_PREFETCH", "1")
    assert launch.prefetch_from_env()
    monkeypatch.setenv("FLASHTREE_PREFETCH", "0")
    assert not launch.prefetch_from_env()


def test_pdl_only_on_cuda_when_enabled(monkeypatch):
    x = torch.zeros(4)
    monkeypatch.setattr(launch, "ENABLED", True)
    assert launch.pdl_options(x) == {"GDC": False}  # no PDL off CUDA, whatever the setting
    monkeypatch.setattr(launch, "ENABLED", False)
    assert launch.pdl_options(x) == {"GDC": False}


def test_pdl_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("FLASHTREE_PDL", raising=False)
    assert launch.enabled_from_env()
    monkeypatch.setenv("FLASHTREE_PDL", "1")
    assert launch.enabled_from_env()
    monkeypatch.setenv("FLASHTREE_PDL", "0")
    assert not launch.enabled_from_env()


def test_kernels_run_with_pdl_options_off_cuda():
    """A launch through pdl_options runs under the interpreter (GDC false: no wait is emitted)."""
    x = torch.randn(3, 64)
    w = torch.randn(64)
    got = fused.rms_norm(x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
