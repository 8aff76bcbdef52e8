# session 29, call 4 (warm; the shipped draft moved out of the tree for this call, prep stashed it): part aa
set -u
bash bench/gpu_step.sh stage-a && ls -la /root/stash
