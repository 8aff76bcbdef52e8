"""Reference files fetched once from PyPI into flashtree's cache (checked against the index's sha256)."""

from __future__ import annotations

import os
from pathlib import Path

from flashtree.defaults import cache_dir, download, pypi_file_url

LLAMA_CPP_SDIST = ("llama-cpp-python", "llama_cpp_python-0.3.36.tar.gz")  # its vendor/llama.cpp


def pypi_file(project: str, filename: str) -> Path:
    dest = cache_dir() / "pypi" / filename
    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        url, sha256 = pypi_file_url(project, filename)
        part = dest.with_name(f"{dest.name}.{os.getpid()}.part")
        download(url, part, sha256, progress=False)
        os.replace(part, dest)
    return dest
