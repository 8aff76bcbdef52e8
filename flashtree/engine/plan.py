"""The memory plan: every byte a run holds on the device, from a GGUF's header (or a synth shape) alone.

The weights are planned by building the target (and the draft) on the `meta` device with the loader's
own code (models/loader.py, models/dflash.py): the same tensors, types and layouts a load allocates, and
no byte of a weight read. The state is planned from the built modules as the engine allocates it: the
KV cache in its types (quant/kv.py), the Gated DeltaNet recurrent and conv state, a verify's pending
state (DeltaNetStore.pending_bytes), the draft's target-feature ring (spec/decoder.py). What the
allocator holds beyond tensors (activations, workspaces, CUDA graphs) is estimated by the constants
below. `flashtree plan` prints it; Engine.load checks it before any weight is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from flashtree.config import DEFAULT_CONTEXT_CAP, MAX_CONTEXT
from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import TensorInfo
from flashtree.models.config import DraftConfig, ModelConfig

GIB = 1 << 30
META = torch.device("meta")
DEFAULT_DRAFT_CTX = 4096  # SpecConfig.draft_ctx: the ring of past target features the draft attends to
DRAFT_DTYPES = {"bf16": "off", "fp8": "matrices"}  # --draft-dtype -> the draft's fp8 mode (kernels/fp8.py)

# What the allocator holds beyond the planned tensors, in one place. Activations: room for a prefill
# chunk of ACTIVATION_TOKENS, as prefill.py sizes a chunk (its per-token activations, within 1 /
# FREE_SHARE of the free memory: it takes longer chunks where more is free); the logits of a verify
# block and of the draft's block, fp32, with a softmax's copy. RUNTIME_RESERVE: cuBLAS and Triton
# workspaces (split-K partial sums), the CUDA graphs' pool beyond one step's activations and the caching
# allocator's rounding: an estimate, to be checked against measured peaks.
ACTIVATION_TOKENS = 128
RUNTIME_RESERVE = 512 << 20


class TensorTable:
    """A model's tensor table without a file (a synth shape's): what Weights reads on `meta`."""

    def __init__(self, tensors: dict[str, TensorInfo], path: str):
        self.tensors, self.path = tensors, Path(path)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise FlashtreeError(f"{self.path}: missing tensor {name!r}")
        return self.tensors[name]

    @staticmethod
    def of_shape(shape: str, type: str) -> tuple[ModelConfig, TensorTable]:
        """The config and tensor table `flashtree synth --shape SHAPE --type TYPE` writes."""
        from flashtree.convert.shapes import get_shape
        from flashtree.convert.synth import synth_plan

        config = get_shape(shape)
        infos = {
            t.name: TensorInfo(t.name, t.qtype, t.spec.shape, t.nbytes) for t in synth_plan(config, type)
        }
        return config, TensorTable(infos, f"--shape {shape}")


def module_bytes(*modules: nn.Module) -> int:
    """Bytes of the storages behind the modules' parameters and buffers, each storage once (a tied LM
    head shares the embedding's): on `meta` as on a real device."""
    storages = {}
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            storage = t.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


@dataclass
class PlanOptions:
    """What a run is asked to do, as far as memory goes: the KV types (None: the model's dtype), the
    speculative mode (ar without a draft) and its sizes."""

    kv_type_k: str | None = None
    kv_type_v: str | None = None
    mode: str = "tree"
    budget: int = 22
    block_size: int | None = None
    draft_ctx: int = DEFAULT_DRAFT_CTX


@dataclass
class MemoryPlan:
    """The plan at one context length: (component, bytes, note) rows and their total."""

    max_ctx: int
    rows: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.rows)

    def as_dict(self) -> dict:
        parts = {name: {"bytes": b, "note": note} for name, b, note in self.rows}
        return {"max_ctx": self.max_ctx, "components": parts, "total_bytes": self.total}


class Planner:
    """A target (and draft) built on `meta`, and the memory a run of it holds at any context length."""

    def __init__(
        self, target: nn.Module, draft: nn.Module | None, options: PlanOptions, device_type: str = "cuda"
    ):
        self.target, self.draft, self.options, self.device_type = target, draft, options, device_type
        self.speculative = draft is not None and options.mode != "ar"
        self.block_size = options.block_size or (draft.config.block_size if draft is not None else 1)
        tree = options.mode == "tree"
        self.max_block = (1 + (options.budget if tree else self.block_size - 1)) if self.speculative else 1
        self.attention = [m for m in target.mixers if not hasattr(m, "conv_weight")]

    def kv_bytes(self, max_ctx: int) -> int:
        """The KV cache of a `max_ctx` context: the engine allocates max_ctx + one verify block of slots."""
        from flashtree.quant.kv import resolve_kv_type, vector_bytes

        slots = max_ctx + self.max_block
        per_slot = sum(
            m.n_kv_heads * vector_bytes(resolve_kv_type(kind, self.target.dtype), m.head_dim)
            for m in self.attention
            for kind in (self.options.kv_type_k, self.options.kv_type_v)
        )
        return per_slot * slots

    def fixed_rows(self) -> list[tuple[str, int, str]]:
        """Every row but the KV cache's: they do not depend on the context length."""
        t, c = self.target, self.target.config
        rows = [("target weights", module_bytes(t), f"{c.arch}, {dtype_name(t.dtype)} compute")]
        if self.draft is not None:
            n = self.draft.config.n_layers
            note = f"{n} layer{'s' * (n != 1)}, {_draft_dtype(self.draft)} matrices"
            rows.append(("draft weights", module_bytes(self.draft), note))
        rows.append(("DeltaNet state", t.state_bytes(0), "recurrent fp32 + conv window"))
        if self.speculative:
            note = f"{self.max_block}-token verify"
            rows.append(("verify pending state", t.pending_bytes(self.max_block), note))
            rows.append(("draft context ring", self.ring_bytes(), f"{self.options.draft_ctx} slots"))
        rows.append(("activations + workspace", self.workspace_bytes(), "estimate: plan.py's constants"))
        return rows

    def ring_bytes(self) -> int:
        from flashtree.spec.decoder import ring_bytes

        ring = self.options.draft_ctx + self.max_block  # spare slots take a step's padded rows
        return ring_bytes(self.draft, ring + self.block_size) + 8 * (ring + self.block_size + 1)

    def workspace_bytes(self) -> int:
        from flashtree.engine.prefill import FREE_SHARE, activation_bytes

        c = self.target.config
        prefill = FREE_SHARE * ACTIVATION_TOKENS * activation_bytes(c, self.device_type)
        logits = 2 * 4 * c.vocab * (self.max_block + (self.block_size if self.speculative else 0))
        return prefill + logits + self.slab_bytes() + RUNTIME_RESERVE

    def slab_bytes(self) -> int:
        """A quantized cache's prefill reads earlier keys through a slab of their values (at most
        SLAB_BYTES, kernels/prefill_attention.py); a float cache never does."""
        from flashtree.kernels.prefill_attention import SLAB_BYTES
        from flashtree.quant.kv import FLOAT_TYPES, resolve_kv_type

        kinds = {
            resolve_kv_type(k, self.target.dtype) for k in (self.options.kv_type_k, self.options.kv_type_v)
        }
        return SLAB_BYTES if self.attention and not kinds <= set(FLOAT_TYPES) else 0

    def plan(self, max_ctx: int) -> MemoryPlan:
        rows = self.fixed_rows()
        kinds = {self.options.kv_type_k, self.options.kv_type_v}
        name = "/".join(k or dtype_name(self.target.dtype) for k in sorted(kinds, key=str))
        n = len(self.attention)
        kv = ("KV cache", self.kv_bytes(max_ctx), f"{name}, {n} attention layer{'s' * (n != 1)}")
        return MemoryPlan(max_ctx, rows[:-1] + [kv] + rows[-1:])

    def largest_context(self, budget: int, limit: int) -> int:
        """The largest context up to `limit` whose plan fits `budget` bytes (0 when none does)."""
        fixed = sum(b for _, b, _ in self.fixed_rows())
        per_token = self.kv_bytes(1) - self.kv_bytes(0)
        room = budget - fixed - self.kv_bytes(0)
        if room < per_token:
            return 0
        return min(limit, room // per_token) if per_token else limit


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]


def _draft_dtype(draft: nn.Module) -> str:
    return dtype_name(draft.dtype) if draft.fp8_mode == "off" else "fp8"


def build_target(
    config: ModelConfig, tensors, device_type: str = "cuda", free: int | None = None, quantized=None
) -> nn.Module:
    """The target as a load on `device_type` builds it, on `meta`: its dtype and packing chosen by the
    loader's rules (default_dtype, default_quantized with `free` bytes for the GPU's free memory)."""
    from flashtree.models.loader import build_model, default_dtype, default_quantized

    device = torch.device(device_type)
    n_params = sum(math.prod(t.shape) for t in tensors.tensors.values())
    if quantized is None:
        quantized = default_quantized(device, tensors, free) if device.type == "cuda" else False
    return build_model(config, tensors, META, default_dtype(device, n_params), quantized)


def build_draft(config: DraftConfig, shapes: dict[str, tuple], target: nn.Module, fp8_mode: str) -> nn.Module:
    """The draft as load_draft builds it next to `target`, on `meta`."""
    from flashtree.models.dflash import DFlashDraft, DraftTensors

    tensors = {name: torch.empty(shape, device=META) for name, shape in shapes.items()}
    return DFlashDraft(config, DraftTensors(tensors, META, target.dtype), target, fp8_mode)


def random_draft_shapes(target_config: ModelConfig, layers: int) -> tuple[DraftConfig, dict[str, tuple]]:
    """The config and shapes of `flashtree synth --draft-for TARGET --layers N`'s draft."""
    from flashtree.convert.shapes import gguf_tensors
    from flashtree.convert.synth import draft_shape_for

    config = draft_shape_for(target_config, layers)
    return config, {spec.name: spec.shape for spec in gguf_tensors(config)}


def context_for(planner: Planner, requested: int | str | None, budget: int | None, limit: int) -> int:
    """The context to plan: `requested`; "auto": the largest that fits `budget` bytes; None: the model's
    own capped at DEFAULT_CONTEXT_CAP, shrunk to what fits `budget` (when given). A FlashtreeError names
    what to lower when it does not fit."""
    if requested not in (None, "auto"):
        if requested > limit:
            raise FlashtreeError(f"--max-ctx {requested} exceeds the model's context length of {limit}")
        if budget is not None:
            check_fits(planner.plan(requested), budget)
        return requested
    cap = limit if requested == "auto" else min(limit, DEFAULT_CONTEXT_CAP)
    if budget is None:
        return cap
    fits = planner.largest_context(budget, min(cap, MAX_CONTEXT))
    if fits < 1:
        check_fits(planner.plan(1), budget)  # raises, naming what does not fit
    return fits


def check_fits(plan: MemoryPlan, budget: int) -> None:
    """A FlashtreeError naming the parts and what to lower, unless `plan` fits `budget` bytes."""
    if plan.total <= budget:
        return
    parts = dict((name, size) for name, size, _ in plan.rows)
    shown = ", ".join(f"{name} {parts[name] / GIB:.2f}" for name in PARTS_NAMED if name in parts)
    lower = ["lower --max-ctx", "use a smaller --kv-type (q8_0, q4_0, tq3_0)"]
    if "draft weights" in parts:
        lower.append("put the draft in fp8 (FLASHTREE_DRAFT_FP8=matrices) or drop it (--draft none)")
    raise FlashtreeError(
        f"a {plan.max_ctx}-token context needs {plan.total / GIB:.2f} GiB but {budget / GIB:.2f} GiB is "
        f"free ({shown} GiB): {', '.join(lower[:-1])} or {lower[-1]}"
    )


PARTS_NAMED = ("KV cache", "target weights", "draft weights")  # what a refusal names


def make_planner(
    target: str | Path | None = None,
    shape: tuple[str, str] | None = None,
    draft: str | Path | None = None,
    draft_layers: int | None = None,
    fp8_mode: str = "off",
    options: PlanOptions | None = None,
    device_type: str = "cuda",
    free: int | None = None,
    quantized: bool | None = None,
) -> Planner:
    """The planner of a target GGUF (or a synth `shape` (name, type)) and a draft (a dir/GGUF, or a
    random one of `draft_layers` layers), from headers alone. free: the GPU's free bytes, for the
    loader's choice of packed weights (default_quantized)."""
    from flashtree.models.dflash import open_draft
    from flashtree.models.loader import open_target

    if (target is None) == (shape is None):
        raise FlashtreeError("plan needs a target: --target FILE or --shape NAME --type T, not both")
    if draft is not None and draft_layers is not None:
        raise FlashtreeError("give either --draft (a draft) or --draft-layers (a random one), not both")
    config, tensors = TensorTable.of_shape(*shape) if shape else open_target(target)[::-1]
    built = build_target(config, tensors, device_type, free, quantized)
    options = options or PlanOptions(mode="tree" if (draft or draft_layers) else "ar")
    if draft is None and draft_layers is None:
        return Planner(built, None, replace(options, mode="ar"), device_type)
    if draft is not None:
        draft_config, _, shapes, _ = open_draft(draft, built)
    else:
        draft_config, shapes = random_draft_shapes(config, draft_layers)
    return Planner(built, build_draft(draft_config, shapes, built, fp8_mode), options, device_type)


def gpu_budget(gpu_memory: float | None) -> int | None:
    """Bytes a run may use: --gpu-memory GiB, else this GPU's free memory, else None (no GPU)."""
    if gpu_memory is not None:
        if not gpu_memory > 0:
            raise FlashtreeError(f"--gpu-memory must be a positive number of GiB, got {gpu_memory}")
        return int(gpu_memory * GIB)
    from flashtree.engine.memory import free_bytes

    return free_bytes(torch.device("cuda")) if torch.cuda.is_available() else None


def parse_max_ctx(text: str) -> int | str:
    """--max-ctx: a token count, or 'auto'."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise FlashtreeError(f"--max-ctx must be a number of tokens or 'auto', got {text!r}") from None
    from flashtree.config import check_max_ctx

    check_max_ctx(value)
    return value


def plan_command(
    target, shape, type, draft, draft_layers, draft_dtype, max_ctx, kv_types, budget, gpu_memory, as_json
) -> None:
    """`flashtree plan`: the table (or JSON) of one plan; kv_types: (--kv-type, -k, -v)."""
    import json

    from flashtree.quant.kv import check_kv_type
    from flashtree.settings import current

    requested = parse_max_ctx(max_ctx)
    available = gpu_budget(gpu_memory)
    if requested == "auto" and available is None:
        raise FlashtreeError("--max-ctx auto needs --gpu-memory GiB on a machine without a GPU")
    if draft_dtype not in DRAFT_DTYPES:
        raise FlashtreeError(f"--draft-dtype must be bf16 or fp8, got {draft_dtype!r}")
    kind, k, v = kv_types
    options = PlanOptions(kv_type_k=k or kind, kv_type_v=v or kind, budget=budget)
    free = available if available is not None else 1 << 62
    planner = make_planner(
        target, (shape, type) if shape else None, draft, draft_layers, DRAFT_DTYPES[draft_dtype], options,
        free=free, quantized=current().quant_kernels,
    )  # fmt: skip
    for m in planner.attention[:1]:
        for kv in {options.kv_type_k, options.kv_type_v} - {None}:
            check_kv_type(kv, m.head_dim)
    limit = planner.target.config.context_length
    plan = planner.plan(context_for(planner, requested, available if requested == "auto" else None, limit))
    if as_json:
        out = plan.as_dict() | {"gpu_memory_bytes": available}
        print(json.dumps(out | {"fits": None if available is None else plan.total <= available}))
        return
    print_plan(plan, available)


def print_plan(plan: MemoryPlan, available: int | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"memory plan at a {plan.max_ctx:,}-token context", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("")
    for name, size, note in plan.rows:
        table.add_row(name, f"{size / GIB:.3f}", note)
    table.add_section()
    table.add_row("total", f"{plan.total / GIB:.3f}", "")
    console = Console()
    console.print(table)
    if available is not None:
        verdict = "fits" if plan.total <= available else "does NOT fit"
        console.print(f"{verdict} in {available / GIB:.2f} GiB")


def plan_load(
    target, draft, mode, spec, max_ctx: int | None, device: torch.device, settings, kv_types=(None, None)
) -> int:
    """The context Engine.load allocates, decided from the plan before any weight is read: `max_ctx`, or
    the model's own capped at DEFAULT_CONTEXT_CAP and shrunk to fit; a FlashtreeError naming what to
    lower when it does not fit the device's free memory. kv_types: K's and V's (None: the model's)."""
    from flashtree.config import SpecConfig, check_max_ctx
    from flashtree.engine.memory import free_bytes

    spec = spec or SpecConfig()
    if max_ctx is not None:
        check_max_ctx(max_ctx)
    has_draft = draft not in (None, "none")
    speculative = has_draft and mode != "ar"
    options = PlanOptions(
        *kv_types, mode=spec.mode if speculative else "ar", budget=spec.budget, block_size=spec.block_size,
        draft_ctx=spec.draft_ctx,
    )  # fmt: skip
    cuda = device.type == "cuda"
    available = free_bytes(device)
    planner = make_planner(
        target, None, draft if has_draft else None, None, settings.draft_fp8 if cuda else "off", options,
        device.type, available, settings.quant_kernels if cuda else None,
    )  # fmt: skip
    return context_for(planner, max_ctx, available, planner.target.config.context_length)
