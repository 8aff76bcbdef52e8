"""Corrupted GGUF files (issue #41): no traceback, no hang, no corrupted header that loads silently.

A seeded generator makes a few hundred broken variants of three tiny files (a qwen35 hybrid target, a
tied-embedding llama target, a DFlash draft GGUF for the llama one) and loads each in this process, under a
per-case alarm, as `flashtree run` would: the target with its tokenizer (plus a chat-template render and a
forward of a few tokens), the draft next to the clean llama target (plus a proposal from target features).

Each variant is in one of three classes, and its outcome is one of: refused (a FlashtreeError), loaded,
traceback (any other exception), hang (past the alarm).
- `structure`: the header's framing is damaged: a bit flipped in a count, length, type, tensor dimension or
  offset, a key name or a tensor name; a truncation; absurd counts, lengths, offsets and dimensions;
  overlapping tensors, duplicated names, dropped or extra tensors. These must be refused, or be harmless.
- `value`: a hyperparameter flashtree reads set to 0, -1, NaN, inf, a huge number or a value of the wrong
  GGUF type. These must be refused (only a huge context_length may load: the memory planner caps it).
- `content`: a bit flipped inside a number or string value. GGUF has no checksum, so a flipped mantissa bit
  of rope.freq_base or a changed letter in a token is just another valid file: these must be refused or load
  with finite outputs, and a load may change only values that no tensor pins down (FREE_KEYS).

How a load is judged: the corrupted file is opened again and compared with the clean one on what flashtree
reads, its READ keys (the config's `{arch}.*` keys, the tokenizer's keys, general.architecture and
general.alignment) and its tensor table (name, type, shape, offset). Equal: the variant is *harmless*,
and its logits (or draft proposal) must equal the clean file's bit for bit. Different: it *changed* the
model; allowed in the content class if only FREE_KEYS differ, and a silent corruption otherwise.
"""

from __future__ import annotations

import faulthandler
import os
import random
import re
import signal
import struct
import subprocess
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from flashtree.convert.hf import convert_checkpoint
from flashtree.errors import FlashtreeError
from flashtree.gguf.reader import open_gguf
from flashtree.gguf.tokenizer import Tokenizer
from flashtree.models.config import GGUF_KEYS
from flashtree.models.dflash import load_draft
from flashtree.models.loader import load_target
from tests.spec_util import random_draft_dir
from tests.tiny import tiny_gguf

SEED = int(os.environ.get("FUZZ_SEED", "41"))  # another seed: a fresh run of other variants
CASE_SECONDS = 10  # per variant; a hang in C code (no Python frame to interrupt) ends the run at 4x this
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)  # GGUF value types
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
          U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip
ALIGN = 32
TOKENIZER_KEYS = [
    *(f"tokenizer.ggml.{k}" for k in ("model", "pre", "tokens", "token_type", "merges", "add_bos_token")),
    *(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "padding")),
    "tokenizer.chat_template",
]
PROBE_TEXT = "def add(a, b): return a + b  # 12345"


# --- a GGUF header as data ----------------------------------------------------------------------------


@dataclass
class KV:
    key: str
    vtype: int
    value: object  # a scalar, a str, or (item type, [items]) for arrays


@dataclass
class Record:
    name: str
    dims: list[int]  # GGUF order (ne)
    ttype: int
    offset: int


@dataclass
class Header:
    version: int
    kvs: list[KV]
    tensors: list[Record]
    data: bytes  # the data section

    def kv(self, key: str) -> KV:
        return next(kv for kv in self.kvs if kv.key == key)


@dataclass(frozen=True)
class Region:
    """Bytes of the header: kind is structure (magic, counts, lengths, types, dims, offsets), key or
    tensor_name (name bytes), number or string (value bytes); owner the key or tensor they belong to."""

    kind: str
    start: int
    size: int
    owner: str


class Walker:
    """Parses a GGUF header independently of flashtree's reader, noting what each byte range is."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.regions = data, 0, []

    def take(self, fmt: str, kind: str, owner: str):
        size = struct.calcsize(fmt)
        self.regions.append(Region(kind, self.pos, size, owner))
        self.pos += size
        return struct.unpack_from(fmt, self.data, self.pos - size)[0]

    def string(self, kind: str, owner: str) -> str:
        n = self.take("<Q", "structure", owner)
        self.regions.append(Region(kind, self.pos, n, owner))
        self.pos += n
        return self.data[self.pos - n : self.pos].decode()

    def value(self, vtype: int, owner: str):
        if vtype == STR:
            return self.string("string", owner)
        if vtype == ARR:
            itype, n = self.take("<I", "structure", owner), self.take("<Q", "structure", owner)
            return itype, [self.value(itype, owner) for _ in range(n)]
        return self.take(SCALAR[vtype], "number", owner)


def parse(data: bytes) -> tuple[Header, list[Region]]:
    w = Walker(data)
    assert w.take("<I", "structure", "magic") == 0x46554747
    version, n_tensors, n_kv = (w.take(f, "structure", "counts") for f in ("<I", "<Q", "<Q"))
    kvs = []
    for _ in range(n_kv):
        key = w.string("key", "")
        w.regions[-1] = replace(w.regions[-1], owner=key)
        vtype = w.take("<I", "structure", key)
        kvs.append(KV(key, vtype, w.value(vtype, key)))
    tensors = []
    for _ in range(n_tensors):
        name = w.string("tensor_name", "")
        w.regions[-1] = replace(w.regions[-1], owner=name)
        dims = [w.take("<Q", "structure", name) for _ in range(w.take("<I", "structure", name))]
        tensors.append(Record(name, dims, w.take("<I", "structure", name), w.take("<Q", "structure", name)))
    start = w.pos + -w.pos % ALIGN
    return Header(version, kvs, tensors, data[start:]), w.regions


def _pack_value(vtype: int, value) -> bytes:
    if vtype == STR:
        return struct.pack("<Q", len(value.encode())) + value.encode()
    if vtype == ARR:
        itype, items = value
        return struct.pack("<IQ", itype, len(items)) + b"".join(_pack_value(itype, i) for i in items)
    return struct.pack(SCALAR[vtype], value)


def serialize(h: Header) -> bytes:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", h.version, len(h.tensors), len(h.kvs)))
    for kv in h.kvs:
        out += _pack_value(STR, kv.key) + struct.pack("<I", kv.vtype) + _pack_value(kv.vtype, kv.value)
    for t in h.tensors:
        out += _pack_value(STR, t.name) + struct.pack(
            f"<I{len(t.dims)}QIQ", len(t.dims), *t.dims, t.ttype, t.offset
        )
    return bytes(out) + bytes(-len(out) % ALIGN) + h.data


def copy(h: Header) -> Header:
    kvs = [KV(kv.key, kv.vtype, kv.value) for kv in h.kvs]
    return Header(h.version, kvs, [replace(t, dims=list(t.dims)) for t in h.tensors], h.data)


def tensor_bytes(h: Header, t: Record) -> int:
    """The tensor's size in the data section: up to the next tensor's offset (or the end)."""
    later = [u.offset for u in h.tensors if u.offset > t.offset]
    return (min(later) if later else len(h.data)) - t.offset


def drop_tensor(h: Header, name: str) -> Header:
    """The header without tensor `name`, its bytes cut out and the later offsets moved down."""
    h = copy(h)
    t = next(t for t in h.tensors if t.name == name)
    size = tensor_bytes(h, t)
    h.data = h.data[: t.offset] + h.data[t.offset + size :]
    h.tensors = [
        replace(u, offset=u.offset - size if u.offset > t.offset else u.offset) for u in h.tensors if u != t
    ]
    return h


def add_tensor(h: Header, name: str, like: str) -> Header:
    """The header with one more tensor `name`, a copy of tensor `like` appended to the data."""
    h = copy(h)
    t = next(t for t in h.tensors if t.name == like)
    offset = len(h.data) + -len(h.data) % ALIGN
    h.data = h.data + bytes(offset - len(h.data)) + h.data[t.offset : t.offset + tensor_bytes(h, t)]
    h.tensors.append(Record(name, list(t.dims), t.ttype, offset))
    return h


# --- the three clean files, and what loading one gives ------------------------------------------------


@dataclass
class Loaded:
    """What a load gives: the config and tokenizer values it read, the tensor bytes, and the outputs."""

    config: object
    tokenizer: dict
    tensors: dict
    outputs: tuple  # (logits or draft proposal, token ids of PROBE_TEXT)


def _tensors(path: Path) -> dict:
    g = open_gguf(path)
    return {name: (t.qtype, t.shape, g.raw(name).tobytes()) for name, t in g.tensors.items()}


def load_as_target(path: Path, _target=None) -> Loaded:
    """What `flashtree run` does with a target: model, tokenizer, a chat prompt, a forward."""
    model, g = load_target(path, device="cpu", dtype=torch.float32)
    tokenizer = Tokenizer.from_gguf_metadata(g.metadata)
    ids = tokenizer.encode(PROBE_TEXT)
    if tokenizer.chat_template is not None:
        ids += tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
    tokens = torch.arange(8) * 37 % model.config.vocab
    logits = model(tokens, model.new_state(16)).logits
    read = {k: v for k, v in g.metadata.items() if k in TOKENIZER_KEYS}
    return Loaded(model.config, read, _tensors(path), (logits, tuple(ids)))


def load_as_draft(path: Path, target) -> Loaded:
    """A draft next to the clean llama target, and its proposal after 12 positions of target features."""
    draft = load_draft(path, target)
    ids = torch.arange(12) * 7 % target.config.vocab
    state = target.new_state(32)
    features = target(ids, state, logits="none", capture=draft.config.target_layer_ids).features
    ctx = draft.new_context(64, block=4)
    draft.append_context(ctx, features)
    return Loaded(draft.config, {}, _tensors(path), (draft.propose(ctx, torch.tensor(3), 4), ()))


@dataclass
class Target:
    """One clean file: its bytes, parsed header and byte regions, and what loading it gives."""

    name: str
    path: Path
    data: bytes
    header: Header
    regions: list[Region]
    load: Callable[[Path, object], Loaded]
    llama: object  # the clean llama target a draft loads next to
    clean: Loaded


@pytest.fixture(scope="module")
def targets(tiny_root) -> dict[str, Target]:
    llama_path = tiny_gguf("llama", 0, tiny_root)
    draft_path = tiny_root / "fuzz-draft.gguf"
    if not draft_path.exists():
        convert_checkpoint(random_draft_dir(llama_path, tiny_root), draft_path, "f32")
    llama, _ = load_target(llama_path, device="cpu", dtype=torch.float32)
    files = {"qwen35": (tiny_gguf("qwen35", 0, tiny_root), load_as_target),
             "llama": (llama_path, load_as_target), "draft": (draft_path, load_as_draft)}  # fmt: skip
    out = {}
    for name, (path, load) in files.items():
        data = path.read_bytes()
        header, regions = parse(data)
        assert serialize(header) == data  # the test's own writer reproduces the file byte for byte
        out[name] = Target(name, path, data, header, regions, load, llama, load(path, llama))
    return out


# --- the corrupted variants ---------------------------------------------------------------------------


@dataclass
class Case:
    target: str
    klass: str  # structure | value | content (module docstring)
    label: str
    data: bytes
    may_load: bool = False  # a value-class case that may load (a huge context_length)


def _flip(t: Target, rng: random.Random, kinds: tuple[str, ...], klass: str) -> Case:
    """One bit flipped in a region of one of `kinds`, chosen owner first (a key or tensor), then byte."""
    regions = [r for r in t.regions if r.kind in kinds and r.size]
    owner = rng.choice(sorted({r.owner for r in regions}))
    region = rng.choice([r for r in regions if r.owner == owner])
    at, bit = region.start + rng.randrange(region.size), rng.randrange(8)
    data = bytearray(t.data)
    data[at] ^= 1 << bit
    return Case(
        t.name, klass, f"flip {region.kind} of {owner!r} at +{at - region.start} bit {bit}", bytes(data)
    )


def _truncate(t: Target, rng: random.Random) -> Case:
    cut = rng.choice([rng.randrange(len(t.data) - len(t.header.data)), rng.randrange(len(t.data))])
    return Case(t.name, "structure", f"truncated to {cut} bytes", t.data[:cut])


def _absurd_u64(t: Target, rng: random.Random) -> Case:
    """A count, length, dimension or offset (8 bytes) set to an absurd value."""
    region = rng.choice([r for r in t.regions if r.kind == "structure" and r.size == 8])
    value = rng.choice([2**64 - 1, 2**63, 2**32, 2**32 - 1, len(t.data), 2 * len(t.data) + 1])
    data = t.data[: region.start] + struct.pack("<Q", value) + t.data[region.start + 8 :]
    return Case(t.name, "structure", f"u64 of {region.owner!r} at {region.start} = {value}", data)


def _edit(t: Target, label: str, edit: Callable[[Header], None]) -> Case:
    h = copy(t.header)
    edit(h)
    return Case(t.name, "structure", label, serialize(h))


def _offset(t: Target, rng: random.Random) -> Case:
    i = rng.randrange(len(t.header.tensors))
    other = rng.choice(t.header.tensors).offset
    old = t.header.tensors[i].offset
    value = rng.choice(
        [2**64 - 1, 2**63, other, old + ALIGN, max(old - ALIGN, 0), len(t.header.data) + ALIGN]
    )
    name = t.header.tensors[i].name
    return _edit(t, f"offset of {name!r} = {value}", lambda h: setattr(h.tensors[i], "offset", value))


def _dims(t: Target, rng: random.Random) -> Case:
    i = rng.randrange(len(t.header.tensors))
    dims = t.header.tensors[i].dims
    if len(dims) == 2 and rng.random() < 0.3:
        new = dims[::-1]
    else:
        d = rng.randrange(len(dims))
        new = list(dims)
        new[d] = rng.choice([dims[d] + 1, dims[d] - 1, dims[d] * 2, dims[d] // 2, 0, 2**32, 2**63])
    return _edit(
        t, f"dims of {t.header.tensors[i].name!r} = {new}", lambda h: setattr(h.tensors[i], "dims", new)
    )


def _ttype(t: Target, rng: random.Random) -> Case:
    i = rng.randrange(len(t.header.tensors))
    new = rng.choice([0, 1, 2, 3, 6, 7, 8, 9, 12, 14, 30, 31, 99])  # F32, F16, Q4_0 ... BF16, unknown
    return _edit(
        t, f"type of {t.header.tensors[i].name!r} = {new}", lambda h: setattr(h.tensors[i], "ttype", new)
    )


def _duplicate(t: Target, rng: random.Random) -> Case:
    if rng.random() < 0.5:
        a, b = rng.sample(range(len(t.header.tensors)), 2)
        name = t.header.tensors[a].name
        return _edit(t, f"tensor {b} renamed {name!r}", lambda h: setattr(h.tensors[b], "name", name))
    a, b = rng.sample(range(len(t.header.kvs)), 2)
    key = t.header.kvs[a].key
    return _edit(t, f"key {b} renamed {key!r}", lambda h: setattr(h.kvs[b], "key", key))


def _drop_or_add(t: Target, rng: random.Random) -> Case:
    names = [r.name for r in t.header.tensors]
    if rng.random() < 0.5:  # not output.weight: without it a target is a valid tied-embedding model
        name = rng.choice([n for n in names if n != "output.weight"])
        return Case(t.name, "structure", f"tensor {name!r} dropped", serialize(drop_tensor(t.header, name)))
    n_blocks = 1 + max(int(n.split(".")[1]) for n in names if n.startswith("blk."))
    name = rng.choice([f"blk.{n_blocks}.attn_norm.weight", "blk.0.attn_norm.weight2", "output_norm"])
    like = next(n for n in names if n.endswith("attn_norm.weight"))
    return Case(t.name, "structure", f"tensor {name!r} added", serialize(add_tensor(t.header, name, like)))


STRUCTURE: list[Callable[[Target, random.Random], Case]] = [
    lambda t, rng: _flip(t, rng, ("structure",), "structure"),
    lambda t, rng: _flip(t, rng, ("key",), "structure"),
    lambda t, rng: _flip(t, rng, ("tensor_name",), "structure"),
    _truncate, _absurd_u64, _offset, _dims, _ttype, _duplicate, _drop_or_add,
]  # fmt: skip

NAN, INF = float("nan"), float("inf")
BAD_COUNTS = [(U32, 0), (I32, -1), (U64, 2**63), (U32, 2**32 - 1), (F32, 4.0), (STR, "4"), (BOOL, True),
              (ARR, (U32, [4, 4]))]  # fmt: skip
BAD_FLOATS = [(F32, 0.0), (F32, -1.0), (F32, NAN), (F32, INF), (F32, -INF), (F32, 1e30), (F64, 1e300),
              (U32, 1), (STR, "1e-6")]  # fmt: skip
BAD_IDS = [(I32, -1), (U32, 2**32 - 1), (U64, 2**63), (F32, 1.0), (STR, "1")]
BAD_LISTS = [
    (ARR, (I32, [-1])),
    (ARR, (U32, [2**32 - 1])),
    (U32, 3),
    (ARR, (STR, ["x"])),
    (ARR, (F32, [1.0])),
]
BAD_STRINGS = [(ARR, (STR, ["bogus_kind"])), (ARR, (U32, [1])), (STR, "full_attention"), (U32, 0)]
BAD_TOKENIZER = {
    "tokens": [(ARR, (U32, [1, 2])), (STR, "x"), (U32, 7), (ARR, (STR, ["a"]))],
    "token_type": [(ARR, (I32, [1])), (ARR, (STR, ["1"])), (U32, 1)],
    "merges": [(ARR, (STR, ["Ġ t", "nonsense"])), (ARR, (STR, ["nospace"])), (U32, 3), (ARR, (U32, [1]))],
    "eos_token_id": BAD_IDS,
    "add_bos_token": [(U32, 1), (STR, "true")],
    "pre": [(STR, "no-such-pre"), (U32, 1)],
    "model": [(STR, "llama"), (U32, 2)],
    "chat_template": [(U32, 5), (ARR, (STR, ["{{ x }}"]))],
}


def _bad_values(key: str, arch: str) -> list[tuple[int, object]]:
    if key.startswith("tokenizer."):
        return BAD_TOKENIZER.get(key.rsplit(".", 1)[-1], [])
    suffix = key.removeprefix(f"{arch}.")
    if suffix in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        return BAD_FLOATS
    if suffix in ("rope.dimension_sections", "dflash.target_layer_ids"):
        return BAD_LISTS
    if suffix == "layer_types":
        return BAD_STRINGS
    if suffix == "dflash.mask_token_id":
        return BAD_IDS
    if suffix == "context_length":  # huge ones may load: the memory planner caps what a file claims
        return [v for v in BAD_COUNTS if v not in ((U64, 2**63), (U32, 2**32 - 1))] + [(U64, 2**40)]
    return BAD_COUNTS


def _may_load(key: str, vtype: int, value) -> bool:
    """A huge context_length or draft block_size loads: the memory planner caps the one, the speculative
    decoder bounds the other when it sizes a block, unless --block-size overrides it (test_bounds.py)."""
    huge = vtype in (U32, U64) and value > 2**31
    return huge and key.endswith(("context_length", "dflash.block_size"))


def value_cases(t: Target, rng: random.Random, per_key: int) -> list[Case]:
    """Each hyperparameter flashtree reads (absent optional ones added), set to `per_key` bad values."""
    arch = t.header.kv("general.architecture").value
    keys = [f"{arch}.{k}" for k in [*GGUF_KEYS.values(), "nextn_predict_layers"]]
    if t.name == "qwen35":  # the tokenizer is the same in the llama file
        keys += [k for k in TOKENIZER_KEYS if any(kv.key == k for kv in t.header.kvs)]
    cases = []
    for key in keys:
        present = any(kv.key == key for kv in t.header.kvs)
        if not present and not key.endswith("nextn_predict_layers"):
            continue
        bad = _bad_values(key, arch)
        for vtype, value in rng.sample(bad, min(per_key, len(bad))):
            h = copy(t.header)
            h.kvs = [kv for kv in h.kvs if kv.key != key] + [KV(key, vtype, value)]
            label = f"{key} = {value!r} (type {vtype})"
            cases.append(Case(t.name, "value", label, serialize(h), _may_load(key, vtype, value)))
    return cases


def content_case(t: Target, rng: random.Random) -> Case:
    return _flip(t, rng, ("number", "string"), "content")


def all_cases(t: Target, n_structure: int, per_key: int, n_content: int) -> list[Case]:
    rng = random.Random(f"{SEED}-{t.name}")
    cases = [STRUCTURE[i % len(STRUCTURE)](t, rng) for i in range(n_structure)]
    cases += value_cases(t, rng, per_key)
    return cases + [content_case(t, rng) for _ in range(n_content)]


# --- loading them -------------------------------------------------------------------------------------


class Hang(BaseException):  # not an Exception: no `except Exception` in the code under test swallows it
    pass


def _alarm(signum, frame):
    raise Hang()


FREE_FIELDS = {"rms_eps", "rope_theta", "context_length", "rope_dim", "rope_sections", "block_size",
               "mask_token_id", "target_layer_ids", "layer_types", "sliding_window"}  # fmt: skip


def _changes(clean: Loaded, got: Loaded) -> set[str]:
    """What flashtree read differently from the clean file: config fields, tokenizer keys, 'tensors'."""
    fields = {f for f in vars(clean.config) if getattr(clean.config, f) != getattr(got.config, f)}
    keys = {k for k in {*clean.tokenizer, *got.tokenizer} if clean.tokenizer.get(k) != got.tokenizer.get(k)}
    return fields - {"name"} | keys | ({"tensors"} if clean.tensors != got.tensors else set())


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def judge(case: Case, t: Target, path: Path) -> tuple[str, str]:
    """(outcome, detail): refused | harmless | changed (allowed) or traceback | hang | silent | nonfinite."""
    path.write_bytes(case.data)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    faulthandler.dump_traceback_later(4 * CASE_SECONDS, exit=True)
    try:
        got = t.load(path, t.llama)
    except FlashtreeError as e:
        return ("refused", str(e)) if "\n" not in str(e) else ("traceback", f"multi-line error: {e}")
    except Hang:
        return "hang", ""
    except Exception:
        return "traceback", traceback.format_exc(limit=-4)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
    changes = _changes(t.clean, got)
    if not torch.isfinite(got.outputs[0]).all():
        return "nonfinite", f"changed {sorted(changes)}"
    if not changes:
        return (
            ("harmless", "")
            if _same(got.outputs, t.clean.outputs)
            else ("silent", "same reads, other outputs")
        )
    allowed = case.may_load or (case.klass == "content" and changes <= FREE_FIELDS | set(TOKENIZER_KEYS))
    return ("changed", f"{sorted(changes)}") if allowed else ("silent", f"changed {sorted(changes)}")


def run_cases(cases: list[Case], targets: dict[str, Target], tmp_path: Path) -> list[tuple[Case, str, str]]:
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        return [(case, *judge(case, targets[case.target], tmp_path / "case.gguf")) for case in cases]
    finally:
        signal.signal(signal.SIGALRM, old)


def _report(results) -> str:
    counts = Counter((case.target, case.klass, outcome) for case, outcome, _ in results)
    lines = [f"{t:7} {k:9} {o:9} {n}" for (t, k, o), n in sorted(counts.items())]
    loaded = [f"  {o}: {c.klass} {c.label}: {d}" for c, o, d in results if o in ("harmless", "changed")]
    bad = [f"{o}: {c.label}: {d}" for c, o, d in results if o in ("traceback", "hang", "silent", "nonfinite")]
    return "\n".join(lines + loaded + bad[:20])


# --- the tests ----------------------------------------------------------------------------------------

# per target: random structure variants, bad values per hyperparameter, random content flips
SIZES = {"qwen35": (110, 3, 40), "llama": (70, 3, 25), "draft": (70, 3, 25)}


@pytest.mark.parametrize("name", list(SIZES))
def test_corrupted_files_are_refused_or_harmless(name, targets, tmp_path):
    cases = all_cases(targets[name], *SIZES[name])
    results = run_cases(cases, targets, tmp_path)
    report = _report(results)
    print(f"\n{name}: {len(cases)} variants\n{report}")
    outcomes = Counter(outcome for _, outcome, _ in results)
    assert not {"traceback", "hang", "silent", "nonfinite"} & set(outcomes), report
    by_class = Counter((case.klass, outcome) for case, outcome, _ in results)
    assert by_class["structure", "refused"] >= 0.8 * sum(c.klass == "structure" for c in cases), report
    assert not [c.label for c, o, _ in results if c.klass == "value" and o == "changed" and not c.may_load]


def _set(key: str, vtype: int, value) -> Callable[[Header], None]:
    """An edit setting metadata `key` ('{arch}.' prefixed unless it is a tokenizer key)."""

    def edit(h: Header) -> None:
        full = key if key.startswith("tokenizer.") else f"{h.kv('general.architecture').value}.{key}"
        h.kvs = [kv for kv in h.kvs if kv.key != full] + [KV(full, vtype, value)]

    return edit


def _tensor(name: str, **changes) -> Callable[[Header], None]:
    def edit(h: Header) -> None:
        i = next(i for i, t in enumerate(h.tensors) if t.name == name)
        h.tensors[i] = replace(h.tensors[i], **{k: v(h) if callable(v) else v for k, v in changes.items()})

    return edit


def _merge_flip(h: Header) -> None:
    """One bit of the first merge flipped, so that it names a token the vocabulary lacks."""
    itype, merges = h.kv("tokenizer.ggml.merges").value
    h.kv("tokenizer.ggml.merges").value = (itype, [chr(ord(merges[0][0]) ^ 1) + merges[0][1:], *merges[1:]])


def _offset_of(name: str) -> Callable[[Header], int]:
    return lambda h: next(t.offset for t in h.tensors if t.name == name)


HANG = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
# The cases issue #41 names: (file, edit, the error expected; None: it loads)
# fmt: off
SHARED = _tensor("blk.1.attn_norm.weight", offset=_offset_of("blk.0.attn_norm.weight"))
ISSUE_CASES = {
    "offset_2^64-1": ("qwen35", _tensor("blk.0.attn_norm.weight", offset=2**64 - 1),
                      "data offset 18446744073709551615"),
    "shared_range": ("qwen35", SHARED, "overlaps"),
    "shape_not_implied": ("qwen35", _tensor("blk.0.ffn_up.weight", dims=[96, 64]),
                          r"'blk.0.ffn_up.weight' has shape \(64, 96\), but .* has \(96, 64\)"),
    "block_count_below_blocks": ("qwen35", _set("block_count", U32, 3),
                                 "block_count is 3 but the file has tensors of blocks 3"),
    "rms_eps_nan": ("qwen35", _set("attention.layer_norm_rms_epsilon", F32, NAN), r"rms_eps .* is nan"),
    "rope_base_0": ("qwen35", _set("rope.freq_base", F32, 0.0), r"rope_theta .* is 0.0, not a finite"),
    "rope_base_negative": ("llama", _set("rope.freq_base", F32, -1.0), r"rope_theta .* is -1.0"),
    "head_count_0": ("qwen35", _set("attention.head_count", U32, 0), "head_count is 0, not a positive"),
    "head_count_7": ("llama", _set("attention.head_count", U32, 7), "7 attention heads do not split"),
    "block_count_0": ("llama", _set("block_count", U32, 0), "block_count is 0, not a positive"),
    "full_attention_interval_0": ("qwen35", _set("full_attention_interval", U32, 0),
                                  "full_attention_interval is 0"),
    "time_step_rank_0": ("qwen35", _set("ssm.time_step_rank", U32, 0), "time_step_rank is 0"),
    "draft_without_output_norm": ("draft", lambda h: drop_tensor(h, "output_norm.weight"),
                                  r"missing tensor\(s\) 'output_norm.weight'"),
    "merges_bit_flip": ("qwen35", _merge_flip, r"tokenizer.ggml.merges: entry 0 .*: no token"),
    "chat_template_hang": ("qwen35", _set("tokenizer.chat_template", STR, HANG), "too many steps"),
    "huge_context_loads": ("llama", _set("context_length", U32, 2**32 - 1), None),
}
# fmt: on


def issue_case(name: str, targets: dict[str, Target]) -> Case:
    target, edit, _ = ISSUE_CASES[name]
    h = copy(targets[target].header)
    h = edit(h) or h
    return Case(target, "structure", name, serialize(h), may_load=True)


@pytest.mark.parametrize("name", list(ISSUE_CASES))
def test_the_issues_cases_are_one_clear_error(name, targets, tmp_path):
    expected = ISSUE_CASES[name][2]
    [(case, outcome, detail)] = run_cases([issue_case(name, targets)], targets, tmp_path)
    if expected is None:
        assert outcome == "changed", detail
    else:
        assert outcome == "refused", detail
        assert re.search(expected, detail), detail


CLI_CASES = ["offset_2^64-1", "head_count_0", "block_count_0", "merges_bit_flip", "chat_template_hang"]


def test_flashtree_run_prints_one_error_line(targets, tmp_path):
    runs = {}
    for name in CLI_CASES:  # all at once: each process spends its first seconds importing torch
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(issue_case(name, targets).data)
        cmd = [sys.executable, "-m", "flashtree", "run", "--target", str(path), "--device", "cpu", "-p", "hi"]
        runs[name] = subprocess.Popen(
            [*cmd, "-n", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    for name, run in runs.items():
        out, err = run.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (name, out, err)
        assert re.search(ISSUE_CASES[name][2], lines[0]), lines[0]


@pytest.mark.parametrize(
    "template, message",
    [
        (HANG, "too many steps"),
        ("{% for x in range(9) recursive %}{{ loop(range(99999)) }}{% endfor %}", "too many steps|Recursion"),
        ("{{ 'x' * 10**10 }}", "builds a value of 10000000000 items"),
        ("{{ 'x' | center(10**8) }}", "builds a value of 100000000"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
         "builds a value of"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
        ("{{ 10 ** 100000 }}", "an integer of about"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)  # fmt: skip
def test_chat_templates_render_with_bounded_work(template, message, targets):
    metadata = dict(open_gguf(targets["qwen35"].path).metadata)
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})
    with pytest.raises(FlashtreeError, match=message):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
