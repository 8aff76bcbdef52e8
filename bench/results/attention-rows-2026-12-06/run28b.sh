# session 28, call 2 (warm, after run28a): the 27B step at 32K with session 26's attention (.ab_old) and the
# verify-tile32 branch's (.ab_tile32), each in its own copy of the files
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
bash bench/gpu_step.sh prep >/dev/null 2>&1
for side in old tile32; do
    keep=$(mktemp -d) && cp -r flashtree tests "$keep/" && cp -r .ab_$side/. .
    STEP_CONTEXT=32768 STEP_WEIGHTS=packed STEP_ARITH=bf16 STEP_SUFFIX=_$side timeout 280 bash bench/gpu_step.sh step
    rm -rf flashtree tests && cp -r "$keep/flashtree" "$keep/tests" .
done
