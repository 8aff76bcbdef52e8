"""Kernel times from CUDA-graph replays: no launch overhead, back-to-back calls as in a decode step."""

from __future__ import annotations

import statistics

import torch


def graph_time_us(calls: list, reps: int = 20) -> float:
    """Median time per call (us) of a CUDA graph that runs `calls` back to back."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)
