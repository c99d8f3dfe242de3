"""One fused short conv + SiLU forward and backward at the small preset's 32K-token shape, inside a CUDA profiler
range, for Nsight Compute (the kernels run at about 1 TB/s there, docs/fast-paths.md):

    ncu --clock-control none --profile-from-start off --set full -k regex:_conv_silu -o conv \\
        python3 -m benchmarks.short_conv_ncu
"""

from __future__ import annotations

import torch

from benchmarks.short_conv import inputs
from k3.ops.short_conv import short_conv_silu


def main() -> None:
    T, C = 32768, 1024
    wide, w, cu = inputs(T, C, "cuda", torch.bfloat16)
    x = wide[..., C:2 * C].detach().requires_grad_()  # the model's column slice of the projection (rows 3C apart)
    w = w.detach().requires_grad_()
    dy = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # compile and warm up outside the profiled range
        torch.autograd.grad(short_conv_silu(x, w, cu), (x, w), dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    torch.autograd.grad(short_conv_silu(x, w, cu), (x, w), dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
