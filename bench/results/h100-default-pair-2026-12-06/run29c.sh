# session 29, call 3: prep for the default pair (no synth), then nothing else: calls 4 and 5 carry the halves
set -u
SYNTH=0 bash bench/gpu_step.sh prep
