#!/bin/bash
# Issue-6 measurements on the device machine, in two calls that reuse the warm machine's /root/stash:
#   bench/gpu_step.sh kernels   kernel checks + tile sweep + 27B layer shapes (bench/gpu_kernels.py);
#                               starts the synthetic Qwen3.6-27B Q4_K_M + 5-layer draft in the background
#   bench/gpu_step.sh step      flashtree bench-step with the quantized kernels, then with dense bf16
#   bench/gpu_step.sh quick     only the 27B types' checks and layer-shape timings (little device time)
#   bench/gpu_step.sh all       in one call: checks, bench-step (default tiles), then sweep + shapes
# Needs: carry .wheels/issue6 (gguf wheel) and .cache/issue6 (Qwen3 tokenizer files for synth); $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .wheels/issue6/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FLASHTREE_CACHE=$PWD/.cache/issue6 PYTHONUNBUFFERED=1
# RAM-backed when /dev/shm can hold the model twice (the writer's side file): no disk in the way
STASH=/root/stash
if [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -gt 40 ] 2>/dev/null; then STASH=/dev/shm/issue6; fi
mkdir -p "$STASH"
echo "stash: $STASH"
FT="python3 -m flashtree"

synth() {
    $FT synth --shape qwen3.6-27b --type q4_k_m "$STASH/q27.gguf" \
        && $FT synth --draft-for "$STASH/q27.gguf" --layers 5 "$STASH/draft5" \
        && touch "$STASH/synth.done"
}

start_synth() {
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
    if [ ! -f "$STASH/synth.done" ]; then
        # own session: survives this command; nice: Triton compiles in the foreground keep the CPU
        export -f synth; export FT STASH
        setsid nohup nice -n 19 bash -c 'time synth' >"$STASH/synth.log" 2>&1 </dev/null &
    fi
}

kernels() {  # kernels NAME STAGES [TYPES]
    python3 bench/gpu_kernels.py "$OUT" --name "$1" --stages "$2" --types "${3:-Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q4_1}" \
        --tiles-out "$STASH/tiles.json" 2>&1 | tee "$OUT/$1.log"
}

step() {
    if [ ! -f "$STASH/synth.done" ]; then
        if ! pgrep -f "synth --" >/dev/null; then time synth >"$STASH/synth.log" 2>&1; fi
        while [ ! -f "$STASH/synth.done" ] && pgrep -f "synth --" >/dev/null; do sleep 2; done
    fi
    tail -c 300 "$STASH/synth.log"; ls -la "$STASH" "$STASH/draft5"
    [ -f "$STASH/tiles.json" ] && export FLASHTREE_QMM_TILES="$(cat "$STASH/tiles.json")"
    echo "tiles: ${FLASHTREE_QMM_TILES:-defaults}"
    $FT bench-step --target "$STASH/q27.gguf" --draft "$STASH/draft5" --out "$OUT/step_quant.json" 2>&1 \
        | grep -v USDT | tee "$OUT/step_quant.log"
    $FT bench-step --target "$STASH/q27.gguf" --draft "$STASH/draft5" --out "$OUT/step_dense.json" --dense 2>&1 \
        | grep -v USDT | tee "$OUT/step_dense.log"
}

case "$1" in
kernels) start_synth && kernels kernels checks,sweep,shapes ;;
step) step ;;
quick) kernels kernels checks,shapes Q4_K,Q6_K ;;
all)
    start_synth && kernels kernels_checks checks Q4_K,Q6_K && rm -f "$STASH/tiles.json" && step
    kernels kernels_tune checks,sweep,shapes Q5_K,Q8_0,Q4_0,Q4_1
    ;;
*)
    echo "usage: $0 kernels|step|all" >&2
    exit 2
    ;;
esac
