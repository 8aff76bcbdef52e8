"""Sweeps, timings and diagnostics of flashtree's kernels and steps, on the lent GPU machine (not shipped).

    python -m benchmarks STAGE [STAGE ...]     the device stages, in order (`python -m benchmarks --help`)
    python -m benchmarks.gpu_kernels OUT ...   one module alone (each says how in its docstring)

The correctness checks are tests: tests/gpu (`-m gpu`, CUDA only), which run with TRITON_INTERPRET=0 so
that the kernels compile. A sweep that must check each setting it times calls the same check
(benchmarks/checks.py). Every change a benchmark makes to the kernels' module-level settings goes
through benchmarks/knobs.py. Results are committed under bench/results/.

Modules: gpu_kernels (quantized-matmul tiles and the 27B's layer shapes), gpu_dense_matmul (the fp32
decode kernel's tiles), gpu_attention (attention settings), gpu_deltanet (tree DeltaNet tiles),
gpu_sum_splits (the K-splits' summing launch), gpu_splits (per-matrix K-split targets on a model),
gpu_profile_steps (kernels per graphed step), gpu_batch_decode and gpu_train_loss (draft training),
ncu_kernels (launches for Nsight Compute), sm90_registers / sm90_opcodes / sm90_fp_fusion (sm_90
compiles on the CPU), replay_al (accept lengths by replay on the CPU); checks, knobs, timing and tiny
are their shared parts; ab_files.sh writes a branch's files for the `ab` stage.
"""
