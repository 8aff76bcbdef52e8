"""The small Triton kernels of the decode/verify path on a real GPU, against their torch paths.

    python bench/gpu_small_kernels.py OUT_DIR      -> OUT_DIR/small_kernels.json; exit 1 on a failure

The CPU tests run these kernels under Triton's interpreter, which is not the compiler; this is the
check on the device (it needs no model files):
- rotary (kernels/rotary.py): bit for bit the torch ops of layers.apply_rotary, fp32 and bf16, full and
  partial rotary, a strided q; and rotary_store (RoPE on q and k plus the K/V cache write in one launch)
  bit for bit rotary + index_copy;
- the DDTree build (kernels/ddtree.py: the draft's top-k in two launches, then the tree in one): the
  torch path's tree (tokens, parents, depths, visibility) on random fp32 draft logits of SmolLM2's and
  the 27B's vocabularies; and the accept walk on it (kernels/accept.py): the torch path's path and
  read-back;
- grouped_attention (models/layers.py: query heads folded into rows) and block_attention (the draft
  block's attention on the GPU, kernels/attention.py) within 1e-5 (fp32) / 1.6e-2 (bf16) of SDPA's own
  grouped-query attention at the drafts' shapes;
- tree conv + SiLU (kernels/tree_conv.py) and the tree Gated DeltaNet (kernels/tree_deltanet.py):
  within 1e-5 of the torch reference in fp32 on a tree with siblings, and each token computed alone
  (from its parent's state: the AR step, also writing its state in place) equal to its row of the
  whole launch (the verify) bit for bit;
- the fused RMSNorm variants and SiLU-and-multiply (kernels/fused.py) at the 27B's shapes: within one
  bf16 unit in the last place of the torch path (fp32: 2e-6 relative), the residual sum bit for bit,
  and a row alone equal to its row of 23 bit for bit;
- decode/verify attention (kernels/attention.py) at the 27B's heads (bf16) and SmolLM2's (fp32), after
  600 committed tokens, in caches of 664 slots (splits of one or two tiles) and 8,192 (256-position splits of
  several tiles): the masked SDPA within rounding, and every node of a tree equal to
  the AR step at its position (its path's K/V committed) bit for bit, with more splits launched too;
- fp8 draft matrices (kernels/fp8.py) at the 27B draft's shapes: the Triton row quantizer's bytes and
  scales equal to torch's cast, and Fp8Linear (torch._scaled_mm) within fp8 rounding of x @ W^T.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

from flashtree import kernels
from flashtree.kernels import fp8, fused
from flashtree.kernels.attention import (
    MAX_SPLIT,
    SPLITS_PER_CACHE,
    block_attention,
    split_positions,
    tree_attention,
)
from flashtree.kernels.qmatmul import int8_of, quantize_activations, reshape_int8
from flashtree.kernels.rotary import rotary, rotary_store
from flashtree.kernels.tree_conv import tree_conv_silu
from flashtree.kernels.tree_deltanet import replay_path, tree_gated_delta_rule
from flashtree.models import layers
from flashtree.models.block import BlockLayout
from flashtree.models.deltanet import delta_rule_inputs, recurrent_delta_rule
from flashtree.models.layers import Rotary, apply_rotary, grouped_attention
from flashtree.spec.accept import accept_path
from flashtree.spec.tree import CHAIN_BONUS, build_tree

# without a GPU: a dry run on the CPU under TRITON_INTERPRET=1
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PARENTS = [-1, 0, 1, 0, 3, 1, 5, 2, -1]  # siblings, a branch back up, a second root child
TOL = 1e-5
FP8_TOL = 0.06  # e4m3's 3 mantissa bits on both operands (tests/test_fp8.py)


def torch_path(fn, *args):
    """fn's torch ops, with the kernels switched off."""
    kernels_on = kernels.triton_kernels_for
    kernels.triton_kernels_for = lambda x: False
    try:
        return fn(*args)
    finally:
        kernels.triton_kernels_for = kernels_on


def torch_rotary(x, cos, sin):
    return torch_path(apply_rotary, x, cos, sin)


def check_rotary() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for heads, head_dim, rot in ((16, 128, 128), (24, 256, 64), (9, 64, 64)):
            for tokens in (1, 23):
                gen = torch.Generator().manual_seed(tokens + head_dim)
                positions = torch.randint(0, 200_000, (tokens,), generator=gen)
                cos, sin = (c.to(DEVICE) for c in Rotary(rot, 1e7).cos_sin(positions, dtype))
                packed = torch.randn(tokens, heads, 2 * head_dim, generator=gen).to(DEVICE, dtype) * 3
                x = packed[..., :head_dim]  # strided, as qwen3.5's gated q
                got, reference = rotary(x, cos, sin), torch_rotary(x, cos, sin)
                rows.append({
                    "kernel": "rotary", "dtype": str(dtype), "shape": [tokens, heads, head_dim], "rot": rot,
                    "bitwise": torch.equal(got, reference),
                    "max_abs_diff": (got.float() - reference.float()).abs().max().item(),
                })  # fmt: skip
    return rows


def check_rotary_store() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, head_dim, rot in ((9, 3, 64, 64), (24, 4, 256, 64)):
            for tokens in (1, 23):
                gen = torch.Generator().manual_seed(tokens + heads)
                width = (heads + 2 * kv_heads) * head_dim
                merged = (torch.randn(tokens, width, generator=gen) * 3).to(DEVICE, dtype)
                q = merged[:, : heads * head_dim].view(tokens, heads, head_dim)
                q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
                k = merged[:, q_end:k_end].view(tokens, kv_heads, head_dim)
                v = merged[:, k_end:].view(tokens, kv_heads, head_dim)
                positions = torch.randint(0, 200_000, (tokens,), generator=gen)
                cos, sin = (c.to(DEVICE) for c in Rotary(rot, 1e7).cos_sin(positions, dtype))
                slots = torch.randperm(600, generator=gen)[:tokens].to(DEVICE)
                caches = [torch.randn(kv_heads, 600, head_dim, generator=gen) for _ in range(2)]
                caches = [c.to(DEVICE, dtype) for c in caches]
                want_k, want_v = (c.clone() for c in caches)
                want_k.index_copy_(1, slots, torch_rotary(k, cos, sin).transpose(0, 1))
                want_v.index_copy_(1, slots, v.transpose(0, 1))
                got_q = rotary_store(q, k, v, cos, sin, *caches, slots)
                bitwise = torch.equal(got_q, torch_rotary(q, cos, sin)) and torch.equal(caches[0], want_k)
                rows.append({
                    "kernel": "rotary_store", "dtype": str(dtype), "shape": [tokens, heads, head_dim],
                    "rot": rot,
                    "bitwise": bitwise and torch.equal(caches[1], want_v),
                })  # fmt: skip
    return rows


def check_ddtree() -> list[dict]:
    rows = []
    for vocab, depth, budget, top_k in ((49152, 15, 22, 8), (248320, 15, 22, 8), (49152, 15, 63, 8)):
        for chain_seed in (True, False):
            gen = torch.Generator().manual_seed(vocab + budget)
            logits = (3 * torch.randn(depth, vocab, generator=gen)).to(DEVICE)
            root = torch.tensor(7, device=DEVICE)
            want = torch_path(build_tree, root, logits, budget, top_k, chain_seed)
            got = build_tree(root, logits, budget, top_k, chain_seed)
            same = [torch.equal(a, b) for a, b in ((got.tokens, want.tokens), (got.layout.parents,
                    want.layout.parents), (got.layout.depths, want.layout.depths),
                    (got.layout.visible, want.layout.visible))]  # fmt: skip
            # the accept kernel (kernels/accept.py) on this tree, samples walking it to a leaf
            samples = got.tokens.cpu().clone()
            for child, parent in enumerate(got.layout.parents.tolist()):
                if parent >= 0:
                    samples[parent] = got.tokens[child]
            samples = samples.to(DEVICE)
            fast, ref = accept_path(got.tokens, got.layout, samples), torch_path(
                accept_path, got.tokens, got.layout, samples)  # fmt: skip
            same_accept = torch.equal(fast.path, ref.path) and torch.equal(
                fast.packed(got.tokens), ref.packed(got.tokens))  # fmt: skip
            rows.append({"kernel": "ddtree", "vocab": vocab, "budget": budget, "chain_seed": chain_seed,
                         "bonus": CHAIN_BONUS if chain_seed else 0.0, "same_tree": all(same),
                         "accepted": int(ref.n), "same_accept": same_accept})  # fmt: skip
    return rows


def check_grouped_attention() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, head_dim, keys_n in ((9, 3, 64, 528), (32, 8, 128, 4112)):
            gen = torch.Generator().manual_seed(heads)
            q = torch.randn(1, heads, 16, head_dim, generator=gen).to(DEVICE, dtype)
            kv = [torch.randn(1, kv_heads, keys_n, head_dim, generator=gen) for _ in range(2)]
            kv = [t.to(DEVICE, dtype) for t in kv]
            mask = (torch.rand(16, keys_n, generator=gen) < 0.7).to(DEVICE)
            mask[:, -16:] = True
            # the draft's block attention over the context slots, then the whole block: one mask for
            # every row (the live slots, a row broadcast), or a mask a row (a sliding window's layer)
            shared = mask[0, :-16][None].expand(16, -1)
            q_rows = q[0].transpose(0, 1).contiguous()  # (16, heads, head_dim)
            cases = [("grouped_attention", grouped_attention(q, *kv, mask, head_dim**-0.5), mask)]
            for kernel, ctx_mask in (("block_attention", shared), ("block_attention rows", mask[:, :-16])):
                block = block_attention(q_rows, kv[0][0], kv[1][0], ctx_mask, head_dim**-0.5, keys_n - 16)
                block_mask = torch.cat([ctx_mask, mask[:, -16:]], dim=1)
                cases.append((kernel, block.transpose(0, 1)[None], block_mask))
            for kernel, got, kernel_mask in cases:
                want = torch.nn.functional.scaled_dot_product_attention(
                    q, *kv, attn_mask=kernel_mask, scale=head_dim**-0.5, enable_gqa=True
                )
                diff = (got.float() - want.float()).abs().max().item()
                rows.append({
                    "kernel": kernel, "dtype": str(dtype), "heads": [heads, kv_heads],
                    "keys": keys_n, "max_abs_diff": diff,
                    # other attention kernels: fp32 sums in another order; bf16 outputs (|x| < 1) 2 ulp apart
                    "within_rounding": diff <= (1e-5 if dtype == torch.float32 else 1.6e-2),
                })  # fmt: skip
    return rows


def check_tree_conv() -> dict:
    gen = torch.Generator().manual_seed(0)
    kernel, channels = 4, 10240  # the 27B's conv channels
    layout = BlockLayout.from_parents(torch.tensor(PARENTS))
    t = layout.size
    src = torch.randn(kernel - 1 + t, channels, generator=gen).to(DEVICE)
    state, new = src[: kernel - 1].clone(), src[kernel - 1 :]
    weight = torch.randn(channels, kernel, generator=gen).to(DEVICE)
    index = layout.conv_window_index(kernel).to(DEVICE)
    windows = torch.empty(t, kernel - 1, channels, device=DEVICE)
    got = tree_conv_silu(state, new, index, weight, windows)
    reference = torch.nn.functional.silu((src[index] * weight.t()[None]).sum(1))
    alone = torch.cat([tree_conv_silu(state, new, index[i : i + 1], weight) for i in range(t)])
    # the AR step: one token, the state updated in place
    ar_out = tree_conv_silu(state, new[:1], index[:1], weight, state[None])
    ar_ok = torch.equal(ar_out, alone[:1]) and torch.equal(state, src[1:kernel])
    err = (got - reference).abs().max().item()
    return {
        "kernel": "tree_conv",
        "max_abs_err": err,
        "ok": err < TOL and torch.equal(windows, src[index][:, 1:]) and ar_ok,
        "rows_bitwise": torch.equal(alone, got),
    }


def check_tree_deltanet(tile: tuple[int, int] | None = None) -> dict:
    gen = torch.Generator().manual_seed(0)
    nk, nv, kd, vd = 16, 48, 128, 128  # the 27B's heads
    t = len(PARENTS)
    projection = torch.randn(t, 2 * nv, generator=gen) * 3
    conv_out, alpha, beta, dt_bias, ssm_a, s0 = (
        x.to(DEVICE)
        for x in (
            torch.randn(t, 2 * nk * kd + nv * vd, generator=gen),
            projection[:, :nv],
            projection[:, nv:],
            torch.randn(nv, generator=gen),
            -torch.rand(nv, generator=gen) * 2,
            torch.randn(nv, kd, vd, generator=gen) * 0.3,
        )
    )
    parents = torch.tensor(PARENTS, dtype=torch.int32, device=DEVICE)
    o, states = tree_gated_delta_rule(conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, nk, tile=tile)
    inputs = delta_rule_inputs(conv_out, alpha, beta, dt_bias, ssm_a, nk, kd, vd)
    ref_o, ref_states = recurrent_delta_rule(*inputs, s0, PARENTS)
    err = max((o - ref_o).abs().max().item(), (states - ref_states).abs().max().item())
    same, root = {"alone": True}, torch.tensor([-1], dtype=torch.int32, device=DEVICE)
    for i, p in enumerate(PARENTS):  # each node alone, from its parent's state as the kernel left it
        step = slice(i, i + 1)
        start = s0 if p < 0 else states[p]
        o_i, s_i = tree_gated_delta_rule(
            conv_out[step], alpha[step], beta[step], dt_bias, ssm_a, start, root, nk, tile=tile
        )
        same["alone"] &= torch.equal(o_i[0], o[i]) and torch.equal(s_i[0], states[i])
    # the AR step writes the new state over the old one (states=state): the same bits
    state = s0.clone()
    o_0, _ = tree_gated_delta_rule(
        conv_out[:1], alpha[:1], beta[:1], dt_bias, ssm_a, state, root, nk, states=state[None], tile=tile
    )
    same["in_place"] = torch.equal(o_0[0], o[0]) and torch.equal(state, states[0])
    # the verify as the model runs it (gates kept, only the restart points' states stored): the same outputs
    # and kept states; its gates feed the commit's replay of each node's ancestry (two layers' copies of the
    # walk), which ends in that node's state
    gates = torch.empty(2, t, 2, nv, device=DEVICE)
    restarts = BlockLayout.from_parents(parents.long()).restart_points()
    kept = torch.zeros_like(states)
    o_v, _ = tree_gated_delta_rule(
        conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, nk, states=kept, tile=tile, gates=gates[0],
        keep=restarts.to(torch.int8),
    )  # fmt: skip
    same["verify"] = torch.equal(o_v, o) and torch.equal(kept[restarts], states[restarts])
    gates[1] = gates[0]
    same["replay"] = True
    for node in range(t):
        path = [node]
        while PARENTS[path[-1]] >= 0:
            path.append(PARENTS[path[-1]])
        path = torch.tensor(path[::-1], dtype=torch.int32, device=DEVICE)
        replayed = torch.stack([s0, s0]).contiguous()
        count = torch.tensor([path.shape[0]], dtype=torch.int32, device=DEVICE)
        replay_path(torch.stack([conv_out, conv_out]), gates, path, count, replayed, nk, tile=tile)
        same["replay"] &= torch.equal(replayed[0], states[node]) and torch.equal(replayed[1], states[node])
    return {
        "kernel": "tree_deltanet", "max_abs_err": err, "ok": err < TOL, "rows_bitwise": all(same.values()),
        "bitwise": same,
    }  # fmt: skip


def within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """bf16: at most one unit in the last place apart; fp32: 2e-6 relative."""
    bf16 = want.dtype == torch.bfloat16
    got, want = got.float(), want.float()
    if bf16:
        return bool(((got - want).abs() <= 2.0 ** (torch.frexp(want)[1] - 8).float()).all())
    return bool(((got - want).abs() <= 2e-6 * want.abs() + 1e-6).all())


def check_fused() -> list[dict]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16, scale=3.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    t, hidden, ff = 23, 5120, 17408  # the 27B's
    x, residual, w = randn(t, hidden), randn(t, 2 * hidden)[:, hidden:], randn(hidden, scale=1.0)
    heads = randn(t, 24 * 512)[:, : 24 * 256].view(t, 24, 256)  # gated q: a strided head view
    o, z = randn(t, 48, 128, dtype=torch.float32), randn(t, 3 * 6144)[:, 6144 : 2 * 6144]
    gate_up = randn(t, 2 * ff)
    q_gate, heads_out = randn(t, 24, 512)[..., 256:], randn(t, 24 * 256)  # gated q: [q_h | gate_h] per head
    cases = {  # name: (kernel(rows), torch path(rows)) -> tuples of outputs; rows: a slice of the tokens
        "rms_norm": (lambda r: (fused.rms_norm(x[r], w, 1e-6),), lambda r: (layers.rms_norm(x[r], w, 1e-6),)),
        "rms_norm heads": (
            lambda r: (fused.rms_norm(heads[r], w[:256], 1e-6),),
            lambda r: (layers.rms_norm(heads[r], w[:256], 1e-6),),
        ),
        "add_rms_norm": (  # (sum, norm)
            lambda r: fused.rms_norm(x[r], w, 1e-6, residual=residual[r]),
            lambda r: layers.add_rms_norm(x[r], residual[r], w, 1e-6),
        ),
        "gated_rms_norm": (
            lambda r: (fused.rms_norm(o[r], w[:128], 1e-6, gate=z[r], out_dtype=torch.bfloat16).flatten(1),),
            lambda r: (layers.gated_rms_norm(o[r], w[:128], 1e-6, z[r], torch.bfloat16),),
        ),
        "sigmoid_gate": (  # the gated attention output: gate a strided head view
            lambda r: (fused.gate_mul(q_gate[r], heads_out[r], "sigmoid"),),
            lambda r: (layers.sigmoid_gate(heads_out[r], q_gate[r]),),
        ),
        "silu_mul": (
            lambda r: (fused.gate_mul(gate_up[r, :ff], gate_up[r, ff:]),),
            lambda r: (layers.silu_mul(gate_up[r, :ff], gate_up[r, ff:]),),
        ),
    }
    rows = []
    for name, (kernel, reference) in cases.items():
        got, want = kernel(slice(None)), torch_path(reference, slice(None))
        ok = all(within_rounding(g, w_) for g, w_ in zip(got, want, strict=True))
        if name == "add_rms_norm":
            ok &= torch.equal(got[0], want[0])  # the residual sum: one rounding, as torch's add
        alone = all(
            torch.equal(g_i, g[i : i + 1])
            for i in (0, t - 1)
            for g_i, g in zip(kernel(slice(i, i + 1)), got, strict=True)
        )
        rows.append({
            "kernel": name, "within_rounding": ok, "rows_bitwise": alone,
            "max_abs_diff": max(
                (g.float() - w_.float()).abs().max().item() for g, w_ in zip(got, want, strict=True)
            ),
        })  # fmt: skip
    return rows + check_fused_quantize(x, residual, w, o, z, gate_up, ff, q_gate, heads_out)


def check_fused_quantize(x, residual, w, o, z, gate_up, ff, q_gate, heads_out) -> list[dict]:
    """quantize=True on one token (the AR step of int8 matrices): the same output bits, carrying exactly
    qmatmul.quantize_activations' codes, scales and sums of the token's row."""
    cases = {
        "rms_norm": lambda q: fused.rms_norm(x[:1], w, 1e-6, quantize=q),
        "add_rms_norm": lambda q: fused.rms_norm(x[:1], w, 1e-6, residual=residual[:1], quantize=q)[1],
        "gated_rms_norm": lambda q: fused.rms_norm(
            o[:1], w[:128], 1e-6, gate=z[:1], out_dtype=torch.bfloat16, quantize=q
        ),
        "silu_mul": lambda q: fused.gate_mul(gate_up[:1, :ff], gate_up[:1, ff:], quantize=q),
        "sigmoid_gate": lambda q: fused.gate_mul(q_gate[:1], heads_out[:1], "sigmoid", quantize=q),
    }
    rows = []
    for name, make in cases.items():
        plain, quantized = make(False), make(True)
        row = reshape_int8(quantized, 1, -1)
        same = [torch.equal(a, b) for a, b in zip(int8_of(row), quantize_activations(row), strict=True)]
        rows.append({
            "kernel": f"{name} quantized", "within_rounding": torch.equal(plain, quantized),
            "rows_bitwise": all(same), "max_abs_diff": 0.0 if all(same) else float("nan"),
        })  # fmt: skip
    return rows


def check_attention() -> list[dict]:
    rows = []
    layout = BlockLayout.from_parents(torch.tensor(PARENTS, device=DEVICE))
    t, start = layout.size, 600
    paths, depths = layout.paths().to(torch.int32), layout.depths.to(torch.int32)
    chain_path = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    heads = {"27B heads bf16": (4, 24, 256, torch.bfloat16), "SmolLM2 heads fp32": (3, 9, 64, torch.float32)}
    for (name, (n_kv, n_heads, hd, dtype)), slots in itertools.product(
        heads.items(),
        (start + 64, MAX_SPLIT * SPLITS_PER_CACHE),  # one-tile splits; splits of several tiles
    ):
        name = f"{name} cache {slots}"
        gen = torch.Generator().manual_seed(hd)
        k, v = (torch.randn(n_kv, slots, hd, generator=gen).to(DEVICE, dtype) for _ in range(2))
        q = torch.randn(t, n_heads, hd, generator=gen).to(DEVICE, dtype)
        start_t = torch.tensor(start, device=DEVICE)
        got = tree_attention(q, k, v, start_t, paths, depths, start + t, hd**-0.5)
        rel = torch.arange(start + t, device=DEVICE) - start
        visible = layout.visible.gather(1, rel.clamp(0, t - 1)[None, :].expand(t, -1))
        mask = (rel < 0)[None, :] | ((rel >= 0)[None, :] & visible)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None], k[None, :, : start + t].float(), v[None, :, : start + t].float(),
            attn_mask=mask, scale=hd**-0.5, enable_gqa=True,
        )[0].transpose(0, 1)  # fmt: skip
        err = (got.float() - want).abs().max().item()
        more = start + 3 * split_positions(slots)  # keys: more (empty) splits launched
        alone = torch.equal(tree_attention(q, k, v, start_t, paths, depths, more, hd**-0.5), got)
        for node in range(t):
            depth = int(layout.depths[node])
            ks, vs = k.clone(), v.clone()
            for j in range(depth + 1):
                src = start + int(layout.paths()[node, j])
                ks[:, start + j], vs[:, start + j] = k[:, src], v[:, src]
            step = tree_attention(
                q[node : node + 1], ks, vs, torch.tensor(start + depth, device=DEVICE), chain_path,
                depths[:1] * 0, start + depth + 1, hd**-0.5,
            )  # fmt: skip
            alone &= torch.equal(step[0], got[node])
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        rows.append(
            {"kernel": f"attention {name}", "max_abs_err": err, "ok": err < tol, "rows_bitwise": alone}
        )
    return rows


def check_fp8() -> list[dict]:
    rows = []
    for m, k, n in ((16, 5120, 34816), (15, 5120, 31040), (23, 25600, 5120), (1, 4096, 5120)):
        g = torch.Generator().manual_seed(m + k + n)
        x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(k, generator=g))  # outlier channels
        x, w = (
            x.to(DEVICE, torch.bfloat16),
            (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, torch.bfloat16),
        )
        codes, scales = fp8.quantize_rows(x)
        want_codes, want_scales = fp8.quantize_rows_reference(x)
        same = torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(
            scales, want_scales
        )
        with torch.no_grad():
            y = layers.Fp8Linear(w)(x)
        want = x.double() @ w.double().t()
        err = float((y.double() - want).norm() / want.norm())
        rows.append({"kernel": "fp8", "shape": [m, k, n], "bytes_equal": same, "rel_err": err})
    return rows


def main(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu (TRITON_INTERPRET)"
    result = {"device": name, "torch": torch.__version__, "rotary": check_rotary() + check_rotary_store()}
    result["ddtree"], result["grouped_attention"] = check_ddtree(), check_grouped_attention()
    recurrent = [check_tree_conv(), check_tree_deltanet(), *check_attention()]
    result.update({row["kernel"]: row for row in recurrent})
    result["fused"] = check_fused()
    result["fp8"] = check_fp8()
    (out_dir / "small_kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    for row in result["rotary"]:
        print(f"{row['kernel']:<13} {row['dtype']:<15} {row['shape']} rot {row['rot']:<4} "
              f"bitwise {row['bitwise']}")  # fmt: skip
    for row in recurrent:
        print(f"{row['kernel']:<14} max |err| {row['max_abs_err']:.2e}  rows bitwise {row['rows_bitwise']}")
    for row in result["fused"]:
        print(f"{row['kernel']:<16} max |diff| {row['max_abs_diff']:.2e}  within rounding "
              f"{row['within_rounding']}  rows bitwise {row['rows_bitwise']}")  # fmt: skip
    for row in result["ddtree"]:
        print(f"ddtree vocab {row['vocab']} budget {row['budget']} chain {row['chain_seed']}: same tree "
              f"{row['same_tree']}, accept of {row['accepted']} the same {row['same_accept']}")  # fmt: skip
    for row in result["grouped_attention"]:
        print(f"grouped_attention {row['dtype']:<15} heads {row['heads']} keys {row['keys']}: "
              f"max |diff| {row['max_abs_diff']:.2e} within rounding {row['within_rounding']}")  # fmt: skip
    for row in result["fp8"]:
        print(f"fp8 {row['shape']}: quantizer bytes equal {row['bytes_equal']}, "
              f"product rel err {row['rel_err']:.2e}")  # fmt: skip
    failures = [r for r in result["rotary"] if not r["bitwise"]]
    failures += [r for r in result["fp8"] if not (r["bytes_equal"] and r["rel_err"] < FP8_TOL)]
    failures += [r for r in result["ddtree"] if not (r["same_tree"] and r["same_accept"])]
    failures += [r for r in result["grouped_attention"] if not r["within_rounding"]]
    failures += [r for r in result["fused"] if not (r["within_rounding"] and r["rows_bitwise"])]
    failures += [r for r in recurrent if not (r["ok"] and r["rows_bitwise"])]
    print("FAILURES" if failures else "all ok", len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
