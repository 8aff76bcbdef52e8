"""The kernels' module-level settings as the benchmarks and device checks read and change them: one place.

The kernels read their tiles, K-splits and switches from module attributes (qmatmul.TILES,
attention.MAX_SPLIT, ...), so a sweep sets an attribute, times, and sets the next. Every such read and
change goes through a helper here, so that when the kernels take their settings as arguments
(flashtree/settings.py) each helper changes in one place and no benchmark does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from flashtree import kernels
from flashtree.kernels import attention, dense_matmul, qmatmul, tree_deltanet
from flashtree.kernels.dense_matmul import DenseTiles
from flashtree.kernels.qmatmul import TileConfig

# --- quantized matmul (kernels/qmatmul.py) --------------------------------------------------------------


def qmm_arithmetic() -> str:
    """The packed matmuls' arithmetic of this process (FLASHTREE_QMM_ARITH): int8 or bf16."""
    return qmatmul.ARITHMETIC


def qmm_tiles() -> dict[str, TileConfig]:
    """The tiles now in force, by bucket key ("m1", "b32", ... and a type's own, "b32:Q6_K")."""
    return dict(qmatmul.TILES)


def qmm_default_tile(key: str) -> TileConfig:
    return qmatmul.DEFAULT_TILES[key]


def qmm_tile_for(m: int, arithmetic: str, qtype: int) -> TileConfig:
    """The tile an M-row product on a `qtype` matrix takes now (its type's own, else its bucket's)."""
    return qmatmul.tile_for(m, arithmetic, qtype)


def set_qmm_tile(key: str, tile: TileConfig | None) -> None:
    """Put `tile` in force for bucket key `key`; None removes the key (a type's own tile: the type then
    takes its bucket's)."""
    if tile is None:
        qmatmul.TILES.pop(key, None)
    else:
        qmatmul.TILES[key] = tile


def set_qmm_tiles(tiles: Mapping[str, TileConfig]) -> None:
    for key, tile in tiles.items():
        set_qmm_tile(key, tile)


def split_target() -> int:
    """The K-split target ((row, split) pairs per matrix) of matrices without their own."""
    return qmatmul.SPLIT_TARGET


def set_split_target(target: int) -> None:
    qmatmul.SPLIT_TARGET = target


def shape_split(key: str) -> int | None:
    """The K-split target of one matrix shape (split_key), if it has its own (FLASHTREE_QMM_SPLITS)."""
    return qmatmul.SHAPE_SPLITS.get(key)


def clear_shape_splits() -> None:
    """Every matrix shape back to the shared target (SPLIT_TARGET)."""
    qmatmul.SHAPE_SPLITS.clear()


@contextmanager
def shape_split_set(key: str, target: int) -> Iterator[None]:
    """Inside: the matrices of split_key `key` cut with K-split target `target`; after: none of its own."""
    qmatmul.SHAPE_SPLITS[key] = target
    try:
        yield
    finally:
        qmatmul.SHAPE_SPLITS.pop(key, None)


def sum_launch() -> tuple[int, int]:
    """The K-splits' summing launch (qmatmul.sum_splits): (sums a program, warps)."""
    return qmatmul.SUM_BLOCK, qmatmul.SUM_WARPS


@contextmanager
def sum_launch_set(block: int, warps: int) -> Iterator[None]:
    """Inside: sum_splits launched with `block` sums a program and `warps` warps; after: as before."""
    before = sum_launch()
    qmatmul.SUM_BLOCK, qmatmul.SUM_WARPS = block, warps
    try:
        yield
    finally:
        qmatmul.SUM_BLOCK, qmatmul.SUM_WARPS = before


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
    "SHORT_ROWS", "ROWS_FROM_KEYS", "VERIFY_QUERIES", "WIDE_FROM_KEYS",
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
    """The tree Gated DeltaNet kernel's default tile (BV, warps; FLASHTREE_DELTA_TILE)."""
    return tuple(tree_deltanet.TILE)


def dense_default_tiles() -> DenseTiles:
    """The fp32 decode kernel's tile of matrices without their own (FLASHTREE_DENSE_TILES)."""
    return dense_matmul.DEFAULT_TILES


@contextmanager
def triton_kernels(on: bool) -> Iterator[None]:
    """Inside: the model paths run our Triton kernels (on) or their torch ops (off), whatever the device
    (kernels.triton_kernels_for); after: as before."""
    before = kernels.triton_kernels_for
    kernels.triton_kernels_for = lambda x: on
    try:
        yield
    finally:
        kernels.triton_kernels_for = before
