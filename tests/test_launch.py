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
    prefill_attention,
    qmatmul,
    rotary,
    tree_conv,
    tree_deltanet,
)
from flashtree.settings import Settings

# every module whose kernels run in decode steps (cross_entropy's run in draft training only)
DECODE_MODULES = [
    accept,
    attention,
    ddtree,
    dense_matmul,
    fused,
    prefill_attention,
    qmatmul,
    rotary,
    tree_conv,
    tree_deltanet,
]


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


# What a kernel may call before its wait: index arithmetic only
BEFORE_THE_WAIT = {"tl.program_id", "tl.arange", "tl.minimum", "tl.cdiv", "rows.to"}


def index_helpers(module) -> set[str]:
    """A module's jit helpers that do index arithmetic only (every call one of BEFORE_THE_WAIT's)."""
    tree = ast.parse(inspect.getsource(module))
    jitted = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and "triton.jit" in ast.unparse(n))
    return {
        n.name
        for n in jitted
        if {ast.unparse(c.func) for c in ast.walk(n) if isinstance(c, ast.Call)} <= BEFORE_THE_WAIT
    }


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
        allowed = BEFORE_THE_WAIT.union(*map(index_helpers, DECODE_MODULES))  # helpers are imported too
        assert called <= allowed, (kernel.name, called - allowed)
        assert kernel.args.args[-1].arg == "GDC", kernel.name
    for call in launches:
        unpacked = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
        assert any(u.startswith("pdl_options(") for u in unpacked), ast.unparse(call.func)


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_pdl_only_on_cuda_when_enabled(monkeypatch, pdl):
    monkeypatch.setenv("FLASHTREE_PDL", pdl)
    assert launch.pdl_options(torch.zeros(4)) == {"GDC": False}  # no PDL off CUDA, whatever the setting


def test_pdl_is_on_unless_turned_off():
    assert Settings.from_env({}).pdl and Settings.from_env({"FLASHTREE_PDL": "1"}).pdl
    assert not Settings.from_env({"FLASHTREE_PDL": "0"}).pdl


def test_kernels_run_with_pdl_options_off_cuda():
    """A launch through pdl_options runs under the interpreter (GDC false: no wait is emitted)."""
    x = torch.randn(3, 64)
    w = torch.randn(64)
    got = fused.rms_norm(x, w, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
