# session 29, call 1: the summing launch's sweep (no GGUF), then the 27B step at 512: defaults (int8 and bf16),
# then bf16 with the sweep's best block x warps (qmatmul.SUM_BLOCK / SUM_WARPS patched in the tree, restored)
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
bash bench/gpu_step.sh prep >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 bash bench/gpu_step.sh sums
best=$(python3 -c "import json;print(json.load(open('$OUT/sum_splits.json'))['best'])")
echo "best: $best"
STEP_WEIGHTS=packed STEP_ARITH="int8 bf16" STEP_SUFFIX=_sum0 timeout 220 bash bench/gpu_step.sh step
b=${best%x*}; w=${best#*x}
cp flashtree/kernels/qmatmul.py /tmp/qmatmul.keep
sed -i "s/^SUM_BLOCK = 1024/SUM_BLOCK = $b/; s/^SUM_WARPS = 4/SUM_WARPS = $w/" flashtree/kernels/qmatmul.py
grep -n "^SUM_" flashtree/kernels/qmatmul.py
STEP_WEIGHTS=packed STEP_ARITH=bf16 STEP_SUFFIX=_sum1 timeout 150 bash bench/gpu_step.sh step
cp /tmp/qmatmul.keep flashtree/kernels/qmatmul.py
