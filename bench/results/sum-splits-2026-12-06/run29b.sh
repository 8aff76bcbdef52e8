# session 29, call 2 (warm): the bf16 27B step at 512 with the default summing launch (call 1's timed out)
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
bash bench/gpu_step.sh prep >/dev/null 2>&1
STEP_WEIGHTS=packed STEP_ARITH=bf16 STEP_SUFFIX=_sum0 timeout 200 bash bench/gpu_step.sh step | grep -v assembl
b=128; w=2
cp flashtree/kernels/qmatmul.py /tmp/qmatmul.keep
sed -i "s/^SUM_BLOCK = 1024/SUM_BLOCK = $b/; s/^SUM_WARPS = 4/SUM_WARPS = $w/" flashtree/kernels/qmatmul.py
STEP_WEIGHTS=packed STEP_ARITH=bf16 STEP_SUFFIX=_sum1b timeout 200 bash bench/gpu_step.sh step | grep -v assembl
cp /tmp/qmatmul.keep flashtree/kernels/qmatmul.py
