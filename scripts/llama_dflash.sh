#!/usr/bin/env bash
# llama.cpp's draft-dflash with flashtree's shipped draft against the SmolLM2-135M-Instruct Q4_1 target,
# side by side with flashtree, on the 30 `flashtree bench` prompts (256 new tokens, greedy): llama.cpp AR
# (llama-completion's eval rate; llama-bench tg256 too), llama.cpp draft-dflash at --spec-draft-n-max 15
# (block_size - 1, the most it takes), 3 (its default) and 7 (N_MAX: which, in order; each llama.cpp result
# is kept as it comes), flashtree plain AR / AR / chain / tree, and flashtree chain at blocks 4 and 8.
# llama.cpp drafts a block of n_max + 1 tokens ([last token, mask x n_max]) and reads it as a chain: at
# n_max 3 the draft, trained on 16-token blocks, sees a 4-token block and predicts far worse (flashtree's
# own chain at block 4 and 8, the same drafting, shows by how much); n_max 15 is the block it was made for.
# llama.cpp is the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, trimmed (STEP=prepare).
#
# Here (no device):  STEP=prepare bash scripts/llama_dflash.sh   -> .stage/llama/{llama.cpp.tar.xz,
#                    smollm2.part.a[a-d] (25 MB pieces of the target), datasets/}
# On the device, five back-to-back calls on one warm machine (each well under 10 minutes):
#   1. STEP=build PIECE=aa   carry .stage/llama/llama.cpp.tar.xz .stage/llama/smollm2.part.aa
#                            (stashes the piece and the shipped draft; the build runs on in the background)
#   2. STEP=piece PIECE=ab   carry .stage/llama/smollm2.part.ab
#   3. STEP=piece PIECE=ac   carry .stage/llama/smollm2.part.ac
#   4. STEP=llama PIECE=ad   carry .stage/llama/smollm2.part.ad .stage/llama/datasets .wheels/issue6
#                            (joins and checks the target, waits for the build, runs llama.cpp: $OUT/llama.json)
#   5. STEP=flashtree        carry .stage/llama/datasets .wheels/issue6
#                            (flashtree bench, then $OUT/llama_dflash.json: both sides in one JSON;
#                            BLOCKS="4 8" by default: the chain at those block sizes, "" for none)
set -u
S=.stage/llama
stash=/root/stash
LLAMA=/root/llama
TARGETS="llama-bench llama-speculative-simple llama-completion llama-tokenize"
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
SDIST=llama_cpp_python-0.3.36.tar.gz

prepare() {  # the trimmed llama.cpp (no models/docs/tests, CPU and CUDA backends only), target pieces
  mkdir -p $S/datasets /tmp/llama-prep
  [ -f /tmp/llama-prep/$SDIST ] || pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llama-prep
  rm -rf /tmp/llama-prep/src && mkdir -p /tmp/llama-prep/src
  tar -xzf /tmp/llama-prep/$SDIST -C /tmp/llama-prep/src
  cp -a /tmp/llama-prep/src/llama_cpp_python-0.3.36/vendor/llama.cpp /tmp/llama-prep/llama.cpp
  (cd /tmp/llama-prep/llama.cpp && rm -rf models docs tests media gguf-py conversion benches tools/ui \
    tools/server tools/cli ci skills scripts/*.py .git* && \
    for b in cann openvino webgpu et metal hexagon sycl vulkan opencl virtgpu musa hip zdnn zendnn; do
      rm -rf ggml/src/ggml-$b; done)
  tar -cJf $S/llama.cpp.tar.xz -C /tmp/llama-prep llama.cpp && rm -rf /tmp/llama-prep/llama.cpp /tmp/llama-prep/src
  python3 -c "from flashtree.defaults import default_target_path; print(default_target_path())" > /tmp/llama-prep/t
  split -b 25M "$(cat /tmp/llama-prep/t)" $S/smollm2.part.
  cp "$(python3 -c 'from flashtree.defaults import cache_dir; print(cache_dir())')"/datasets/*.jsonl.gz $S/datasets/
  ls -la $S $S/datasets
}

build() {  # configure and build in its own session: it outlives this call
  mkdir -p $LLAMA && tar -xJf $S/llama.cpp.tar.xz -C $LLAMA
  cd $LLAMA/llama.cpp || exit 1
  setsid nohup bash -c "cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release \
    && cmake --build build -j16 --target $TARGETS && touch $LLAMA/built" > $LLAMA/build.log 2>&1 < /dev/null &
  cd - > /dev/null
}

wait_build() {  # up to 7 minutes
  for _ in $(seq 84); do [ -f $LLAMA/built ] && return 0; sleep 5; done
  echo "llama.cpp build not finished:"; tail -20 $LLAMA/build.log; exit 1
}

flashtree_env() {
  mkdir -p $stash/cache && cp -r $S/datasets $stash/cache/
  pip install -q --no-index --no-deps --target /tmp/site .wheels/issue6/*.whl 2>/dev/null
  export FLASHTREE_CACHE=$stash/cache TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
}

bench() {  # flashtree bench on the pair; $1: folder name, then bench's own options
  local name=$1; shift
  python3 -m flashtree bench --target $stash/target.gguf --draft $stash/draft.gguf --n 10 --max-tokens 256 \
    --seed 0 --device cuda --out $stash/$name "$@" > $stash/$name.log 2>&1
  echo "flashtree bench $name rc=$?"; tail -4 $stash/$name.log
}

mkdir -p $stash
case "${STEP:-}" in
  prepare) prepare ;;
  build)
    cp $S/smollm2.part.$PIECE $stash/ && cp flashtree/drafts/smollm2-135m-instruct.gguf $stash/draft.gguf
    build; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $stash/device.txt ;;
  piece) cp $S/smollm2.part.$PIECE $stash/ && ls -la $stash ;;
  llama)
    cp $S/smollm2.part.$PIECE $stash/ && cat $stash/smollm2.part.a? > $stash/target.gguf
    md5=$(md5sum $stash/target.gguf | cut -d' ' -f1)
    [ "$md5" = $GGUF_MD5 ] || { echo "target md5 $md5, want $GGUF_MD5"; exit 1; }
    flashtree_env
    python3 -m benchmarks.llama_dflash prompts $stash/target.gguf $stash/prompts || exit 1
    wait_build
    python3 -m benchmarks.llama_dflash llama $LLAMA/llama.cpp/build/bin $stash/target.gguf $stash/draft.gguf \
      $stash/prompts $stash/llama.json --n-max "${N_MAX:-15,3,7}"
    echo "rc=$?"; cp $stash/llama.json $stash/llama.log "$OUT/" ;;
  flashtree)
    flashtree_env
    bench ft --modes ar,chain,tree --baseline plain --budget 22
    dirs="$stash/ft"
    for b in ${BLOCKS-4 8}; do bench ft_block$b --modes chain --block-size $b; dirs="$dirs $stash/ft_block$b"; done
    python3 -m benchmarks.llama_dflash merge $stash/llama.json $dirs "$OUT/llama_dflash.json"
    cp $stash/ft/results.md "$OUT/flashtree_results.md"; cat $stash/device.txt ;;
  *) echo "STEP=prepare|build|piece|llama|flashtree (see the comment at the top)"; exit 2 ;;
esac
