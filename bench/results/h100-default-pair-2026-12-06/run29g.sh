# session 29, call 11 (warm, after prep and stage-a; draft out of the tree): the pair's graphed steps profiled
# (bench/gpu_profile_steps.py, unchanged since abe08f7) with main's package, then session 19's, twice each
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
G=/root/stash/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $G ] || cat /root/stash/smollm2.part.aa .stage/draft/smollm2.part.ab >$G
md5sum $G
for round in 1 2; do
    PAIR_NAME=main$round timeout 100 bash bench/gpu_step.sh profile-pair | grep -A16 "^== tree"
    keep=$(mktemp -d) && cp -r flashtree "$keep/" && rm -rf flashtree && cp -r .ab_s19/flashtree .
    FLASHTREE_GIT_COMMIT=abe08f7 PAIR_NAME=s19_$round timeout 100 bash bench/gpu_step.sh profile-pair | grep -A16 "^== tree"
    rm -rf flashtree && cp -r "$keep/flashtree" .
done
