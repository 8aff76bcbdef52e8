#!/usr/bin/env bash
# Train the shipped SmolLM2-135M-Instruct draft on the lent GPU machine (docs: gpu-machine.md).
#
# Staged here first, in the git-ignored .stage/draft/: the gguf wheel (whl/), the prompt file
# (prompts.jsonl.gz, from flashtree.train.prompts.build_prompts), the benchmark prompt cache
# (cache/datasets/) and the target GGUF split in two (smollm2.part.aa/ab, 64 MiB per call).
#   call 1: scripts/train_draft_gpu.sh smoke   carrying .stage/draft minus part ab: stashes part aa
#           and runs the whole pipeline on a tiny target (catches CUDA-only failures cheaply);
#   call 2: scripts/train_draft_gpu.sh full    carrying .stage/draft minus part aa: joins the GGUF,
#           generates responses, trains, writes the draft to $OUT (in 15 MB pieces), evaluates AL.
set -uo pipefail
S=.stage/draft
STASH=/root/stash
GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD FLASHTREE_CACHE=$PWD/$S/cache
export FLASHTREE_QUANT_KERNELS=0  # dense bf16 target weights (the same dequantized values)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $S/whl/*.whl || exit 1
mkdir -p $STASH

if [ "${1:-}" = smoke ]; then
  cp $S/smollm2.part.aa $STASH/
  nvidia-smi -L
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  python3 -m flashtree train-draft --target $S/tiny.gguf --out /tmp/smoke --layers 2 \
    --prompts $S/smoke_prompts.jsonl.gz --max-new-tokens 40 --gen-batch 8 --gen-minutes 1 \
    --train-minutes 0.15 --batch 4 --anchors 8 --device cuda || exit 1
  python3 -m flashtree.train.evaluate --target $S/tiny.gguf --draft /tmp/smoke --out $OUT/smoke_eval.json \
    --n 1 --max-new-tokens 24 --workers 2 --datasets humaneval --device cuda
  exit
fi

[ -f $GGUF ] || cat $STASH/smollm2.part.aa $S/smollm2.part.ab > $GGUF
echo "$GGUF_MD5  $GGUF" | md5sum -c || exit 1
RUN=$STASH/run
nvidia-smi -L | tee $OUT/train.log
python3 -m flashtree train-draft --target $GGUF --out $RUN --layers 3 --prompts $S/prompts.jsonl.gz \
  --gen-batch 2048 --gen-minutes ${GEN_MINUTES:-2.8} --train-minutes ${TRAIN_MINUTES:-3.0} \
  --batch 32 --anchors 64 --lr 6e-4 --device cuda 2>&1 | tee -a $OUT/train.log
cp $RUN/config.json $RUN/train_log.jsonl $RUN/train_config.json $OUT/
split -b 15M $RUN/model.safetensors $OUT/model.safetensors.part.
python3 -m flashtree.train.evaluate --target $GGUF --draft $RUN --out $OUT/eval.json --workers 6 \
  --minutes ${EVAL_MINUTES:-1.0} --device cuda 2>&1 | tee $OUT/eval.log
