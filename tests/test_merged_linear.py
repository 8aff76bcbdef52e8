"""MergedLinear: projections of one input in as few matmuls as their storage allows.

References: each matrix's own product (F.linear on its dense weight; quant_matmul on its own packed rows,
through Triton's interpreter) and the GGUF's tensors decoded one by one. The packed kernels compute each
output row independently of the others, so a merged matrix's rows must equal the separate matrices' rows
bit for bit, as long as the K-split count (k_splits, from the row count) is the same; it is at these
shapes (checked below). On real shapes a merged matrix may get fewer K-splits than its largest part,
which changes the fp32 summation order (not the batch invariance: every M still adds the same terms).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashtree.convert.synth import synth_model
from flashtree.kernels.qlinear import QuantLinear
from flashtree.kernels.qmatmul import k_splits, layout, quant_matmul
from flashtree.models.attention import Attention
from flashtree.models.layers import Linear, MergedLinear
from flashtree.models.llama import unpermute_rows
from flashtree.models.loader import load_target
from flashtree.quant.formats import QT, block_size
from flashtree.quant.pack import random_blocks

COLS = {QT.Q4_K: 512, QT.Q6_K: 512, QT.Q8_0: 576}  # 2 super-blocks; 18 legacy blocks (units of 2)
ROWS = [37, 16, 24]  # q-, k- and v-like parts, none a multiple of a tile
DENSE_TOL = 1e-6  # relative (norm) error, one fp32 GEMM vs several: only the summation order may differ


def packed(qtype: QT, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng([int(qtype), rows, seed])
    return torch.from_numpy(random_blocks(qtype, rows, cols, rng))  # (rows, row_bytes) uint8


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def build(rows: torch.Tensor, qtype: int | None, cols: int):
    return Linear(rows) if qtype is None else QuantLinear(rows, qtype, (rows.shape[0], cols))


def test_dense_merge_equals_separate_products():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 64, generator=g) for n in ROWS]
    merged = MergedLinear.dense(weights)
    assert len(merged.groups) == 1
    x = torch.randn(3, 5, 64, generator=g)  # any leading shape
    for y, part, w in zip(merged(x), merged.parts, weights, strict=True):
        assert y.shape == (3, 5, w.shape[0]) and rel_err(y, F.linear(x, w)) < DENSE_TOL
        assert torch.equal(part.weight, w) and torch.equal(part.dense_weight(torch.float64), w.double())
        assert part.out_features == w.shape[0]


@pytest.mark.parametrize("qtype", list(COLS), ids=lambda t: t.name)
def test_packed_merge_is_row_for_row_the_separate_kernels(qtype):
    cols = COLS[qtype]
    raws = [packed(qtype, n, cols, seed=i) for i, n in enumerate(ROWS)]
    merged = MergedLinear.from_rows(raws, [int(qtype)] * 3, lambda r, t: build(r, t, cols))
    (group,) = merged.groups
    assert isinstance(group, QuantLinear) and group.out_features == sum(ROWS)
    units = cols // block_size(qtype) // layout(qtype, cols).group
    assert all(k_splits(sum(ROWS), units) == k_splits(n, units) for n in ROWS)  # see the module doc
    separate = [QuantLinear(raw, qtype, (n, cols)) for raw, n in zip(raws, ROWS, strict=True)]
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    for m in (1, 5):  # the dp4a and the tensor-core kernels
        y = quant_matmul(x[:m], group.fields, qtype, sum(ROWS), cols)
        for part, lin in zip(merged.parts, separate, strict=True):
            expected = quant_matmul(x[:m], lin.fields, qtype, lin.out_features, cols)
            assert torch.equal(y[:, part.rows], expected), (qtype.name, m, part.rows)
    for part, lin in zip(merged.parts, separate, strict=True):
        assert torch.equal(part.dense_weight(), lin.dense_weight())
    # off CUDA, MergedLinear itself: the decoded weights times x
    for y, lin in zip(merged(x), separate, strict=True):
        assert rel_err(y, lin(x)) < DENSE_TOL


def test_mixed_types_fall_back_to_one_matmul_per_type():
    cols = 512
    kinds = [int(QT.Q4_K), int(QT.Q6_K), None, int(QT.Q4_K)]
    sizes = [37, 16, 24, 8]
    g = torch.Generator().manual_seed(2)
    rows = [
        torch.randn(n, cols, generator=g) if t is None else packed(QT(t), n, cols, seed=i)
        for i, (t, n) in enumerate(zip(kinds, sizes, strict=True))
    ]
    merged = MergedLinear.from_rows(rows, kinds, lambda r, t: build(r, t, cols))
    assert [type(m) for m in merged.groups] == [QuantLinear, QuantLinear, Linear]
    assert [m.out_features for m in merged.groups] == [37 + 8, 16, 24]
    assert merged.part_groups == [0, 1, 2, 0]
    separate = [build(r, t, cols) for r, t in zip(rows, kinds, strict=True)]
    x = torch.randn(4, cols, generator=g)
    outputs = merged(x)
    for y, part, lin in zip(outputs, merged.parts, separate, strict=True):
        assert y.shape == (4, lin.out_features) and rel_err(y, lin(x)) < DENSE_TOL
        assert torch.equal(part.dense_weight(), lin.dense_weight())
    q4k = merged.groups[0]  # the kernel on the Q4_K group: its parts' rows, bit for bit
    y = quant_matmul(x, q4k.fields, QT.Q4_K, q4k.out_features, cols)
    for i in (0, 3):
        lin = separate[i]
        assert torch.equal(y[:, merged.parts[i].rows], quant_matmul(x, lin.fields, QT.Q4_K, sizes[i], cols))


# --- the loader -----------------------------------------------------------------------------------------

PROJECTIONS = {  # merged module -> the GGUF matrices it holds, in order
    "attention": ("qkv", ["attn_q", "attn_k", "attn_v"]),
    "deltanet": ("in_proj", ["attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"]),
    "mlp": ("gate_up", ["ffn_gate", "ffn_up"]),
}


def merged_modules(layer):
    kind = "attention" if isinstance(layer.mixer, Attention) else "deltanet"
    for owner, key in ((layer.mixer, kind), (layer.mlp, "mlp")):
        attr, names = PROJECTIONS[key]
        yield getattr(owner, attr), names


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def q4_k_m(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp("merged") / f"{family}.gguf"
    synth_model(f"tiny-{family}", "q4_k_m", path, seed=5)
    dense, gguf = load_target(path, device="cpu", quantized=False)
    packed_model, _ = load_target(path, device="cpu", quantized=True)
    return family, gguf, dense, packed_model


def test_loader_merges_same_type_matrices(q4_k_m):
    """Dense: one matmul per merged module. Packed: one per GGUF type among its matrices; Q4_K_M gives
    some layers a Q6_K attn_v / attn_qkv, so both cases occur."""
    family, gguf, dense, packed_model = q4_k_m
    n_groups = set()
    for i, (d_layer, p_layer) in enumerate(zip(dense.layers, packed_model.layers, strict=True)):
        for (d, names), (p, _) in zip(merged_modules(d_layer), merged_modules(p_layer), strict=True):
            types = [gguf.info(f"blk.{i}.{n}.weight").qtype for n in names]
            assert len(d.groups) == 1 and isinstance(d.groups[0], Linear)
            assert len(p.groups) == len(set(types)) and all(isinstance(g, QuantLinear) for g in p.groups)
            assert [p.groups[g].qtype for g in p.part_groups] == types
            n_groups.add(len(p.groups))
    assert n_groups == {1, 2}, family  # all-same and mixed-type layers both seen


def test_loaded_parts_are_the_gguf_matrices(q4_k_m):
    """Each part, dense or packed, decodes to its GGUF tensor (llama's q/k rows un-permuted, on the packed
    GGUF rows too): what the HF export and the draft initialisation read."""
    family, gguf, dense, packed_model = q4_k_m
    c = dense.config
    heads = {"attn_q": c.n_heads, "attn_k": c.n_kv_heads} if family == "llama" else {}
    for i, (d_layer, p_layer) in enumerate(zip(dense.layers, packed_model.layers, strict=True)):
        for (d, names), (p, _) in zip(merged_modules(d_layer), merged_modules(p_layer), strict=True):
            for name, d_part, p_part in zip(names, d.parts, p.parts, strict=True):
                expected = gguf.tensor(f"blk.{i}.{name}.weight", dtype=torch.float32)
                if name in heads:
                    expected = unpermute_rows(expected, heads[name])
                assert torch.equal(d_part.weight, expected), (i, name)
                assert torch.equal(p_part.dense_weight(), expected), (i, name)


def test_packed_and_dense_loads_give_the_same_logits(q4_k_m):
    """On CPU a packed layer is its decoded weight times x: the same numbers as the dense load."""
    _, _, dense, packed_model = q4_k_m
    ids = torch.randint(0, dense.config.vocab, (12,), generator=torch.Generator().manual_seed(0))
    expected = dense(ids, dense.new_state(16)).logits
    assert rel_err(packed_model(ids, packed_model.new_state(16)).logits, expected) < DENSE_TOL
