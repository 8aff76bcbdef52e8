# session 29, call 8 (warm, after prep and stage-a; draft out of the tree): the default pair's tree and plain AR,
# with main's package, then with session 19's (abe08f7, .ab_s19/flashtree), side by side on one machine
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
PAIR_ARGS="--modes tree --baseline plain" PAIR_NAME=pair_main timeout 200 bash bench/gpu_step.sh pair | tail -9
keep=$(mktemp -d) && cp -r flashtree "$keep/" && rm -rf flashtree && cp -r .ab_s19/flashtree .
FLASHTREE_GIT_COMMIT=abe08f7 PAIR_ARGS="--modes tree --baseline plain" PAIR_NAME=pair_s19 timeout 200 bash bench/gpu_step.sh pair | tail -9
rm -rf flashtree && cp -r "$keep/flashtree" .
