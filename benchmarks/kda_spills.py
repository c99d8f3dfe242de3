"""Registers, spill bytes and shared memory of the KDA chunk kernels for an H100/H200 (sm_90), compiled offline.

No GPU needed: each kernel of `k3/ops/kda/chunk_*.py` (`chunk_prefill.py` included) is compiled by
`triton.compile` for GPUTarget("cuda", 90, 64) with the launch settings of `TUNING` (or the ones given), bf16
inputs, K = V = 128, C = 64 (16 for the prefill kernels), divisibility 16 on pointers and H like the real JIT; the
PTX then goes through the ptxas bundled with Triton (`-v -arch=sm_90a`), whose report gives registers and spills. A
proxy for speed, not a measurement of it (docs/kda-kernels.md, "Variants tried").

    python benchmarks/kda_spills.py                       # every kernel at its TUNING settings
    python benchmarks/kda_spills.py _bwd_k_block --warps 2 4   # one kernel, several warp counts
    python benchmarks/kda_spills.py _prep_intra --maxnreg 128 168   # with a register cap (more programs per SM)
    python benchmarks/kda_spills.py _prep_intra _prep_wu --maxnreg 0 128 --sass   # 0: no cap; SASS counts
    python benchmarks/kda_spills.py _bwd_vk _bwd_vv --warps 4 8 --maxnreg 0 168 128 --stages 1 3 --sass
    python benchmarks/kda_spills.py _bwd_vk _bwd_vv --bf16-storage ut dse du   # default: TUNING's

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from k3.ops.kda import chunk_bwd, chunk_output, chunk_prefill, chunk_prepare, chunk_state  # noqa: E402
from k3.ops.kda.tuning import TUNING, _launch_options  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
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


def compile_report(fn, num_warps: int, num_stages: int = 3, maxnreg: int | None = None, sass: bool = False,
                   bf16_args=(), **constexprs) -> tuple:
    """(registers, spill store bytes, spill load bytes, shared bytes) of one kernel for sm_90; with `sass`
    also its SASS counts (`sass_counts`). bf16_args: pointers of FP32_ARGS taken as bf16 instead."""
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name] = "constexpr"
            constants[name] = {**CONSTEXPRS, **constexprs}[name]
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = ("i32" if name in ("H", "TT", "c_lo", "c_hi")
                               else "*fp32" if name in FP32_ARGS and name not in bf16_args
                               else "*i32" if name in INT32_ARGS else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
    report = sm90_report(fn, signature, constants, attrs, num_warps, num_stages, maxnreg, sass=sass)
    return report[:4] + report[5:]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="*", help=f"some of {', '.join(TUNING_PREFIX)} (default: all)")
    p.add_argument("--warps", type=int, nargs="+", help="warp counts to try instead of TUNING's")
    p.add_argument("--bv", type=int, help="value block instead of TUNING's (kernels that take BV)")
    p.add_argument("--maxnreg", type=int, nargs="+", help="register caps per thread to try (a launch option; 0: none)")
    p.add_argument("--stages", type=int, nargs="+", help="num_stages to try instead of TUNING's (Triton's default 3)")
    p.add_argument("--sass", action="store_true", help="also count SASS instructions (cuobjdump)")
    p.add_argument("--bf16-storage", nargs="*", choices=["hs", "ut", "dse", "du"],
                   help="the backward intermediates compiled as bf16 (default: TUNING['bwd_storage_bf16']; none: "
                        "all fp32)")
    args = p.parse_args()
    stored_bf16 = TUNING["bwd_storage_bf16"] if args.bf16_storage is None else args.bf16_storage
    # the backward's other bf16 switches, as `_bwd` allocates for bf16 inputs (the names are the kernels' arguments)
    switched_bf16 = ((["daqk_out", "dakk_out", "daqk_in", "dakk_in"] if TUNING["bwd_da_bf16"] else [])
                     + (["dqh_out", "dkh_out", "dqh_in", "dkh_in", "dqh", "dkh"] if TUNING["bwd_scratch_bf16"]
                        else []))

    unknown = set(args.kernels) - set(TUNING_PREFIX)
    if unknown:
        p.error(f"unknown kernels {sorted(unknown)}; choose from {', '.join(TUNING_PREFIX)}")
    print(f"{'kernel':14s} {'settings':40s} {'regs':>5s} {'spill st/ld B':>14s} {'shared KB':>10s}")
    for name in args.kernels or list(TUNING_PREFIX):
        base = {**tuned_settings(name, args.bv), **VARIANT_SETTINGS.get(name, {})}
        # as `_bwd` launches it
        if name in ("_bwd_vk", "_bwd_vk_qp", "_bwd_vk_nd", "_bwd_vk_vv") and len(set(stored_bf16)) < 4:
            base["num_stages"] = TUNING["bwd_vk_fp32_stages"]
            base["BV"] = args.bv or TUNING["bwd_vk_fp32_bv"]
        for warps, stages, cap in itertools.product(args.warps or [base["num_warps"]],
                                                    args.stages or [base.get("num_stages")],
                                                    args.maxnreg or [base.get("maxnreg")]):
            settings = {**base, "num_warps": warps, "maxnreg": cap or None}
            if stages is not None:
                settings["num_stages"] = stages
            regs, stores, loads, shared, *sass = compile_report(
                kernel_fn(name), **settings, sass=args.sass,
                bf16_args=[*(stored_bf16 if name in STORED_FOR_BACKWARD else ()), *switched_bf16,
                           *KERNEL_BF16_ARGS.get(name, ())],
                **KERNEL_CONSTEXPRS.get(name, {}))
            shown = {k: v for k, v in settings.items() if v is not None}
            print(f"{name:14s} {str(shown):52s} {regs:5d} {f'{stores} / {loads}':>14s} {shared / 1024:10.0f}"
                  + (f"  SASS {sass[0]['total']} (BAR {sass[0]['BAR']}, EX2 {sass[0]['EX2']}, loop bodies "
                     f"{sass[0]['loops']})" if sass else ""), flush=True)


if __name__ == "__main__":
    main()
