"""Session 29 probe (issue 5), written in session 28: `_state_bwd` without Aqk, on Q′ = Q⊙Γ − Aqk·W.

Per step `_state_bwd` computes dŨ = Aqkᵀ·dO + Kd·dS_end and dS_start = Qgᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·dŨ. Since
Wᵀ·dŨ = (Aqk·W)ᵀ·dO + Wᵀ·(Kd·dS_end), with Q′ = Qg − Aqk·W (per chunk, no recurrence):

    dS_start = Q′ᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·(Kd·dS_end),   dŨ = Aqkᵀ·dO + Kd·dS_end,

and Aqkᵀ·dO, which nothing in the chain waits for, can leave the pass (session 28 run 2: o, off the forward
pass's chain the same way, cost `_state` 0.47 of its 1.19 ms). `_state_bwd_qp` below is the library's `_state_bwd`
with Q′ in Qg's place, without Aqk's tile and product, storing only the chain's part Kd·dS_end of dŨ. This checks it
against the library kernel (dS_end at every chunk, dh0, and dŨ once Aqkᵀ·dO is added back, to bf16-storage
tolerance) and times both, at T=128 H=2 in the interpreter with --quick, at B=1 T=8192 H=96 on a GPU. If the pass
gains what the forward's did, the plumbing is: Q′ from `_prep_wu`'s W slices (it can load Q⊙Γ and Aqk), Aqkᵀ·dO
added to dŨ in `_bwd_vv` (it loads dO) run before `_bwd_vk`, and `_bwd_vk`'s dβ partials summed in `_bwd_norms`.

    PYTHONPATH=. python3 benchmarks/sessions/s29_state_bwd_probe.py [--quick] [--out probe.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.kda import chunk_operands, rel
from k3.ops import interpreting
from k3.ops.kda import triton_chunk as tc
from k3.ops.kda.triton_common import _bp, _cast, _load_gamma, _sequence_coords, _state_mm, backward_storage


@triton.jit
def _state_bwd_qp_step(dS, g_end, j, qp, kd, w, gc, do, du, dse, bos, L, c0, i_h, i_v, off_s,
                       H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                       BF16: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """Chunk j, walking backwards: dŨ's chain part Kd·dS_end (stored); dS_start = Q′ᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ
    times that part."""
    row0 = j * C
    Kd = tl.load(_bp(kd, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    Qp = tl.load(_bp(qp, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    W = tl.load(_bp(w, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    dO = tl.load(_bp(do, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
    g_next = _load_gamma(gc, c0, tl.maximum(j - 1, 0), i_h, H, K, True)
    tl.store(dse + ((c0 + j) * H + i_h) * K * V + off_s, _cast(dS, dse.dtype.element_ty, INTERP))
    dUs = _state_mm(Kd, dS, BF16, SPLIT, INTERP)
    tl.store(_bp(du, bos, L, i_h, row0, i_v * BV, H, V, C, BV), _cast(dUs, du.dtype.element_ty, INTERP),
             boundary_check=(0,))
    return (_state_mm(tl.trans(Qp), dO, BF16, SPLIT, INTERP) + tl.exp(g_end)[:, None] * dS
            - _state_mm(tl.trans(W), dUs, BF16, SPLIT, INTERP)), g_next


@triton.jit
def _state_bwd_qp(qp, kd, w, gc, do, du, dse, dh0, cu, chunk_off,
                  H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                  BF16: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """`_state_bwd` (no dht) on Q′: one (value block, sequence, head), last chunk first."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_h, bos, L, c0, n_chunks = _sequence_coords(cu, chunk_off, i_nh, H, C)
    off_s = tl.arange(0, K)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :]
    dS = tl.zeros([K, BV], dtype=tl.float32)
    g_end = _load_gamma(gc, c0, n_chunks - 1, i_h, H, K, n_chunks > 0)
    if INTERP:
        j = n_chunks - 1
        while j >= 0:
            dS, g_end = _state_bwd_qp_step(dS, g_end, j, qp, kd, w, gc, do, du, dse, bos, L, c0, i_h, i_v, off_s,
                                           H, K, V, BV, C, BF16, SPLIT, INTERP)
            j -= 1
    else:
        for jj in range(n_chunks):
            dS, g_end = _state_bwd_qp_step(dS, g_end, n_chunks - 1 - jj, qp, kd, w, gc, do, du, dse, bos, L, c0,
                                           i_h, i_v, off_s, H, K, V, BV, C, BF16, SPLIT, INTERP)
    tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_s, dS)


def per_chunk(x, C):
    """[TT, H, D] (TT a multiple of C) → [TT/C, H, C, D]."""
    TT, H, D = x.shape
    return x.reshape(TT // C, C, H, D).transpose(1, 2)


def from_chunks(x):
    NT, H, C, D = x.shape
    return x.transpose(1, 2).reshape(NT * C, H, D)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true", help="T=128 H=2, no timing (the interpreter on CPU)")
    args = ap.parse_args()
    B, T, H = (1, 128, 2) if args.quick else (1, 8192, 96)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    plan, _, (W, U, Qg, Kd, Aqk, gc, *_) = chunk_operands(B, T, H, device=dev)
    C = tc.CHUNK
    # Q′ = Qg − Aqk·W per chunk (Aqk lower triangular, fp32), rounded once to bf16
    qp = (per_chunk(Qg, C).float() - per_chunk(Aqk, C).float() @ per_chunk(W, C).float()).to(torch.bfloat16)
    qp = from_chunks(qp).contiguous()
    do = torch.randn(B * T, H, 128, device=dev, generator=torch.Generator(dev).manual_seed(6)).bfloat16()
    du_dt, dse_dt = backward_storage(torch.bfloat16, "du"), backward_storage(torch.bfloat16, "dse")
    interp = interpreting()

    def library():
        du = torch.empty(B * T, H, 128, dtype=du_dt, device=dev)
        dse = torch.empty(plan.NT, H, 128, 128, dtype=dse_dt, device=dev)
        dh0 = torch.empty(plan.N, H, 128, 128, device=dev)
        BV = tc.TUNING["state_bwd_bv"]
        tc._state_bwd[(128 // BV, plan.N * H)](Qg, Kd, Aqk, W, gc, do, dh0, du, dse, dh0, plan.cu, plan.chunk_off,
                                               H=H, K=128, V=128, BV=BV, C=C, USE_DHT=False, BF16=False, SPLIT=True,
                                               INTERP=interp, **tc._launch_options("state_bwd"))
        return du, dse, dh0

    def probe(launch):
        du = torch.empty(B * T, H, 128, dtype=du_dt, device=dev)
        dse = torch.empty(plan.NT, H, 128, 128, dtype=dse_dt, device=dev)
        dh0 = torch.empty(plan.N, H, 128, 128, device=dev)
        BV = launch.get("BV", 32)
        opts = {k: v for k, v in launch.items() if k != "BV"}
        _state_bwd_qp[(128 // BV, plan.N * H)](qp, Kd, W, gc, do, du, dse, dh0, plan.cu, plan.chunk_off, H=H, K=128,
                                               V=128, BV=BV, C=C, BF16=False, SPLIT=True, INTERP=interp, **opts)
        return du, dse, dh0

    ref_du, ref_dse, ref_dh0 = library()
    launches = [dict(BV=32, num_warps=4, num_stages=3), dict(BV=32, num_warps=4, num_stages=2)]
    rows = []
    for launch in launches:
        du, dse, dh0 = probe(launch)
        local = from_chunks(per_chunk(Aqk, C).float().transpose(-1, -2) @ per_chunk(do, C).float())
        errs = {"dS_end": rel(dse, ref_dse), "dh0": rel(dh0, ref_dh0), "du": rel(du.float() + local, ref_du)}
        ms = ref_ms = None
        if not args.quick:
            ms = triton.testing.do_bench(lambda: probe(launch), warmup=10, rep=100, return_mode="median")
            ref_ms = triton.testing.do_bench(library, warmup=10, rep=100, return_mode="median")
        rows.append({"launch": launch, "errors_vs_library": errs, "ms": ms, "library_ms": ref_ms})
        print(json.dumps(rows[-1]), flush=True)
        # both carry bf16 storage (dS_end, dŨ) and the probe a bf16 Q′: agreement to a few bf16 roundings
        assert all(e < 2e-2 for e in errs.values()), errs
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": {"B": B, "T": T, "H": H}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
