"""Decode steps replayed from CUDA graphs.

A decode step (AR, or draft + verify + accept + commit) is a few hundred to a few thousand small
kernels; launched one by one from Python, the launches cost more than the GPU work
(bench/results/h200-launch-cuts-2026-12-03). Every step function is written with fixed shapes for a
given key and no host reads (positions and lengths are device tensors, the KV read length is a bucket),
so the first run of a key is captured into a CUDA graph and every later run is one replay.

Step code keeps no host-side books: the caller advances ModelState.seq_len from the step's read-back
result, the same way whether the step ran eagerly, was captured or was replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from flashtree.models.state import ModelState

MIN_KEYS = 256  # smallest KV-read bucket
MAX_GRAPHS = 16  # graphs kept (KV buckets x sampling settings); the oldest goes first


def graphs_wanted(device: torch.device, enabled: bool = True) -> bool:
    """CUDA graphs on CUDA devices unless the settings turn them off (FLASHTREE_CUDA_GRAPHS=0)."""
    return device.type == "cuda" and enabled


def kv_bucket(needed: int, capacity: int) -> int:
    """A power-of-two KV read length >= needed, so a handful of graphs covers every length (keys past
    the committed length are masked, and cost a read of at most as many slots again)."""
    return min(max(MIN_KEYS, 1 << (needed - 1).bit_length()), capacity)


class StepRunner:
    """graphs: capture and replay (CUDA only). bucketed: read the KV cache in buckets, as graphs must;
    on by default with graphs, and on its own it runs the graphs' exact computation eagerly (tests)."""

    def __init__(self, state: ModelState, graphs: bool, bucketed: bool | None = None):
        self.state, self.enabled = state, graphs
        self.bucketed = graphs if bucketed is None else bucketed
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None  # one memory pool for all steps

    def n_keys(self, needed: int) -> int | None:
        """KV slots a step that needs `needed` reads: its bucket, or None (exactly `needed`)."""
        return kv_bucket(needed, self.state.max_ctx) if self.bucketed else None

    def run(self, key: Hashable, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """step()'s result: eagerly, or from the graph captured for `key` (captured right after the
        first, real, eager run, which also compiles every kernel the capture will record)."""
        if not self.enabled:
            return step()
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            return out
        result = step()
        if len(self.graphs) >= MAX_GRAPHS:
            del self.graphs[next(iter(self.graphs))]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()  # recorded, not run
        self.graphs[key] = (graph, out)
        return result
