"""Decoding one sequence: the Engine and its stream (generate), the chunked prefill, CUDA-graph steps,
sampling, and the memory plan that sizes the cache before anything is allocated."""
