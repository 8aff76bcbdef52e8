#!/usr/bin/env bash
# The default pair (SmolLM2-135M-Instruct Q4_1 + the shipped draft as it was at BASE, which both sides
# read) at HEAD and at a base commit side by side, from git-archive copies (.stage/head, .stage/base, as
# scripts/device_ab.sh). The target and that draft, concatenated, come in pieces .stage/pair/p1..p4 (each
# call carries at most 64 MiB with the tree), one a call, stashed in /root/stash:
#   PIECE=p1|p2|p3 bash scripts/device_pair_ab.sh                     (carry .stage/pair/$PIECE)
#   PIECE=p4 BASE=<sha> HEAD_SHA=<sha> bash scripts/device_pair_ab.sh  (the last piece, then the benchmark;
#       carry .wheels/issue6 .stage/pair/p4 .stage/pair/datasets .stage/base .stage/head)
# TARGET_BYTES: the target's size (the rest is the draft). Results under $OUT.
set -u
stash=/root/stash; mkdir -p $stash/cache
cp ".stage/pair/$PIECE" $stash/
[ "$PIECE" = p4 ] || { ls -la $stash; exit 0; }
cat $stash/p1 $stash/p2 $stash/p3 $stash/p4 > $stash/blob
head -c "${TARGET_BYTES:-98362432}" $stash/blob > $stash/target.gguf
tail -c +$((${TARGET_BYTES:-98362432} + 1)) $stash/blob > $stash/draft.gguf
md5sum $stash/target.gguf $stash/draft.gguf | tee "$OUT/pair_md5.txt"
cp -r .stage/pair/datasets $stash/cache/
pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt"
export FLASHTREE_CACHE=$stash/cache TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
for side in head base; do
  commit=${HEAD_SHA:-head}; [ "$side" = base ] && commit=${BASE:-base}
  FLASHTREE_GIT_COMMIT=$commit PYTHONPATH=/tmp/site:$PWD/.stage/$side python3 -m flashtree bench \
    --target $stash/target.gguf --draft $stash/draft.gguf --n "${N:-10}" --max-tokens 256 --modes ar,tree \
    --baseline plain --budget 22 --seed 0 --device cuda --out "$OUT/pair_$side" > "$OUT/pair_$side.log" 2>&1
  echo "$side rc=$?"; tail -15 "$OUT/pair_$side.log"
done
