"""Registers and spills of non-KDA Triton kernels (short conv + SiLU, loss rows, SiTU-GLU, MoE combine) for
sm_90, offline.

No GPU needed: `triton.compile` for GPUTarget("cuda", 90, 64) with the launch settings the ops use, then the
ptxas bundled with Triton (`-v -arch=sm_90a`). It also shows that a kernel compiles for the H200 at all,
before any device time is spent. A proxy for speed, not a measurement (the KDA kernels' report, whose
compile-and-ptxas step this reuses, is `benchmarks/kda_spills.py`).

    python benchmarks/kernel_spills.py
    python benchmarks/kernel_spills.py --conv-bwd 64x128x4 32x128x4   # both backward kernels at BTxBCxwarps

The short-conv kernels are compiled as they launch at the model's shapes (C = 1,024 or 12,288, 8,192 tokens,
strides multiples of C), where the JIT specialises those integers as multiples of 16 and the channel masks
allow 16-byte loads; the "(odd C)" rows compile the backward without that, as at test shapes like C = 70.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import k3.ops.attn_res as attn_res  # noqa: E402
import k3.ops.cross_entropy as cross_entropy  # noqa: E402
import k3.ops.router as router  # noqa: E402
import k3.ops.grouped_gemm as grouped_gemm  # noqa: E402
import k3.ops.moe as moe  # noqa: E402
import k3.ops.short_conv as short_conv  # noqa: E402
import k3.ops.situ as situ  # noqa: E402
from benchmarks.kda_spills import sm90_report  # noqa: E402

LOSS_ARGS = dict(L="*bf16", Y="*i64", LOSS="*fp32", V="i32", stride="i64", ignore_index="i32")
CONV_FWD_ARGS = dict(X="*bf16", Wt="*fp32", POS="*i32", Y="*bf16", R="i32", C="i32", stride_x="i32")
SITU_FWD_ARGS = dict(G="*bf16", U="*bf16", P="*fp32", F="*bf16", M="i32", N="i32", stride_g="i32", stride_u="i32",
                     stride_f="i32", beta1="fp32", beta2="fp32")
SITU_BWD_ARGS = dict(G="*bf16", U="*bf16", DF="*bf16", DG="*bf16", DU="*bf16", M="i32", N="i32", stride_g="i32",
                     stride_u="i32", stride_df="i32", stride_dg="i32", stride_du="i32", beta1="fp32", beta2="fp32")
SITU_WEIGHTED_BWD_ARGS = dict(G="*bf16", U="*bf16", DA="*bf16", P="*fp32", DG="*bf16", DU="*bf16", WACT="*bf16",
                              DP="*fp32", M="i32", stride_g="i32", stride_u="i32", stride_da="i32", stride_dg="i32",
                              stride_du="i32", stride_w="i32", beta1="fp32", beta2="fp32")
SUM_ROWS_ARGS = dict(Y="*bf16", DEST="*i64", OUT="*fp32", N="i32", L="i32", stride_y="i32")
CONV_GRAD_ARGS = dict(X="*bf16", Wt="*fp32", POS="*i32", DY="*bf16", G="*fp32", DW="*fp32", R="i32", C="i32",
                      stride_x="i32", stride_dy="i32")
CONV_DX_ARGS = dict(G="*fp32", Wt="*fp32", POS="*i32", DX="*bf16", R="i32", C="i32")
GMM_WGRAD_ARGS = dict(A="*bf16", B="*bf16", C="*bf16", C2="*bf16", OFFS="*i32", KO="i32", N="i32", SPLIT="i32",
                      stride_ak="i32", stride_am="i32", stride_bm="i32", stride_bn="i32", stride_cg="i32",
                      stride_ck="i32", stride_cn="i32")
CONV_ALIGNED = ("R", "C", "stride_x", "stride_dy")  # multiples of 16 at the model's shapes
SPREAD_ARGS = dict(X="*fp32", SRC="*i64", OUT="*bf16", N="i32", M="i32", L="i32", stride_x="i32")
TOPK_ARGS = dict(S="*fp32", BIAS="*fp32", IDX="*i64", CUT="*fp32", N="i32", E="i32")
QB_ARGS = dict(S="*fp32", CUT="*fp32", LO="*fp32", WIDTH="*fp32", COUNTS="*i64", N="i32", E="i32", NUM_BINS="i32")


def attn_res_bwd_args(ns: int) -> dict:
    """The fused read's backward over `ns` bf16 sources (tuples of pointers)."""
    return dict(srcs=("*bf16",) * ns, dsrcs=("*bf16",) * ns, W="*fp32", DOUT="*bf16", LSE="*fp32", DW_PART="*fp32",
                N="i32", D="i32", eps="fp32")


def report(fn, args: dict, constexprs: dict, num_warps: int, aligned: tuple = ()) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes, stack frame bytes) of one kernel for sm_90; pointer
    arguments divisible by 16, as the real JIT specialises them, and so the integer arguments in `aligned`."""
    signature = {name: "constexpr" if name in constexprs else args[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if isinstance(args.get(name), str) and args[name].startswith("*") or name in aligned}
    attrs.update({(i, j): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                  if isinstance(args.get(name), tuple) for j in range(len(args[name]))})  # tuples of pointers
    registers, stores, loads, _, stack = sm90_report(fn, signature, constexprs, attrs, num_warps)
    return registers, stores, loads, stack


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conv-bwd", nargs="*", default=[], help="extra tilings of both backward kernels, e.g. 64x128x4")
    args = ap.parse_args()
    sc = short_conv
    conv_bwd = dict(W=4, BT=sc._CONV_BWD_BT, BC=sc._CONV_BWD_BC)
    cases = [
        ("loss rows (grad)", cross_entropy._loss_rows_kernel, LOSS_ARGS,
         dict(WRITE_GRAD=True, BV=4096, TILES=40), 8),
        ("loss rows (loss only)", cross_entropy._loss_rows_kernel, LOSS_ARGS,
         dict(WRITE_GRAD=False, BV=4096, TILES=40), 8),
        ("conv+silu fwd", sc._conv_silu_fwd_kernel, CONV_FWD_ARGS, dict(W=4, BT=sc._CONV_BT, BC=sc._CONV_BC),
         4, CONV_ALIGNED),
        ("conv+silu bwd g, dw (blocks, the default)", sc._conv_silu_grad_blocks_kernel, CONV_GRAD_ARGS,
         dict(W=4, BT=sc._CONV_GRAD_BLOCKS[0], BC=sc._CONV_GRAD_BLOCKS[1], BLOCKS=sc._CONV_GRAD_BLOCKS[3],
              STAGES=sc._CONV_GRAD_BLOCKS[4]), sc._CONV_GRAD_BLOCKS[2], CONV_ALIGNED),
        ("conv+silu bwd g, dw (one block per program)", sc._conv_silu_grad_kernel, CONV_GRAD_ARGS, conv_bwd,
         sc._CONV_BWD_WARPS, CONV_ALIGNED),
        ("conv+silu bwd dx", sc._conv_silu_dx_kernel, CONV_DX_ARGS, conv_bwd, sc._CONV_BWD_WARPS, CONV_ALIGNED),
        ("conv+silu bwd g, dw (odd C)", sc._conv_silu_grad_kernel, CONV_GRAD_ARGS, conv_bwd, sc._CONV_BWD_WARPS),
        ("conv+silu bwd dx (odd C)", sc._conv_silu_dx_kernel, CONV_DX_ARGS, conv_bwd, sc._CONV_BWD_WARPS),
        ("situ-glu fwd", situ._situ_fwd_kernel, SITU_FWD_ARGS,
         dict(HAS_P=False, BLOCK_M=situ._BLOCK_M, BLOCK_N=situ._BLOCK_N), 4),
        ("situ-glu fwd (row-weighted)", situ._situ_fwd_kernel, SITU_FWD_ARGS,
         dict(HAS_P=True, BLOCK_M=situ._BLOCK_M, BLOCK_N=situ._BLOCK_N), 4),
        ("situ-glu bwd (row-weighted)", situ._situ_weighted_bwd_kernel, SITU_WEIGHTED_BWD_ARGS,
         dict(N=320, BLOCK_M=situ._WEIGHTED_BLOCK_M, BLOCK_N=situ._WEIGHTED_BLOCK_N), 4),
        ("moe combine (sum of k rows)", moe._sum_rows_kernel, SUM_ROWS_ARGS,
         dict(K=8, BLOCK_N=moe._SUM_BLOCK_N, BLOCK_L=moe._SUM_BLOCK_L), 4),
        ("situ-glu bwd", situ._situ_bwd_kernel, SITU_BWD_ARGS, dict(BLOCK_M=situ._BLOCK_M, BLOCK_N=situ._BLOCK_N), 4),
    ]
    for tiling in args.conv_bwd:
        bt, bc, warps = map(int, tiling.split("x"))
        cases.append((f"conv+silu bwd g, dw {tiling}", sc._conv_silu_grad_kernel, CONV_GRAD_ARGS,
                      dict(W=4, BT=bt, BC=bc), warps, CONV_ALIGNED))
        cases.append((f"conv+silu bwd dx {tiling}", sc._conv_silu_dx_kernel, CONV_DX_ARGS,
                      dict(W=4, BT=bt, BC=bc), warps, CONV_ALIGNED))
    cases += [
        ("moe spread rows", moe._spread_rows_kernel, SPREAD_ARGS,
         dict(BLOCK_M=moe._SPREAD_BLOCK_M, BLOCK_L=moe._SPREAD_BLOCK_L), 4),
        ("router top-k + cutoff (E=64)", router._topk_cutoff_kernel, TOPK_ARGS,
         dict(K=8, BLOCK_N=32, BLOCK_E=64), 4),
        ("router top-k + cutoff (E=896)", router._topk_cutoff_kernel, TOPK_ARGS,
         dict(K=16, BLOCK_N=2, BLOCK_E=1024), 4),
        ("qb histogram (E=64)", router._qb_histogram_kernel, QB_ARGS, dict(BLOCK_N=64, BLOCK_E=64), 4),
    ]
    # the AttnRes read's backward at the small preset (D = 768): one row on one warp (the launch) and the earlier
    # 2 rows on 4 warps, 3 and 8 sources, the last adding
    for ns in (3, 8):
        common = dict(NS=ns, NS_PAD=triton_next_pow2(ns), ITERS=64, ACCUMULATE=(1 << (ns - 1)) - 1, BLOCK_D=1024)
        cases.append((f"attn_res bwd, {ns} sources", attn_res._ar_bwd_kernel, attn_res_bwd_args(ns),
                      dict(common, BLOCK_M=1), 1))
        cases.append((f"attn_res bwd 2x4, {ns} src", attn_res._ar_bwd_kernel, attn_res_bwd_args(ns),
                      dict(common, BLOCK_M=2), 4))
    cfg = grouped_gemm.WGRAD_CONFIG
    cases.append(("grouped gemm wgrad", grouped_gemm._grouped_mm_wgrad_kernel, GMM_WGRAD_ARGS,
                  dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], K_TILES=5, N_TILES=3, PRECISION="tf32",
                       INTERP=False, TWO_OUTPUTS=False, ACCUMULATE=False), cfg["warps"], ("stride_am",)))
    # as the weight gradients accumulate in place (k3.ops.weight_grads): fp32 w1 and w3 .grad, added into
    cases.append(("grouped gemm wgrad into .grad", grouped_gemm._grouped_mm_wgrad_kernel,
                  dict(GMM_WGRAD_ARGS, C="*fp32", C2="*fp32"),
                  dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], K_TILES=5, N_TILES=3, PRECISION="tf32",
                       INTERP=False, TWO_OUTPUTS=True, ACCUMULATE=True), cfg["warps"], ("stride_am",)))
    print(f"{'kernel':28s} {'settings':34s} {'regs':>5s} {'spill st/ld B':>14s} {'stack B':>8s}")
    for name, fn, fn_args, constexprs, warps, *aligned in cases:
        regs, stores, loads, stack = report(fn, fn_args, constexprs, warps, *aligned)
        tiles = ("BT", "BC", "BV", "BLOCK_M", "BLOCK_N", "BLOCK_L", "BM", "BN", "BK")
        settings = ", ".join(f"{k}={v}" for k, v in constexprs.items() if k in tiles) + f", {warps} warps"
        print(f"{name:28s} {settings:34s} {regs:5d} {f'{stores} / {loads}':>14s} {stack:8d}")


if __name__ == "__main__":
    main()
