"""The kernels' launch tables (tiles, K-split targets, arithmetic) and the frozen `KernelConfig` that carries
them from the settings to every launch. No triton here: the settings, the planner and the CPU path read
these tables without it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from flashtree.errors import FlashtreeError

ARITHMETICS = ("int8", "bf16")
QMM_KERNELS = ("triton", "gluon")  # gluon: kernels/gluon_qmm.py where it applies (opt-in, issue #40)


@dataclass(frozen=True)
class TileConfig:
    """A quantized-matmul launch: one per row bucket (and optionally per GGUF type in a bucket)."""

    rows: int  # BN: output rows per program (M = 1: one thread per row, so 32 * warps)
    warps: int
    stages: int  # Triton pipelining stages of the unit loop (the tensor-core kernel's loads)
    unroll: int = 1  # M = 1: units per loop step, their loads in flight together (M > 1: 1)
    fused_sum: int = 1  # K-splits added by the tile's last program (1) or by a second kernel (0)


# Keys: "m1" (M = 1, dp4a), "m16"/"m32"/"m64" (M padded to that many tensor-core columns); "b16"/"b32"/
# "b64" the bf16 arithmetic's buckets (M = 1 included); "BUCKET:TYPE" one GGUF type's own tile there.
# Chosen by device sweeps (bench/results/h100-q6k-tiles-2026-12-05 for b32:Q6_K).
DEFAULT_TILES: Mapping[str, TileConfig] = MappingProxyType({
    "m1": TileConfig(64, 2, 1, 2, 1),
    "m16": TileConfig(128, 4, 2, 1, 0),
    "m32": TileConfig(64, 4, 2, 1, 0),
    "m64": TileConfig(64, 4, 1, 1, 0),
    "b16": TileConfig(64, 4, 1, 1, 0),
    "b32": TileConfig(128, 4, 2, 1, 0),
    "b64": TileConfig(128, 4, 2, 1, 0),
    "b32:Q6_K": TileConfig(128, 4, 1, 1, 0),
})  # fmt: skip


@dataclass(frozen=True)
class DenseTiles:
    """A launch of the fp32 decode-row matmul (kernels/dense_matmul.py) for one matrix shape."""

    rows: int  # BN: output features per program
    k_block: int  # BK: K values per loop step
    warps: int
    stages: int
    programs: int  # K-splits are added until about this many programs run (qmatmul.k_splits)
    fused_sum: int = 1  # K-splits added by the tile's last program (1) or by a second launch (0)


# "default", or per matrix shape "NxK" (never per M: batch invariance): the default pair's own, each the
# fastest over a speculative step's calls in a device sweep (benchmarks' dense stage).
DEFAULT_DENSE_TILES: Mapping[str, DenseTiles] = MappingProxyType({
    "default": DenseTiles(rows=64, k_block=64, warps=4, stages=1, programs=264),
    "960x576": DenseTiles(16, 32, 4, 2, 264),  # q/k/v
    "576x576": DenseTiles(16, 128, 4, 1, 264),  # o
    "3072x576": DenseTiles(64, 64, 4, 1, 264, fused_sum=0),  # gate/up
    "576x1536": DenseTiles(16, 32, 4, 2, 264),  # down
    "576x2880": DenseTiles(32, 32, 4, 2, 264),  # the draft's fc
    "49152x576": DenseTiles(64, 64, 4, 1, 264, fused_sum=0),  # LM head
})  # fmt: skip


def _frozen(table: Mapping) -> Mapping:
    return MappingProxyType(dict(table))


@dataclass(frozen=True)
class KernelConfig:
    """What the GPU kernels launch with, fixed when an engine is built.

    arithmetic: the packed matmuls' (int8 or bf16; None: bf16 when speculating, int8 for plain decoding);
    tiles / dense_tiles: launch tables; splits: K-split targets per matrix ("ARITH:TYPE:NxK");
    dense_kernel: the fp32 decode-row kernel instead of cuBLAS (None: when speculating);
    delta_tile: the tree DeltaNet kernel's (BV, warps); qmm_kernel: the packed bf16 matmul's kernel
    (QMM_KERNELS)."""

    arithmetic: str | None = None
    tiles: Mapping[str, TileConfig] = field(default_factory=lambda: DEFAULT_TILES)
    splits: Mapping[str, int] = field(default_factory=dict)
    dense_kernel: bool | None = None
    dense_tiles: Mapping[str, DenseTiles] = field(default_factory=lambda: DEFAULT_DENSE_TILES)
    delta_tile: tuple[int, int] = (16, 1)
    qmm_kernel: str = "triton"

    def __post_init__(self) -> None:
        if self.arithmetic is not None and self.arithmetic not in ARITHMETICS:
            raise FlashtreeError(f"arithmetic {self.arithmetic!r}: expected one of {', '.join(ARITHMETICS)}")
        if self.qmm_kernel not in QMM_KERNELS:
            raise FlashtreeError(f"matmul kernel {self.qmm_kernel!r}: one of {', '.join(QMM_KERNELS)}")
        # the defaults' keys are known (tests/test_cli.py), and checking them would import gguf
        given = () if self.tiles is DEFAULT_TILES else self.tiles
        unknown = [key for key in given if not known_tile_key(key)]
        if unknown or not set(DEFAULT_TILES).issubset(self.tiles):
            raise FlashtreeError(f"matmul tiles: unknown keys {sorted(unknown)} or a bucket missing")
        if "default" not in self.dense_tiles:
            raise FlashtreeError('dense tiles: the "default" entry is missing')
        bv, warps = self.delta_tile
        if bv < 1 or bv & (bv - 1) or warps not in (1, 2, 4, 8):
            raise FlashtreeError(f"DeltaNet tile {self.delta_tile}: BV a power of two, warps 1, 2, 4 or 8")
        for name in ("tiles", "splits", "dense_tiles"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def arithmetic_for(self, speculative: bool) -> str:
        """The packed matmuls' arithmetic: the setting's if any, else bf16 for speculative decoding (its
        verify is faster) and int8 for plain decoding (its AR step is faster)."""
        return self.arithmetic or ("bf16" if speculative else "int8")

    def dense_kernel_for(self, speculative: bool) -> bool:
        """Whether fp32 decode rows run our batch-invariant kernel: the setting's if any, else when
        speculating (a verify row must equal the AR step's; cuBLAS's one-row GEMV is faster alone)."""
        return speculative if self.dense_kernel is None else self.dense_kernel

    def tile_for(self, key: str, type_name: str) -> TileConfig:
        """The tile of a bucket `key` for a matrix of GGUF type `type_name`: its own there if set."""
        return self.tiles.get(f"{key}:{type_name}", self.tiles[key])

    def dense_tiles_for(self, n: int, k: int) -> DenseTiles:
        return self.dense_tiles.get(f"{n}x{k}", self.dense_tiles["default"])


def known_tile_key(key: str) -> bool:
    from gguf import GGMLQuantizationType  # here: every command reads the settings, and they this module

    bucket, _, type_ = key.partition(":")
    return bucket in DEFAULT_TILES and (not type_ or type_ in GGMLQuantizationType.__members__)


DEFAULT_KERNELS = KernelConfig()
