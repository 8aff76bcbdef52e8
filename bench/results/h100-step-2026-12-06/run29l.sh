# session 29, last call: the 27B step at 512 cached tokens at main's defaults (2c3dfb9), int8 then bf16
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
bash bench/gpu_step.sh prep >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
STEP_WEIGHTS=packed STEP_ARITH="int8 bf16" timeout 300 bash bench/gpu_step.sh step | grep -v assembl
