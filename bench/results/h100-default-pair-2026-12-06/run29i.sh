# session 29: the attention's rows a program: at most 2 rows in the narrow tile (and the AR step's one row
# alone) vs the defaults, SmolLM2's heads (the pair's 8215-slot cache to 1024 keys; context + 1024 beyond) and
# the 27B's; each setting's rows checked bitwise first (the AR step's one row against a verify's rows)
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
SYNTH=0 bash bench/gpu_step.sh prep >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/bench FLASHTREE_CACHE=/root/stash/cache PYTHONUNBUFFERED=1
S='[{}, {"SHORT_ROWS": 2, "ROWS_FROM_KEYS": 1099511627776, "AR_ONE_ROW": true}]'
mkdir -p $OUT/smol_short $OUT/smol_long $OUT/big
ATTN_HEADS=SmolLM2 ATTN_SLOTS=8215 ATTN_CONTEXTS=64,256,512,1024 ATTN_SETTINGS="$S" \
    timeout 120 python3 bench/gpu_attention.py $OUT/smol_short 2>&1 | grep -v USDT | tee $OUT/smol_short/attention.log
ATTN_HEADS=SmolLM2 ATTN_CONTEXTS=2048,8192,32768 ATTN_SETTINGS="$S" \
    timeout 120 python3 bench/gpu_attention.py $OUT/smol_long 2>&1 | grep -v USDT | tee $OUT/smol_long/attention.log
ATTN_HEADS=27B ATTN_CONTEXTS=512,2048,8192,32768 ATTN_SETTINGS="$S" \
    timeout 200 python3 bench/gpu_attention.py $OUT/big 2>&1 | grep -v USDT | tee $OUT/big/attention.log
