"""What compiling without fp fusion costs the kernels whose variants must agree bit for bit (no GPU needed).

    python -m benchmarks.sm90_fp_fusion OUT.json

The AR step, the verify and the commit's replay run different compiled variants of the tree DeltaNet,
tree conv and attention kernels (constexpr switches, a token count of 1 specialized). With fp fusion on,
whether a multiply and an add become one fma is the compiler's choice in each variant; off, every source
line rounds as written in all of them. Each variant's launch at the 27B's heads is recorded under
Triton's interpreter and compiled for sm_90 both ways (flashtree/kernels/sm90.py); printed: its SASS
instructions and the fp32 multiply / add / fma among them. A count, not a time: the time is the GPU's
`deltanet` / `attention` stages.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # record the launches on the CPU; sm90.py compiles without it

import torch  # noqa: E402

from flashtree.bench.run import provenance  # noqa: E402
from flashtree.kernels.attention import tree_attention  # noqa: E402
from flashtree.kernels.sm90 import compile_for_sm90, recording  # noqa: E402
from flashtree.kernels.tree_conv import tree_conv_silu  # noqa: E402
from flashtree.kernels.tree_deltanet import replay_path, tree_gated_delta_rule  # noqa: E402
from flashtree.models.block import BlockLayout  # noqa: E402

NK, NV, KD, VD = 16, 48, 128, 128  # the 27B's DeltaNet heads
N_HEADS, N_KV, HD = 24, 4, 256  # its attention heads
PARENTS = [-1, 0, 1, 0]  # a chain and a sibling: the verify's reload path compiled in
OPCODES = ("FFMA", "FMUL", "FADD")


def recorded(launch) -> dict:
    """The one kernel launch `launch()` makes, as sm90.py records it."""
    with recording() as records:
        launch()
    (record,) = records
    return record


def record_variants() -> list[tuple[str, dict]]:
    gen = torch.Generator().manual_seed(0)
    t = len(PARENTS)
    parents = torch.tensor(PARENTS, dtype=torch.int32)
    layout = BlockLayout.from_parents(parents.long())
    conv_out = torch.randn(t, 2 * NK * KD + NV * VD, generator=gen)
    alpha, beta = torch.randn(2, t, NV, generator=gen)
    dt_bias, ssm_a = torch.randn(NV, generator=gen), -torch.rand(NV, generator=gen)
    s0 = torch.randn(NV, KD, VD, generator=gen)
    state, gates = s0.clone(), torch.zeros(t, 2, NV)  # the replay compiles the same for any gates
    replayed = torch.stack([s0, s0]).contiguous()
    conv_state, weight = torch.randn(3, 64, generator=gen), torch.randn(64, 4, generator=gen)
    new, conv_now = torch.randn(t, 64, generator=gen), conv_state.clone()
    q, k, v = torch.randn(t, N_HEADS, HD).bfloat16(), *torch.randn(2, N_KV, 64, HD).bfloat16()
    keep = layout.restart_points().to(torch.int8)
    two_layers = torch.stack([conv_out, conv_out]), torch.stack([gates, gates])
    path, count = parents[:2] + 1, torch.tensor([2], dtype=torch.int32)

    def attention(rows: int):
        sub = BlockLayout.from_parents(parents[:rows].long())
        paths, depths = sub.paths().to(torch.int32), sub.depths.to(torch.int32)
        tree_attention(q[:rows], k, v, torch.tensor(32), paths, depths, 32 + rows, HD**-0.5)

    launches = {
        "tree DeltaNet, AR step (in place)": lambda: tree_gated_delta_rule(
            conv_out[:1], alpha[:1], beta[:1], dt_bias, ssm_a, state, parents[:1], NK, states=state[None]
        ),
        "tree DeltaNet, verify (gates, restart states)": lambda: tree_gated_delta_rule(
            conv_out, alpha, beta, dt_bias, ssm_a, s0, parents, NK, gates=gates, keep=keep
        ),
        "tree DeltaNet, commit replay": lambda: replay_path(*two_layers, path, count, replayed, NK),
        "tree conv, AR step": lambda: tree_conv_silu(
            conv_now, new[:1], torch.tensor([[0, 1, 2, 3]]), weight, windows=conv_now[None]
        ),
        "tree conv, verify": lambda: tree_conv_silu(
            conv_state, new, layout.conv_window_index(4), weight, windows=torch.empty(t, 3, 64)
        ),
        "attention, AR step": lambda: attention(1),
        "attention, verify": lambda: attention(t),
    }
    return [(name, recorded(launch)) for name, launch in launches.items()]


def main(out: Path) -> int:
    rows = []
    variants = record_variants()
    for fusion in (True, False):
        records = [r | {"options": r["options"] | {"enable_fp_fusion": fusion}} for _, r in variants]
        for (name, _), facts in zip(variants, compile_for_sm90(records, also="sass"), strict=True):
            if facts["failure"]:
                print(f"{name}: did not compile\n{facts['failure']}")
                return 1
            ops = facts["opcodes"]["kernel"]
            row = {"variant": name, "fp_fusion": fusion, "instructions": sum(ops.values())}
            rows.append(row | {op: ops.get(op, 0) for op in OPCODES})
    print(f"{'variant':<46} {'fusion':>6} {'instructions':>12} " + " ".join(f"{op:>5}" for op in OPCODES))
    for row in sorted(rows, key=lambda r: (r["variant"], not r["fp_fusion"])):
        print(f"{row['variant']:<46} {row['fp_fusion']!s:>6} {row['instructions']:>12} "
              + " ".join(f"{row[op]:>5}" for op in OPCODES))  # fmt: skip
    out.write_text(json.dumps({**provenance(), "variants": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "sm90_fp_fusion.json")))
