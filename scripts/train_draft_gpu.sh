#!/usr/bin/env bash
# Train the shipped SmolLM2-135M-Instruct draft on the lent GPU machine and benchmark it, in one lease
# (docs: gpu-machine.md; the device tool's limits: 10 min per call, 64 MiB carried per call, 30 s warm
# between calls).
#
# Staged here first, in the git-ignored .stage/draft/ (scripts/stage_draft.sh builds it): the gguf
# wheel (whl/), the prompt file (prompts.jsonl.gz), the benchmark prompt cache (cache/datasets/), a tiny
# target (tiny.gguf, smoke_prompts.jsonl.gz) and the SmolLM2 GGUF in pieces (smollm2.part.aa, ab...);
# optionally data/ (the data.tgz.part.* a run returned: generation resumes where it stopped),
# extra/NAME/ (the data.tgz.part.* of other runs: their responses are trained on too, --extra-data) and
# init.gguf (a draft to go on training, e.g. `cp flashtree/drafts/*.gguf .stage/draft/init.gguf`).
# That is more than one call carries, so every call adds the part of .stage/draft it carries to the
# machine's $STAGE, and the pipeline takes everything from there. Move the shipped draft
# (flashtree/drafts/) out of the checkout during the calls: it would travel with the working tree.
#   calls 1..n-1: `stash` (carry any part of .stage/draft), or `smoke` (the same, then a run of the
#                 pipeline on the tiny target: catches CUDA-only failures cheaply);
#   call n:       `launch` (carry the rest): joins the pieces, starts `pipeline` in its own process
#                 session (it outlives the call while the machine stays held), then waits;
#   then:         `wait` (carry nothing), call after call, until the draft and the bench are back.
# A plan that fits (session 9; the working tree is ~4 MB without the shipped draft):
#   1. smoke:  whl, tiny.gguf, smoke_prompts.jsonl.gz, cache/datasets (its bench reads the prompts), part aa;
#   2. stash:  init.gguf, the prompt file (PROMPTS), data (optional, ~19 MB for 15 M tokens);
#   3. launch: part ab.
# The machine goes back 30 s after a call ends, taking $STASH with it (sessions 4 and 5 lost runs that
# way, each time during a gap of the caller). So every call that ends returns what a lost machine would
# take: the generated data once generation is over (data.tgz.part.*: put them in .stage/draft/data/
# for the next lease), and the draft of the trainer's latest checkpoint (snapshot-stepN-q8_0.gguf.part.*,
# Q8_0 GGUF, usable as is, e.g. as init.gguf). A `wait` that lands on a fresh machine exits at once
# (code 3); a pipeline that fails ends `launch` / `wait` at once.
# `pipeline`: generate responses (GEN_MINUTES; shards already in data/ are kept), train (TRAIN_MINUTES,
# from init.gguf if staged), write the draft, convert it to the Q8_0 GGUF that ships, then
# `flashtree bench` on the default pair with it (AR, chain, tree, HF and plain-AR baselines; 10 prompts per set).
# BASELINES (default hf,plain): the bench's --baseline (plain alone saves the ~40 s of HF generation).
# BENCH_INIT=1: also bench init.gguf's tree against plain AR (the draft trained from, in the same run);
# PROFILE=0: no step profile at the end (a lease short of time).
# DEV_PROMPTS (default 10): train-draft --dev-prompts, the replayed AL of the target's greedy responses to
# that many development prompts per benchmark set (none of the reports') in val_log.jsonl at every
# checkpoint beside the held-out responses' (which rose in the twelfth run while the benchmark did not).
# PROMPTS (default prompts.jsonl.gz): the prompt file(s) of the stage to generate from (several,
# space-separated: one mix, whose batches a time-limited generation covers in a seeded random order,
# e.g. after the earlier runs' data was lost with the checkout in session 18); prompts-fresh.jsonl.gz
# once the first pool's greedy responses are used (with SAMPLED_EVERY=0 PASSES=1: greedy responses
# to new prompts are what moved the draft; the sixth run's sampled ones did not); prompts-fresh2.jsonl.gz
# once both are used (the eighth run trained on both: stage its data and the seventh's under extra/).
# SELF_N (default 0; issue #43 part 3): before training, the target writes self-prompts on the GPU
# (`benchmarks.self_prompts write --batch 1024`) until SELF_N raw turns, going on from the CPU run's
# committed raw.jsonl (bench/results/cpu-self-prompts-2026-12-06); train-draft takes their training split
# (--self-prompts), and after the bench the held-out split's tree AL is measured for the new draft and for
# init.gguf (al.json, al_init.json; 50 prompts x 64 tokens), returned with the results.
# SEED (default 0) orders the prompt batches: keep it, SAMPLED_EVERY and PASSES while data/ holds an
# earlier run's shards (the fourth and fifth runs': SEED=1 SAMPLED_EVERY=0 PASSES=4, shards 0-63 of 108).
# SAMPLED_EVERY (default 4): in the first pass over the prompts every n-th batch gets sampled
# responses, the rest greedy (0: all greedy); PASSES (default 1) responses per prompt, those after the
# first sampled (generation stops at GEN_MINUTES wherever it is). The `smoke` call also checks the
# decode path's Triton kernels against their torch paths (tests/gpu/test_small_kernels_gpu.py and its
# neighbours, `python -m benchmarks small`'s set), and the pipeline ends with a profile of the graphed
# AR / chain / tree steps (benchmarks/gpu_profile_steps.py).
set -uo pipefail
S=.stage/draft
STASH=/root/stash
STAGE=$STASH/stage
GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
RUN=$STASH/run
DRAFT_GGUF=$STASH/draft-q8_0.gguf
BENCH=$STASH/bench
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD FLASHTREE_CACHE=$STASH/cache

stash() {  # what this call carries of .stage/draft, added to $STAGE
  mkdir -p $STAGE $STASH/cache && { [ ! -d $S ] || cp -r $S/. $STAGE/; } && ls $STAGE
  [ ! -d $S/cache ] || cp -r $S/cache/. $STASH/cache/
}

install() {
  [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $STAGE/whl/*.whl || exit 1
}

pipeline_running() {  # a failed pipeline ends the wait at once instead of after WAIT_SECONDS
  pgrep -f "train_draft_gpu.sh pipeline" >/dev/null
}

results() {  # what exists of the log, the run's configs, training and validation logs, the bench
  tar -czf $OUT/results.tar.gz -C $STASH log run/config.json run/train_log.jsonl run/val_log.jsonl \
    run/train_config.json bench self/prompts.jsonl self/provenance.json self/al.json self/al_init.json \
    2>/dev/null || true
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
stash)
  stash
  ;;
smoke)
  stash && install
  nvidia-smi -L
  python3 -m flashtree train-draft --target $STAGE/tiny.gguf --out /tmp/smoke --layers 2 \
    --prompts $STAGE/smoke_prompts.jsonl.gz --max-new-tokens 40 --gen-batch 8 --gen-minutes 0.3 \
    --passes 2 --train-minutes 0.1 --batch 4 --anchors 8 --dev-prompts 1 --device cuda || exit 1
  python3 -m flashtree convert /tmp/smoke /tmp/smoke.gguf --type q8_0 || exit 1
  python3 -m flashtree bench --target $STAGE/tiny.gguf --draft /tmp/smoke.gguf --n 1 --max-tokens 24 \
    --baseline hf,plain --out /tmp/smoke-bench --device cuda || exit 1
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_small_kernels_gpu.py \
    tests/gpu/test_attention_gpu.py tests/gpu/test_tree_deltanet_gpu.py 2>&1 | tail -n 30  # the decode path's kernels
  ;;
launch)
  stash && install
  cat $STAGE/smollm2.part.* > $GGUF  # every piece carried so far, in name order
  echo "$GGUF_MD5  $GGUF" | md5sum -c || exit 1
  if [ -d $STAGE/data ] && [ ! -d $RUN/data ]; then  # a returned run's shards: generation resumes
    mkdir -p $RUN && cat $STAGE/data/data.tgz.part.* | tar -xzf - -C $RUN && ls $RUN/data | wc -l
  fi
  for parts in $STAGE/extra/*/; do  # earlier runs' responses, trained on too (--extra-data)
    [ -d "$parts" ] || continue
    mkdir -p $STASH/extra/$(basename $parts) && cat $parts/data.tgz.part.* | tar -xzf - -C $STASH/extra/$(basename $parts)
  done
  # The pipeline runs from its own copy: later calls re-sync the working tree under it.
  rm -rf $STASH/src && mkdir -p $STASH/src && cp -r flashtree scripts benchmarks $STASH/src/
  [ "${SELF_N:-0}" = 0 ] || { mkdir -p $STASH/self && cp bench/results/cpu-self-prompts-2026-12-06/raw.jsonl $STASH/self/; }
  cd $STASH/src
  setsid nohup bash scripts/train_draft_gpu.sh pipeline > $STASH/log 2>&1 < /dev/null &
  for _ in $(seq "${WAIT_SECONDS:-540}"); do sleep 1; pipeline_running || break; done
  tail -n 25 $STASH/log
  save_data
  snapshot
  ;;
pipeline)  # run from $STASH/src
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi -L
  earlier=() && [ ! -f $STAGE/init.gguf ] || earlier=(--init $STAGE/init.gguf)  # what earlier runs left
  for d in $STASH/extra/*/data; do [ ! -d "$d" ] || earlier+=(--extra-data "$d"); done
  prompts=() && for f in ${PROMPTS:-prompts.jsonl.gz}; do prompts+=(--prompts "$STAGE/$f"); done
  if [ "${SELF_N:-0}" != 0 ]; then  # self-written prompts, their training split (see the header)
    python3 -m benchmarks.self_prompts write --out $STASH/self --target $GGUF --n "$SELF_N" --batch 1024 \
      --device cuda || exit 1
    prompts+=(--self-prompts $STASH/self/prompts.jsonl)
  fi
  python3 -m flashtree train-draft --target $GGUF --out $RUN --layers 5 "${prompts[@]}" \
    "${earlier[@]}" --seed "${SEED:-0}" --gen-batch 2048 --sampled-every "${SAMPLED_EVERY:-4}" --passes "${PASSES:-1}" \
    --gen-minutes "${GEN_MINUTES:-7}" \
    --train-minutes "${TRAIN_MINUTES:-12}" --batch 32 --anchors 64 --lr "${LR:-6e-4}" \
    --dev-prompts "${DEV_PROMPTS:-10}" --device cuda || exit 1
  python3 -m flashtree convert $RUN $DRAFT_GGUF --type q8_0 || exit 1
  python3 -m flashtree bench --target $GGUF --draft $DRAFT_GGUF --n 10 --max-tokens 256 --modes ar,chain,tree \
    --budget 22 --baseline "${BASELINES:-hf,plain}" --seed 0 --out $BENCH --device cuda
  if [ "${BENCH_INIT:-0}" = 1 ] && [ -f $STAGE/init.gguf ]; then  # the draft trained from, side by side
    python3 -m flashtree bench --target $GGUF --draft $STAGE/init.gguf --n 10 --max-tokens 256 --modes tree \
      --budget 22 --baseline plain --seed 0 --out $BENCH/init --device cuda
  fi
  if [ "${SELF_N:-0}" != 0 ]; then  # held-out self-prompts' tree AL: the draft trained from, then the new
    [ ! -f $STAGE/init.gguf ] || { python3 -m benchmarks.self_prompts al --out $STASH/self --target $GGUF \
      --draft $STAGE/init.gguf --n 50 --device cuda && mv $STASH/self/al.json $STASH/self/al_init.json; }
    python3 -m benchmarks.self_prompts al --out $STASH/self --target $GGUF --draft $DRAFT_GGUF --n 50 --device cuda
  fi
  [ "${PROFILE:-1}" = 0 ] || python3 -m benchmarks.gpu_profile_steps $BENCH/profile_steps $GGUF $DRAFT_GGUF 2>&1 \
    | grep -v USDT | tail -n 60
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
  echo "usage: $0 stash|smoke|launch|pipeline|wait" >&2
  exit 2
  ;;
esac
