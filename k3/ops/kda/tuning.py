"""Launch settings of the KDA Triton kernels, in one table (`TUNING`), and the options a launch takes from it.

Chosen for K = V = 128 on an H100/H200 (sm_90) from the compiler's register and spill report and timed
alternatives; docs/kda-kernels.md, "Launch settings", gives the measurement behind each line, "Variants tried"
what lost. Benchmarks and tests override entries (`benchmarks/kda.py --tuning`, `--compare`).

Per kernel: "<name>_warps", and optionally "<name>_stages" (software pipelining depth) and "<name>_maxnreg" (a
register cap per thread, so that more programs share an SM); None: Triton's default. The table ends with the
variants: alternative code paths that are built and tested in the interpreter but not yet timed on a GPU, so off.
"""

from __future__ import annotations

TUNING = {
    # the prepare (`chunk_prepare.py`)
    "prep_gate_warps": 1, "prep_gate_stages": None, "prep_gate_maxnreg": None,  # a light kernel: 1 warp beat 4
    "prep_intra_warps": 4, "prep_intra_stages": None, "prep_intra_maxnreg": 128,  # the cap beat 168 registers
    "prep_solve_warps": 4, "prep_solve_stages": None, "prep_solve_maxnreg": None,
    "prep_wu_warps": 4, "prep_wu_stages": None, "prep_wu_maxnreg": 128,  # no spills at the cap, and faster
    # the 16×16 inverses' products for 16-bit inputs: "tf32" (tensor cores; the same errors from fp64 to two
    # digits as exact FMA, and faster) or "ieee" (exact FMA, what fp32 inputs always take)
    "prep_inverse": "tf32",
    # the inference `_state` (`chunk_state.py`; no stores for a backward): 3 stages pipeline each step's loads
    "state_bv": 32, "state_warps": 4, "state_stages": 3, "state_maxnreg": None,
    # `_state` when it also stores Ũ (the training forward, the backward's recompute): the same, in split products
    "state_ut_bv": 32, "state_ut_warps": 4, "state_ut_stages": 3, "state_ut_maxnreg": None,
    # `_state`'s products split bf16 (`_mm_split`, ~16 mantissa bits): more accurate than tf32 and faster, since
    # the bf16 tiles reach the tensor cores as loaded
    "state_split": True,
    # ... also where no backward can follow, so an inference o is bit-identical to a training forward's
    "state_split_inference": True,
    # every state pass in plain bf16 products (`chunk_kda(state_bf16=True)`, fla's choice): faster, but dA_log's
    # error from fp64 reaches its limit; for timing
    "state_bf16": False,
    "state_bwd_bv": 32, "state_bwd_warps": 4, "state_bwd_stages": 3, "state_bwd_maxnreg": None,
    # `_state_bwd`'s products: "split" (more accurate than tf32 and faster), "tf32" or "bf16". Split and bf16 were
    # correct on the H200 only at 4 warps and 2-3 stages (1 stage miscompiled), so other launches are refused
    "state_bwd_products": "split",
    # the training forward's o from the bf16 chunk-start states and Ũ it stores anyway (`_fwd_o`,
    # `chunk_output.py`): `_state` then runs without Q⊙Γ and Aqk, in less shared memory
    "state_o_apart": True, "fwd_o_bv": 64, "fwd_o_warps": 4, "fwd_o_stages": None, "fwd_o_maxnreg": None,
    # the value-side backward (`chunk_bwd.py`): `_bwd_vk` per (key slice of bwd_vk_cols, chunk, head) holds one
    # program of ~255 registers per SM; 8 warps and 3 stages make every loop tile an async copy
    "bwd_vk_cols": 64, "bwd_vk_bv": 64, "bwd_vk_warps": 8, "bwd_vk_stages": 3, "bwd_vk_maxnreg": None,
    # ... where any of its loop tiles is fp32, twice the shared memory per stage: smaller value blocks
    "bwd_vk_fp32_bv": 32, "bwd_vk_fp32_stages": 4,
    # which of the chunk-start states ("hs"), Ũ ("ut"), dS_end ("dse") and dŨ ("du") are stored in bf16 for bf16
    # inputs (`backward_storage`; fla stores all four so): less traffic, errors still below fla's
    "bwd_storage_bf16": ["hs", "ut", "dse", "du"],
    # the scratch dq̂, dk̂ between the backward's kernels in bf16 for bf16 inputs: half their traffic for two more
    # roundings (dq, dk still below fla's error)
    "bwd_scratch_bf16": True,
    # dAqk and dAkk in bf16 for bf16 inputs: each 16×16 block is read by eight `_bwd_k_block` programs
    "bwd_da_bf16": True,
    "bwd_vv_bv": 64, "bwd_vv_warps": 8, "bwd_vv_stages": 2, "bwd_vv_maxnreg": 128,
    # the score backward per (16-row block, key slice of 32): the 64-register cap (some spills) fits eight
    # programs per SM, which beat fewer unspilled ones
    "bwd_k_cols": 32, "bwd_k_warps": 4, "bwd_k_stages": None, "bwd_k_maxnreg": 64,
    # `_bwd_gate` per (key slice of 32, chunk, head): 32-column slices beat 128
    "bwd_gate_cols": 32, "bwd_gate_warps": 4, "bwd_gate_stages": None, "bwd_gate_maxnreg": None,
    "bwd_norms_rows": 16, "bwd_norms_warps": 4, "bwd_norms_stages": None, "bwd_norms_maxnreg": None,
    # decode (`fused_recurrent.py`)
    "decode_bv": 64, "decode_warps": 4,
    # the inference forward (no backward can follow) in 16- or 32-token chunks (`chunk_prefill.py`); False: the
    # training forward's kernels without their stores for a backward
    "prefill": True,
    # ... where its state pass has at least this many (value block, sequence, head) programs: it fills the GPU
    "prefill_min_programs": 128,
    # ... or, with fewer, enough token-heads (TT·H): [min programs, min token-heads, only as a pipeline (one
    # sequence)]; with fewer programs and less work the 64-token kernels are faster
    "prefill_few_programs": [[64, 2 ** 19, False], [32, 2 ** 20, True]],
    # its chunk: 32 tokens (two launches of `_prefill_prepare`) while the state pass has at most
    # prefill_chunk32_max_programs programs, where it is latency-bound and half the sequential steps win; else 16,
    # whose smaller products and skipped join win once the pass is throughput-bound
    "prefill_chunk": 32,
    "prefill_chunk32_max_programs": 64,
    "prefill_prepare_warps": 4, "prefill_prepare_stages": None, "prefill_prepare_maxnreg": None,
    # the join of a 32-token chunk's halves (`_prefill_prepare` HALF 2): the cap fits four programs per SM
    "prefill_join_warps": 4, "prefill_join_stages": None, "prefill_join_maxnreg": 128,
    # `_prefill_state` per (value block of 64, sequence, head), 3 stages; warps None: a warpgroup per 64 value
    # columns. The dispatch thresholds above count programs at BV 64 whatever BV launches (`_state_programs`)
    "prefill_state_bv": 64, "prefill_state_warps": None, "prefill_state_stages": 3, "prefill_state_maxnreg": None,
    # the prefill state pass in plain bf16 products for 16-bit inputs (FlashKDA's choice): faster, and o stays
    # within its tolerance and below fla's error; fp32 inputs keep the split products
    "prefill_state_bf16": True,
    "prefill_inverse": "tf32",  # as prep_inverse, for `_prefill_prepare`
    # the inference forward as a pipeline of segments of chunks (`pipelined`): each segment's state pass
    # (latency-bound) on a high-priority side stream beside the next segment's prepare (throughput-bound); one
    # segment per prefill_segment_tokens tokens, at most prefill_segments
    "prefill_segments": 8, "prefill_segment_tokens": 2048,
    # ... with at least prefill_tail_min_programs state programs (None: more than the GPU has SMs) each segment's
    # prepare outlasts its state pass, so the last segments are shorter (fractions of a regular one) to shorten the
    # pipeline's tail; then one regular segment per prefill_tail_segment_tokens tokens
    "prefill_tail_min_programs": None, "prefill_tail_segment_tokens": 4096, "prefill_segment_tail": [0.5, 0.25],
    # ... only while the state pass fits in one wave (None: two programs per SM; beyond, it is throughput-bound
    # itself), with at least prefill_pipeline_min_work token-heads (with little work the launches are the time),
    # and for one sequence (segments cut the chunks in global order: several sequences would take turns)
    "prefill_pipeline_max_programs": None, "prefill_pipeline_min_work": 2 ** 19,

    # Variants: alternative code paths, built and tested in the interpreter, off until timed on a GPU. Each line
    # gives the predicted change of fwd+bwd at the K3 shape (docs/kda-kernels.md, "Variants tried").
    # `_state_bwd` on Q′ = Q⊙Γ − Aqk·W, without Aqk's tile and product in its chain: −0.05 to −0.3 ms
    "state_bwd_qprime": False,
    # `_fwd_o` as one program per (chunk, head) walking the value blocks, Q⊙Γ and Aqk loaded once: −0.03 to −0.1 ms
    "fwd_o_loop": False,
    # 32: `_bwd_k_block` on 32-row blocks, half the neighbours' loads against fewer programs per SM: a toss-up
    "bwd_k_rows": 16,
    # the norm backward's sums over K from the scores in `_bwd_vv` (Euler's identity), so no `_bwd_norms`: −0.2 ms
    "norms_from_scores": False,
    # `_bwd_gate`'s work done by the last `_bwd_k_block` program per chunk and key slice, no launch: −0.2 ms
    "bwd_gate_fused": False,
    # `_bwd_vv`'s work done by the last `_bwd_vk` program per chunk, no launch: −0.25 ms
    "bwd_vv_fused": False,
}


def _launch_options(kernel: str, bv: int | None = None) -> dict:
    """num_warps, and num_stages / maxnreg where TUNING sets them, for one kernel's launch. Warps None (for a
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
