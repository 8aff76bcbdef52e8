# session 28, call 4: the 27B step at the defaults, 512 cached tokens, packed int8 and bf16 (the H200 run
# of current main the README owes, if the service gives an H200)
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
bash bench/gpu_step.sh prep >/dev/null 2>&1
STEP_CONTEXT=512 STEP_WEIGHTS=packed STEP_ARITH="int8 bf16" STEP_SUFFIX=_512 timeout 400 bash bench/gpu_step.sh step
