"""The decode step's three heaviest kernels, launched a few times each for Nsight Compute (H200/H100).

    ncu --set full -k regex:'_matvec_kernel|_matmul_kernel|_tree_gated' --launch-skip 2 --launch-count 3 \
        python -m benchmarks.ncu_kernels     (`python -m benchmarks ncu`: this, with its report as text)

Why: the 27B's two missed targets are bound by these kernels (bench/results/h100-step-2026-12-05): the
int8 one-row matvec (7.26 of the AR step's 8.62 ms of kernels, 0.74 of copy bandwidth), the bf16
tensor-core matmul at 23 rows (12.2 of the verify's 19.8 ms, 0.44 of copy) and the tree DeltaNet
(2.06 ms, ~1.8 us a token, latency-bound). Timings say how long they take; ncu's stall reasons, issue
rates and memory throughput say what holds them back, which a tile sweep cannot.

Each kernel runs at a 27B shape on random bytes: the FFN's gate/up matrix (17408 x 5120 Q4_K) at M = 1
int8 and at M = 23 bf16, and the delta rule over the 27B's 48 value heads along a 23-node tree. Three
launches each, in that order (the kernel filter and --launch-skip pick which ncu profiles).
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.gpu_deltanet import KD, NK, NV, TREE, VD
from flashtree.kernels.qmatmul import quant_matmul, repack
from flashtree.kernels.tree_deltanet import tree_gated_delta_rule
from flashtree.quant.formats import QT
from flashtree.quant.pack import random_blocks

ROWS, COLS = 17408, 5120
LAUNCHES = 5  # ncu skips the first two (compile and warm-up)


def main() -> None:
    device = torch.device("cuda")
    base = torch.from_numpy(random_blocks(QT.Q4_K, 256, COLS, np.random.default_rng(0)))
    fields = [f.to(device) for f in repack(base.repeat(ROWS // 256, 1).contiguous(), QT.Q4_K, COLS)]
    for m, arithmetic in ((1, "int8"), (23, "bf16")):
        x = torch.randn(m, COLS, device=device, dtype=torch.bfloat16)
        for _ in range(LAUNCHES):
            quant_matmul(x, fields, QT.Q4_K, ROWS, COLS, arithmetic)
    t = len(TREE)
    conv_out = torch.randn(t, 2 * NK * KD + NV * VD, device=device)
    projection = torch.randn(t, 2 * NV, device=device) * 3
    state = torch.randn(NV, KD, VD, device=device) * 0.3
    parents = torch.tensor(TREE, dtype=torch.int32, device=device)
    dt_bias, ssm_a = torch.randn(NV, device=device), -torch.rand(NV, device=device) * 2
    for _ in range(LAUNCHES):
        tree_gated_delta_rule(
            conv_out, projection[:, :NV], projection[:, NV:], dt_bias, ssm_a, state, parents, NK
        )
    torch.cuda.synchronize()
    print("launched", LAUNCHES, "of each kernel")


if __name__ == "__main__":
    main()
