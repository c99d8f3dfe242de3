"""CUDA kernel times of one call, by kernel (torch.profiler): shared by the benchmarks' `--profile` options."""

from __future__ import annotations

from typing import Callable

import torch


def kernel_times(step: Callable[[], object], iters: int = 5) -> dict[str, tuple[float, int]]:
    """Run `step` once (warm-up and compilation), then `iters` times under the profiler; returns
    {kernel name: (ms per call, launches per call)}, largest first."""
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
    return {e.key: (e.self_device_time_total / iters / 1e3, e.count // iters) for e in events}


def print_kernel_times(label: str, step: Callable[[], object], iters: int = 5, top: int = 12) -> float:
    """`kernel_times`, printed: the kernel time per call and its `top` kernels, each with its launches per
    call. Returns the kernel ms per call."""
    times = kernel_times(step, iters)
    total = sum(ms for ms, _ in times.values())
    print(f"[profile] {label}: {total:.3f} ms of kernel time per call")
    for key, (ms, count) in list(times.items())[:top]:
        print(f"[profile]   {ms:8.3f} ms  x{count:<3d} {key[:90]}")
    return total
