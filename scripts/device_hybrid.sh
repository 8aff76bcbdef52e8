#!/usr/bin/env bash
# Issue #43 part 1 on the device: `benchmarks/hybrid_target.py all` (data, train, convert, check) in the
# background, in two back-to-back calls on one warm machine. Here first: bash scripts/gpu_wheels.sh,
# pip download --no-deps -d .wheels/fla fla-core==0.6.0 einops, python -m benchmarks.hybrid_target stage
# --out .stage/hybrid.
#   STEP=start COMMIT=<this checkout's>   carry .stage/hybrid/prompts.jsonl.gz .stage/hybrid/teacher.md5
#       .wheels/issue6 .wheels/fla, and the teacher: scripts/llama_dflash.sh's /root/stash/target.gguf (the
#       same SmolLM2 GGUF) when that ran on this machine, else .stage/hybrid/teacher.part.* over earlier calls
#       (cp .stage/hybrid/* /root/stash/hybrid/); waits up to WAIT_S (default 540) seconds
#   STEP=collect   waits up to WAIT_S more, then $OUT/results.tar.gz (log, data/train/loss/check/provenance
#       JSONs) and the q4_k_m GGUF in 15 MB pieces ($OUT/hybrid-q4_k_m.gguf.part.*)
set -u
S=/root/stash/hybrid
mkdir -p $S
wait_run() {
  for _ in $(seq $((${WAIT_S:-540} / 5))); do kill -0 "$(cat $S/pid)" 2>/dev/null || break; sleep 5; done
}
case "${STEP:-}" in
start)
  cp .stage/hybrid/* $S/
  if [ -f /root/stash/target.gguf ]; then cp /root/stash/target.gguf $S/teacher.gguf
  else cat $S/teacher.part.* > $S/teacher.gguf; fi
  (cd $S && md5sum -c teacher.md5) || exit 1
  pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl .wheels/fla/*.whl
  cp -r flashtree benchmarks bench $S/
  cd $S && (FLASHTREE_GIT_COMMIT=${COMMIT:-unknown} PYTHONPATH=/tmp/site:$S PYTHONUNBUFFERED=1 setsid nohup \
    python3 -m benchmarks.hybrid_target all --out run --target teacher.gguf --prompts prompts.jsonl.gz \
    --device cuda > log 2>&1 < /dev/null & echo $! > pid)
  wait_run; tail -n 30 $S/log ;;
collect)
  wait_run; cd $S && tail -n 40 log
  tar -czf "$OUT/results.tar.gz" log run/*.json 2>/dev/null
  [ -f run/hybrid-q4_k_m.gguf ] && split -b 15M run/hybrid-q4_k_m.gguf "$OUT/hybrid-q4_k_m.gguf.part." ;;
*) echo "STEP=start|collect (see the comment at the top)"; exit 2 ;;
esac
