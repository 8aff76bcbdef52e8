"""The kernels' settings as the benchmarks and device checks read and change them: one place.

The library's kernels take their tiles and K-split targets from a frozen KernelConfig (flashtree/kernels/
tiles.py, filled from FLASHTREE_* by flashtree/settings.py). A sweep keeps the config it is trying here,
changes it one setting at a time, and passes `kernels()` to every launch it times. The few module
constants a sweep still varies (SPLIT_TARGET, the attention's, EMULATE_PTX) are changed only here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

from flashtree import settings
from flashtree.kernels import attention, qmatmul
from flashtree.kernels.tiles import DEFAULT_TILES, DenseTiles, KernelConfig, TileConfig

_config = {"kernels": settings.current().kernels, "sum": (qmatmul.SUM_BLOCK, qmatmul.SUM_WARPS)}

# --- quantized matmul (kernels/qmatmul.py) --------------------------------------------------------------


def kernels() -> KernelConfig:
    """The kernel config a sweep has in force now: the process's settings plus the sweep's changes."""
    return _config["kernels"]


def _use(**change) -> None:
    _config["kernels"] = replace(kernels(), **change)


def qmm_arithmetic() -> str:
    """The packed matmuls' arithmetic of this process (FLASHTREE_QMM_ARITH; int8 when unset)."""
    return kernels().arithmetic_for(speculative=False)


def qmm(x, fields, qtype: int, rows: int, cols: int, arithmetic: str | None = None):
    """qmatmul.quant_matmul under the config in force (in `arithmetic`, default qmm_arithmetic())."""
    arithmetic = arithmetic or qmm_arithmetic()
    return qmatmul.quant_matmul(x, fields, qtype, rows, cols, arithmetic, kernels=kernels())


def qmm_tiles() -> dict[str, TileConfig]:
    """The tiles now in force, by bucket key ("m1", "b32", ... and a type's own, "b32:Q6_K")."""
    return dict(kernels().tiles)


def qmm_default_tile(key: str) -> TileConfig:
    return DEFAULT_TILES[key]


def qmm_tile_for(m: int, arithmetic: str, qtype: int) -> TileConfig:
    """The tile an M-row product on a `qtype` matrix takes now (its type's own, else its bucket's)."""
    return qmatmul.tile_for(m, arithmetic, qtype, kernels())


def set_qmm_tile(key: str, tile: TileConfig | None) -> None:
    """Put `tile` in force for bucket key `key`; None removes the key (a type's own tile: the type then
    takes its bucket's)."""
    tiles = qmm_tiles()
    if tile is None:
        tiles.pop(key, None)
    else:
        tiles[key] = tile
    _use(tiles=tiles)


def set_qmm_tiles(tiles: Mapping[str, TileConfig]) -> None:
    _use(tiles={**qmm_tiles(), **tiles})


def split_target() -> int:
    """The K-split target ((row, split) pairs per matrix) of matrices without their own."""
    return qmatmul.SPLIT_TARGET


def set_split_target(target: int) -> None:
    qmatmul.SPLIT_TARGET = target


def shape_split(key: str) -> int | None:
    """The K-split target of one matrix shape (split_key), if it has its own (FLASHTREE_QMM_SPLITS)."""
    return kernels().splits.get(key)


def clear_shape_splits() -> None:
    """Every matrix shape back to the shared target (SPLIT_TARGET)."""
    _use(splits={})


@contextmanager
def shape_split_set(key: str, target: int) -> Iterator[None]:
    """Inside: the matrices of split_key `key` cut with K-split target `target`; after: none of its own."""
    _use(splits={**kernels().splits, key: target})
    try:
        yield
    finally:
        _use(splits={k: v for k, v in kernels().splits.items() if k != key})


def sum_launch() -> tuple[int, int]:
    """The K-splits' summing launch (qmatmul.sum_splits): (sums a program, warps)."""
    return _config["sum"]


@contextmanager
def sum_launch_set(block: int, warps: int) -> Iterator[None]:
    """Inside: sum_splits launched with `block` sums a program and `warps` warps; after: as before."""
    before = sum_launch()
    _config["sum"] = (block, warps)
    try:
        yield
    finally:
        _config["sum"] = before


def sum_splits(y, parts) -> None:
    """qmatmul.sum_splits with the summing launch in force."""
    qmatmul.sum_splits(y, parts, *sum_launch())


@contextmanager
def emulated_ptx() -> Iterator[None]:
    """Inside: the packed kernels run the integer emulations of their inline PTX, on CUDA too."""
    qmatmul.EMULATE_PTX = True
    try:
        yield
    finally:
        qmatmul.EMULATE_PTX = False


# --- attention (kernels/attention.py) -------------------------------------------------------------------

ATTENTION_KNOBS = (
    "MAX_SPLIT", "SPLITS_PER_CACHE", "TILE_POSITIONS", "BF16_DOTS", "NUM_WARPS", "NUM_STAGES", "MAX_ROWS",
    "SHORT_ROWS", "ROWS_FROM_KEYS", "VERIFY_QUERIES", "WIDE_FROM_KEYS", "UNPACKED_QUERIES",
    "UNPACKED_FROM_KEYS", "COMBINE_SLOTS",
)  # fmt: skip


def attention_settings() -> dict:
    """The decode/verify attention's settings now in force, by name (ATTENTION_KNOBS)."""
    return {knob: getattr(attention, knob) for knob in ATTENTION_KNOBS}


@contextmanager
def attention_set(change: Mapping) -> Iterator[dict]:
    """Inside: the attention's settings with `change` applied (names of ATTENTION_KNOBS); yields them all.
    After: as before."""
    unknown = sorted(set(change) - set(ATTENTION_KNOBS))
    if unknown:
        raise ValueError(f"unknown attention settings {unknown} (known: {', '.join(ATTENTION_KNOBS)})")
    before = attention_settings()
    for knob, value in change.items():
        setattr(attention, knob, value)
    try:
        yield attention_settings()
    finally:
        for knob, value in before.items():
            setattr(attention, knob, value)


# --- the other kernels ----------------------------------------------------------------------------------


def delta_tile() -> tuple[int, int]:
    """The tree Gated DeltaNet kernel's tile (BV, warps; FLASHTREE_DELTA_TILE)."""
    return tuple(kernels().delta_tile)


def dense_default_tiles() -> DenseTiles:
    """The fp32 decode kernel's tile of matrices without their own (FLASHTREE_DENSE_TILES)."""
    return kernels().dense_tiles["default"]


@contextmanager
def triton_kernels(on: bool) -> Iterator[None]:
    """Inside: the model paths run our Triton kernels (on) or their torch ops (off), whatever the device
    (FLASHTREE_KERNELS=triton or torch, which kernels.triton_kernels_for reads); after: as before."""
    with settings.overriding("FLASHTREE_KERNELS", "triton" if on else "torch"):
        yield
