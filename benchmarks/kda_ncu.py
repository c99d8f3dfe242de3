"""The KDA chunk kernels under Nsight Compute: one forward (inference, no stores for a backward) and one
forward + backward at a given shape, between cudaProfilerStart/Stop so that `ncu --profile-from-start off`
sees exactly those launches (the warm-up and Triton's compilation run before).

    ncu --clock-control none --profile-from-start off --set full -k regex:'^_(prep|state|bwd)' \
        --kernel-name-base function -o kda python3 -m benchmarks.kda_ncu --shape 1,8192,96

The report gives per kernel DRAM bytes, L2 hit rate, issue-slot use, occupancy and the warp stall reasons
(docs/kda-kernels.md, "Measurements")."""

from __future__ import annotations

import argparse

import torch

from benchmarks.kda import forward_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1,8192,96", help="B,T,H (K = V = 128)")
    ap.add_argument("--tuning", default="", help="JSON: TUNING overrides, as benchmarks.kda --tuning")
    args = ap.parse_args()
    B, T, H = (int(x) for x in args.shape.split(","))
    if args.tuning:
        import json

        from k3.ops.kda.tuning import TUNING

        TUNING.update(json.loads(args.tuning))
    forward, forward_backward = forward_steps(B, T, H, "cuda")
    for _ in range(2):  # compile every specialisation, warm the allocator
        forward()
        forward_backward()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    forward()
    forward_backward()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one forward and one forward+backward at B={B} T={T} H={H}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
