#!/usr/bin/env bash
# Issue #39 on the device, in stages a call each (the machine stays warm between back-to-back calls, and
# /root/stash with it). Carry .wheels/issue6 and .cache/issue6 (scripts/gpu_wheels.sh).
#   STAGE=tests  the synthetic 27B + 5-layer draft in the background; the GPU tests TESTS (default: the
#                long-context kernels, attention, verify rows, graphs) for at most TESTS_S seconds
#   STAGE=prefill  benchmarks/gpu_prefill.py: the prefill attention kernel at the 27B's heads over caches of
#                KV (default bf16,q8_0,tq3_0), chunk starts up to 64K
#   STAGE=run    flashtree plan's 27B table, and benchmarks/long_run.py: a real 262,144-token tq3_0 run with
#                fp8 draft matrices in a 22 GiB budget (the allocator capped), its peak GPU memory next to
#                the plan
#   STAGE=rows   bench-step --context CONTEXTS in KV type KV (default 8192,65536 in tq3_0 and bf16); the suite
#                runs at the first length, so the 256K row is KV=tq3_0 CONTEXTS=8192,261000 (~8 min: two
#                261K prefills at ~1600 tok/s), never CONTEXTS=261000 alone (bench/results/h100-long-rows-2026-12-07)
# Results under $OUT.
set -u
pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD FLASHTREE_CACHE=/root/stash/cache TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
mkdir -p /root/stash/cache && cp -r .cache/issue6/. /root/stash/cache/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt"
q=/root/stash/q27.gguf; d=/root/stash/d5
wait_synth() { while [ ! -f /root/stash/synth.done ] && pgrep -f "flashtree synth" >/dev/null; do sleep 2; done; }
case "${STAGE:-tests}" in
tests)
  if [ ! -f /root/stash/synth.done ] && ! pgrep -f "flashtree synth" >/dev/null; then
    setsid nohup bash -c "python3 -m flashtree synth --shape qwen3.6-27b --type q4_k_m $q && python3 -m flashtree \
      synth --draft-for $q --layers 5 $d && touch /root/stash/synth.done" > /root/stash/synth.log 2>&1 &
  fi
  timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/gpu/test_kv_types_gpu.py \
    tests/gpu/test_prefill_attention_gpu.py tests/gpu/test_attention_gpu.py tests/gpu/test_verify_rows_gpu.py \
    tests/gpu/test_graphs_gpu.py} > "$OUT/gpu_tests.log" 2>&1
  echo "rc=$?" >> "$OUT/gpu_tests.log"; tail -25 "$OUT/gpu_tests.log" ;;
prefill)
  python3 -m benchmarks.gpu_prefill "$OUT" --kv-types "${KV:-bf16,q8_0,tq3_0}" 2>&1 | tail -30 ;;
run)
  wait_synth; tail -c 300 /root/stash/synth.log
  python3 -m flashtree plan --target $q --draft $d --max-ctx 262144 --kv-type tq3_0 --draft-dtype fp8 | tee "$OUT/plan.txt"
  FLASHTREE_DRAFT_FP8=matrices timeout "${RUN_S:-540}" python3 -m benchmarks.long_run --target $q --draft $d \
    --max-ctx 262144 --kv-type tq3_0 --out "$OUT/long_run_tq3_0.json" 2>&1 | tail -20 ;;
rows)
  wait_synth
  for kv in ${KV:-tq3_0 bf16}; do
    python3 -m flashtree bench-step --target $q --draft $d --context "${CONTEXTS:-8192,65536}" --kv-type $kv \
      --repeats 5 --out "$OUT/step_long_$kv.json" > "$OUT/step_long_$kv.log" 2>&1
    echo "$kv rc=$?"; grep -i "context\|prefill\|roofline" "$OUT/step_long_$kv.log" | tail -12
  done ;;
esac
