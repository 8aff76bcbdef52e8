#!/usr/bin/env bash
# Train the shipped SmolLM2-135M-Instruct draft on the lent GPU machine and benchmark it, in one lease
# (docs: gpu-machine.md; the device tool's limits: 10 min per call, 30 s warm between calls).
#
# Staged here first, in the git-ignored .stage/draft/: the gguf wheel (whl/), the prompt file
# (prompts.jsonl.gz, from flashtree.train.prompts.build_prompts), the benchmark prompt cache
# (cache/datasets/), a tiny target (tiny.gguf) and the SmolLM2 GGUF in pieces (smollm2.part.aa, ab...):
# the working tree travels with at most 64 MiB a call, so also move the shipped 12 MB draft
# (flashtree/drafts/) out of the checkout during calls 1 and 2 (the pipeline does not use it).
#   call 1: `smoke`   (carry .stage/draft minus part ab): stashes the pieces carried, runs the pipeline on the
#                     tiny target (catches CUDA-only failures cheaply);
#   call 2: `launch`  (carry .stage/draft minus part aa): joins the pieces, starts `pipeline` in its own
#                     process session (it outlives the call while the machine stays held), then waits;
#   calls 3+: `wait`  (carry nothing): waits, then returns the artifacts when the pipeline is done.
# The machine goes back 30 s after a call ends, taking the stash with it (it happened in sessions 4
# and 5, each time during a gap of the caller, not of the machine). So every call that ends returns what
# a lost machine would take: the generated data once generation is over (data.tgz.part.*), and the
# draft of the trainer's latest checkpoint (snapshot-stepN-q8_0.gguf.part.*, Q8_0 GGUF, usable as is).
# A `wait` that lands on a fresh machine exits at once (code 3) instead of waiting for nothing.
# To continue after a loss: put the data parts in .stage/draft/data/ (scripts/stage_draft.sh builds the
# rest of .stage/draft), then `smoke`, `stage-data` (carry .stage/draft/data), and `launch` with
# GEN_MINUTES=0: the pipeline finds every shard and spends the whole lease on training.
# Training can go on from an earlier draft (a snapshot returned by a lost run, or the shipped one):
# stage the GGUF in three pieces (PART_SIZE=33M bash scripts/stage_draft.sh), then `smoke` (carry
# piece aa, the tiny target...), `stash flashtree/drafts/<draft>` (carry piece ab; the draft travels
# in the working tree, back in place for this call only) and `launch` with INIT=/root/stash/<draft>
# (carry piece ac, the prompts...);
# give another SEED so that a time-limited generation answers other prompts than the last run's.
# `pipeline`: generate responses, train (GEN_MINUTES, TRAIN_MINUTES), write the draft, convert it to the
# Q8_0 GGUF that ships, then `flashtree bench` on the default pair with that GGUF (AR, chain, tree, HF
# baseline; 10 prompts per set).
set -uo pipefail
S=.stage/draft
STASH=/root/stash
GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
RUN=$STASH/run
DRAFT_GGUF=$STASH/draft-q8_0.gguf
BENCH=$STASH/bench
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD FLASHTREE_CACHE=$STASH/cache

install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $S/whl/*.whl || exit 1
}

stash_pieces() {  # the target GGUF pieces this call carries
  mkdir -p $STASH && cp $S/smollm2.part.* $STASH/ 2>/dev/null
}

pipeline_running() {  # a failed pipeline ends the wait at once instead of after WAIT_SECONDS
  pgrep -f "train_draft_gpu.sh pipeline" >/dev/null
}

results() {  # what exists of the log, the run's configs and training log, the bench
  tar -czf $OUT/results.tar.gz -C $STASH log run/config.json run/train_log.jsonl run/train_config.json \
    bench 2>/dev/null || true
}

collect() {  # the artifacts, at most 8 files of 16 MiB for $OUT; the draft only once
  results
  if [ -f $DRAFT_GGUF ] && [ ! -f $STASH/draft.sent ]; then
    split -b 15M $DRAFT_GGUF $OUT/draft-q8_0.gguf.part. && touch $STASH/draft.sent
  fi
  ls -la $OUT
}

snapshot() {  # the draft of the trainer's last checkpoint (run/snapshot), as Q8_0 GGUF, if new
  local step
  step=$(cat $RUN/snapshot/step 2>/dev/null) || return 0
  [ "$step" != "$(cat $STASH/snapshot.sent 2>/dev/null)" ] || return 0
  python3 -m flashtree convert $RUN/snapshot $STASH/snapshot.gguf --type q8_0 >/dev/null || return 0
  split -b 15M $STASH/snapshot.gguf $OUT/snapshot-step$step-q8_0.gguf.part. && echo "$step" > $STASH/snapshot.sent
  results
}

save_data() {  # once generation is over (the trainer has written its config), the data for $OUT
  [ -f $RUN/train_config.json ] && [ ! -f $STASH/data.sent ] || return 0
  tar -czf - -C $RUN data | split -b 15M - $OUT/data.tgz.part. && touch $STASH/data.sent
}

case "${1:-}" in
smoke)
  stash_pieces && cp -r $S/cache $STASH/
  install
  nvidia-smi -L
  python3 -m flashtree train-draft --target $S/tiny.gguf --out /tmp/smoke --layers 2 \
    --prompts $S/smoke_prompts.jsonl.gz --max-new-tokens 40 --gen-batch 8 --gen-minutes 0.3 \
    --train-minutes 0.1 --batch 4 --anchors 8 --device cuda || exit 1
  python3 -m flashtree convert /tmp/smoke /tmp/smoke.gguf --type q8_0 || exit 1
  python3 -m flashtree bench --target $S/tiny.gguf --draft /tmp/smoke.gguf --n 1 --max-tokens 24 \
    --baseline hf --out /tmp/smoke-bench --device cuda
  ;;
launch)
  install
  stash_pieces
  cat $STASH/smollm2.part.* > $GGUF  # every piece carried so far, in name order
  echo "$GGUF_MD5  $GGUF" | md5sum -c || exit 1
  # The pipeline runs from its own copy: later calls re-sync the working tree under it.
  rm -rf $STASH/src && mkdir -p $STASH/src && cp -r flashtree scripts $S $STASH/src/ && cp -r $S/cache $STASH/
  cd $STASH/src
  setsid nohup bash scripts/train_draft_gpu.sh pipeline > $STASH/log 2>&1 < /dev/null &
  for _ in $(seq "${WAIT_SECONDS:-540}"); do sleep 1; pipeline_running || break; done
  tail -n 25 $STASH/log
  save_data
  snapshot
  ;;
stash)  # copy the carried GGUF pieces and the paths given after `stash` into $STASH (e.g. INIT's draft)
  shift && stash_pieces; cp -r "$@" $STASH/ && ls -la $STASH
  ;;
stage-data)  # the data returned by a lost machine's run
  mkdir -p $RUN && cat $S/data/data.tgz.part.* | tar -xzf - -C $RUN && ls $RUN/data | wc -l
  ;;
pipeline)  # run from $STASH/src
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi -L
  python3 -m flashtree train-draft --target $GGUF --out $RUN --layers 5 --prompts draft/prompts.jsonl.gz \
    ${INIT:+--init "$INIT"} --seed "${SEED:-0}" --gen-batch 2048 --sampled-every 4 --gen-minutes "${GEN_MINUTES:-7}" \
    --train-minutes "${TRAIN_MINUTES:-12}" --batch 32 --anchors 64 --lr "${LR:-6e-4}" --device cuda || exit 1
  python3 -m flashtree convert $RUN $DRAFT_GGUF --type q8_0 || exit 1
  python3 -m flashtree bench --target $GGUF --draft $DRAFT_GGUF --n 10 --max-tokens 256 --modes ar,chain,tree \
    --budget 22 --baseline hf --seed 0 --out $BENCH --device cuda
  touch $STASH/done
  ;;
wait)  # until the pipeline is done, the draft is written (returned at once: the bench may not
       # finish in the lease) or WAIT_SECONDS pass; then what exists of the artifacts
  # A fresh machine (the held one was given back while no call ran) has no run: say so at once
  # instead of spending the wait on it.
  [ -f $STASH/log ] || { echo "no run on this machine: the machine was lost; see the header" >&2; exit 3; }
  for _ in $(seq "${WAIT_SECONDS:-540}"); do
    [ -f $STASH/done ] || { [ -f $DRAFT_GGUF ] && [ ! -f $STASH/draft.sent ]; } || ! pipeline_running && break
    sleep 1
  done
  tail -n 40 $STASH/log
  save_data
  { [ -f $STASH/done ] || [ -f $DRAFT_GGUF ]; } && collect || snapshot
  ;;
*)
  echo "usage: $0 smoke|stash PATH...|stage-data|launch|pipeline|wait" >&2
  exit 2
  ;;
esac
