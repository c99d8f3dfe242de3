"""Session 30 probe (issue 5), written in sessions 28-29: `_state_bwd` on Q′ = Q⊙Γ − Aqk·W against the default pass.

Per step `_state_bwd` computes dŨ = Aqkᵀ·dO + Kd·dS_end and dS_start = Qgᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·dŨ. Since
Wᵀ·dŨ = (Aqk·W)ᵀ·dO + Wᵀ·(Kd·dS_end), with Q′ = Qg − Aqk·W (per chunk, no recurrence):

    dS_start = Q′ᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·(Kd·dS_end),   dŨ = Aqkᵀ·dO + Kd·dS_end,

and Aqkᵀ·dO, which nothing in the chain waits for, leaves the pass (`TUNING["state_bwd_qprime"]`: the library's
QPRIME specialisation stores only Kd·dS_end; `_bwd_vk` and `_bwd_vv` take the rest; docs/kda-kernels.md §7 item
65). Session 28 run 2: o, off the forward pass's chain the same way, cost `_state` 0.47 of its 1.19 ms. This times
the pass alone both ways on the prepare's operands (Q′ from `_prep_wu`, as the library computes it) at a few launch
settings, and checks it: dS_end at every chunk and dh0 agree, and dŨ once Aqkᵀ·dO is added back, to bf16-storage
tolerance. At T=128 H=2 in the interpreter with --quick (no timing), at B=1 T=8192 H=96 on a GPU.

    PYTHONPATH=. python3 benchmarks/sessions/s30_state_bwd_probe.py [--quick] [--out probe.json]
"""
from __future__ import annotations

import json

import torch
import triton

from benchmarks.kda import chunk_operands, probe_setup, rel
from k3.ops import interpreting
from k3.ops.kda import triton_chunk as tc
from k3.ops.kda.triton_common import backward_storage


def per_chunk(x, C):
    """[TT, H, D] (TT a multiple of C) → [TT/C, H, C, D]."""
    TT, H, D = x.shape
    return x.reshape(TT // C, C, H, D).transpose(1, 2)


def from_chunks(x):
    NT, H, C, D = x.shape
    return x.transpose(1, 2).reshape(NT * C, H, D)


def main() -> None:
    args, (B, T, H), dev = probe_setup("no timing")
    plan, _, ops = chunk_operands(B, T, H, device=dev, qprime=True)
    W, U, Qg, Kd, Aqk, gc, qp = ops.W, ops.U, ops.Qg, ops.Kd, ops.Aqk, ops.gc, ops.Qp
    C = tc.CHUNK
    do = torch.randn(B * T, H, 128, device=dev, generator=torch.Generator(dev).manual_seed(6)).bfloat16()
    du_dt, dse_dt = backward_storage(torch.bfloat16, "du"), backward_storage(torch.bfloat16, "dse")
    interp = interpreting()

    def state_bwd(qprime, launch):
        du = torch.empty(B * T, H, 128, dtype=du_dt, device=dev)
        dse = torch.empty(plan.NT, H, 128, 128, dtype=dse_dt, device=dev)
        dh0 = torch.empty(plan.N, H, 128, 128, device=dev)
        BV = launch.get("BV", tc.TUNING["state_bwd_bv"])
        opts = {k: v for k, v in launch.items() if k != "BV"}
        tc._state_bwd[(128 // BV, plan.N * H)](qp if qprime else Qg, Kd, Aqk, W, gc, do, dh0, du, dse, dh0, plan.cu,
                                               plan.chunk_off, H=H, K=128, V=128, BV=BV, C=C, USE_DHT=False,
                                               BF16=False, SPLIT=True, QPRIME=qprime, INTERP=interp, **opts)
        return du, dse, dh0

    default = tc._launch_options("state_bwd")
    ref_du, ref_dse, ref_dh0 = state_bwd(False, default)
    ref_ms = None if args.quick else triton.testing.do_bench(lambda: state_bwd(False, default), warmup=10, rep=100,
                                                             return_mode="median")
    local = from_chunks(per_chunk(Aqk, C).float().transpose(-1, -2) @ per_chunk(do, C).float())
    rows = []
    for launch in [default, dict(num_warps=4, num_stages=2), dict(BV=64, num_warps=8, num_stages=2)]:
        du, dse, dh0 = state_bwd(True, launch)
        errs = {"dS_end": rel(dse, ref_dse), "dh0": rel(dh0, ref_dh0), "du": rel(du.float() + local, ref_du)}
        ms = None
        if not args.quick:
            ms = triton.testing.do_bench(lambda: state_bwd(True, launch), warmup=10, rep=100, return_mode="median")
        rows.append({"launch": launch, "errors_vs_default": errs, "ms": ms, "default_ms": ref_ms})
        print(json.dumps(rows[-1]), flush=True)
        # both carry bf16 storage (dS_end, dŨ) and the probe a bf16 Q′: agreement to a few bf16 roundings
        assert all(e < 2e-2 for e in errs.values()), errs
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": {"B": B, "T": T, "H": H}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
