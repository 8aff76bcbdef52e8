# session 28, call 1: prep (27B synth in the background), main's attention and the verify-tile32 branch's
# swept at their defaults (rows checked bitwise), then the 27B step at 32K cached tokens (packed, bf16)
set -u
export FLASHTREE_GIT_COMMIT=$(cat .ab_run/commit)
bash bench/gpu_step.sh prep >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/bench FLASHTREE_CACHE=/root/stash/cache PYTHONUNBUFFERED=1
sweep() {  # $1: name, $2: settings (python list)
    mkdir -p "$OUT/$1"
    timeout 150 python3 -c "
import sys; from pathlib import Path; import gpu_attention as g; g.SETTINGS=$2; sys.exit(g.main(Path('$OUT/$1')))" 2>&1 \
        | grep -v "Warning\|warn(\|output = op" | tee "$OUT/$1/attention.log"
}
sweep main '[{}]'
keep=$(mktemp -d) && cp -r flashtree tests "$keep/" && cp -r .ab_tile32/. . && sweep tile32 '[{}]'
rm -rf flashtree tests && cp -r "$keep/flashtree" "$keep/tests" .
STEP_CONTEXT=32768 STEP_WEIGHTS=packed STEP_ARITH=bf16 STEP_SUFFIX=_main timeout 280 bash bench/gpu_step.sh step
