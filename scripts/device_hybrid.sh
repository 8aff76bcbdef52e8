#!/usr/bin/env bash
# Issue #43 parts 1-2 on the device, one background pipeline over back-to-back calls on one warm machine:
# `benchmarks/hybrid_target.py all` (data, train, convert, check), then, unless DRAFT_MINUTES=0, its DFlash
# draft (`flashtree train-draft` on the hybrid q4_k_m GGUF: generation GEN_MINUTES, default 3, training
# DRAFT_MINUTES, default 6; Q8_0 GGUF), `flashtree bench` of the pair (ar, chain, tree; 10 prompts a set,
# plain-AR baseline) and `flashtree bench-step` (the per-step costs). Here first: bash
# scripts/gpu_wheels.sh, pip download --no-deps -d .wheels/fla fla-core==0.6.0 einops, python -m
# benchmarks.hybrid_target stage --out .stage/hybrid, and STEP=prepare bash scripts/llama_dflash.sh (its
# datasets/, the benchmark prompts).
#   STEP=start COMMIT=<this checkout's>   carry .stage/hybrid/prompts.jsonl.gz .stage/hybrid/teacher.md5
#       .stage/llama/datasets .wheels/issue6 .wheels/fla, and the teacher: scripts/llama_dflash.sh's
#       /root/stash/target.gguf (the same SmolLM2 GGUF) when that ran on this machine, else
#       .stage/hybrid/teacher.part.* over earlier calls (cp .stage/hybrid/* /root/stash/hybrid/);
#       waits up to WAIT_S (default 540) seconds
#   STEP=collect   waits up to WAIT_S more (call again while it runs), then $OUT/results.tar.gz (log, the
#       JSONs of the run, the draft's training log, the bench and bench-step results) and the GGUFs
#       (hybrid q4_k_m, draft q8_0) in 15 MB pieces
set -u
S=/root/stash/hybrid
mkdir -p $S
wait_run() {
  for _ in $(seq $((${WAIT_S:-540} / 5))); do kill -0 "$(cat $S/pid)" 2>/dev/null || break; sleep 5; done
}
pipeline() {  # in $S
  python3 -m benchmarks.hybrid_target all --out run --target teacher.gguf --prompts prompts.jsonl.gz \
    --device cuda || return 1
  [ "${DRAFT_MINUTES:-6}" = 0 ] && return 0
  python3 -m flashtree train-draft --target run/hybrid-q4_k_m.gguf --out run/draft --layers 5 \
    --prompts prompts.jsonl.gz --gen-batch 2048 --gen-minutes "${GEN_MINUTES:-3}" \
    --train-minutes "${DRAFT_MINUTES:-6}" --batch 32 --anchors 64 --dev-prompts 10 --device cuda || return 1
  python3 -m flashtree convert run/draft run/draft-q8_0.gguf --type q8_0 || return 1
  python3 -m flashtree bench --target run/hybrid-q4_k_m.gguf --draft run/draft-q8_0.gguf --n 10 \
    --max-tokens 256 --modes ar,chain,tree --budget 22 --baseline plain --seed 0 --out run/bench --device cuda
  python3 -m flashtree bench-step --target run/hybrid-q4_k_m.gguf --draft run/draft-q8_0.gguf \
    --out run/bench_step.json
}
case "${STEP:-}" in
start)
  cp .stage/hybrid/* $S/
  if [ -f /root/stash/target.gguf ]; then cp /root/stash/target.gguf $S/teacher.gguf
  else cat $S/teacher.part.* > $S/teacher.gguf; fi
  (cd $S && md5sum -c teacher.md5) || exit 1
  pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl .wheels/fla/*.whl
  mkdir -p $S/cache && cp -r .stage/llama/datasets $S/cache/
  cp -r flashtree benchmarks bench $S/
  export FLASHTREE_GIT_COMMIT=${COMMIT:-unknown} FLASHTREE_CACHE=$S/cache PYTHONPATH=/tmp/site:$S \
    PYTHONUNBUFFERED=1 DRAFT_MINUTES=${DRAFT_MINUTES:-6} GEN_MINUTES=${GEN_MINUTES:-3}
  export -f pipeline
  cd $S && (setsid nohup bash -c pipeline > log 2>&1 < /dev/null & echo $! > pid)
  wait_run; tail -n 30 $S/log ;;
collect)
  wait_run; cd $S && tail -n 40 log
  tar -czf "$OUT/results.tar.gz" log run/*.json run/draft/*.json* run/bench 2>/dev/null
  for g in hybrid-q4_k_m draft-q8_0; do
    [ -f run/$g.gguf ] && split -b 15M run/$g.gguf "$OUT/$g.gguf.part."
  done ;;
*) echo "STEP=start|collect (see the comment at the top)"; exit 2 ;;
esac
