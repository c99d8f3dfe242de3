"""Shared by the chunked KDA kernels (`triton_chunk.py`, 64-token chunks, training and prefill; `triton_prefill.py`,
32- and 16-token chunks, the inference forward): launch settings, device helpers, the chunk plan.

The numerics of the helpers (round-to-nearest casts, split-bf16 products, flush-to-zero exps) are described in
docs/kda-kernels.md §4; the launch settings' measurements beside each entry of TUNING.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from k3.ops import triton_runs_on
from k3.ops.kda.reference import document_offsets

CHUNK = 64
SUB = 16
# Launch configurations for K = V = 128 on an H200 (docs/kda-kernels.md: chosen from the compiler's register
# and spill report and the measured variants). Benchmarks may override entries (`benchmarks/kda.py --tuning`).
# For each chunk kernel "<name>_warps", and optionally "<name>_stages" and "<name>_maxnreg" (a register cap per
# thread, so that more programs share an SM; None: Triton's default).
TUNING = {
    # the prepare (docs/kda-kernels.md §7 items 10 and 12): `_prep_gate`, `_prep_intra`, `_prep_solve`, `_prep_wu`;
    # forward 4.64 → 3.31 ms at the K3 shape with the gate pre-pass (session 8, run 1)
    "prep_gate_warps": 1, "prep_gate_stages": None, "prep_gate_maxnreg": None,  # 0.28 ms at 4 warps, 0.25 at 1 (run 3)
    "prep_intra_warps": 4, "prep_intra_stages": None, "prep_intra_maxnreg": 128,  # 2.57 ms at 168, 2.43 at 128 (run 7)
    # (`_prep_intra` with one anchor per row block, `_intra_off_step`: 0.98 → 0.88 ms, session 9 run 4)
    "prep_solve_warps": 4, "prep_solve_stages": None, "prep_solve_maxnreg": None,
    "prep_wu_warps": 4, "prep_wu_stages": None, "prep_wu_maxnreg": 128,  # 0.96 → 0.84 ms, 0 spills (run 7)
    # the inference `_state` (no stores for a backward): split products at 3 stages, forward 2.995 → 2.884 ms at
    # the K3 shape, 0.979 → 0.998 at the small preset's (session 12 run 4; tf32 at 3 stages: 3.14 → 4.08, run 3)
    "state_bv": 32, "state_warps": 4, "state_stages": 3, "state_maxnreg": None,
    # `_state` when it also stores Ũ (the training forward, the backward's recompute): tf32 products at 8 warps
    # (2.12 ms at the K3 shape); split-bf16 products at 4 warps 1.88 ms (session 9 run 4), 1.29 ms at 3 stages
    # (session 12 run 3)
    "state_ut_bv": 32, "state_ut_warps": 4, "state_ut_stages": 3, "state_ut_maxnreg": None,
    # the training forward's o apart from `_state` (`_fwd_o`, from the bf16 chunk-start states and Ũ it stores;
    # `output_apart`): `_state` then runs without Q⊙Γ and Aqk (128 KB of shared memory at 3 stages against 216, 88
    # at 2). Session 28 run 2 at the K3 shape: `_state` 1.19 → 0.71 ms (0.74 at 2 stages) plus `_fwd_o` 0.39 (its
    # Aqk·Ũ in tf32 then; split bf16 since, untimed), fwd+bwd 9.951 → 9.849; o 3.1 → 3.8e-3 from fp64 at T = 8192
    # H = 4 (fla 5.4e-3, limit 5e-3)
    "state_o_apart": True, "fwd_o_bv": 64, "fwd_o_warps": 4, "fwd_o_stages": None, "fwd_o_maxnreg": None,
    # `_fwd_o` as one program per (chunk, head) walking the value blocks, Q⊙Γ and Aqk loaded once (docs §7 item 66;
    # untimed: off)
    "fwd_o_loop": False,
    # `_state_bwd` in split-bf16 products at 4 warps, 3 stages: 2.15 → 1.37 ms at the K3 shape, 0.67 → 0.46 at the
    # small preset's, and closer to fp64 than tf32 at 8 warps, 1 stage (2 stages: 1.58 and 0.52 ms; session 12
    # runs 1-2; `state_bwd_products`)
    "state_bwd_bv": 32, "state_bwd_warps": 4, "state_bwd_stages": 3, "state_bwd_maxnreg": None,
    # `_state`'s products in split bf16 (`_mm_split`: more accurate than tf32, and without tf32's conversion of the
    # bf16 tiles) unless state_bf16: the launch that stores Ũ 2.12 → 1.88 ms at 4 warps, the inference forward
    # 3.231 → 3.255 ms (session 9 runs 3-4). `_state_bwd` has its own switch, `state_bwd_products` (below)
    "state_split": True,
    # the inference forward (no backward can follow) in split bf16 too, so its o is bit-identical to a training
    # forward's that computes o inside `_state` (all but bf16 inputs with `state_o_apart`). tf32 there: 3.134 →
    # 3.102 ms at the K3 shape at 2 stages (session 10 run 1), the default until session 12, whose 3-stage split
    # launch took 2.884 ms
    "state_split_inference": True,
    # every `_state` launch in plain bf16 products (as `chunk_kda(state_bf16=True)`; fla's choice), for timing:
    # with bf16 `_state_bwd` products, fwd+bwd 13.98 ms at the K3 shape, but dA_log 2.0e-2 from fp64 (session 12)
    "state_bf16": False,
    # `_state_bwd`'s products: "split" (as `_state`'s), "tf32" or "bf16" (1.38 ms at the K3 shape, dA_log 1.0e-2
    # from fp64 against split's 5.6e-3). Split and bf16 are correct on the H200 at 4 warps with 2 or 3 stages;
    # with 1 stage the build computed wrong gradients (bf16 at 8 warps, split at 4) or faulted (split at 8): a
    # miscompile of the unpipelined loads, as in sessions 4 and 9 (session 12 runs 1-2); 8 warps at 2-3 stages is
    # untimed. Launches outside the measured region are refused.
    "state_bwd_products": "split",
    # `_state_bwd` on Q′ = Q⊙Γ − Aqk·W (`_prep_wu` writes it, bf16 for bf16 inputs), without Aqk's tile and product in
    # its chain: dS_start = Q′ᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·(Kd·dS_end), and dŨ's Aqkᵀ·dO taken in `_bwd_vk` (as
    # −Aqkᵀ·dQg on dW) and `_bwd_vv` (per value block, and Aqkᵀ·dAqk on dŨ·Ũᵀ) instead (docs/kda-kernels.md §7 item
    # 65). Offline the pass drops to 218 registers, no spills, 172 KB at 3 stages (255, 12 B, 204 KB). Untimed: off
    "state_bwd_qprime": False,
    # the q/k norm backward's and dβ's sums over K from the scores (Euler's identity: ⟨q̂_r, dq̂_r⟩'s score part is
    # Σ_i dAqk[r, i]·Aqk[r, i], and so on) in `_bwd_vv`, with the value side's parts from `_bwd_vk`'s slices, on Ã
    # (Akk before β) that the prepare keeps ([TT, H, 64], bf16 for bf16 inputs: 96 MiB per layer at the K3 shape):
    # `_bwd_k_block` then writes dq and dk, and `_bwd_norms` (0.33 ms there, its 1.2 GB of traffic) does not run
    # (docs/kda-kernels.md §7 item 69). Untimed: off
    "norms_from_scores": False,
    # the value-side backward over key slices from the forward's Ũ (docs/kda-kernels.md §7 item 13): `_bwd_vk` per
    # (key slice of bwd_vk_cols, chunk, head), then `_bwd_vv` per (chunk, head); fwd+bwd 19.95 → 18.53 ms at the K3
    # shape with bwd_vk_maxnreg 168 (session 8, run 1). 8 warps, 3 stages, 128 registers: every loop tile an async
    # copy, `_bwd_vk` 3.66 → 3.40 ms, 3.09 with the kept norms (`_load_norm`); `_bwd_vv` at 3 stages with its
    # partials summed first 1.18 → 1.02 ms (session 9 run 4)
    # (session 13: 64-column slices without the register cap, one program of 255 registers per SM, `_bwd_vk` 2.91 →
    # 2.65 ms and `_bwd_vv` 1.02 → 0.94 (half the partials) at the K3 shape, run 3)
    # (session 24: with T, G, q̂ and k̂ loaded before the value loop, 2.63 → 2.32 ms, run 2. Run 3: 2.33 at 3 stages,
    # 2.27 at 4 (172 KB of shared memory, still one program per SM), 2.85 at 2; 4 stages the default since session
    # 25: the KDA GPU tests passed with it, and fwd+bwd 11.238 → 11.192 ms, `_bwd_vk` 2.33 → 2.27, run 1)
    # (session 26: with its loop's tiles in bf16 (bwd_storage_bf16) 124 KB at 4 stages, 160 at 6: 2.24 → 2.17 ms,
    # run 1; on value blocks of 64, 152 KB at 3 stages: 2.18 → 2.07, 192 KB at 4: 2.08, run 4. Where any of the
    # tiles is fp32 the launch is bwd_vk_fp32_bv / _stages, session 25's: BV 64 takes 224 KB at 3 stages there)
    "bwd_vk_cols": 64, "bwd_vk_bv": 64, "bwd_vk_warps": 8, "bwd_vk_stages": 3, "bwd_vk_maxnreg": None,
    "bwd_vk_fp32_bv": 32, "bwd_vk_fp32_stages": 4,
    # which of the chunk-start states ("hs") and Ũ ("ut", from the training `_state`), dS_end ("dse") and dŨ ("du",
    # from `_state_bwd`) are stored in bf16 for bf16 inputs (fp32 otherwise; `backward_storage`); `_bwd_vk` and
    # `_bwd_vv` multiply them as stored (`_dot_stored`: plain bf16 products; a bf16 tile against an fp32 one goes
    # in as tf32). fla stores all four in bf16. Session 26 run 1 at the K3 shape, fwd+bwd 11.120 ms with none: all
    # four 10.879 (`_bwd_vk` 2.27 → 2.24, `_state` 1.29 → 1.20, `_state_bwd` 1.27 → 1.20, `_bwd_vv` 0.94 → 0.85),
    # and 10.787 with `_bwd_vk` at 6 stages (2.17); ut, dse, du 11.089; ut, du 11.556 (the mixed products' tf32
    # conversions: `_bwd_vk` 2.66). Errors at T = 8192 H = 4 (dense / varlen, none → all four): dq 3.1 → 3.6e-3,
    # dk 2.9 → 3.7e-3, dA_log 2.5 → 3.5e-3 and 0.6 → 2.1e-3, all below fla's (docs/kda-kernels.md §7 item 53)
    "bwd_storage_bf16": ["hs", "ut", "dse", "du"],
    # the scratch dq̂, dk̂ that `_bwd_vk` writes, `_bwd_k_block` finishes and `_bwd_norms` reads in bf16 for bf16
    # inputs (fp32 otherwise): half of their 3.2 GB of traffic at the K3 shape, two more roundings (session 26).
    # Session 28 run 2 at the K3 shape: fwd+bwd 9.951 → 9.694 ms (`_bwd_vk` 1.79 → 1.68, `_bwd_norms` 0.42 → 0.33,
    # `_bwd_k_block` 2.48 → 2.44); dq 3.7 → 4.3e-3, dk 3.7 → 4.4e-3 from fp64 at T = 8192 H = 4 (fla 4.9, 5.1e-3)
    "bwd_scratch_bf16": True,
    # dAqk and dAkk, which `_bwd_vv` writes and `_bwd_k_block` reads (each 16×16 block by eight programs), in bf16
    # for bf16 inputs (fp32 otherwise); `_bwd_k_block` multiplies them in tf32 as before. Session 27 run 1 at the
    # K3 shape: fwd+bwd 10.343 → 10.065 ms (`_bwd_k_block` 2.77 → 2.55, `_bwd_vv` 0.74 → 0.68); at T = 8192 H = 4
    # dq 3.6 → 3.7e-3, dA_log 3.6 → 3.4e-3, the rest within 0.1e-3 (docs/kda-kernels.md §7 item 58)
    "bwd_da_bf16": True,
    # `_bwd_vv` since dAkk = −Tᵀ·(dŨ·Ũᵀ) (session 27, no dT partials to sum): on value blocks of 64 at 2 stages
    # 0.74 → 0.69 ms at the K3 shape (run 1; 4 warps 0.78)
    "bwd_vv_bv": 64, "bwd_vv_warps": 8, "bwd_vv_stages": 2, "bwd_vv_maxnreg": 128,
    # `_bwd_vv`'s work done by `_bwd_vk`: the last of a chunk's key-slice programs to finish (an atomic count per chunk
    # and head) runs it on value blocks of bwd_vv_bv, at `_bwd_vk`'s launch, with dO, dŨ and Ũ still in L2 from its
    # siblings' loops (docs/kda-kernels.md §7 item 71). Untimed: off
    "bwd_vv_fused": False,
    # `_bwd_k_block` (session 13) per (16-row block, key slice of 32): capped at 72 registers (92 B of spills) for seven
    # programs per SM, 3.54 → 2.75 ms at the K3 shape (96: 3.26, 80: 2.96, 64: 2.77; runs 3-4). With bf16 dA
    # (session 27) 64 registers (100 B of spills, eight programs per SM): 2.53 → 2.48-2.49 ms in runs 3-4, the small
    # preset's layer 0.42 → 0.40; the default since run 5 (the GPU tests of the score backward passed under it)
    "bwd_k_cols": 32, "bwd_k_warps": 4, "bwd_k_stages": None, "bwd_k_maxnreg": 64,
    # `_bwd_k_block` on 32-row blocks anchored at their middle row (16: the prepare's blocks): half the neighbours'
    # loads (docs/kda-kernels.md §7 item 67; untimed: 16)
    "bwd_k_rows": 16,
    # (session 25: two row blocks per program, each neighbour's tiles loaded once for both, 3.56 ms at 128 registers,
    # 3.59 at 96, 3.94 at 80: deleted, commit 60f62a9 has it; 64-column slices on 8 warps 3.18. Session 27 run 4: one
    # program per (key slice, chunk) walking the four blocks, 2.53 → 2.72 ms at 96 registers, 2.80 at 128, 2.90 at 88:
    # deleted, commit 0386c48 has it)
    # `_bwd_gate` per (key slice of bwd_gate_cols, chunk, head): 0.38 ms at the K3 shape (128 columns: 0.51; run 1).
    # (Session 27 run 2 moved its cumsum and gate chain into `_bwd_vk`, run after `_bwd_k_block`: `_bwd_vk` 1.80 →
    # 3.13 ms, fwd+bwd 10.545 against ~10.0; reverted, §7 item 59)
    "bwd_gate_cols": 32, "bwd_gate_warps": 4, "bwd_gate_stages": None, "bwd_gate_maxnreg": None,
    # `_bwd_gate`'s work done by `_bwd_k_block`: the last of a chunk's row blocks to finish on a key slice (an atomic
    # count per chunk, head and slice) runs the reverse cumsum and the gate chain, on dG its siblings have just
    # written (read from L2), so the launch and dG's second trip to memory go (docs/kda-kernels.md §7 item 70; on
    # bwd_k_cols' slices, bwd_gate_cols then unused). Untimed: off
    "bwd_gate_fused": False,
    "bwd_norms_rows": 16, "bwd_norms_warps": 4, "bwd_norms_stages": None, "bwd_norms_maxnreg": None,
    "decode_bv": 64, "decode_warps": 4,
    # the inference forward (no backward can follow) in 16-token chunks (`triton_prefill.py`, session 14); False:
    # the training forward's kernels without their stores for a backward
    "prefill": True,
    # ... where the state pass has at least this many (value block, sequence, head) programs (`prefill_applies`)
    # ... or, with fewer (and at most prefill_chunk32_max_programs: 32-token chunks), where the layer has enough
    # token-heads (TT·H): [min programs, min token-heads, only where the pipeline below applies (one sequence)].
    # Session 22 runs 1, 2 and 5 (32-token chunks), against the 64-token kernels: 64 programs at 2^20 token-heads
    # (T = 32768 H = 32, pipelined) 2.63 against 3.80 ms, at 2^19 (B = 2 T = 16384 H = 16, not pipelined) 1.688
    # against 1.920, at 2^17 (B = 4 T = 4096 H = 8) 1.170 against 0.619;
    # 32 programs at 2^20 (T = 65536 H = 16) 4.401 pipelined, 5.139 not, against 5.186; 16 programs at 2^20
    # (T = 131072 H = 8) 7.999 pipelined against 7.904
    "prefill_min_programs": 128,
    "prefill_few_programs": [[64, 2 ** 19, False], [32, 2 ** 20, True]],
    # its chunk: 16 tokens, or 32 (two launches of `_prefill_prepare`, HALF 1 and 2) while the state pass has at most
    # prefill_chunk32_max_programs (value block, sequence, head) programs (`prefill_chunk_for`), else 16. With split
    # state products 32 won at one wave (K3 shape, 192 programs: 1.97 against 2.02 ms; session 15 run 3); with the
    # bf16 state products and tf32 inverses below, 16 won there (1.667 against 1.776 ms, H = 64 1.270 against
    # 1.267; session 21 run 3). As 4-segment pipelines (session 22 run 1): 192 programs 1.502 (16) against 1.709
    # (32), 128 1.094 against 1.170, 64 (T = 32768 H = 32) 3.377 against 2.705: 32 at a quarter of a wave
    "prefill_chunk": 32,
    "prefill_chunk32_max_programs": 64,
    # `_prefill_prepare`: 0.92 ms at the K3 shape uncapped (128 registers), 0.99 at 96 (session 14 run 3; before it
    # formed W and U, 96 registers won: 0.93 → 0.87, run 2)
    "prefill_prepare_warps": 4, "prefill_prepare_stages": None, "prefill_prepare_maxnreg": None,
    # ... its second launch at 32-token chunks (HALF 2, the join): 128 registers (68 B of spills offline, 4
    # programs per SM) 1.19 ms for both launches, uncapped (168, 3 per SM) 1.24, 8 warps 1.59 (session 15 run 2)
    "prefill_join_warps": 4, "prefill_join_stages": None, "prefill_join_maxnreg": 128,
    # `_prefill_state` per (value block, sequence, head): 1.26 ms at 2 stages, 1.08 at 3 (run 3); BV 32 2.64
    # and 8 warps 4.04 (run 1, then on P, K_d and V instead of W and U). Warps None: 4 per 64 value columns, at
    # least 4 (`_launch_options`). BV 128 on 8 warps (one program per (sequence, head): its two warpgroups share
    # the step's W, Q_d and K_r tiles) won in session 23 run 4 (K3 shape 1.338 against 1.379 ms) but lost in all
    # three timings of session 24 (runs 1-2, the configs' order rotated per round: 1.341 against 1.326, H = 64
    # 0.953 against 0.905; varlen and T = 32768 tie). prefill_min_programs, prefill_few_programs,
    # prefill_chunk32_max_programs and (below) prefill_pipeline_max_programs count programs at BV 64 whatever BV
    # launches (`_state_programs`)
    "prefill_state_bv": 64, "prefill_state_warps": None, "prefill_state_stages": 3, "prefill_state_maxnreg": None,
    # the prefill state pass in plain bf16 products for 16-bit inputs (its fp32 state rounded to bf16 as an operand,
    # FlashKDA's choice; fp32 inputs keep the split products): state pass 0.78 → 0.60 ms at 32-token chunks, 1.09 →
    # 0.83 at 16 (K3 shape); o 3.0 → 4.0e-3 from fp64 at 16-token chunks, 4.1e-3 at T = 32768 (limit 5e-3, fla
    # 5.4e-3; session 21 run 2)
    "prefill_state_bf16": True,
    # the products of the 16×16 inverses (`_inv16`) for 16-bit inputs: "tf32" (tensor cores) or "ieee" (exact FMA,
    # what fp32 inputs always take). tf32: `_prefill_prepare` 0.913 → 0.824 ms at 16-token chunks (no change at 32)
    # and `_prep_intra` 0.86 → 0.78, with the same errors from fp64 to two digits (A_log 2.2 → 2.5e-3; session 21
    # run 2). (U stored in bf16 lost there: the state pass 0.78 → 0.82 ms at 32, 1.09 → 1.22 at 16.)
    "prefill_inverse": "tf32",
    "prep_inverse": "tf32",
    # the inference forward as a pipeline of segments of chunks (`pipelined`, `prefill_segments_for`): each segment's
    # state pass (latency-bound, a few programs per SM) runs on a high-priority side stream beside the next segment's
    # prepare (throughput-bound), instead of after the whole prepare; one segment per prefill_segment_tokens tokens
    # of the layer, at most prefill_segments. Session 22 run 1 (16-token chunks; 1 / 2 / 4 / 8 segments): K3 shape
    # (192 programs) 1.655 / 1.537 / 1.502 / 1.523 ms, H = 64 1.260 / 1.135 / 1.094 / 1.089, T = 32768 H = 32
    # 3.835 / 3.523 / 3.377 / 3.331 (32-token chunks: 4 segments 2.738, 8 2.623, run 2); 16 segments lose (1.61,
    # 1.80)
    "prefill_segments": 8, "prefill_segment_tokens": 2048,
    # ... but with at least prefill_tail_min_programs state programs (None: more than the GPU has SMs), one per
    # prefill_tail_segment_tokens tokens, then shorter segments, each the given fraction of a regular one
    # (`segment_bounds`). There each segment's prepare outlasts its state pass (K3 shape: 317 against 186 µs), and the
    # last state pass runs alone after the whole prepare (155 µs), so a short last segment shortens the pipeline's
    # tail. Session 25 run 4, rotated, ms, equal segments / 4096 tokens + [0.5, 0.25]: K3 shape (192 programs) 1.319
    # / 1.290, H = 80 (160) 1.128 / 1.101, T = 16384 H = 96 2.611 / 2.578, H = 128 (256) 1.717 / 1.717; below
    # the threshold it loses: H = 64 (128) 0.903 / 0.908, T = 32768 H = 32 (64) 2.366 / 2.407
    "prefill_tail_min_programs": None, "prefill_tail_segment_tokens": 4096, "prefill_segment_tail": [0.5, 0.25],
    # ... only while the state pass has at most prefill_pipeline_max_programs (None: two per SM, one wave): with
    # several waves the state pass is throughput-bound itself, and the pipeline lost or tied (varlen6 / varlen8 at
    # H = 96, 1152 and 1536 programs: 1.722 / 1.630 ms alone, 1.748 / 1.748 at 4 segments, 1.738 / 1.637 at 2); and
    # with at least prefill_pipeline_min_work token-heads (TT·H): with little work the launches are the time (B = 4
    # T = 4096 H = 8, 2^17 token-heads: 4 segments 1.170 ms, 8 1.972)
    # ... and only for one sequence: segments cut the chunks in global order, so with several sequences a segment
    # holds few of them and the state pass walks them one after another (B = 2 T = 16384 H = 16: 2.246 ms in 8
    # segments against 1.688 in one; session 22 run 5)
    "prefill_pipeline_max_programs": None, "prefill_pipeline_min_work": 2 ** 19,
}
# (Sessions 11-12 had a "few programs" rule: BV 64 for the Ũ launch and 4-warp `_state_bwd` where the state passes
# had one to two programs per SM. The 3-stage launches above beat it there too, `_state` 0.52 → 0.43 ms at 8 × 4096,
# H = 8 (session 12 run 4), so the rule was deleted; commit 2f816f6 has it.)
# The code variants of the session-9 Nsight Compute analysis (docs/kda-ncu-session9.md), timed in session 9 run 4 at
# the K3 shape (docs/kda-kernels.md §6), are the only code now: the kept norms (`_load_norm`), `_bwd_vv`'s partials
# summed first, `_prep_intra`'s one anchor; with the launch settings above fwd+bwd 16.41 → 15.21 ms. A flush-to-zero
# exp (`libdevice.fast_expf`) in `_prep_intra`, `_bwd_vk` and `_bwd_k` lost (15.27 ms with it) and was deleted;
# session 13 brought it back (`_exp`) in `_prep_intra` and the new `_bwd_k_block` only, where it wins.
# Session 13 replaced the two-sweep `_bwd_k` (one program per key slice and chunk; commit 965a25b has it) by
# `_bwd_k_block` + `_bwd_gate`: fwd+bwd 14.01 → 11.65 ms at the K3 shape with the caps above (docs/kda-kernels.md
# §7 items 22-25).


def segment_bounds(n_chunks: int, segments: int, tail: Sequence[float] = ()) -> list[tuple[int, int]]:
    """[lo, hi) ranges of chunk indices that split n_chunks chunks into `segments` near-equal pipeline segments,
    followed by one shorter segment per entry of `tail` (its size as a fraction of a regular one), fewer if there
    are too few chunks. Every bound is even, so a chunk table sliced at it (two int32 per chunk) keeps the 16-byte
    alignment that Triton specialises kernels on."""
    pairs = -(-n_chunks // 2)
    weights = [1.0] * max(1, segments) + [float(w) for w in tail]
    if any(w <= 0 for w in weights):
        raise ValueError(f"segment tail fractions must be positive, got {list(tail)}")
    edges = [0.0, *itertools.accumulate(weights)]  # the last is sum(weights) exactly: the last cut is n_chunks
    cuts = [min(2 * round(pairs * e / edges[-1]), n_chunks) for e in edges]
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]


@functools.cache
def _side_stream(device: torch.device, thread: int) -> torch.cuda.Stream:
    """One per device and thread: a stream shared across threads would tie one thread's work (or CUDA graph capture)
    to another's."""
    return torch.cuda.Stream(device, priority=-1)  # the highest priority: its blocks are scheduled first


def pipelined(device: torch.device, n: int, produce, consume) -> None:
    """produce(i), then consume(i), for i in range(n), with consume(i) overlapping produce(i + 1): on CUDA the
    producers run on the current stream and the consumers, in order, on a high-priority side stream, each after its
    producer (an event); the current stream then waits for the side stream, so whatever follows (and the caching
    allocator's reuse of the memory both used) is ordered after all of it. Elsewhere (CPU, the Triton interpreter)
    the calls run in that order. Works under CUDA graph capture (the events become the graph's edges)."""
    if device.type != "cuda" or n <= 1:
        for i in range(n):
            produce(i)
            consume(i)
        return
    # Triton launches on the current device's current stream: make it the device's
    with torch.cuda.device(device):
        main, side = torch.cuda.current_stream(device), _side_stream(device, threading.get_ident())
        for i in range(n):
            produce(i)
            ready = torch.cuda.Event()
            ready.record(main)
            side.wait_event(ready)
            with torch.cuda.stream(side):
                consume(i)
        main.wait_stream(side)


def _launch_options(kernel: str, bv: int | None = None) -> dict:
    """num_warps, and num_stages / maxnreg where TUNING sets them, for one chunk kernel's launch. Warps None (for a
    kernel launched with value block bv): a warpgroup per 64 value columns, at least one."""
    warps = TUNING[f"{kernel}_warps"]
    if warps is None:
        if bv is None:
            raise ValueError(f"TUNING['{kernel}_warps'] is None: the warps follow the value block, which was not given")
        warps = 4 * max(bv // 64, 1)
    options = {"num_warps": warps}
    for key, option in (("stages", "num_stages"), ("maxnreg", "maxnreg")):
        if TUNING.get(f"{kernel}_{key}") is not None:
            options[option] = TUNING[f"{kernel}_{key}"]
    return options


@triton.jit
def _exp(x, INTERP: tl.constexpr):
    """exp(x) flushed to zero below fp32's normal range (ex2.approx.ftz, `libdevice.fast_expf`; tl.exp in the
    interpreter): it skips tl.exp's denormal scaling, three of its five instructions. The anchored factors are
    within e^±80, so a flushed result is a product that is below fp32's range anyway. `_bwd_k_block` 3.51 → 3.46
    ms, `_prep_intra` 0.88 → 0.85 at the K3 shape (session 13 run 2, session 9 run 4)."""
    if INTERP:
        return tl.exp(x)
    return libdevice.fast_expf(x)


@triton.jit
def _cast(x, dt: tl.constexpr, INTERP: tl.constexpr):
    """x.to(dt) with round-to-nearest-even; the interpreter truncates to bf16, so there it is done by hand."""
    if INTERP and dt == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def _mm(a, b, BF16: tl.constexpr, INTERP: tl.constexpr):
    """a @ b with fp32 accumulation: tf32 tensor cores on fp32 operands, or bf16 operands when BF16.

    The interpreter's bf16 dot is unusable, so there the bf16 rounding is emulated in fp32.
    """
    if BF16:
        if INTERP:
            return tl.dot(_cast(a, tl.bfloat16, INTERP).to(tl.float32), _cast(b, tl.bfloat16, INTERP).to(tl.float32))
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def _dot16(a, b, INTERP: tl.constexpr):
    """a @ b of two bf16 operands, fp32 accumulation (the interpreter has no bf16 dot: exact in fp32 there)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _dot_stored(a, b, INTERP: tl.constexpr):
    """a @ b on operands as stored, fp32 accumulation: plain bf16 products when both are bf16 (exact products of
    the stored values; the backward's bf16 storage, `backward_storage`), else tf32."""
    if a.dtype.is_bf16() and b.dtype.is_bf16():
        return _dot16(a, b, INTERP)
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def _split(x, INTERP: tl.constexpr):
    """x = hi + lo to about 16 mantissa bits, both bf16 (hi = x rounded to nearest)."""
    hi = _cast(x, tl.bfloat16, INTERP)
    return hi, _cast(x.to(tl.float32) - hi.to(tl.float32), tl.bfloat16, INTERP)


@triton.jit
def _mm_split(a, b, INTERP: tl.constexpr):
    """a @ b on bf16 tensor cores to about 16 mantissa bits (the state passes): an fp32 operand goes in as
    bf16 hi + lo, and the products hi·hi + hi·lo + lo·hi are summed in fp32; a bf16 operand is exact as it is.
    More accurate than tf32 (10 bits), and the bf16 tiles reach the tensor cores as loaded, where tf32 first
    converts them to fp32 in shared memory (Nsight Compute, session 9: most of `_state`'s instructions)."""
    if a.dtype.is_bf16():
        if b.dtype.is_bf16():
            return _dot16(a, b, INTERP)
        b_hi, b_lo = _split(b, INTERP)
        return _dot16(a, b_hi, INTERP) + _dot16(a, b_lo, INTERP)
    a_hi, a_lo = _split(a, INTERP)
    if b.dtype.is_bf16():
        return _dot16(a_hi, b, INTERP) + _dot16(a_lo, b, INTERP)
    b_hi, b_lo = _split(b, INTERP)
    return _dot16(a_hi, b_hi, INTERP) + (_dot16(a_hi, b_lo, INTERP) + _dot16(a_lo, b_hi, INTERP))


@triton.jit
def _state_mm(a, b, BF16: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """The state passes' products: `_mm_split` with SPLIT, else `_mm` (tf32, or plain bf16 with BF16)."""
    if SPLIT:
        return _mm_split(a, b, INTERP)
    return _mm(a, b, BF16, INTERP)


@triton.jit
def _bp(x, bos, L, i_h, row0, col0, H, W: tl.constexpr, C: tl.constexpr, BW: tl.constexpr):
    """Block pointer to rows row0 … row0+C−1 (of one document of length L starting at token bos), columns
    col0 … col0+BW−1, head i_h, of a [TT, H, W] tensor. Rows past L read as zero and are not written."""
    return tl.make_block_ptr(x + (bos * H + i_h) * W, (L, W), (H * W, 1), (row0, col0), (C, BW), (1, 0))


@triton.jit
def _chunk_coords(cu, chunk_idx, i_c, C: tl.constexpr):
    """Chunk i_c of the plan → (its document's first token, the document's length, the chunk's first row)."""
    n = tl.load(chunk_idx + 2 * i_c)
    row0 = tl.load(chunk_idx + 2 * i_c + 1) * C
    bos = tl.load(cu + n).to(tl.int64)
    return bos, tl.load(cu + n + 1) - tl.load(cu + n), row0


@triton.jit
def _sequence_coords(cu, chunk_off, i_nh, H, C: tl.constexpr):
    """(document, head) program i_nh → (head, first token, length, first chunk's index, number of chunks)."""
    n = i_nh // H
    bos = tl.load(cu + n).to(tl.int64)
    L = tl.load(cu + n + 1) - tl.load(cu + n)
    return i_nh % H, bos, L, tl.load(chunk_off + n).to(tl.int64), tl.cdiv(L, C)


@triton.jit
def _load_gamma(gc, c0, j, i_h, H, K: tl.constexpr, valid):
    """G_C [K] (or Γ_C) of chunk j of the sequence whose first chunk is c0, from gc [NT, H, K]; zeros unless
    valid (False for a sequence with no chunk, whose chunk index may lie past gc). `_prefill_state` and `_state_bwd`
    load it one step ahead, for their next step: Triton's pipeliner leaves this [K] load in its iteration, and
    waiting for it took 42% of the inference state pass's stall samples (ncu, session 23 run 1). Loaded ahead: the
    forward 1.52 → 1.38 ms at the K3 shape, `_state_bwd` 1.39 → 1.28 ms (run 2)."""
    return tl.load(gc + ((c0 + j) * H + i_h).to(tl.int64) * K + tl.arange(0, K), mask=valid, other=0.0)


@triton.jit
def _load_beta(b, bos, L, row0, i_h, H, C: tl.constexpr):
    """β = σ(b) for rows row0 … row0+C−1 of one document; 0 past its end."""
    p_b = tl.make_block_ptr(b + bos * H + i_h, (L,), (H,), (row0,), (C,), (0,))
    b_raw = tl.load(p_b, boundary_check=(0,), padding_option="zero").to(tl.float32)
    return tl.where(row0 + tl.arange(0, C) < L, tl.sigmoid(b_raw), 0.0)


@triton.jit
def _gate_inputs(z, A_log, dt_bias, bos, L, row0, c0, i_h, H, K: tl.constexpr, R: tl.constexpr, NC: tl.constexpr):
    """The gate's inputs on rows [row0, +R) and columns [c0, +NC) of one head: (z, exp(A), dt_bias slice);
    `_bwd_vk` loads them ahead of its value loop, `_gate_tile` right where it needs them."""
    z_raw = tl.load(_bp(z, bos, L, i_h, row0, c0, H, K, R, NC), boundary_check=(0,), padding_option="zero")
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    bias = tl.load(dt_bias + i_h * K + c0 + tl.arange(0, NC)).to(tl.float32)
    return z_raw, a, bias


@triton.jit
def _gate_from(z_raw, a, bias, valid, G_MIN: tl.constexpr):
    """(g, pre-activation x) from `_gate_inputs`: g = g_min·σ(exp(A)·(z + dt_bias)), zero on rows not valid."""
    x = a * (z_raw.to(tl.float32) + bias[None, :])
    return tl.where(valid[:, None], G_MIN * tl.sigmoid(x), 0.0), x


@triton.jit
def _gate_tile(z, A_log, dt_bias, bos, L, row0, c0, i_h, H, K: tl.constexpr, R: tl.constexpr, NC: tl.constexpr,
               G_MIN: tl.constexpr):
    """The lower-bounded gate on rows [row0, +R) and columns [c0, +NC) of one head: (g, pre-activation x,
    valid rows); g = g_min·σ(exp(A)·(z + dt_bias)), zero past the document end."""
    valid = row0 + tl.arange(0, R) < L
    z_raw, a, bias = _gate_inputs(z, A_log, dt_bias, bos, L, row0, c0, i_h, H, K, R, NC)
    g, x = _gate_from(z_raw, a, bias, valid, G_MIN)
    return g, x, valid


@triton.jit
def _mm16(a, b, PRECISION: tl.constexpr):
    """A 16×16 product at a chosen precision: "ieee" (exact FMA; its unswizzled operand reads are 3-5-way
    bank-conflicted, Nsight Compute session 15) or "tf32" (tensor cores, 10-bit operands; `_prefill_prepare` 0.913 →
    0.824 ms, `_prep_intra` 0.86 → 0.78 at the K3 shape, session 21). tf32x3 lost for the inverses (session 15)."""
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _mm32(a, b):
    """Exact-fp32 product of two 16×16 blocks, for `_prep_solve`'s off-diagonal blocks of T."""
    return _mm16(a, b, "ieee")


def _inverse_precision(kernel: str, dtype: torch.dtype) -> str:
    """The precision of `_inv16`'s products in `kernel` ("prefill" or "prep") for inputs of `dtype`:
    `TUNING["<kernel>_inverse"]` for 16-bit inputs, exact ("ieee") for fp32 ones."""
    value = TUNING[f"{kernel}_inverse"]
    if value not in ("ieee", "tf32"):
        raise ValueError(f"TUNING['{kernel}_inverse'] must be 'ieee' or 'tf32', got {value!r}")
    return value if dtype in (torch.bfloat16, torch.float16) else "ieee"


@triton.jit
def _inv16(A, BC: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower BC×BC block: A is nilpotent, so (I − A)(I + A²)(I + A⁴)(I + A⁸); the products
    at PRECISION (`_mm16`)."""
    r = tl.arange(0, BC)
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    A2 = _mm16(A, A, PRECISION)
    A4 = _mm16(A2, A2, PRECISION)
    return _mm16(_mm16(_mm16(eye - A, eye + A2, PRECISION), eye + A4, PRECISION), eye + _mm16(A4, A4, PRECISION),
                 PRECISION)


@triton.jit
def _store_block(x, ptr, bos, L, i_h, row0, col0, H, W: tl.constexpr, BC: tl.constexpr, INTERP: tl.constexpr):
    tl.store(_bp(ptr, bos, L, i_h, row0, col0, H, W, BC, BC), _cast(x, ptr.dtype.element_ty, INTERP),
             boundary_check=(0,))


@triton.jit
def _load_block(x, bos, L, i_h, row0, col0, H, W: tl.constexpr, BC: tl.constexpr):
    """The BC×BC block at (row0, col0) of a [TT, H, W] tensor; rows past the document end read as zero."""
    return tl.load(_bp(x, bos, L, i_h, row0, col0, H, W, BC, BC), boundary_check=(0,), padding_option="zero")


class _Plan:
    """Chunk bookkeeping for packed documents: offsets, (document, chunk) per global chunk, first chunk per document.

    Built on the host from ints and sent to the device in one non-blocking copy: planning never waits for
    the GPU. Plans are cached by their offsets (`make_plan`), so the layers of one forward share one.
    """

    def __init__(self, offsets: tuple[int, ...], device: torch.device, chunk: int = CHUNK):
        self.offsets = offsets
        self.chunk = chunk
        self.N = len(offsets) - 1
        counts = [-(-(e - s) // chunk) for s, e in zip(offsets[:-1], offsets[1:])]
        first = [0]
        for c in counts:
            first.append(first[-1] + c)
        self.NT = first[-1]
        pairs = [x for n, c in enumerate(counts) for j in range(c) for x in (n, j)] or [0, 0]
        # each table starts on a 16-byte boundary: Triton specialises kernels on pointer alignment
        pad = -(self.N + 1) % 4
        host = torch.tensor(list(offsets) + [0] * pad + first + [0] * pad + pairs, dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        packed = host.to(device, non_blocking=True)
        self._host = host  # kept: a CUDA graph captured with this plan copies from it at every replay
        n = self.N + 1 + pad
        self.cu = packed[: self.N + 1]
        self.chunk_off = packed[n: n + self.N + 1]  # [N+1]
        self.chunk_idx = packed[2 * n:].view(-1, 2)  # [NT, 2]


@functools.lru_cache(maxsize=16)
def _cached_plan(offsets: tuple[int, ...], device: torch.device, chunk: int) -> _Plan:
    return _Plan(offsets, device, chunk)


def plan_for(offsets: tuple[int, ...], device: torch.device, chunk: int = CHUNK) -> _Plan:
    """The plan of these document offsets in chunks of `chunk` tokens: cached, except while a CUDA graph is being
    captured (a graph keeps its own copy; a shared cached one could be freed under it)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _Plan(offsets, device, chunk)
    return _cached_plan(offsets, device, chunk)


def make_plan(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device,
              cu_seqlens_host: Sequence[int] | None = None) -> _Plan:
    """The plan for a [B, T] input, dense or packed by `cu_seqlens`. `cu_seqlens_host` (the same offsets as
    host ints, e.g. `SequenceLayout.offsets`) spares reading `cu_seqlens` back, which waits for the GPU."""
    if cu_seqlens is None:
        offsets = tuple(i * T for i in range(B + 1))
    elif cu_seqlens_host is not None:
        offsets = tuple(int(x) for x in cu_seqlens_host)
        if len(offsets) != cu_seqlens.numel():
            raise ValueError(f"cu_seqlens_host has {len(offsets)} offsets, cu_seqlens {cu_seqlens.numel()}")
        if B != 1 or offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seqlens_host must be non-decreasing from 0 to T={T} with B = 1, got B={B}, "
                             f"{offsets[0]} … {offsets[-1]}")
    else:
        offsets = tuple(document_offsets(cu_seqlens, B, T))
    return plan_for(offsets, device)


def _check_device(*xs: torch.Tensor) -> None:
    if not triton_runs_on(xs[0]):
        raise RuntimeError("chunk_kda runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1")
    if any(x.device != xs[0].device for x in xs):
        raise ValueError("all inputs must be on one device")


BACKWARD_STORED = ("hs", "ut", "dse", "du")


def backward_storage(dtype: torch.dtype, name: str, otherwise: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of one tensor the training forward or `_state_bwd` stores for the value-side backward ("hs": the
    chunk-start states, "ut": Ũ, "dse": dS_end, "du": dŨ): bf16 for bf16 inputs where TUNING["bwd_storage_bf16"]
    names it, else `otherwise` (fp32; Ũ passes U's dtype)."""
    chosen = TUNING["bwd_storage_bf16"]
    if not set(chosen) <= set(BACKWARD_STORED):
        raise ValueError(f"TUNING['bwd_storage_bf16'] names some of {BACKWARD_STORED}, got {chosen!r}")
    return torch.bfloat16 if dtype == torch.bfloat16 and name in chosen else otherwise


def backward_scratch(dtype: torch.dtype, switch: str) -> torch.dtype:
    """The dtype of a backward scratch tensor behind an on/off TUNING switch ("bwd_scratch_bf16": dq̂, dk̂;
    "bwd_da_bf16": dAqk, dAkk): bf16 for bf16 inputs where the switch is on, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 and TUNING[switch] else torch.float32


def inter_dtypes(dtype: torch.dtype, all_bf16: bool = False) -> tuple[torch.dtype, torch.dtype]:
    """Storage dtypes of the chunk operands: (W, Q⊙Γ, K⊙exp(G_C − G)) and (U, Aqk).

    U and Aqk multiply the state's corrections directly; rounding them to bf16 costs the most accuracy
    (docs/kda-kernels.md), so they stay fp32 unless `all_bf16` (a measured variant).
    """
    if dtype in (torch.bfloat16, torch.float16):
        return torch.bfloat16, (torch.bfloat16 if all_bf16 else torch.float32)
    return torch.float32, torch.float32
