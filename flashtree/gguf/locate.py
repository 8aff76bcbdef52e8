"""Models where users keep them: `--target` and `--draft` take a path or a name in another tool's store.

- a path: a GGUF (or a draft directory), as it is;
- `OWNER/REPO[:FILE or QUANT]`: a file of a repo in the local Hugging Face cache, found by huggingface_hub's
  cache scan (nothing is downloaded); a repo without GGUFs whose snapshot holds config.json and
  model.safetensors (a z-lab DFlash draft) is that directory;
- `ollama:NAME[:TAG]`: the GGUF blob that Ollama's manifest of NAME:TAG (default latest) names as its model
  layer; NAME is a library model, or NAMESPACE/NAME, or HOST/NAMESPACE/NAME;
- `lmstudio:PUBLISHER/REPO[:FILE or QUANT]`: a GGUF in LM Studio's models folder.
A repo of one model file needs no selector (mmproj projectors aside); QUANT picks the file whose name holds
that tag (`Q4_K_M` matches `Qwen3-8B-Q4_K_M.gguf`, not `...-Q4_K_M_L.gguf`). `find_models` lists every
model of every store by the name that resolves to it, with its architecture and type read from the GGUF
header alone (`gguf_header`), for `flashtree models`. Where the stores are is the settings' (model_stores).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from flashtree.errors import FlashtreeError
from flashtree.settings import ModelStores, model_stores

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_LIBRARY = "registry.ollama.ai", "library"
HF_REPO = re.compile(r"[\w.-]+/[\w.-]+(:.+)?")  # OWNER/NAME[:SELECTOR]: Hugging Face's repo id rules
SHOWN = 12  # candidates an error lists


@dataclass(frozen=True)
class FoundModel:
    """One model of a store: the name that resolves to it, where it is, and its header's facts."""

    name: str
    path: Path
    size: int
    arch: str | None = None
    quant: str | None = None

    def as_dict(self) -> dict:
        return asdict(self) | {"path": str(self.path)}


def resolve_model(spec: str | Path, stores: ModelStores | None = None) -> Path:
    """The file (or draft directory) `spec` names: an existing path as it is, else a store's name (see the
    module docstring); a name that matches nothing, or more than one file, is a FlashtreeError listing
    the candidates. Text of no store's form comes back as a path, for the loader to refuse."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        return path
    stores = stores or model_stores()
    if text.startswith("ollama:"):
        return _ollama_blob(text.removeprefix("ollama:"), stores.ollama)
    if text.startswith("lmstudio:"):
        return _pick("lmstudio:", text.removeprefix("lmstudio:"), _lmstudio_repos(stores.lmstudio),
                     f"LM Studio's models folder ({_listed(stores.lmstudio)})")  # fmt: skip
    if HF_REPO.fullmatch(text) and not text.partition(":")[0].endswith(".gguf"):
        where = f"no such file, and the Hugging Face cache ({stores.hf_hub})"
        return _pick("", text, _hf_repos(stores.hf_hub), where)
    return path


def find_models(stores: ModelStores | None = None) -> list[FoundModel]:
    """Every model in the Hugging Face cache, Ollama's store and LM Studio's folder, by its name."""
    stores = stores or model_stores()
    named = [*_repo_names("", _hf_repos(stores.hf_hub)), *_ollama_models(stores.ollama)]
    named += _repo_names("lmstudio:", _lmstudio_repos(stores.lmstudio))
    return [_describe(name, path) for name, path in named]


# --- picking a file of a repo ----------------------------------------------------------------------------

Repos = dict[str, dict[str, Path]]  # repo -> {file label (path in the repo; "" for the directory): path}


def _pick(prefix: str, text: str, repos: Repos, where: str) -> Path:
    repo, _, selector = text.partition(":")
    found = {r.lower(): r for r in repos}.get(repo.lower())
    if found is None:
        known = ", ".join(prefix + r for r in sorted(repos)[:SHOWN]) or "none"
        raise FlashtreeError(f"{prefix}{text}: {where} has no {repo} (it has: {known})")
    files = repos[found]
    matches = [label for label in files if _selected(label, selector)]
    if not selector and len(matches) > 1:
        matches = [label for label in matches if not Path(label).name.lower().startswith("mmproj")]
    if len(matches) == 1:
        return files[matches[0]]
    listed = ", ".join(f"{prefix}{found}:{label}" for label in sorted(files)[:SHOWN])
    if not matches:
        raise FlashtreeError(f"{prefix}{text}: no file of {found} matches {selector!r} (it has: {listed})")
    raise FlashtreeError(f"{prefix}{text} is ambiguous: {len(matches)} files; name one: {listed}")


def _selected(label: str, selector: str) -> bool:
    """Whether `selector` (empty, a file name or path in the repo, or a quant tag) picks `label`."""
    if not selector or selector in (label, Path(label).name):
        return True
    tag = re.compile(rf"(?<![A-Za-z0-9]){re.escape(selector)}(?![A-Za-z0-9_])", re.IGNORECASE)
    return bool(label) and tag.search(Path(label).name) is not None


def _repo_names(prefix: str, repos: Repos) -> list[tuple[str, Path]]:
    """(name, path) of every file: the bare repo where it is the repo's only file."""
    return [
        (f"{prefix}{repo}" if len(files) == 1 else f"{prefix}{repo}:{label}", path)
        for repo, files in sorted(repos.items())
        for label, path in sorted(files.items())
    ]


# --- the stores --------------------------------------------------------------------------------------------


def _hf_repos(hub: Path) -> Repos:
    """The model repos of the hub cache: their GGUFs (newest revision first: main's, then by date), or the
    snapshot directory of a safetensors draft."""
    if not hub.is_dir():
        return {}
    from huggingface_hub import scan_cache_dir

    repos: Repos = {}
    for repo in scan_cache_dir(hub).repos:
        if repo.repo_type != "model":
            continue
        files: dict[str, Path] = {}
        newest = sorted(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified), reverse=True)
        for revision in newest:
            for f in revision.files:
                label = f.file_path.relative_to(revision.snapshot_path).as_posix()
                if label.endswith(".gguf"):
                    files.setdefault(label, f.file_path)
        if not files and newest and _is_draft_dir(newest[0].snapshot_path):
            files[""] = newest[0].snapshot_path
        if files:
            repos[repo.repo_id] = files
    return repos


def _is_draft_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def _lmstudio_repos(roots: Iterable[Path]) -> Repos:
    repos: Repos = {}
    for root in roots:
        for gguf in sorted(root.glob("*/*/**/*.gguf")) if root.is_dir() else ():
            publisher, repo, *rest = gguf.relative_to(root).parts
            repos.setdefault(f"{publisher}/{repo}", {}).setdefault("/".join(rest), gguf)
    return repos


def _ollama_manifests(roots: Iterable[Path]) -> dict[str, tuple[Path, Path]]:
    """{name as ollama:NAME takes it: (models dir, manifest)}: library models by their bare name."""
    found: dict[str, tuple[Path, Path]] = {}
    for root in roots:
        base = root / "manifests"
        for manifest in sorted(base.glob("*/*/*/*")) if base.is_dir() else ():
            host, namespace, model, tag = manifest.relative_to(base).parts
            name = f"{namespace}/{model}" if namespace != OLLAMA_LIBRARY else model
            name = f"{host}/{namespace}/{model}" if host != OLLAMA_REGISTRY else name
            found.setdefault(f"{name}:{tag}", (root, manifest))
    return found


def _ollama_blob(text: str, roots: Iterable[Path]) -> Path:
    name, _, tag = text.partition(":")
    manifests = _ollama_manifests(roots)
    entry = manifests.get(f"{name}:{tag or 'latest'}")
    if entry is None:
        tags = sorted(m for m in manifests if m.partition(":")[0] == name) or sorted(manifests)
        known = ", ".join(f"ollama:{m}" for m in tags[:SHOWN]) or "none"
        raise FlashtreeError(
            f"ollama:{text}: no such model in Ollama's store ({_listed(roots)}; it has: {known})"
        )
    return _model_layer(*entry)


def _model_layer(root: Path, manifest: Path) -> Path:
    """The blob that an Ollama manifest names as its model layer (a GGUF)."""
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8"))["layers"]
        digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise FlashtreeError(f"{manifest}: not an Ollama manifest with a model layer") from None
    blob = root / "blobs" / str(digest).replace(":", "-")
    if not blob.is_file():
        raise FlashtreeError(f"{manifest}: its model layer {blob} is missing (ollama pull it again)")
    return blob


def _ollama_models(roots: Iterable[Path]) -> list[tuple[str, Path]]:
    named = []
    for name, (root, manifest) in _ollama_manifests(roots).items():
        try:
            named.append((f"ollama:{name}", _model_layer(root, manifest)))
        except FlashtreeError:
            continue  # a manifest without its model (a pull broken off): nothing to run
    return named


def _listed(paths: Iterable[Path]) -> str:
    return ", ".join(map(str, paths))


# --- what a model is ---------------------------------------------------------------------------------------


def _describe(name: str, path: Path) -> FoundModel:
    if path.is_dir():  # a safetensors draft: its config.json says what it is
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            config = {}
        arch = (config.get("architectures") or [None])[0] if isinstance(config, dict) else None
        dtype = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        return FoundModel(name, path, size, arch, dtype)
    header = gguf_header(path)
    quant = header.get("general.file_type")
    return FoundModel(name, path, path.stat().st_size, header.get("general.architecture"), _file_type(quant))


def _file_type(value: object) -> str | None:
    if not isinstance(value, int):
        return None
    from gguf import LlamaFileType

    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
HEADER_KEYS = ("general.architecture", "general.file_type")


def gguf_header(path: Path, keys: tuple[str, ...] = HEADER_KEYS) -> dict[str, object]:
    """The scalar or string values of `keys` in a GGUF's metadata, read up to the last of them (other
    values are skipped unread, arrays too): a listing of many multi-GB files costs a few reads each.
    {} for a file that is not a GGUF v2/v3; what was found before a malformed entry, for a damaged one."""
    found: dict[str, object] = {}
    try:
        with open(path, "rb") as f:
            magic, version, _, n_kv = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version not in (2, 3):
                return {}
            for _ in range(n_kv):
                key = _read_string(f)
                vtype = _unpack(f, "<I")
                if key in keys and vtype != _ARRAY:
                    found[key] = _read_string(f) if vtype == _STRING else _unpack(f, _SCALARS[vtype])
                    if len(found) == len(keys):
                        break
                else:
                    _skip(f, vtype)
    except (OSError, struct.error, KeyError, UnicodeDecodeError):
        pass
    return found


def _unpack(f, fmt: str):
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _read_string(f) -> str:
    n = _unpack(f, "<Q")
    data = f.read(n)
    if len(data) != n:
        raise struct.error("string past the end of the file")
    return data.decode("utf-8")


def _skip(f, vtype: int) -> None:
    if vtype == _STRING:
        f.seek(_unpack(f, "<Q"), 1)
    elif vtype == _ARRAY:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        f.seek(struct.calcsize(_SCALARS[vtype]), 1)


def size_text(n: int) -> str:
    """Bytes as people read them: 4.92 GB, 20.60 MB, 512 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
