"""Every decode-path Triton kernel, as decode steps launch it, compiled for an H200 (sm_90) on the CPU.

Under TRITON_INTERPRET=1 the kernels run their CPU form: no PDL wait (GDC false) and the
integer emulations instead of inline PTX (ASM false). Their GPU form compiles only on the device, where a
mistake costs device time. So the launches of a packed tiny qwen35's prefill, AR steps and tree steps
(with a draft), of the dense fp32 kernel and of the quantized matmuls of every type and arithmetic are
recorded under the interpreter, and each distinct kernel configuration is compiled for sm_90 with its GPU
switches on (GDC, ASM) in a process without the interpreter (flashtree/kernels/sm90.py)."""

import numpy as np
import pytest
import torch
from spec_util import generate, random_draft

from flashtree.convert.synth import synth_model
from flashtree.kernels import attention, dense_matmul, fp8, qmatmul
from flashtree.kernels.prefill_attention import prefill_attention
from flashtree.kernels.sm90 import compile_for_sm90, recording
from flashtree.kernels.tree_deltanet import tree_gated_delta_rule
from flashtree.models.block import BlockLayout
from flashtree.models.loader import load_target
from flashtree.models.state import KVStore
from flashtree.quant.kv import quantize
from flashtree.quant.pack import random_blocks


@pytest.fixture(scope="module")
def decode_launches(tmp_path_factory, tiny_root) -> list[dict]:
    """Every distinct launch of prefill, AR and tree decoding of a packed tiny qwen35 (DeltaNet and gated
    attention layers) with a random draft, and of the dense kernel, with every decode kernel on."""
    path = tmp_path_factory.mktemp("sm90") / "tiny-qwen35.gguf"
    synth_model("tiny-qwen35", "q4_k_m", path, seed=5)
    target, _ = load_target(path, device="cpu", quantized=True)
    draft = random_draft(path, target, tiny_root, layers=1)
    with pytest.MonkeyPatch.context() as mp, recording() as records:
        mp.setenv("FLASHTREE_KERNELS", "triton")
        prompt = torch.randint(
            0, target.config.vocab, (3,), generator=torch.Generator().manual_seed(5)
        ).tolist()
        for mode in ("ar", "tree"):
            generate(target, draft if mode == "tree" else None, prompt, 2, mode=mode, block_size=4, budget=6)
        for rows in (1, 5):
            dense_matmul.dense_linear(torch.randn(rows, 96), torch.randn(80, 96))
            dense_matmul.dense_linear(torch.randn(rows, 96), torch.randn(80, 96), up=torch.randn(rows, 96))
            for residual in (torch.randn(rows, 96), None):  # a norm made as the tile loads
                norm = dense_matmul.Norm(torch.randn(96), 1e-6, residual, torch.empty(rows, 96))
                dense_matmul.dense_linear(torch.randn(rows, 96), torch.randn(80, 96), norm=norm)
        for qtype in sorted(qmatmul.KERNEL_TYPES):  # the types a q4_k_m model does not have too
            raw = torch.from_numpy(random_blocks(qtype, 16, 256, np.random.default_rng(qtype)))
            fields = qmatmul.repack(raw, qtype, 256)
            for rows, arithmetic in ((1, "int8"), (3, "int8"), (1, "bf16")):
                qmatmul.quant_matmul(torch.randn(rows, 256), fields, qtype, 16, 256, arithmetic)
        fp8.quantize_rows(torch.randn(3, 96).bfloat16())  # an fp8 draft's activations
        # a bf16 model's attention at 256-dim heads (the 27B's), with the dots it takes on CUDA
        kv = torch.randn(1, 80, 256).bfloat16()
        for rows in (3, 10):  # 10: a long context's verify, in the wider query tile (5 rows in 32)
            tile = attention.row_group(6, rows, attention.WIDE_FROM_KEYS if rows == 10 else 70)
            assert rows == 3 or tile == (5, attention.VERIFY_QUERIES)
            layout = BlockLayout.chain(rows)
            paths, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
            q = torch.randn(rows, 6, 256).bfloat16()
            attention.tree_attention(
                q, kv, kv, torch.tensor(60), paths, depths, 60 + rows, 0.0625, tile=tile, dots="bf16"
            )
        # quantized KV caches (quant/kv.py): the attention over their planes, with a window, and the fused
        # RoPE + quantizing write
        for kinds in (("q4_0", "tq3_0"), ("tq3_0", "q8_0")):
            k, v = (quantize(torch.randn(1, 80, 256), kind) for kind in kinds)
            for rows in (1, 3, 10):  # 10: a long context's verify, in the unpacked cache's 64-query tile
                layout = BlockLayout.chain(rows)
                paths, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
                q = torch.randn(rows, 6, 256).bfloat16()
                tile = None if rows < 10 else attention.row_group(6, rows, attention.UNPACKED_FROM_KEYS, True)
                assert tile in (None, (10, attention.UNPACKED_QUERIES))
                attention.tree_attention(
                    q, k, v, torch.tensor(60), paths, depths, 60 + rows, 0.0625, window=30, tile=tile,
                    dots="bf16",
                )  # fmt: skip
            q, new = torch.randn(2, 6, 256).bfloat16(), torch.randn(2, 1, 256).bfloat16()
            cos_sin = torch.randn(2, 64).bfloat16()
            KVStore(1, 1, 8, 256, torch.bfloat16, "cpu", kinds).layer(0).write_rotated(
                torch.tensor([3, 4]), q, new, new, cos_sin, cos_sin
            )
        # a quantized cache's prefill: the chunk's own keys in-kernel, the earlier ones through a slab (LSE)
        k, v = (quantize(torch.randn(1, 80, 256), kind) for kind in ("tq3_0", "q8_0"))
        prefill_attention(torch.randn(4, 6, 256).bfloat16(), k, v, 70, 0.0625, slab_bytes=1)
        for tile in ((32, 4), (8, 1)):  # FLASHTREE_DELTA_TILE choices besides the default
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
    return records


@pytest.fixture(scope="module")
def sm90(decode_launches) -> list[dict]:
    """Each recorded launch compiled for sm_90 with GDC and ASM on: its PTX facts, or its failure."""
    return compile_for_sm90(decode_launches)


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
        "_rotary_store_kernel",
        "_split_kernel",
    } <= names
    failures = [f"{r['name']}:\n{r['failure']}" for r in sm90 if r["failure"]]
    assert not failures, "\n".join(failures)


def test_under_pdl_nothing_is_read_before_the_wait(sm90):
    """PDL lets a kernel start before the one ahead of it has finished (kernels/launch.py): every decode
    kernel waits, and loads nothing before it waits."""
    for r in sm90:
        assert r["waits"] and r["loads_before"] == 0, r


def test_every_decode_kernel_fits_an_sms_shared_memory(sm90):
    """Shared memory is checked only at launch: a tile or pipeline depth that needs more than an sm_90 SM
    has (227 KB a program) fails there, on the device. The device's Triton (3.6) asked 303104 bytes for
    the 27B's attention at three stages of 64-position tiles; the Triton here compiles that to less, so
    this checks each kernel as this Triton builds it, not the device's exact figure."""
    for r in sm90:
        assert r["shared_bytes"] <= 232448, r
