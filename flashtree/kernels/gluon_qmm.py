"""The bf16 Q4_K matmul for sm_90 in Gluon (explicit layouts), opt-in: FLASHTREE_QMM_KERNEL=gluon (issue #40).

Triton's `tl` kernel (qmatmul.py) spends ~1.3 of its 4.8 SASS instructions a weight moving the codes into
the wgmma A-operand layout (bench/results/cpu-sm90-qmm-sass-2026-12-07). Here the codes are loaded straight
into that layout and decoded in registers:

- Layout (`fragment_fields`, once at load; `unpack` inverts it): inside each row's 32-byte run of a Q4_K
  group pair (low nibbles: group 2p, high: group 2p + 1), value k = 16j + 8h + 2c + t moves to byte
  8c + 4j + 2t + h. Thread c of a quad (the fragment's k columns 2c, 2c + 1, 2c + 8, 2c + 9, + 16) then
  reads its row's 8 bytes with one 8-byte load, and in each word k, k + 1 sit in bytes 0 and 2:
  `(w >> s) & 0x000F000F | 0x43004300`, s = 0, 8, 4, 12, is a bf16x2 magic pair in register order.
- Numerics: the same as the `tl` kernel's bf16 path, op for op: scale = bf16(d * sc), shift = bf16(-dmin
  * mn), per weight fma(fma(128 + code, 1, -128), scale, shift) in bf16x2, one wgmma m64nBMk16 pair per
  32-value group into the fp32 accumulator in k order (A from registers, B = x from shared memory), the
  same K-splits and the same split sums (qmatmul.sum_splits). So its outputs equal the `tl` kernel's bit
  for bit (tests/gpu/test_gluon_qmm_gpu.py checks that on the device) and are batch-invariant alike.
"""

from __future__ import annotations

import torch

from flashtree.kernels import qmatmul
from flashtree.quant.formats import QT

# --- layout (torch, any device) -----------------------------------------------------------------------

RUN = 32  # bytes of one row's group pair: 64 values, two per byte


def _fragment_positions() -> torch.Tensor:
    """New byte position of value k (0-63 of a group pair, byte k % 32 of the GGUF run)."""
    k = torch.arange(RUN)
    j, h, c, t = k // 16, k // 8 % 2, k // 2 % 4, k % 2
    return 8 * c + 4 * j + 2 * t + h


POSITIONS = _fragment_positions()
ORDER = torch.argsort(POSITIONS)  # new byte p holds old byte ORDER[p]


def _permute_runs(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """q (n_blocks, 8, n_rows, 4) int32 (qmatmul.repack's Q4_K codes: chunk 2p + i holds bytes 16i..16i+15
    of group pair p's run) with every run's bytes reordered: new byte b = old byte index[b]."""
    n_blocks, _, n_rows, _ = q.shape
    runs = q.view(torch.uint8).view(n_blocks, 4, 2, n_rows, 16).permute(0, 1, 3, 2, 4)
    runs = runs.reshape(n_blocks, 4, n_rows, RUN)[..., index.to(q.device)]
    out = runs.view(n_blocks, 4, n_rows, 2, 16).permute(0, 1, 3, 2, 4).contiguous()
    return out.view(n_blocks, 8, n_rows, 16).view(torch.int32).view(q.shape)


def fragment_fields(fields: list[torch.Tensor]) -> list[torch.Tensor]:
    """qmatmul.repack's Q4_K fields (q, hdr) with q's runs in fragment order (the module doc); hdr shared."""
    q, hdr = fields
    return [_permute_runs(q, ORDER), hdr]


def standard_fields(fields: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `fragment_fields`."""
    q, hdr = fields
    return [_permute_runs(q, POSITIONS), hdr]


def unpack(fields: list[torch.Tensor], n_cols: int, rows: slice = slice(None)) -> torch.Tensor:
    """The GGUF rows (n_rows, row_bytes) uint8 of fragment-ordered Q4_K fields, bit for bit."""
    return qmatmul.unpack(standard_fields(fields), QT.Q4_K, n_cols, rows)


def fragment_codes(q: torch.Tensor) -> torch.Tensor:
    """The codes (n_rows, n_blocks * 256) as the kernel's bit ops read fragment-ordered q: thread c's word j
    of a run, shifted by 0, 8 (values k, k + 1 and k + 8, k + 9 of the low group) and 4, 12 (the high
    group), masked to the nibbles in bits 0-3 and 16-19 (the bf16x2 pair's low and high value)."""
    n_blocks, _, n_rows, _ = q.shape
    runs = q.view(torch.uint8).view(n_blocks, 4, 2, n_rows, 16).permute(3, 0, 1, 2, 4)
    words = runs.reshape(n_rows, n_blocks, 4, 4, 2, 4).to(torch.int64)  # (row, blk, p, c, j, byte)
    words = (words << (8 * torch.arange(4))).sum(-1)  # little-endian int32 words, as int64
    out = torch.empty(n_rows, n_blocks, 4, 2, 4, 2, 2, 2, dtype=torch.int64)  # (.., p, g, c, j, h, t)
    for g in range(2):
        for h in range(2):
            pair = (words >> (8 * h + 4 * g)) & 0x000F000F
            out[:, :, :, g, :, :, h, 0] = pair & 0xFFFF
            out[:, :, :, g, :, :, h, 1] = pair >> 16
    # value 64p + 32g + 16j + 8h + 2c + t
    return out.permute(0, 1, 2, 3, 5, 6, 4, 7).reshape(n_rows, n_blocks * 256)
