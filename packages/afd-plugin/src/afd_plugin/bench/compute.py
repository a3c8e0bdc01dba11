"""This host's compute rates at one thread (as each AFD role server runs here): fp32 matrix
multiplication throughput and the weight-streaming rate of a one-row product, medians of
several repetitions."""

from __future__ import annotations

import statistics
import time


def matmul_flops(size: int = 512, reps: int = 5) -> float:
    """flop/s of a [size, 4 size] x [4 size, 4 size] fp32 product at one thread."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(size, 4 * size), torch.randn(4 * size, 4 * size)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * size * (4 * size) ** 2 / statistics.median(times)


def memory_bandwidth(width: int = 4096, reps: int = 7) -> float:
    """bytes/s at which a one-row fp32 product [1, width] x [width, width] streams its
    weights at one thread: the rate a decode step's weight reads run at (a plain sum
    reads ~1.4x faster on this machine, and predicts decode steps too fast)."""
    import torch

    torch.set_num_threads(1)
    w, x = torch.randn(width, width), torch.randn(1, width)
    torch.nn.functional.linear(x, w)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t0)
    return w.numel() * 4 / statistics.median(times)
