"""K smoothing and exact sink keys, emulated on the CPU's torch path around benchmarks.kv_quality (an
experiment, not flashtree code): SMOOTH=1 stores each quantized K minus its layer's per-head mean over the
first write (the first prefill chunk, its SINKS first tokens left out), which leaves every softmax
unchanged (q.m is the same for all keys of a query); SINKS=N reads the first N keys back unquantized.

    SMOOTH=1 SINKS=1 PYTHONPATH=. python3 k_smoothing_experiment.py --out DIR --types tq3_0,q4_0 \
        --parts ppl --ppl-seqs 1 --ppl-len 1024
"""

import os
import sys

import torch

import benchmarks.kv_quality as kv_quality
from flashtree.models import state
from flashtree.quant.kv import FLOAT_TYPES, rotate

MEANS, EXACT = {}, {}
SMOOTH = os.environ.get("SMOOTH", "1") == "1"
SINKS = int(os.environ.get("SINKS", "0"))
plain_write, plain_read, plain_perplexity = state.KVCache.write, state.KVCache.read, kv_quality.perplexity


def write(self, slots, k, v):
    if self.k.kind not in FLOAT_TYPES:
        key = self.k.fields[0].data_ptr()
        if key not in MEANS:
            rest = k.float()[SINKS:] if k.shape[0] > SINKS + 8 else k.float()
            MEANS[key] = rest.mean(0, keepdim=True) if SMOOTH else torch.zeros_like(rest[:1])
            if SINKS:
                x = k.float()[:SINKS] - MEANS[key]
                EXACT[key] = (rotate(x) if self.k.kind == "tq3_0" else x).transpose(0, 1)
        k = (k.float() - MEANS[key]).to(k.dtype)
    return plain_write(self, slots, k, v)


def read(self, n_keys):
    k, v = plain_read(self, n_keys)
    key = self.k.fields[0].data_ptr()
    if key in EXACT:
        k = k.clone()
        k[:, :SINKS] = EXACT[key]
    return k, v


def perplexity(target, kind, seqs, chunk):
    MEANS.clear()
    EXACT.clear()
    return plain_perplexity(target, kind, seqs, chunk)


state.KVCache.write, state.KVCache.read, kv_quality.perplexity = write, read, perplexity
sys.argv = ["kv_quality", *sys.argv[1:]]
kv_quality.main()
