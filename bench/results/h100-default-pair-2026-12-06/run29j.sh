# session 29 (warm, after prep and stage-a; draft out of the tree): the default pair's tree and plain AR with
# main's attention, then with .ab_rows' (at most 2 rows a program below 4096 keys, the AR step's row alone)
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
PAIR_ARGS="--modes tree --baseline plain" PAIR_NAME=pair_main timeout 150 bash bench/gpu_step.sh pair | tail -5
keep=$(mktemp -d) && cp -r flashtree tests "$keep/" && cp -r .ab_rows/. .
PAIR_ARGS="--modes tree --baseline plain" PAIR_NAME=pair_rows2 timeout 150 bash bench/gpu_step.sh pair | tail -5
rm -rf flashtree tests && cp -r "$keep/flashtree" "$keep/tests" .
