#!/usr/bin/env bash
# The default pair (SmolLM2-135M-Instruct Q4_1 + the shipped draft) at HEAD and at a base commit side by
# side, from git-archive copies (.stage/head, .stage/base, as scripts/device_ab.sh). The 98 MB target comes
# in 25 MB pieces (split -b 25M FILE .stage/pair/smollm2.part.), one a call, stashed in /root/stash:
#   PIECE=aa|ab|ac bash scripts/device_pair_ab.sh        (carry .stage/pair/smollm2.part.$PIECE)
#   PIECE=ad BASE=<sha> HEAD_SHA=<sha> bash scripts/device_pair_ab.sh   (the last piece, then the benchmark;
#       carry .wheels/issue6 .stage/pair/smollm2.part.ad .stage/pair/datasets .stage/base .stage/head)
# The shipped draft is stashed from the first call's tree (STASH_DRAFT=1). Results under $OUT.
set -u
stash=/root/stash; mkdir -p $stash/cache
cp ".stage/pair/smollm2.part.$PIECE" $stash/
[ "${STASH_DRAFT:-0}" = 1 ] && cp flashtree/drafts/smollm2-135m-instruct.gguf $stash/draft.gguf
[ "$PIECE" = ad ] || { ls -la $stash; exit 0; }
cat $stash/smollm2.part.a? > $stash/target.gguf
echo "md5 $(md5sum $stash/target.gguf | cut -d' ' -f1) (want ${GGUF_MD5:-a1231443440b107ff29f02bdb38c9d0a})" | tee "$OUT/pair_md5.txt"
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
