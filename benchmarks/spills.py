"""Registers, spill bytes, stack, shared memory and SASS counts of the Triton kernels for an H100/H200 (sm_90),
compiled offline: the KDA chunk kernels and the other ops' kernels (short conv + SiLU, loss rows, SiTU-GLU, MoE
combine and spread, router, AttnRes read backward, grouped-GEMM weight gradient).

No GPU needed: `triton.compile` for GPUTarget("cuda", 90, 64) with the launch settings the ops use (or the ones
given), divisibility 16 on pointers like the real JIT; the PTX then goes through the ptxas bundled with Triton
(`-v -arch=sm_90a`), whose report gives registers and spills. It also shows that a kernel compiles for the H200 at
all, before any device time is spent. A proxy for speed, not a measurement of it (docs/kda-kernels.md, "Variants
tried").

    python benchmarks/spills.py                       # every kernel at its launch settings
    python benchmarks/spills.py kda                   # the KDA kernels only; `ops`: the others only
    python benchmarks/spills.py _bwd_k_block --warps 2 4   # one kernel, several warp counts
    python benchmarks/spills.py _prep_intra --maxnreg 128 168   # with a register cap (more programs per SM)
    python benchmarks/spills.py _prep_intra _prep_wu --maxnreg 0 128 --sass   # 0: no cap; SASS counts
    python benchmarks/spills.py _bwd_vk _bwd_vv --warps 4 8 --maxnreg 0 168 128 --stages 1 3 --sass
    python benchmarks/spills.py _bwd_vk _bwd_vv --bf16-storage ut dse du   # default: TUNING's
    python benchmarks/spills.py conv --conv-bwd 64x128x4 32x128x4   # both conv backward kernels at BTxBCxwarps

A kernel is named by its KDA name (`_bwd_vk_nd`, the keys of TUNING_PREFIX below) or by a word of the other
kernels' labels (`conv`, `situ`, `router`, `attn_res`, ...). `--warps`, `--stages`, `--maxnreg` and `--sass` apply
to every kernel named; `--bv` and `--bf16-storage` to the KDA kernels.

The KDA kernels (`k3/ops/kda/chunk_*.py`, `chunk_prefill.py` included) compile with the launch settings of
`TUNING`, bf16 inputs, K = V = 128, C = 64 (16 for the prefill kernels), H divisible by 16. The short-conv kernels
compile as they launch at the model's shapes (C = 1,024 or 12,288, 8,192 tokens, strides multiples of C), where the
JIT specialises those integers as multiples of 16 and the channel masks allow 16-byte loads; the "(odd C)" rows
compile the backward without that, as at test shapes like C = 70.

`--sass` also disassembles the cubin (the bundled `cuobjdump -sass`) and counts instructions (NOPs excluded):
the whole kernel, its barriers, and each loop body (a backward branch; software pipelining can copy a body
into a prologue, so a loop's trip count multiplies only the body shown).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import k3.ops.attn_res as attn_res  # noqa: E402
import k3.ops.cross_entropy as cross_entropy  # noqa: E402
import k3.ops.grouped_gemm as grouped_gemm  # noqa: E402
import k3.ops.moe as moe  # noqa: E402
import k3.ops.router as router  # noqa: E402
import k3.ops.short_conv as short_conv  # noqa: E402
import k3.ops.situ as situ  # noqa: E402
from k3.ops.kda import chunk_bwd, chunk_output, chunk_prefill, chunk_prepare, chunk_state  # noqa: E402
from k3.ops.kda.tuning import TUNING, _launch_options  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


# ---- one kernel through triton.compile and ptxas --------------------------------------------------------------

def sm90_report(fn, signature: dict, constants: dict, attrs: dict, num_warps: int,
                num_stages: int = 3, maxnreg: int | None = None, sass: bool = False) -> tuple:
    """Compile one kernel for sm_90 and read ptxas's report: (registers, spill store bytes, spill load
    bytes, shared bytes, stack frame bytes), and with `sass` the SASS counts (`sass_counts`) last. maxnreg
    caps the registers per thread (None: no cap)."""
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 64),
                            options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([str(PTXAS), "-v", "-arch=sm_90a", str(ptx), "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stack, stores, loads = map(int, re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                              r"(\d+) bytes spill loads", report).groups())
    result = (registers, stores, loads, kernel.metadata.shared, stack)
    return result + (sass_counts(kernel.asm["cubin"]),) if sass else result


def sass_counts(cubin: bytes) -> dict:
    """Static SASS instruction counts of a cubin (NOPs excluded): total, barriers (BAR), exp2 (MUFU.EX2) and
    the instructions of each loop body (from a backward branch's target to the branch)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(PTXAS.parent / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
    instrs = [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    instrs = [(a, op) for a, op in instrs if not op.startswith("NOP")]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", op) for _, op in instrs]
    loops = []
    for (addr, _), op in zip(instrs, ops):
        target = re.match(r"BRA\S*\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr:
            loops.append(sum(int(target.group(1), 16) <= a <= addr for a, _ in instrs))
    return {"total": len(instrs), "BAR": sum(op.startswith("BAR") for op in ops),
            "EX2": sum(op.startswith("MUFU.EX2") for op in ops), "loops": loops}


@dataclass
class Case:
    """One kernel as it launches: what `sm90_report` compiles, and the launch options a sweep may replace."""
    label: str
    fn: object
    signature: dict
    constants: dict
    attrs: dict
    num_warps: int
    num_stages: int | None = None  # None: Triton's default, 3
    maxnreg: int | None = None  # None: no cap
    tiles: str = ""  # the block sizes shown beside the launch options


# ---- the KDA chunk kernels ------------------------------------------------------------------------------------

FP32_ARGS = {"A_log", "dt_bias", "t_in", "t_out", "hs", "dse", "du", "dqh_in", "dkh_in", "dg_in", "daqk_in",
             "dakk_in", "db_in", "dqh_out", "dkh_out", "dg_out", "daqk_out", "dakk_out", "db_out", "dA_part",
             "dbias_part", "aqk_out", "u_out", "gc_out", "gc", "h0", "ht", "aqk", "u", "dht", "dh0", "kn_out", "kn_in",
             "dqh", "dkh", "db_part", "g_in", "g_out", "gc_in", "ut", "dbk_out", "dbk_in",
             "qn_in", "qn_out", "u_out", "m_out", "m_in", "aqk_in", "nd_out", "nd_in", "nrm_out", "nrm_in"}
INT32_ARGS = {"cu", "chunk_idx", "chunk_off", "hs_off", "done"}
CONSTEXPRS = dict(K=128, V=128, C=64, BC=16, G_MIN=-5.0, INTERP=False, SCORES_BF16=True, BF16=False,
                  USE_H0=True, STORE_HT=False, STORE_HS=True, WRITE_O=False, USE_DHT=False, SK=64, SV=64,
                  STORE_UT=False, SPLIT=TUNING["state_split_inference"], STORE_QN=False, HALF=0,
                  INVERSE=TUNING["prefill_inverse"],  # the prefill's, for bf16 inputs (`_prep_intra`: below)
                  SEGMENT=False, QPRIME=False, LOOP=False, STORE_AT=False, ROW_DOTS=False, NORMS=False, GATE=False,
                  VV=False, BVV=64)
# kernel -> its TUNING key prefix, in launch order; "_state_ut" is `_state` when it also stores Ũ (the backward's
# recompute launch, and the training forward's with `state_o_apart`, which then writes o in `_fwd_o`),
# "_state_ut_o" the training forward's that also writes o (more shared memory: 216 KB at 3 stages against 128, and
# 288 KB at 4, more than an H200's SM has; fp32 inputs, or `state_o_apart` off), both with the state_ut settings
TUNING_PREFIX = {"_prep_gate": "prep_gate", "_prep_intra": "prep_intra", "_prep_solve": "prep_solve",
                 "_prep_wu": "prep_wu", "_state": "state", "_state_ut": "state_ut", "_state_ut_o": "state_ut",
                 "_fwd_o": "fwd_o", "_state_bwd": "state_bwd", "_prep_wu_qp": "prep_wu", "_state_bwd_qp": "state_bwd",
                 "_bwd_vk_qp": "bwd_vk", "_bwd_vv_qp": "bwd_vv", "_fwd_o_loop": "fwd_o",
                 "_bwd_k_block32": "bwd_k", "_prep_intra_at": "prep_intra", "_bwd_vk_nd": "bwd_vk",
                 "_bwd_vv_nd": "bwd_vv", "_bwd_k_block_nd": "bwd_k", "_bwd_k_block_gate": "bwd_k",
                 "_bwd_vk_vv": "bwd_vk",
                 "_bwd_vk": "bwd_vk", "_bwd_vv": "bwd_vv", "_bwd_k_block": "bwd_k", "_bwd_gate": "bwd_gate",
                 "_bwd_norms": "bwd_norms", "_prefill_prepare": "prefill_prepare", "_prefill_state": "prefill_state",
                 "_prefill_prepare_half1": "prefill_prepare",
                 "_prefill_prepare_half2": "prefill_join"}
# the launches whose chunk-start states, Ũ, dS_end, dŨ follow TUNING["bwd_storage_bf16"] (the inference `_state`
# stores fp32 states, the ones it returns)
STORED_FOR_BACKWARD = {"_state_ut", "_state_ut_o", "_fwd_o", "_fwd_o_loop", "_state_bwd", "_bwd_vk", "_bwd_vv",
                       "_state_bwd_qp", "_bwd_vk_qp", "_bwd_vv_qp", "_bwd_vk_nd", "_bwd_vv_nd", "_bwd_vk_vv"}
# pointers that are bf16 in one specialisation only (`_bwd_vv` writes the β logit's gradient, b's dtype, with NORMS)
KERNEL_BF16_ARGS = {"_bwd_vv_nd": ("db_out",)}
# per-kernel constexprs on top of CONSTEXPRS
_SK = TUNING["bwd_k_cols"]
_SKV = TUNING["bwd_vk_cols"]
KERNEL_CONSTEXPRS = {"_prep_intra": dict(INVERSE=TUNING["prep_inverse"]),
                     "_state_ut": dict(STORE_UT=True, SPLIT=TUNING["state_split"]),
                     "_state_ut_o": dict(STORE_UT=True, WRITE_O=True, SPLIT=TUNING["state_split"]),
                     "_state_bwd": dict(SPLIT=TUNING["state_bwd_products"] == "split",
                                        BF16=TUNING["state_bwd_products"] == "bf16"),
                     "_state_bwd_qp": dict(SPLIT=TUNING["state_bwd_products"] == "split",
                                           BF16=TUNING["state_bwd_products"] == "bf16", QPRIME=True),
                     "_fwd_o": dict(SPLIT=TUNING["state_split"]),
                     "_fwd_o_loop": dict(SPLIT=TUNING["state_split"], LOOP=True),
                     "_bwd_vk": dict(SK=_SKV), "_bwd_vv": dict(NS=128 // _SKV), "_bwd_k_block": dict(SK=_SK),
                     # the variants' specialisations (`TUNING`'s last section): the 32-row score backward
                     # (`bwd_k_rows`)
                     "_bwd_k_block32": dict(SK=64, BC=32),
                     # `TUNING["state_bwd_qprime"]`'s
                     "_prep_wu_qp": dict(QPRIME=True), "_bwd_vk_qp": dict(SK=_SKV, QPRIME=True),
                     "_bwd_vv_qp": dict(NS=128 // _SKV, QPRIME=True),
                     # `TUNING["norms_from_scores"]`'s
                     "_prep_intra_at": dict(INVERSE=TUNING["prep_inverse"], STORE_AT=True, STORE_QN=True),
                     "_bwd_vk_nd": dict(SK=_SKV, ROW_DOTS=True), "_bwd_vv_nd": dict(NS=128 // _SKV, NORMS=True),
                     "_bwd_k_block_nd": dict(SK=_SK, NORMS=True),
                     # `TUNING["bwd_gate_fused"]`'s
                     "_bwd_k_block_gate": dict(SK=_SK, GATE=True),
                     # `TUNING["bwd_vv_fused"]`'s
                     "_bwd_vk_vv": dict(SK=_SKV, VV=True, BVV=TUNING["bwd_vv_bv"]),
                     "_bwd_gate": dict(SK=TUNING["bwd_gate_cols"]),
                     "_bwd_norms": dict(NS=128 // _SK, BT=TUNING["bwd_norms_rows"]),
                     "_prefill_prepare": dict(HALF=0),
                     "_prefill_prepare_half1": dict(HALF=1), "_prefill_prepare_half2": dict(HALF=2),
                     # the K3 shape's (192 programs: 16-token chunks, `prefill_chunk_for`, in a pipeline's segments)
                     "_prefill_state": dict(C=16, STORE_HS=False, EVERY=64 // 16, SEGMENT=True,
                                            BF16=TUNING["prefill_state_bf16"],
                                            SPLIT=not TUNING["prefill_state_bf16"])}


# launch settings of the variants that TUNING's shared prefix does not describe: the 32-row score backward at a
# 64-column, 8-warp launch (at the 16-row kernel's 4 warps and 64-register cap it spills 1.4 KB)
VARIANT_SETTINGS = {"_bwd_k_block32": dict(num_warps=8, maxnreg=128)}


KERNEL_MODULES = (chunk_prepare, chunk_state, chunk_output, chunk_bwd, chunk_prefill)


def kernel_fn(name: str):
    aliases = {"_state_ut": "_state", "_state_ut_o": "_state", "_prep_wu_qp": "_prep_wu", "_state_bwd_qp": "_state_bwd",
               "_bwd_vk_qp": "_bwd_vk", "_bwd_vv_qp": "_bwd_vv", "_fwd_o_loop": "_fwd_o",
               "_bwd_k_block32": "_bwd_k_block", "_prep_intra_at": "_prep_intra", "_bwd_vk_nd": "_bwd_vk",
               "_bwd_vv_nd": "_bwd_vv", "_bwd_k_block_nd": "_bwd_k_block", "_bwd_k_block_gate": "_bwd_k_block",
               "_bwd_vk_vv": "_bwd_vk", "_prefill_prepare_half1": "_prefill_prepare",
               "_prefill_prepare_half2": "_prefill_prepare"}
    name = aliases.get(name, name)
    return next(getattr(m, name) for m in KERNEL_MODULES if hasattr(m, name))


def tuned_settings(name: str, bv: int | None = None) -> dict:
    """The launch settings of TUNING for one kernel (`_launch_options`), with value block bv instead of TUNING's
    where given (capped at V, as the launches do)."""
    prefix = TUNING_PREFIX[name]
    bv_key = f"{prefix}_bv"
    settings = {}
    if bv_key in TUNING:
        settings["BV"] = min(bv if bv is not None else TUNING[bv_key], CONSTEXPRS["V"])
    settings.update(_launch_options(prefix, settings.get("BV")))
    return settings


def kda_case(name: str, bv: int | None, stored_bf16) -> Case:
    """One KDA kernel at its TUNING launch (value block `bv` where given), bf16 inputs; the backward's
    intermediates in `stored_bf16` (names of `--bf16-storage`) compiled as bf16."""
    settings = {**tuned_settings(name, bv), **VARIANT_SETTINGS.get(name, {})}
    # as `_bwd` launches it
    if name in ("_bwd_vk", "_bwd_vk_qp", "_bwd_vk_nd", "_bwd_vk_vv") and len(set(stored_bf16)) < 4:
        settings["num_stages"] = TUNING["bwd_vk_fp32_stages"]
        settings["BV"] = bv or TUNING["bwd_vk_fp32_bv"]
    # the backward's other bf16 switches, as `_bwd` allocates for bf16 inputs (the names are the kernels' arguments)
    switched_bf16 = ((["daqk_out", "dakk_out", "daqk_in", "dakk_in"] if TUNING["bwd_da_bf16"] else [])
                     + (["dqh_out", "dkh_out", "dqh_in", "dkh_in", "dqh", "dkh"] if TUNING["bwd_scratch_bf16"]
                        else []))
    bf16_args = {*(stored_bf16 if name in STORED_FOR_BACKWARD else ()), *switched_bf16,
                 *KERNEL_BF16_ARGS.get(name, ())}
    fn = kernel_fn(name)
    values = {**CONSTEXPRS, **KERNEL_CONSTEXPRS.get(name, {}), **({"BV": settings["BV"]} if "BV" in settings else {})}
    signature, constants, attrs = {}, {}, {}
    for i, arg in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[arg] = "constexpr"
            constants[arg] = values[arg]
        elif arg == "scale":
            signature[arg] = "fp32"
        else:
            signature[arg] = ("i32" if arg in ("H", "TT", "c_lo", "c_hi")
                              else "*fp32" if arg in FP32_ARGS and arg not in bf16_args
                              else "*i32" if arg in INT32_ARGS else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
    return Case(name, fn, signature, constants, attrs, settings["num_warps"], settings.get("num_stages"),
                settings.get("maxnreg"), f"BV={settings['BV']}" if "BV" in settings else "")


# ---- the other ops' kernels -----------------------------------------------------------------------------------

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


def op_case(label: str, fn, args: dict, constexprs: dict, num_warps: int, aligned: tuple = ()) -> Case:
    """One kernel with argument types `args` and constexprs `constexprs`: pointer arguments divisible by 16, as
    the real JIT specialises them, and so the integer arguments in `aligned`."""
    signature = {name: "constexpr" if name in constexprs else args[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if isinstance(args.get(name), str) and args[name].startswith("*") or name in aligned}
    attrs.update({(i, j): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                  if isinstance(args.get(name), tuple) for j in range(len(args[name]))})  # tuples of pointers
    tiles = ("BT", "BC", "BV", "BLOCK_M", "BLOCK_N", "BLOCK_L", "BM", "BN", "BK")
    shown = ", ".join(f"{k}={v}" for k, v in constexprs.items() if k in tiles)
    return Case(label, fn, signature, constexprs, attrs, num_warps, tiles=shown)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def op_cases(conv_bwd_tilings=()) -> list[Case]:
    """Every non-KDA kernel at its launch settings, and both conv backward kernels at each extra tiling
    ("BTxBCxwarps")."""
    sc = short_conv
    conv_bwd = dict(W=4, BT=sc._CONV_BWD_BT, BC=sc._CONV_BWD_BC)
    cases = [
        op_case("loss rows (grad)", cross_entropy._loss_rows_kernel, LOSS_ARGS,
                dict(WRITE_GRAD=True, BV=4096, TILES=40), 8),
        op_case("loss rows (loss only)", cross_entropy._loss_rows_kernel, LOSS_ARGS,
                dict(WRITE_GRAD=False, BV=4096, TILES=40), 8),
        op_case("conv+silu fwd", sc._conv_silu_fwd_kernel, CONV_FWD_ARGS, dict(W=4, BT=sc._CONV_BT, BC=sc._CONV_BC),
                4, CONV_ALIGNED),
        op_case("conv+silu bwd g, dw (blocks, the default)", sc._conv_silu_grad_blocks_kernel, CONV_GRAD_ARGS,
                dict(W=4, BT=sc._CONV_GRAD_BLOCKS[0], BC=sc._CONV_GRAD_BLOCKS[1], BLOCKS=sc._CONV_GRAD_BLOCKS[3],
                     STAGES=sc._CONV_GRAD_BLOCKS[4]), sc._CONV_GRAD_BLOCKS[2], CONV_ALIGNED),
        op_case("conv+silu bwd g, dw (one block per program)", sc._conv_silu_grad_kernel, CONV_GRAD_ARGS, conv_bwd,
                sc._CONV_BWD_WARPS, CONV_ALIGNED),
        op_case("conv+silu bwd dx", sc._conv_silu_dx_kernel, CONV_DX_ARGS, conv_bwd, sc._CONV_BWD_WARPS,
                CONV_ALIGNED),
        op_case("conv+silu bwd g, dw (odd C)", sc._conv_silu_grad_kernel, CONV_GRAD_ARGS, conv_bwd,
                sc._CONV_BWD_WARPS),
        op_case("conv+silu bwd dx (odd C)", sc._conv_silu_dx_kernel, CONV_DX_ARGS, conv_bwd, sc._CONV_BWD_WARPS),
        op_case("situ-glu fwd", situ._situ_fwd_kernel, SITU_FWD_ARGS,
                dict(HAS_P=False, BLOCK_M=situ._BLOCK_M, BLOCK_N=situ._BLOCK_N), 4),
        op_case("situ-glu fwd (row-weighted)", situ._situ_fwd_kernel, SITU_FWD_ARGS,
                dict(HAS_P=True, BLOCK_M=situ._BLOCK_M, BLOCK_N=situ._BLOCK_N), 4),
        op_case("situ-glu bwd (row-weighted)", situ._situ_weighted_bwd_kernel, SITU_WEIGHTED_BWD_ARGS,
                dict(N=320, BLOCK_M=situ._WEIGHTED_BLOCK_M, BLOCK_N=situ._WEIGHTED_BLOCK_N), 4),
        op_case("moe combine (sum of k rows)", moe._sum_rows_kernel, SUM_ROWS_ARGS,
                dict(K=8, BLOCK_N=moe._SUM_BLOCK_N, BLOCK_L=moe._SUM_BLOCK_L), 4),
        op_case("situ-glu bwd", situ._situ_bwd_kernel, SITU_BWD_ARGS,
                dict(BLOCK_M=situ._BLOCK_M, BLOCK_N=situ._BLOCK_N), 4),
    ]
    for tiling in conv_bwd_tilings:
        bt, bc, warps = map(int, tiling.split("x"))
        cases.append(op_case(f"conv+silu bwd g, dw {tiling}", sc._conv_silu_grad_kernel, CONV_GRAD_ARGS,
                             dict(W=4, BT=bt, BC=bc), warps, CONV_ALIGNED))
        cases.append(op_case(f"conv+silu bwd dx {tiling}", sc._conv_silu_dx_kernel, CONV_DX_ARGS,
                             dict(W=4, BT=bt, BC=bc), warps, CONV_ALIGNED))
    cases += [
        op_case("moe spread rows", moe._spread_rows_kernel, SPREAD_ARGS,
                dict(BLOCK_M=moe._SPREAD_BLOCK_M, BLOCK_L=moe._SPREAD_BLOCK_L), 4),
        op_case("router top-k + cutoff (E=64)", router._topk_cutoff_kernel, TOPK_ARGS,
                dict(K=8, BLOCK_N=32, BLOCK_E=64), 4),
        op_case("router top-k + cutoff (E=896)", router._topk_cutoff_kernel, TOPK_ARGS,
                dict(K=16, BLOCK_N=2, BLOCK_E=1024), 4),
        op_case("qb histogram (E=64)", router._qb_histogram_kernel, QB_ARGS, dict(BLOCK_N=64, BLOCK_E=64), 4),
    ]
    # the AttnRes read's backward at the small preset (D = 768): one row on one warp (the launch) and the earlier
    # 2 rows on 4 warps, 3 and 8 sources, the last adding
    for ns in (3, 8):
        common = dict(NS=ns, NS_PAD=triton_next_pow2(ns), ITERS=64, ACCUMULATE=(1 << (ns - 1)) - 1, BLOCK_D=1024)
        cases.append(op_case(f"attn_res bwd, {ns} sources", attn_res._ar_bwd_kernel, attn_res_bwd_args(ns),
                             dict(common, BLOCK_M=1), 1))
        cases.append(op_case(f"attn_res bwd 2x4, {ns} src", attn_res._ar_bwd_kernel, attn_res_bwd_args(ns),
                             dict(common, BLOCK_M=2), 4))
    cfg = grouped_gemm.WGRAD_CONFIG
    cases.append(op_case("grouped gemm wgrad", grouped_gemm._grouped_mm_wgrad_kernel, GMM_WGRAD_ARGS,
                         dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], K_TILES=5, N_TILES=3, PRECISION="tf32",
                              INTERP=False, TWO_OUTPUTS=False, ACCUMULATE=False), cfg["warps"], ("stride_am",)))
    # as the weight gradients accumulate in place (k3.ops.weight_grads): fp32 w1 and w3 .grad, added into
    cases.append(op_case("grouped gemm wgrad into .grad", grouped_gemm._grouped_mm_wgrad_kernel,
                         dict(GMM_WGRAD_ARGS, C="*fp32", C2="*fp32"),
                         dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], K_TILES=5, N_TILES=3, PRECISION="tf32",
                              INTERP=False, TWO_OUTPUTS=True, ACCUMULATE=True), cfg["warps"], ("stride_am",)))
    return cases


# ---- the report -----------------------------------------------------------------------------------------------

def select(names: list[str], conv_bwd_tilings=()) -> tuple[list[str], list[Case]]:
    """(KDA kernel names, other kernels' cases) that `names` pick: a KDA kernel by its name, the others by a word
    of their labels; "kda" and "ops" all of either; none: all. Extra conv tilings are always in. Raises KeyError
    with the names that match nothing."""
    ops = op_cases(conv_bwd_tilings)
    if not names:
        return list(TUNING_PREFIX), ops
    kda = [n for n in TUNING_PREFIX if "kda" in names or n in names]
    extra = {f"conv+silu bwd {part} {t}" for t in conv_bwd_tilings for part in ("g, dw", "dx")}
    words = [n for n in names if n not in TUNING_PREFIX and n not in ("kda", "ops")]
    picked = [c for c in ops if "ops" in names or c.label in extra or any(w.lower() in c.label for w in words)]
    unknown = [w for w in words if not any(w.lower() in c.label for c in ops)]
    if unknown:
        raise KeyError(unknown)
    return kda, picked


def launch_text(case: Case, warps: int, stages: int | None, cap: int | None) -> str:
    parts = [case.tiles] if case.tiles else []
    parts.append(f"{warps} warp" + ("s" if warps != 1 else ""))
    parts += [f"{stages} stages"] if stages is not None else []
    parts += [f"maxnreg {cap}"] if cap else []
    return ", ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="*", help=f"KDA kernels ({', '.join(TUNING_PREFIX)}), words of the other "
                                              "kernels' labels, `kda` or `ops` (default: every kernel)")
    p.add_argument("--warps", type=int, nargs="+", help="warp counts to try instead of the launch's")
    p.add_argument("--bv", type=int, help="value block instead of TUNING's (KDA kernels that take BV)")
    p.add_argument("--maxnreg", type=int, nargs="+", help="register caps per thread to try (a launch option; 0: none)")
    p.add_argument("--stages", type=int, nargs="+", help="num_stages to try instead of the launch's (Triton's "
                                                         "default 3)")
    p.add_argument("--sass", action="store_true", help="also count SASS instructions (cuobjdump)")
    p.add_argument("--bf16-storage", nargs="*", choices=["hs", "ut", "dse", "du"],
                   help="the KDA backward intermediates compiled as bf16 (default: TUNING['bwd_storage_bf16']; "
                        "none: all fp32)")
    p.add_argument("--conv-bwd", nargs="*", default=[], help="extra tilings of both short-conv backward kernels, "
                                                              "e.g. 64x128x4 (BTxBCxwarps)")
    args = p.parse_args()
    stored_bf16 = TUNING["bwd_storage_bf16"] if args.bf16_storage is None else args.bf16_storage
    try:
        kda, ops = select(args.kernels, args.conv_bwd)
    except KeyError as e:
        p.error(f"no kernel matches {e.args[0]}; KDA kernels: {', '.join(TUNING_PREFIX)}; others: "
                + "; ".join(c.label for c in op_cases()))

    print(f"{'kernel':44s}  {'launch':40s}  {'regs':>5s}  {'spill st/ld B':>14s}  {'stack B':>7s}  {'shared KB':>9s}")
    for case in [kda_case(name, args.bv, stored_bf16) for name in kda] + ops:
        for warps, stages, cap in itertools.product(args.warps or [case.num_warps], args.stages or [case.num_stages],
                                                    args.maxnreg or [case.maxnreg]):
            regs, stores, loads, shared, stack, *sass = sm90_report(
                case.fn, case.signature, case.constants, case.attrs, warps, 3 if stages is None else stages,
                cap or None, sass=args.sass)
            print(f"{case.label:44s}  {launch_text(case, warps, stages, cap):40s}  {regs:5d}  "
                  f"{f'{stores} / {loads}':>14s}  {stack:7d}  {shared / 1024:9.0f}"
                  + (f"  SASS {sass[0]['total']} (BAR {sass[0]['BAR']}, EX2 {sass[0]['EX2']}, loop bodies "
                     f"{sass[0]['loops']})" if sass else ""), flush=True)


if __name__ == "__main__":
    main()
