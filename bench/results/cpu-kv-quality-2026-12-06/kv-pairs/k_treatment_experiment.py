"""K (and V) treatments for 3.5-bit keys, emulated on the CPU's torch path around benchmarks.kv_quality
(an experiment, not flashtree code; issue #39's "tq3_0 within 3 % of bf16").

The cache is allocated f32 for K and V; `KVCache.write_rotated` is replaced by one that RoPEs q and k as
the torch path does, then stores each K / V row as the value its treatment reads back (quantize, then
dequantize, then undo the treatment's exact transforms), so every logit reads the emulated cache. Every
transform is fixed per sequence once the first write of a layer (the first prefill chunk, 256 tokens)
has set it, or per position (the first SINKS keys exact): an AR step and a verify of the same rows would
store the same values.

Treatments of K (stats over the first chunk, its sink rows left out; head = KV head):
- codes: tq3 (tq3_0: signs + Walsh-Hadamard over 64, 8-level Lloyd-Max, fp16 scale per 32; 3.5 bits),
  tq3nr (the same codes and scales without the rotation), q4 (q4_0, 4.5), q8 (q8_0, 8.5), none (f32).
- smooth: subtract the head's mean key m (exact: q.m is the same for every key of a query).
- scale s (per head, per channel; k' = (k - m) / s, q' = q * s, exact): rms (s = rms of k - m),
  bal (s = sqrt(rms_k / rms_q): minimizes E[(q . err)^2] for an error spread evenly over channels, the
  Cauchy-Schwarz optimum of sum q_j^2 s_j^2 * sum k_j^2 / s_j^2), sq (SmoothQuant alpha = 0.5,
  s = sqrt(max|k| / max|q|)); pair=1 ties s over each RoPE pair (j, j + hd/2), which makes the diagonal
  commute with RoPE (its stats are then position-free). q's stats over the KV head's query heads.
- full: the matrix form of bal: k' = A (k - m), q' = A^-T q with A^T A = P, P C_k P = C_q (the
  geometric mean of C_k^-1 and C_q, C the head's second moments over the first chunk): minimizes
  tr(P^-1 C_q) tr(P C_k).
- sinks: the first N keys kept exact (bf16 in a build; f32 here).
- layers: only these layers' K in `codes`, the rest in `other` (per-layer sensitivity, mixed types).
V: the same knobs (vcodes, vsmooth: subtract the head's mean value, exact since the softmax weights sum
to 1).

    OMP_NUM_THREADS=1 PYTHONPATH=. python3 k_treatment_experiment.py --len 1024 \
        --out kv_treatments-1024.json --runs NAME[,NAME@SEED...]   (names: RUNS below)
    python3 k_treatment_experiment.py --table kv_treatments-1024-seeds.json
"""

import argparse
import json
import math
import time
from functools import cache
from pathlib import Path

import torch

import benchmarks.kv_quality as kv_quality
from flashtree.engine.generate import Engine
from flashtree.models import state
from flashtree.models.layers import apply_rotary
from flashtree.quant.kv import BLOCK, _hadamard, dequantize, quantize

PLAIN_WRITE_ROTATED = state.KVCache.write_rotated
# Lloyd-Max quantizers of a unit Gaussian (8 levels: tq3_0's CENTROIDS)
LLOYD_MAX = {
    2: (0.4527800, 1.5104176),
    3: (0.2450942, 0.7560052, 1.3439092, 2.1519797),
    4: (0.1283950, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896),
}

V3 = {"vcodes": "tq3"}  # V as tq3_0, the target pair
RUNS = {
    "f32": {"codes": "none", "vcodes": "none"},
    "vtq3": {"codes": "none", **V3},
    "vtq3_smooth": {"codes": "none", **V3, "vsmooth": True},
    "tq3": {"codes": "tq3", **V3},
    "tq3_smooth": {"codes": "tq3", "smooth": True, **V3},
    "tq3_rms": {"codes": "tq3", "smooth": True, "scale": "rms", **V3},
    "tq3_rms_pair": {"codes": "tq3", "smooth": True, "scale": "rms", "pair": True, **V3},
    "tq3_bal": {"codes": "tq3", "smooth": True, "scale": "bal", **V3},
    "tq3_bal_pair": {"codes": "tq3", "smooth": True, "scale": "bal", "pair": True, **V3},
    "tq3_sq": {"codes": "tq3", "smooth": True, "scale": "sq", **V3},
    "tq3_full": {"codes": "tq3", "smooth": True, "scale": "full", **V3},
    "tq3nr_bal_pair": {"codes": "tq3nr", "smooth": True, "scale": "bal", "pair": True, **V3},
    "tq3nr_rms_pair": {"codes": "tq3nr", "smooth": True, "scale": "rms", "pair": True, **V3},
    "tq3_smooth_s1": {"codes": "tq3", "smooth": True, "sinks": 1, **V3},
    "tq3_bal_pair_s1": {"codes": "tq3", "smooth": True, "scale": "bal", "pair": True, "sinks": 1, **V3},
    "tq3_bal_pair_s4": {"codes": "tq3", "smooth": True, "scale": "bal", "pair": True, "sinks": 4, **V3},
    "tq3_full_s1": {"codes": "tq3", "smooth": True, "scale": "full", "sinks": 1, **V3},
    "tq3_full_s4": {"codes": "tq3", "smooth": True, "scale": "full", "sinks": 4, **V3},
}
for _i in range(30):  # K tq3_0 in layer i alone, V exact: which layers' keys carry the loss
    RUNS[f"only{_i}"] = {"codes": "tq3", "layers": [_i], "other": "none", "vcodes": "none"}

RUNS["engine_tq3_0"] = {"engine": "tq3_0/tq3_0"}  # the engine's own path, for the emulation's check
RUNS["engine_tq3_0_k"] = {"engine": "tq3_0/f32"}
RUNS["tq3_vnone"] = {"codes": "tq3", "vcodes": "none"}
for _seed in (1, 2, 3):  # another rotation's signs: how much the PPL moves with which values round where
    RUNS[f"tq3_seed{_seed}"] = {"codes": "tq3", **V3, "seed": _seed}
    RUNS[f"tq3_sq_seed{_seed}"] = {"codes": "tq3", "smooth": True, "scale": "sq", **V3, "seed": _seed}
    RUNS[f"tq3_bal_seed{_seed}"] = {"codes": "tq3", "smooth": True, "scale": "bal", **V3, "seed": _seed}
for _a in (0.3, 0.7, 1.0):  # s = rms_k^a / rms_q^(1 - a)
    RUNS[f"tq3_bal_a{_a}"] = {"codes": "tq3", "smooth": True, "scale": "bal", "alpha": _a, **V3}
RUNS["tq4_bal_v2"] = {"codes": "tq4", "smooth": True, "scale": "bal", "vcodes": "tq2"}  # 4.5 + 2.5 bits
RUNS["tq4_bal"] = {"codes": "tq4", "smooth": True, "scale": "bal", **V3}  # 4.5 + 3.5
RUNS["q4_bal"] = {"codes": "q4", "smooth": True, "scale": "bal", **V3}
RUNS["q4_smooth"] = {"codes": "q4", "smooth": True, **V3}
RUNS["vtq2"] = {"codes": "none", "vcodes": "tq2"}
for _n in (2, 4):  # the n channels of largest q-weighted energy E[q_j^2] E[k_j^2] kept exact (bf16)
    RUNS[f"tq3_bal_keep{_n}"] = {"codes": "tq3", "smooth": True, "scale": "bal", "keep": _n, **V3}

RUNS["tok3_smooth"] = {"codes": "tok3", "smooth": True, **V3}
RUNS["tokr3_smooth"] = {"codes": "tokr3", "smooth": True, **V3}
RUNS["tok3"] = {"codes": "tok3", **V3}
RUNS["tok3_smooth_vnone"] = {"codes": "tok3", "smooth": True, "vcodes": "none"}
for _seed in (1, 2, 3):
    RUNS[f"tokr3_smooth_seed{_seed}"] = {"codes": "tokr3", "smooth": True, **V3, "seed": _seed}

B = {"codes": "tq3", "smooth": True, "scale": "bal", **V3}  # smoothed and balanced tq3_0 K
RUNS["tq3_bal_s1"] = {**B, "sinks": 1}
RUNS["tq3_sq_s1"] = {**B, "scale": "sq", "sinks": 1}
RUNS["tq3_bal_keep2_s1"] = {**B, "keep": 2, "sinks": 1}
RUNS["pre_tq3_smooth"] = {"codes": "tq3", "smooth": True, "prerope": True, **V3}
RUNS["pre_tq3_bal"] = {**B, "prerope": True}
RUNS["pre_tq3_bal_s1"] = {**B, "prerope": True, "sinks": 1}
RUNS["pre_tok3_smooth"] = {"codes": "tok3", "smooth": True, "prerope": True, **V3}
RUNS["pre_tokr3_smooth"] = {"codes": "tokr3", "smooth": True, "prerope": True, **V3}
RUNS["pre_tok3_smooth_s1"] = {"codes": "tok3", "smooth": True, "prerope": True, "sinks": 1, **V3}
RUNS["pre_tok4_smooth"] = {"codes": "tok4", "smooth": True, "prerope": True, **V3}
# K q8_0 in the layers whose tq3_0 K costs most alone (1024 tokens: 10, 19, 9, 23, 16, 13), the rest
# smoothed and balanced tq3_0
for _n, _ls in ((1, [10]), (2, [10, 19]), (3, [10, 19, 9]), (6, [10, 19, 9, 23, 16, 13])):
    RUNS[f"q8x{_n}_bal"] = {**B, "codes": "q8", "layers": _ls, "other": "tq3"}
    RUNS[f"q8x{_n}_bal_s1"] = {**B, "codes": "q8", "layers": _ls, "other": "tq3", "sinks": 1}
    RUNS[f"q8x{_n}_plain"] = {"codes": "q8", "layers": _ls, "other": "tq3", **V3}

RUNS["tq5_bal"] = {**B, "codes": "tq5"}  # 5.5-bit K (32 levels), 3.5-bit V
RUNS["tq5_bal_s1"] = {**B, "codes": "tq5", "sinks": 1}
RUNS["tq4_bal_s1"] = {**B, "codes": "tq4", "sinks": 1}
RUNS["tq6_bal"] = {**B, "codes": "tq6"}
RUNS["q8_vtq3"] = {"codes": "q8", **V3}

P = {**B, "prerope": True, "sinks": 1}  # pre-RoPE, smoothed, balanced tq3_0 K, the first key exact
RUNS["pre_tq3_full_s1"] = {**P, "scale": "full"}
RUNS["pre_tq3_full"] = {**P, "scale": "full", "sinks": 0}
RUNS["pre_tq3_bal_keep2_s1"] = {**P, "keep": 2}
RUNS["pre_tq3_sq_s1"] = {**P, "scale": "sq"}
RUNS["pre_tq3_bal_s4"] = {**P, "sinks": 4}
RUNS["pre_tq3_bal_a0.7_s1"] = {**P, "alpha": 0.7}
RUNS["pre_tq3_bal_a0.3_s1"] = {**P, "alpha": 0.3}
RUNS["pre_tq3_smooth_s1"] = {**P, "scale": None}
RUNS["pre_tokr3_smooth_s1"] = {**P, "codes": "tokr3", "scale": None}
RUNS["pre_tokr3_bal_s1"] = {**P, "codes": "tokr3"}
RUNS["pre_tq4_bal_s1"] = {**P, "codes": "tq4"}
RUNS["pre_tq5_bal_s1"] = {**P, "codes": "tq5"}
RUNS["pre_q8x3_bal_s1"] = {**P, "codes": "q8", "layers": [10, 19, 9], "other": "tq3"}
RUNS["pre_q8x6_bal_s1"] = {**P, "codes": "q8", "layers": [10, 19, 9, 23, 16, 13], "other": "tq3"}
RUNS["pre_tq3_bal_s1_vnone"] = {**P, "vcodes": "none"}
RUNS["pre_tq3_full_s1_vnone"] = {**P, "scale": "full", "vcodes": "none"}

for _name in ("pre_tq3_bal_s1", "pre_tq3_full_s1", "vtq3"):
    RUNS[f"{_name}_vbal"] = {**RUNS[_name], "vbal": True}
    RUNS[f"{_name}_vbal_vsmooth"] = {**RUNS[_name], "vbal": True, "vsmooth": True}

RUNS["tq3nr_bal"] = {**B, "codes": "tq3nr"}  # the balancing without the Hadamard rotation
RUNS["tq3nr_rms"] = {**B, "codes": "tq3nr", "scale": "rms"}
RUNS["pre_tq3nr_bal_s1"] = {**P, "codes": "tq3nr"}
RUNS["pre_tq3nr_full_s1"] = {**P, "codes": "tq3nr", "scale": "full"}

LAYER, STATS, O_NORMS = {}, {}, {}
CFG: dict = {}


def signs(hd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tq3_0's two sign vectors for seed 0 (rotation_signs), another pair for other seeds."""
    g = torch.Generator().manual_seed(0x7E3A + hd + 1000 * seed)
    return (torch.randint(0, 2, (2 * hd,), generator=g) * 2 - 1).float().split(hd)


@cache
def lloyd_max_table(bits: int) -> torch.Tensor:
    """The positive half of the 2^bits-level Lloyd-Max quantizer of a unit Gaussian, by iteration."""
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    c = torch.linspace(-3.5, 3.5, 2**bits, dtype=torch.float64)
    for _ in range(3000):
        t = torch.cat([torch.tensor([-40.0]), (c[1:] + c[:-1]) / 2, torch.tensor([40.0])]).double()
        pdf = normal.log_prob(t).exp()
        c = (pdf[:-1] - pdf[1:]) / (normal.cdf(t[1:]) - normal.cdf(t[:-1]))
    return c[2 ** (bits - 1) :].float()


def lloyd_max(x: torch.Tensor, bits: int) -> torch.Tensor:
    """tq3_0's block quantizer (nearest level of x / rms, least-squares fp16 scale, nearest again) with
    the 2^bits-level Lloyd-Max table, x (..., hd) -> its dequantized values."""
    half = torch.tensor(LLOYD_MAX[bits]) if bits in LLOYD_MAX else lloyd_max_table(bits)
    table = torch.cat([-half.flip(0), half])
    bounds = (table[1:] + table[:-1]) / 2
    y = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    rms = (y * y).mean(-1, keepdim=True).sqrt()
    c = table[torch.bucketize(y / rms.clamp_min(1e-30), bounds)]
    d = ((y * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)).half().float()
    c = table[torch.bucketize(y / d.clamp_min(1e-30), bounds)]
    return (c * d).reshape(x.shape)


def codes(x: torch.Tensor, kind: str, seed: int = 0) -> torch.Tensor:
    """x (..., hd) fp32 through `kind`'s quantize -> dequantize, back in x's domain (tq*: the signs,
    Walsh-Hadamard and signs of tq3_0's rotation; seed 0 is tq3_0's own)."""
    if kind == "none":
        return x
    if kind.startswith("tok"):  # KIVI-like: each channel's blocks of 32 consecutive positions (tokr: rotated)
        t = x.shape[0]
        assert t % BLOCK == 0, "whole token groups only (prefill chunks of 256)"
        y = x.reshape(t // BLOCK, BLOCK, *x.shape[1:]).movedim(1, -1)  # (groups, n_kv, hd, 32)
        return (
            codes(y, "tq" + kind[-1] + ("" if kind.startswith("tokr") else "nr"), seed)
            .movedim(-1, 1)
            .reshape(x.shape)
        )
    if kind.startswith("tq"):
        hd = x.shape[-1]
        first, second = signs(hd, seed)
        rot = not kind.endswith("nr")
        y = _hadamard(x * first, hd) * second if rot else x
        y = lloyd_max(y, int(kind[2]))
        return _hadamard(y * second, hd) * first if rot else y
    return dequantize(quantize(x, {"q4": "q4_0", "q8": "q8_0"}[kind]))


def pair_tied(x: torch.Tensor) -> torch.Tensor:
    """Per-channel second moments (..., hd) -> each RoPE pair's mean of the two, on both channels."""
    a, b = x.chunk(2, dim=-1)
    m = (a + b) / 2
    return torch.cat([m, m], dim=-1)


def sqrtm(c: torch.Tensor) -> torch.Tensor:
    w, u = torch.linalg.eigh(c)
    return u @ torch.diag_embed(w.clamp_min(0).sqrt()) @ u.transpose(-1, -2)


def k_transform(k: torch.Tensor, q: torch.Tensor, cfg: dict) -> dict:
    """The head's fixed transform from the first chunk's rotated k (T, n_kv, hd) and q (T, heads, hd)."""
    t, n_kv, hd = k.shape
    qg = q.reshape(t, n_kv, q.shape[1] // n_kv, hd).transpose(1, 2).reshape(-1, n_kv, hd)  # GQA groups
    m = k.mean(0) if cfg.get("smooth") else torch.zeros(n_kv, hd, dtype=torch.float64)
    kc = k - m
    out = {"m": m}
    scale = cfg.get("scale")
    if scale in ("rms", "bal", "sq"):
        k2, q2 = (kc * kc).mean(0), (qg * qg).mean(0)
        if cfg.get("pair"):
            k2, q2 = pair_tied(k2), pair_tied(q2)
        if scale == "rms":
            s = k2.sqrt()
        elif scale == "bal":
            a = cfg.get("alpha", 0.5)
            s = k2.sqrt() ** a / q2.sqrt() ** (1 - a)
        else:
            s = (kc.abs().amax(0) / qg.abs().amax(0)).sqrt()
        out["s"] = s.clamp_min(1e-6 * s.max())
    if cfg.get("keep"):
        energy = (kc * kc).mean(0) * (qg * qg).mean(0)
        keep = torch.zeros(n_kv, hd, dtype=torch.bool)
        keep.scatter_(1, energy.topk(cfg["keep"], dim=-1).indices, True)
        out["keep"] = keep
    elif scale == "full":
        ck = torch.einsum("thi,thj->hij", kc, kc) / t
        cq = torch.einsum("thi,thj->hij", qg, qg) / qg.shape[0]
        eye = torch.eye(hd, dtype=ck.dtype) * 1e-6
        ck = ck + eye * ck.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
        cq = cq + eye * cq.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
        rk = sqrtm(ck)
        rk_inv = torch.linalg.inv(rk)
        p = rk_inv @ sqrtm(rk @ cq @ rk) @ rk_inv  # P C_k P = C_q, P symmetric positive definite
        a = sqrtm(p)  # A^T A = P (A symmetric)
        out["a"], out["a_inv"] = a, torch.linalg.inv(a)
    return out


def treat(x: torch.Tensor, tr: dict, kind: str, seed: int = 0) -> torch.Tensor:
    """x (T, n_kv, hd) fp64 through its transform, the codes, and back (kept channels: zeroed before
    the codes, then bf16)."""
    y = x - tr["m"]
    keep = tr.get("keep")
    kept = y
    if keep is not None:
        y = torch.where(keep, 0.0, y)
    if "s" in tr:
        y = codes((y / tr["s"]).float(), kind, seed).double() * tr["s"]
    elif "a" in tr:
        z = torch.einsum("hij,thj->thi", tr["a"], y)
        y = torch.einsum("hij,thj->thi", tr["a_inv"], codes(z.float(), kind, seed).double())
    else:
        y = codes(y.float(), kind, seed).double()
    if keep is not None:
        y = torch.where(keep, kept.to(torch.bfloat16).double(), y)
    return y + tr["m"]


def write_rotated(self, slots, q, k, v, cos, sin, norms=None):
    assert norms is None  # SmolLM2 has no q/k norms
    layer = LAYER.setdefault(self.k.data.data_ptr(), len(LAYER))
    qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    sinks = CFG.get("sinks", 0)
    pre = CFG.get("prerope")  # K quantized before RoPE (KVQuant): the read adds m, multiplies s, RoPEs
    kd, vd, qd = (k if pre else kr).double(), v.double(), (q if pre else qr).double()
    if layer not in STATS:  # the first write of this layer: the sequence's fixed transforms
        rest = slice(sinks, None) if k.shape[0] > sinks + 8 else slice(None)
        vm = vd[rest].mean(0) if CFG.get("vsmooth") else torch.zeros_like(vd[0])
        vtr = {"m": vm}
        if CFG.get("vbal"):  # v' = v / s, s = sqrt(rms_v / |W_o column|): the output error through o_proj
            vc = vd[rest] - vm
            vtr["s"] = ((vc * vc).mean(0).sqrt() / O_NORMS[layer]).sqrt()
        STATS[layer] = (k_transform(kd[rest], qd[rest], CFG), vtr)
    ktr, vtr = STATS[layer]
    layers = CFG.get("layers")
    kkind = CFG["codes"] if layers is None or layer in layers else CFG.get("other", "none")
    khat = treat(kd, ktr, kkind, CFG.get("seed", 0))
    vhat = treat(vd, vtr, CFG.get("vcodes", "none"), CFG.get("seed", 0))
    if pre:
        khat = apply_rotary(khat.float(), cos, sin).double()
    if sinks:
        exact = (slots < sinks)[:, None, None]
        khat = torch.where(exact, kr.double(), khat)
    self.write(slots, khat.float(), vhat.float())
    return qr


state.KVCache.write_rotated = write_rotated


def table(path: Path) -> None:
    """Each run of a JSON over its rotation seeds (NAME@SEED): the geometric mean PPL, % vs f32, range."""
    runs = json.loads(path.read_text())["runs"]
    ref, groups = runs["f32"]["ppl"], {}
    for name, r in runs.items():
        groups.setdefault(name.partition("@")[0], []).append(r["ppl"])
    for name, ppls in groups.items():
        mean = math.exp(sum(map(math.log, ppls)) / len(ppls))
        rel, lo, hi = (100 * (p / ref - 1) for p in (mean, min(ppls), max(ppls)))
        print(f"| {name} | {len(ppls)} | {mean:.4f} | {rel:+.1f} % | {lo:+.1f} .. {hi:+.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", type=Path, help="print a JSON's table and exit")
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--runs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.table:
        table(args.table)
        return
    torch.set_grad_enabled(False)
    base = Engine.load(mode="tree", device="cpu", max_ctx=kv_quality.MAX_CTX)
    seqs = kv_quality.held_out(base.tokenizer, 1, args.len)
    for i, block in enumerate(base.target.layers):  # each V channel's weight in o_proj, per KV head
        mixer = block.mixer
        n_kv, hd = mixer.n_kv_heads, mixer.head_dim
        cols = mixer.o(torch.eye(mixer.n_heads * hd)).double()  # row c: W_o's column c
        norms = (cols * cols).sum(-1).reshape(n_kv, mixer.n_heads // n_kv, hd).sum(1).sqrt()
        O_NORMS[i] = norms
    report = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    report.update(commit=kv_quality.git_commit(), threads=torch.get_num_threads(), len=args.len,
                  chunk=args.chunk, ppl_modules=kv_quality.PPL_MODULES)  # fmt: skip
    for name in args.runs.split(","):
        CFG.clear()
        base_name, _, seed = name.partition("@")  # NAME@SEED: the run with another rotation's signs
        CFG.update(RUNS[base_name], **({"seed": int(seed)} if seed else {}))
        LAYER.clear()
        STATS.clear()
        t0 = time.time()
        state.KVCache.write_rotated = PLAIN_WRITE_ROTATED if "engine" in CFG else write_rotated
        r = kv_quality.perplexity(base.target, CFG.get("engine", "f32"), seqs, args.chunk)
        ref = report["runs"].get("f32", {}).get("ppl")
        rel = f" ({100 * (r['ppl'] / ref - 1):+.2f} % vs f32)" if ref else ""
        kv_quality.say(f"{name}: ppl {r['ppl']:.4f}{rel} in {time.time() - t0:.0f} s")
        report["runs"][name] = {"cfg": dict(CFG), "ppl": r["ppl"], "tokens": r["tokens"],
                                "nll": math.log(r["ppl"])}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
