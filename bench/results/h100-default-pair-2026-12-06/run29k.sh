# session 29 (warm, as run29j): .ab_rows' attention on the default pair with AR too (outputs checked against AR)
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
keep=$(mktemp -d) && cp -r flashtree tests "$keep/" && cp -r .ab_rows/. .
PAIR_ARGS="--modes ar,tree --baseline plain" PAIR_NAME=pair_rows2_ar timeout 200 bash bench/gpu_step.sh pair | tail -22
rm -rf flashtree tests && cp -r "$keep/flashtree" "$keep/tests" .
