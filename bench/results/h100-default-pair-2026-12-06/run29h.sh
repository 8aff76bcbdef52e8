# session 29: the attention's rows a program at short contexts: SmolLM2's heads in the default pair's 8215-slot
# cache, then the 27B's heads (cache = context + 1024); each setting's rows checked bitwise first
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
SYNTH=0 bash bench/gpu_step.sh prep >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/bench FLASHTREE_CACHE=/root/stash/cache PYTHONUNBUFFERED=1
mkdir -p $OUT/smol $OUT/big
ATTN_HEADS=SmolLM2 ATTN_SLOTS=8215 ATTN_CONTEXTS=64,128,256,512,1024 \
ATTN_SETTINGS='[{}, {"MAX_ROWS": 1}, {"MAX_ROWS": 2}, {"SPLITS_PER_CACHE": 256}, {"MAX_ROWS": 1, "SPLITS_PER_CACHE": 256}]' \
    timeout 240 python3 bench/gpu_attention.py $OUT/smol 2>&1 | grep -v USDT | tee $OUT/smol/attention.log
ATTN_HEADS=27B ATTN_CONTEXTS=512,2048,8192 ATTN_SETTINGS='[{}, {"MAX_ROWS": 1}]' \
    timeout 200 python3 bench/gpu_attention.py $OUT/big 2>&1 | grep -v USDT | tee $OUT/big/attention.log
