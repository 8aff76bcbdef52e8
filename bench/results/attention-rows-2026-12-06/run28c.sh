# session 28, call 3: the verify's wider tile swept (never / from 4096 keys / always) at 512..32K, then the
# 27B step (packed, bf16) at 512 and 32K cached tokens with the defaults
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
bash bench/gpu_step.sh prep >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/bench FLASHTREE_CACHE=/root/stash/cache PYTHONUNBUFFERED=1
mkdir -p "$OUT/sweep"
timeout 300 python3 bench/gpu_attention.py "$OUT/sweep" 2>&1 | grep -v "Warning\|warn(\|output = op" | tee "$OUT/sweep/attention.log"
for context in 32768 512; do
    STEP_CONTEXT=$context STEP_WEIGHTS=packed STEP_ARITH=bf16 STEP_SUFFIX=_$context timeout 200 bash bench/gpu_step.sh step
done
