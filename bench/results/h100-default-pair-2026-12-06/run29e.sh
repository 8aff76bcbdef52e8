# session 29, call 5 (warm; draft still out): the default pair, AR / tree / plain AR, 10 prompts a set
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
PAIR_ARGS="--modes ar,tree --baseline plain" timeout 560 bash bench/gpu_step.sh pair
