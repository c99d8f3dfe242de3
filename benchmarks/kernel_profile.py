"""CUDA kernel times of one call, by kernel (torch.profiler): shared by the benchmarks' `--profile` options."""

from __future__ import annotations

from typing import Callable

import torch


def print_kernel_times(label: str, step: Callable[[], object], iters: int = 5, top: int = 12) -> float:
    """Run `step` once (warm-up and compilation), then `iters` times under the profiler; print the kernel time
    per call and its `top` kernels, each with its launches per call. Returns the kernel ms per call."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events = events or [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / iters / 1e3
    print(f"[profile] {label}: {total:.3f} ms of kernel time per call")
    for e in events[:top]:
        print(f"[profile]   {e.self_device_time_total / iters / 1e3:8.3f} ms  x{e.count // iters:<3d} {e.key[:90]}")
    return total
