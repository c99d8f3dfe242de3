"""`chunk_kda`: Triton kernels for chunked KDA on raw layer inputs (training and prefill), forward and backward.

A forward that no backward can follow goes to `triton_prefill.py` (32- or 16-token chunks) where it fills the GPU
(`prefill_applies`); the kernels here serve training, and inference at few (value block, sequence, head) programs.
Launch settings (`TUNING`), the shared device helpers and the chunk plan live in `triton_common.py`.

The math is the UT-transform chunked form of docs/kda.md §3; the kernel design, the numerics and every
measured variant are in docs/kda-kernels.md. In short:

- The gate g = g_min·σ(exp(A)·(z + dt_bias)), the q/k L2 norms (and q's scale) and β = σ(b) are computed
  inside the kernels from the raw inputs, never materialised.
- Chunks are C = 64 tokens, split into four 16-row blocks. Inside a block the pairwise decays
  exp(G[r] − G[i]) are factorised around the block's first row (both factors within e^{±75} because
  g ≥ −5); across blocks around the later (row) block's first row in the prepare, and also the earlier block's
  last row in the backward (all factors ≤ 1). So every score block
  is a tensor-core matmul (docs/kda.md §4). (I + Akk)⁻¹ comes from the four 16×16 diagonal inverses
  (A nilpotent: (I − A)(I + A²)(I + A⁴)(I + A⁸); tf32 products for 16-bit inputs, exact fp32 for fp32 ones:
  `TUNING["prep_inverse"]`) and T_RJ = −T_RR·Σ Akk_RM·T_MJ.
- Forward: `_prep_gate` writes the in-chunk cumulative gate G (fp32), G_C and ‖k‖; `_prep_intra` (one program per
  16-row block) the Q⊙Γ rows, Aqk and T's storage (the diagonal inverses, Akk below them); `_prep_solve` turns
  that into T in place; `_prep_wu` (column slices) writes W, U and K⊙exp(G_C − G). All run over every chunk in
  parallel. `_state` then walks each sequence's chunks in order with the state in registers, split over value
  blocks, and writes the output (and, on request, the state at every chunk start and Ũ = U − W·S). A training
  forward that keeps them in bf16 writes o afterwards from them instead (`_fwd_o`, `TUNING["state_o_apart"]`):
  `_state` is faster without o's tiles and products even though nothing in its chain waits for o.
- Backward: by default (`save_intermediates`) the forward keeps W, Q⊙Γ, K⊙exp(G_C − G), Aqk, G_C, G, T, the
  chunk-start states and Ũ, at ~1.9 GiB per layer at the K3 shape (`chunk_kda`'s docstring); with the switch
  off only the raw inputs are saved and the prepare kernels and `_state` run again. Then `_state_bwd` walks the
  chunks backwards for the state gradient; `_bwd_vk` (per key slice) and `_bwd_vv` (per chunk: dAqk, dv and
  dAkk = −Tᵀ·(dŨ·Ũᵀ), which needs no key side) gather everything that contracts over the value dim;
  `_bwd_k_block` (per 16-row block and key slice) the score backward, in the prepare's blocks and anchors;
  `_bwd_gate` (per key slice and chunk) the reverse cumsum and the gate chain; `_bwd_norms` (per row) the two sums
  over K that remain, the q/k norm backward and dβ's σ'. (`TUNING["norms_from_scores"]` takes those sums from the
  scores in `_bwd_vv` instead, so `_bwd_k_block` finishes dq and dk and `_bwd_norms` does not run;
  `TUNING["bwd_gate_fused"]` has the last of a chunk's row blocks on each key slice run `_bwd_gate`'s work, and
  `TUNING["bwd_vv_fused"]` the last of a chunk's `_bwd_vk` programs `_bwd_vv`'s.)

Intermediates are stored in bf16 for bf16 inputs except U and Aqk (fp32 unless all_bf16) and G and T (fp32); the
chunk-start states, Ũ, dS_end and dŨ that the value-side backward reads are bf16 as TUNING["bwd_storage_bf16"]
names them (all four by default), and multiplied there as stored; the states carried by the state passes and all
accumulators are fp32; the state passes' products (`_state`, `_state_bwd`) are split bf16 (about 16 mantissa bits,
`_mm_split`), other fp32 operands multiply in tf32, bf16 score blocks in bf16.
Everything is indexed by packed document offsets (`cu_seqlens`, fla's convention); a dense batch is B
equal-length documents. On CPU the same kernels run in the Triton interpreter (`TRITON_INTERPRET=1`, set
before triton is imported).

Legend: B batch, T tokens, TT = B·T, H heads, K key dim, V value dim, N sequences, NT chunks, C chunk size,
BC sub-block (16 rows), NB = C/BC sub-blocks, BV value block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3.ops import interpreting
from k3.ops.kda.triton_common import (CHUNK, SUB, TUNING, _bp, _cast, _check_device, _chunk_coords, _dot_stored,
                                      _exp, _gate_from, _gate_inputs, _gate_tile, _inv16, _inverse_precision,
                                      _launch_options, _load_beta, _load_block, _load_gamma, _mm, _mm32,
                                      _sequence_coords, _state_mm, _store_block, backward_scratch, backward_storage,
                                      inter_dtypes, make_plan)
from k3.ops.kda.triton_prefill import prefill_applies, prefill_forward


@triton.jit
def _solve_below_diagonal(T00, T11, T22, T33, A10, A20, A21, A30, A31, A32):
    """The blocks below the diagonal of T = (I + Akk)⁻¹ from its diagonal blocks T_RR and Akk's blocks below
    the diagonal: T_RJ = −T_RR·Σ_{J≤M<R} Akk_RM·T_MJ (`_prep_solve`)."""
    T10 = -_mm32(T11, _mm32(A10, T00))
    T21 = -_mm32(T22, _mm32(A21, T11))
    T20 = -_mm32(T22, _mm32(A20, T00) + _mm32(A21, T10))
    T32 = -_mm32(T33, _mm32(A32, T22))
    T31 = -_mm32(T33, _mm32(A31, T11) + _mm32(A32, T21))
    T30 = -_mm32(T33, _mm32(A30, T00) + _mm32(A31, T10) + _mm32(A32, T20))
    return T10, T20, T21, T30, T31, T32


# forward kernels


@triton.jit
def _row_norm(x, bos, L, row0, i_h, H, K: tl.constexpr, BC: tl.constexpr):
    """sqrt(‖x_r‖² + 1e-6) for the BC rows at row0 (zero rows past the document end give 1e-3)."""
    xr = tl.load(_bp(x, bos, L, i_h, row0, 0, H, K, BC, K), boundary_check=(0,), padding_option="zero")
    xr = xr.to(tl.float32)
    return tl.sqrt(tl.sum(xr * xr, 1) + 1e-6)


@triton.jit
def _diag_scores(qs, ks, kc, BC: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr):
    """Diagonal 16×16 blocks of Ã (Akk before its β scaling, strictly lower) and Aqk (lower incl. the diagonal).

    With bf16 inputs the operands are bf16: a 16-row operand is replicated in every warp of the dot and
    in tf32 the kernel spilled registers (docs/kda-kernels.md); bf16 keeps e^±75 (fp32's exponent range).
    """
    r = tl.arange(0, BC)
    kcT = tl.trans(kc)
    At = tl.where(r[:, None] > r[None, :], _mm(ks, kcT, BF16, INTERP), 0.0)
    Aqk = tl.where(r[:, None] >= r[None, :], _mm(qs, kcT, BF16, INTERP), 0.0)
    return At, Aqk


# the prepare: `_prep_gate` (G, G_C, ‖k‖), `_prep_intra` (Q⊙Γ, Aqk, T's diagonal blocks and Akk below them),
# `_prep_solve` (T in place), `_prep_wu` (W, U, K⊙exp(G_C − G)); docs/kda-kernels.md §7 items 10 and 12


@triton.jit
def _prep_gate(k, z, A_log, dt_bias, cu, chunk_idx, g_out, gc_out, kn_out,
               H, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, G_MIN: tl.constexpr):
    """One (chunk, head): the in-chunk cumulative gate G [TT, H, K] fp32, G_C and ‖k‖ per row.

    G is summed per 16-row block, continuing from the previous block's last row. Rows past the document end
    have g = 0 and are not written; G_C is G at the chunk's last valid row.
    """
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    last = tl.arange(0, BC)[:, None] == BC - 1
    carry = tl.zeros([K], dtype=tl.float32)
    for J in tl.static_range(C // BC):
        r0 = row0 + J * BC
        g, _, _ = _gate_tile(z, A_log, dt_bias, bos, L, r0, 0, i_h, H, K, BC, K, G_MIN)
        G = carry[None, :] + tl.cumsum(g, 0)
        tl.store(_bp(g_out, bos, L, i_h, r0, 0, H, K, BC, K), G, boundary_check=(0,))
        tl.store(tl.make_block_ptr(kn_out + bos * H + i_h, (L,), (H,), (r0,), (BC,), (0,)),
                 _row_norm(k, bos, L, r0, i_h, H, K, BC), boundary_check=(0,))
        carry = tl.sum(tl.where(last, G, 0.0), 0)
    # G_C from the last tile's last row (a 1D store of `carry` made the compiler compute the gate twice)
    p_gc = gc_out + (i_c * H + i_h).to(tl.int64) * K + tl.arange(0, K)[None, :] + tl.zeros([BC, 1], dtype=tl.int32)
    tl.store(p_gc, G, mask=last)


@triton.jit
def _intra_row_block(qh, kh, beta, G, a, bos, L, i_h, r0, R, qg_out, aqk_out, t_out, at_out,
                     H, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, SCORES_BF16: tl.constexpr,
                     INVERSE: tl.constexpr, STORE_AT: tl.constexpr, INTERP: tl.constexpr):
    """Row block R's own part of `_prep_intra`: its rows of Q⊙Γ, its diagonal blocks of Aqk and of T's storage
    ((I + Akk_RR)⁻¹), zeros right of them, and with STORE_AT Ã_RR; returns the anchored qs = q̂⊙exp(G − a),
    ks = k̂⊙exp(G − a) for the off-diagonal blocks."""
    tl.store(_bp(qg_out, bos, L, i_h, r0, 0, H, K, BC, K),
             _cast(qh * _exp(G, INTERP), qg_out.dtype.element_ty, INTERP), boundary_check=(0,))
    rf = _exp(G - a[None, :], INTERP)
    qs = qh * rf
    ks = kh * rf
    Atd, Qdd = _diag_scores(qs, ks, kh * _exp(a[None, :] - G, INTERP), BC, SCORES_BF16, INTERP)
    _store_block(Qdd, aqk_out, bos, L, i_h, r0, R * BC, H, C, BC, INTERP)
    _store_block(_inv16(beta[:, None] * Atd, BC, INVERSE), t_out, bos, L, i_h, r0, R * BC, H, C, BC, INTERP)
    if STORE_AT:
        _store_block(Atd, at_out, bos, L, i_h, r0, R * BC, H, C, BC, INTERP)
    # zeros right of the diagonal block (Aqk and T are read back as 64×64 tiles), one masked store each
    rows = r0 + tl.arange(0, BC)
    cols = tl.arange(0, C)
    off = ((bos + rows).to(tl.int64) * H + i_h)[:, None] * C + cols[None, :]
    upper = (rows < L)[:, None] & (cols >= (R + 1) * BC)[None, :]
    zeros = tl.zeros([BC, C], dtype=tl.float32)
    tl.store(aqk_out + off, zeros.to(aqk_out.dtype.element_ty), mask=upper)
    tl.store(t_out + off, zeros, mask=upper)
    return qs, ks


@triton.jit
def _g_block(g_in, bos, L, i_h, r0, c0, H, K: tl.constexpr, SK: tl.constexpr, BC: tl.constexpr,
             AO: tl.constexpr = 0):
    """The prepare's G ([TT, H, K] fp32) on the BC rows at r0 of one document, columns [c0, c0 + SK), with its
    anchor a (G at row AO of the block, or at its last row before the document end if that comes first; the first
    row by default) and end e (G at the last row before the document end): loaded, not reduced. Rows past the end
    take G = a, so every factor exp(±(G − a)) there is 1 (q̂ = k̂ = 0 on them)."""
    ck = c0 + tl.arange(0, SK)
    G = tl.load(_bp(g_in, bos, L, i_h, r0, c0, H, K, BC, SK), boundary_check=(0,), padding_option="zero")
    a = tl.load(g_in + ((bos + tl.minimum(r0 + AO, L - 1)) * H + i_h).to(tl.int64) * K + ck)
    e = tl.load(g_in + ((bos + tl.minimum(r0 + BC, L) - 1) * H + i_h).to(tl.int64) * K + ck)
    return tl.where((r0 + tl.arange(0, BC) < L)[:, None], G, a[None, :]), a, e


@triton.jit
def _gate_rows(g_in, kn_in, bos, L, row0, i_h, H, K: tl.constexpr, BC: tl.constexpr):
    """The 16 rows at row0 of G (zeros past the document end), G at their first row (zeros past the end) and
    ‖k‖ (1 past the end: k there is zero, and k̂ must be too). (`_g_block` is the backward's column-slice form with
    the past-the-end rows set and the block's end; used here it cost `_prep_intra` 87 SASS instructions and 4 B of
    spills offline, in the off-diagonal walk that needs neither, so the forward keeps this one.)"""
    r = row0 + tl.arange(0, BC)
    G = tl.load(_bp(g_in, bos, L, i_h, row0, 0, H, K, BC, K), boundary_check=(0,), padding_option="zero")
    first = tl.load(g_in + ((bos + row0) * H + i_h) * K + tl.arange(0, K), mask=row0 < L, other=0.0)
    kn = tl.load(tl.make_block_ptr(kn_in + bos * H + i_h, (L,), (H,), (row0,), (BC,), (0,)), boundary_check=(0,),
                 padding_option="zero")
    return G, first, tl.where(r < L, kn, 1.0)


@triton.jit
def _intra_off_step(k, g_in, kn_in, bos, L, row0, J, i_h, qs, ks, beta, a, r0, aqk_out, t_out, at_out,
                    H, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, SCORES_BF16: tl.constexpr,
                    STORE_AT: tl.constexpr, INTERP: tl.constexpr):
    """Blocks (R, J < R) of Aqk and of Akk (β-scaled, into T's storage; with STORE_AT Ã before the scaling into
    at_out) from block J's G and ‖k‖ as `_prep_gate` stored them, around one anchor, the row block's first row:
    exp(G[r] − G[i]) = exp(G[r] − a_R)·exp(a_R − G[i]), both ≤ 1 (G does not increase and i < r0), so the row
    operands qs, ks are the same for every J (with bf16 scores `_prep_intra` rounds them once); a factor that
    underflows to 0 (a_R − G[i] down to −5·48) bounds a true product that is below fp32's range anyway. (Two
    anchors, exp(a_R − e_J)·exp(e_J − G[i]) around block J's last row as `_bwd_k_block` does: 0.98 ms against 0.88,
    session 9 run 4.)"""
    rJ = row0 + J * BC
    GJ, _, knJ = _gate_rows(g_in, kn_in, bos, L, rJ, i_h, H, K, BC)
    k_raw = tl.load(_bp(k, bos, L, i_h, rJ, 0, H, K, BC, K), boundary_check=(0,), padding_option="zero")
    kJ = k_raw.to(tl.float32) / knJ[:, None]
    kT = tl.trans(kJ * _exp(a[None, :] - GJ, INTERP))
    At = _mm(ks, kT, SCORES_BF16, INTERP)
    Aqk = _mm(qs, kT, SCORES_BF16, INTERP)
    _store_block(Aqk, aqk_out, bos, L, i_h, r0, J * BC, H, C, BC, INTERP)
    _store_block(beta[:, None] * At, t_out, bos, L, i_h, r0, J * BC, H, C, BC, INTERP)
    if STORE_AT:
        _store_block(At, at_out, bos, L, i_h, r0, J * BC, H, C, BC, INTERP)


@triton.jit
def _prep_intra(q, k, b, g_in, kn_in, cu, chunk_idx, qg_out, aqk_out, t_out, qn_out, at_out,
                scale, H, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                SCORES_BF16: tl.constexpr, STORE_QN: tl.constexpr, INVERSE: tl.constexpr, STORE_AT: tl.constexpr,
                INTERP: tl.constexpr):
    """One (16-row block R, chunk, head), on `_prep_gate`'s G and ‖k‖: block R's rows of Q⊙Γ, of Aqk (zeros
    right of the diagonal block) and of T's storage: Akk_RJ (β-scaled) left of the diagonal, (I + Akk_RR)⁻¹ on
    it, zeros right of it. The off-diagonal blocks take one walk over the blocks J < R (G_J, k̂_J; re-reads that
    hit L1/L2; `_intra_off_step`). `_prep_solve` then turns T's storage into T. STORE_QN: also ‖q‖ into qn_out
    [TT, H] for the backward (`_load_norm`). STORE_AT: also Ã (Akk before its β scaling) into at_out [TT, H, C],
    its diagonal blocks with zeros on and above their diagonal and nothing right of them, for the backward's sums
    from the scores (`TUNING["norms_from_scores"]`, `_bwd_vv`)."""
    NB: tl.constexpr = C // BC
    pid = tl.program_id(0)
    i_c = pid // NB
    R = pid % NB
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    r0 = row0 + R * BC
    # a block past the document end writes nothing (and its anchor, read as 0, would overflow exp(a − G_J))
    if r0 >= L:
        return
    G, a, k_n = _gate_rows(g_in, kn_in, bos, L, r0, i_h, H, K, BC)
    valid = r0 + tl.arange(0, BC) < L
    # rows past the document end (q̂ = k̂ = 0): G = a keeps exp(±(G − a)) at 1; the zeros read there would give
    # exp(−a), up to e^320 = inf, and inf·0 = NaN in the score dots
    G = tl.where(valid[:, None], G, a[None, :])
    q_raw = tl.load(_bp(q, bos, L, i_h, r0, 0, H, K, BC, K), boundary_check=(0,), padding_option="zero")
    k_raw = tl.load(_bp(k, bos, L, i_h, r0, 0, H, K, BC, K), boundary_check=(0,), padding_option="zero")
    q_raw = q_raw.to(tl.float32)
    q_n = tl.sqrt(tl.sum(q_raw * q_raw, 1) + 1e-6)
    if STORE_QN:
        tl.store(tl.make_block_ptr(qn_out + bos * H + i_h, (L,), (H,), (r0,), (BC,), (0,)), q_n, boundary_check=(0,))
    qh = q_raw / q_n[:, None] * scale
    kh = k_raw.to(tl.float32) / k_n[:, None]
    beta = _load_beta(b, bos, L, r0, i_h, H, BC)
    qs, ks = _intra_row_block(qh, kh, beta, G, a, bos, L, i_h, r0, R, qg_out, aqk_out, t_out, at_out, H, K, C, BC,
                              SCORES_BF16, INVERSE, STORE_AT, INTERP)
    if SCORES_BF16:
        # the row operands of every off-diagonal block, rounded once (`_mm` leaves bf16 operands as they are)
        qs = _cast(qs, tl.bfloat16, INTERP)
        ks = _cast(ks, tl.bfloat16, INTERP)
    if INTERP:
        J = 0
        while J < R:
            _intra_off_step(k, g_in, kn_in, bos, L, row0, J, i_h, qs, ks, beta, a, r0, aqk_out, t_out, at_out,
                            H, K, C, BC, SCORES_BF16, STORE_AT, INTERP)
            J += 1
    else:
        for J in range(0, R):
            _intra_off_step(k, g_in, kn_in, bos, L, row0, J, i_h, qs, ks, beta, a, r0, aqk_out, t_out, at_out,
                            H, K, C, BC, SCORES_BF16, STORE_AT, INTERP)


@triton.jit
def _prep_solve(t_out, cu, chunk_idx, H, C: tl.constexpr, BC: tl.constexpr, INTERP: tl.constexpr):
    """One (chunk, head): T's storage (Akk_RJ below the diagonal, T_RR on it, from `_prep_intra`) into T in
    place: T_RJ = −T_RR·Σ_{J≤M<R} Akk_RM·T_MJ."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    T00 = _load_block(t_out, bos, L, i_h, row0, 0, H, C, BC)
    T11 = _load_block(t_out, bos, L, i_h, row0 + BC, BC, H, C, BC)
    T22 = _load_block(t_out, bos, L, i_h, row0 + 2 * BC, 2 * BC, H, C, BC)
    T33 = _load_block(t_out, bos, L, i_h, row0 + 3 * BC, 3 * BC, H, C, BC)
    A10 = _load_block(t_out, bos, L, i_h, row0 + BC, 0, H, C, BC)
    A20 = _load_block(t_out, bos, L, i_h, row0 + 2 * BC, 0, H, C, BC)
    A21 = _load_block(t_out, bos, L, i_h, row0 + 2 * BC, BC, H, C, BC)
    A30 = _load_block(t_out, bos, L, i_h, row0 + 3 * BC, 0, H, C, BC)
    A31 = _load_block(t_out, bos, L, i_h, row0 + 3 * BC, BC, H, C, BC)
    A32 = _load_block(t_out, bos, L, i_h, row0 + 3 * BC, 2 * BC, H, C, BC)
    T10, T20, T21, T30, T31, T32 = _solve_below_diagonal(T00, T11, T22, T33, A10, A20, A21, A30, A31, A32)
    # every load above comes before any overwrite, in every thread of the program
    tl.debug_barrier()
    _store_block(T10, t_out, bos, L, i_h, row0 + BC, 0, H, C, BC, INTERP)
    _store_block(T20, t_out, bos, L, i_h, row0 + 2 * BC, 0, H, C, BC, INTERP)
    _store_block(T21, t_out, bos, L, i_h, row0 + 2 * BC, BC, H, C, BC, INTERP)
    _store_block(T30, t_out, bos, L, i_h, row0 + 3 * BC, 0, H, C, BC, INTERP)
    _store_block(T31, t_out, bos, L, i_h, row0 + 3 * BC, BC, H, C, BC, INTERP)
    _store_block(T32, t_out, bos, L, i_h, row0 + 3 * BC, 2 * BC, H, C, BC, INTERP)


@triton.jit
def _prep_wu(k, v, b, g_in, gc_in, cu, chunk_idx, t_in, kn_in, w_out, u_out, kd_out, qg_in, aqk_in, qp_out,
             H, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr,
             QPRIME: tl.constexpr, INTERP: tl.constexpr):
    """One (column slice s, chunk, head), on T and `_prep_gate`'s G, G_C and ‖k‖. Slices s < K/SK: columns
    [s·SK, +SK) of W = T·diag(β)(K⊙Γ) and K⊙exp(G_C − G), and with QPRIME of Q′ = Q⊙Γ − Aqk·W (from `_prep_intra`'s
    Q⊙Γ and Aqk and W before its rounding; qp_out may be qg_in: each slice is read before it is written) for
    `_state_bwd` (`TUNING["state_bwd_qprime"]`); the others: columns of U = T·diag(β)V."""
    NS: tl.constexpr = K // SK + V // SV
    pid = tl.program_id(0)
    i_c = pid // NS
    s = pid % NS
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    beta = _load_beta(b, bos, L, row0, i_h, H, C)
    Tm = tl.load(_bp(t_in, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
    if s < K // SK:
        c0 = s * SK
        valid = row0 + tl.arange(0, C) < L
        k_raw = tl.load(_bp(k, bos, L, i_h, row0, c0, H, K, C, SK), boundary_check=(0,), padding_option="zero")
        k_n = tl.load(tl.make_block_ptr(kn_in + bos * H + i_h, (L,), (H,), (row0,), (C,), (0,)),
                      boundary_check=(0,), padding_option="zero")
        kh = k_raw.to(tl.float32) / tl.where(valid, k_n, 1.0)[:, None]
        # zeros past the document end: exp(0) = 1 meets k̂ = β = 0 there
        G = tl.load(_bp(g_in, bos, L, i_h, row0, c0, H, K, C, SK), boundary_check=(0,), padding_option="zero")
        gc = tl.load(gc_in + (i_c * H + i_h).to(tl.int64) * K + c0 + tl.arange(0, SK))
        W = tl.dot(Tm, beta[:, None] * kh * tl.exp(G))
        tl.store(_bp(w_out, bos, L, i_h, row0, c0, H, K, C, SK), _cast(W, w_out.dtype.element_ty, INTERP),
                 boundary_check=(0,))
        tl.store(_bp(kd_out, bos, L, i_h, row0, c0, H, K, C, SK),
                 _cast(kh * tl.exp(gc[None, :] - G), kd_out.dtype.element_ty, INTERP), boundary_check=(0,))
        if QPRIME:
            Aq = tl.load(_bp(aqk_in, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,),
                         padding_option="zero").to(tl.float32)
            p_q = _bp(qg_in, bos, L, i_h, row0, c0, H, K, C, SK)
            Qp = tl.load(p_q, boundary_check=(0,), padding_option="zero").to(tl.float32) - tl.dot(Aq, W)
            tl.store(_bp(qp_out, bos, L, i_h, row0, c0, H, K, C, SK), _cast(Qp, qp_out.dtype.element_ty, INTERP),
                     boundary_check=(0,))
    else:
        c0 = (s - K // SK) * SV
        v_t = tl.load(_bp(v, bos, L, i_h, row0, c0, H, V, C, SV), boundary_check=(0,), padding_option="zero")
        U = tl.dot(Tm, beta[:, None] * v_t.to(tl.float32))
        tl.store(_bp(u_out, bos, L, i_h, row0, c0, H, V, C, SV), _cast(U, u_out.dtype.element_ty, INTERP),
                 boundary_check=(0,))


@triton.jit
def _state_step(S, j, w, u, qg, kd, aqk, gc, o, hs, ut, bos, L, c0, i_h, i_v, off_s,
                H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                STORE_HS: tl.constexpr, WRITE_O: tl.constexpr, STORE_UT: tl.constexpr, BF16: tl.constexpr,
                SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """Chunk j of one sequence in `_state`; returns the state after it. STORE_UT: also store Ũ (for the
    backward's `_bwd_vk` / `_bwd_vv`; a separate specialisation, so the inference forward compiles without it).
    G_C is loaded in the step: loaded one step ahead (`_load_gamma`, as `_state_bwd` and `_prefill_state` do) this
    launch took 1.30 → 1.57 ms at the K3 shape (session 23 run 2), where the load was already behind two products."""
    row0 = j * C
    W = tl.load(_bp(w, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    Kd = tl.load(_bp(kd, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    U = tl.load(_bp(u, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
    g_end = tl.load(gc + ((c0 + j) * H + i_h) * K + tl.arange(0, K))
    Ut = U.to(tl.float32) - _state_mm(W, S, BF16, SPLIT, INTERP)
    if STORE_UT:
        tl.store(_bp(ut, bos, L, i_h, row0, i_v * BV, H, V, C, BV), _cast(Ut, ut.dtype.element_ty, INTERP),
                 boundary_check=(0,))
    if WRITE_O:
        Qg = tl.load(_bp(qg, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
        Aq = tl.load(_bp(aqk, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
        out = _state_mm(Qg, S, BF16, SPLIT, INTERP) + _state_mm(Aq, Ut, BF16, SPLIT, INTERP)
        tl.store(_bp(o, bos, L, i_h, row0, i_v * BV, H, V, C, BV), _cast(out, o.dtype.element_ty, INTERP),
                 boundary_check=(0,))
    if STORE_HS:
        # the chunk-start state, stored last and through a block pointer: at the start, through the offset tile,
        # the forward that also writes o spilled 796 B (offline sm_90 report; here 156 B)
        tl.store(tl.make_block_ptr(hs + ((c0 + j) * H + i_h).to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV),
                                   (K, BV), (1, 0)), _cast(S, hs.dtype.element_ty, INTERP))
    return tl.exp(g_end)[:, None] * S + _state_mm(tl.trans(Kd), Ut, BF16, SPLIT, INTERP)


@triton.jit
def _state(w, u, qg, kd, aqk, gc, h0, o, ht, hs, ut, cu, chunk_off,
           H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
           USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_HS: tl.constexpr, WRITE_O: tl.constexpr,
           STORE_UT: tl.constexpr, BF16: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """One (value block, sequence, head): the chunk-to-chunk state hand-off, in order, state in registers.

    Per chunk: Ũ = U − W·S; O = (Q⊙Γ)·S + Aqk·Ũ (with WRITE_O); S ← Diag(exp(G_C))·S + (K⊙exp(G_C − G))ᵀ·Ũ.
    hs (optional) receives S at every chunk start, ht the final state, ut (with STORE_UT) Ũ.
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_h, bos, L, c0, n_chunks = _sequence_coords(cu, chunk_off, i_nh, H, C)
    off_s = tl.arange(0, K)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :]  # [K, BV]
    if USE_H0:
        S = tl.load(h0 + i_nh.to(tl.int64) * K * V + off_s).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    # The interpreter cannot take a loaded scalar as a `range` bound; compiled code needs `for` to pipeline loads.
    if INTERP:
        j = 0
        while j < n_chunks:
            S = _state_step(S, j, w, u, qg, kd, aqk, gc, o, hs, ut, bos, L, c0, i_h, i_v, off_s, H, K, V, BV, C,
                            STORE_HS, WRITE_O, STORE_UT, BF16, SPLIT, INTERP)
            j += 1
    else:
        for j in range(n_chunks):
            S = _state_step(S, j, w, u, qg, kd, aqk, gc, o, hs, ut, bos, L, c0, i_h, i_v, off_s, H, K, V, BV, C,
                            STORE_HS, WRITE_O, STORE_UT, BF16, SPLIT, INTERP)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + off_s, S)


@triton.jit
def _fwd_o_block(Qg, Aq, hs, ut, o, bos, L, row0, i_c, i_h, i_v, H, K: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr, C: tl.constexpr, BF16: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """Value block i_v of `_fwd_o`'s chunk."""
    S = tl.load(tl.make_block_ptr(hs + (i_c * H + i_h).to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV),
                                  (K, BV), (1, 0)))
    Ut = tl.load(_bp(ut, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
    out = _state_mm(Qg, S, BF16, SPLIT, INTERP) + _state_mm(Aq, Ut, BF16, SPLIT, INTERP)
    tl.store(_bp(o, bos, L, i_h, row0, i_v * BV, H, V, C, BV), _cast(out, o.dtype.element_ty, INTERP),
             boundary_check=(0,))


@triton.jit
def _fwd_o(qg, aqk, hs, ut, o, cu, chunk_idx, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
           C: tl.constexpr, BF16: tl.constexpr, SPLIT: tl.constexpr, LOOP: tl.constexpr, INTERP: tl.constexpr):
    """One (value block, chunk, head) of the training forward's output, O = (Q⊙Γ)·S + Aqk·Ũ, from the chunk-start
    state and Ũ that `_state` stored for the backward (`TUNING["state_o_apart"]`): `_state` then walks the chunks
    without Q⊙Γ and Aqk, in less shared memory. The products are `_state`'s (`_state_mm`: split bf16 by default,
    so the fp32 Aqk keeps ~16 bits where tf32 would keep 10; its bf16 tiles S, Ũ and Q⊙Γ are exact as stored).
    LOOP (`TUNING["fwd_o_loop"]`): one program per (chunk, head) walks the value blocks, Q⊙Γ and Aqk loaded once."""
    NV: tl.constexpr = 1 if LOOP else V // BV
    pid = tl.program_id(0)
    i_c = pid // NV
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    Qg = tl.load(_bp(qg, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    Aq = tl.load(_bp(aqk, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
    if LOOP:
        for i_v in range(V // BV):
            _fwd_o_block(Qg, Aq, hs, ut, o, bos, L, row0, i_c, i_h, i_v, H, K, V, BV, C, BF16, SPLIT, INTERP)
    else:
        _fwd_o_block(Qg, Aq, hs, ut, o, bos, L, row0, i_c, i_h, pid % NV, H, K, V, BV, C, BF16, SPLIT, INTERP)


# backward kernels


@triton.jit
def _load_norm(n_in, bos, L, row0, i_h, H, BC: tl.constexpr):
    """The prepare's row norms ‖q‖ or ‖k‖ ([TT, H] fp32) of the BC rows at row0; 1 past the document end.

    Kept from the prepare (+8 bytes per token and head) for `_bwd_vk`, `_bwd_k_block` and `_bwd_norms`, instead of a
    full-row load per key slice: `_bwd_k` 4.88 → 4.77 ms, `_bwd_vk` 3.40 → 3.09 at the K3 shape (session 9 run 4)."""
    n = tl.load(tl.make_block_ptr(n_in + bos * H + i_h, (L,), (H,), (row0,), (BC,), (0,)), boundary_check=(0,),
                padding_option="zero")
    return tl.where(row0 + tl.arange(0, BC) < L, n, 1.0)


@triton.jit
def _unit_cols(q, k, qn_in, kn_in, bos, L, row0, c0, i_h, scale, H, K: tl.constexpr, SK: tl.constexpr,
               BC: tl.constexpr):
    """q̂ (times scale) and k̂ on the BC rows at row0 and the key columns [c0, c0 + SK), normalised by the
    prepare's whole-row norms (`_load_norm`)."""
    q_n = _load_norm(qn_in, bos, L, row0, i_h, H, BC)
    k_n = _load_norm(kn_in, bos, L, row0, i_h, H, BC)
    q_s = tl.load(_bp(q, bos, L, i_h, row0, c0, H, K, BC, SK), boundary_check=(0,), padding_option="zero")
    k_s = tl.load(_bp(k, bos, L, i_h, row0, c0, H, K, BC, SK), boundary_check=(0,), padding_option="zero")
    # one reciprocal per row, not a division per element
    return q_s.to(tl.float32) * (scale / q_n)[:, None], k_s.to(tl.float32) * (1.0 / k_n)[:, None]


@triton.jit
def _state_bwd_step(dS, g_end, j, qg, kd, aqk, w, gc, do, du, dse, bos, L, c0, i_h, i_v, off_s,
                    H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                    BF16: tl.constexpr, SPLIT: tl.constexpr, QPRIME: tl.constexpr, INTERP: tl.constexpr):
    """Chunk j, walking backwards: dŨ = Aqkᵀ·dO + Kd·dS_end; dS_start = Qgᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·dŨ.
    With QPRIME, qg holds Q′ = Qg − Aqk·W, and only dŨ's chain part Kd·dS_end is taken and stored: Wᵀ·dŨ =
    (Aqk·W)ᵀ·dO + Wᵀ·(Kd·dS_end), so dS_start = Q′ᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·(Kd·dS_end); `_bwd_vk` and `_bwd_vv`
    add Aqkᵀ·dO's share. g_end is G_C of chunk j; returns chunk j − 1's too (`_load_gamma`)."""
    row0 = j * C
    if not QPRIME:
        Aq = tl.load(_bp(aqk, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
    Kd = tl.load(_bp(kd, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    Qg = tl.load(_bp(qg, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    W = tl.load(_bp(w, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    dO = tl.load(_bp(do, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
    g_next = _load_gamma(gc, c0, tl.maximum(j - 1, 0), i_h, H, K, True)
    tl.store(dse + ((c0 + j) * H + i_h) * K * V + off_s, _cast(dS, dse.dtype.element_ty, INTERP))
    if QPRIME:
        dUt = _state_mm(Kd, dS, BF16, SPLIT, INTERP)
    else:
        dUt = _state_mm(tl.trans(Aq), dO, BF16, SPLIT, INTERP) + _state_mm(Kd, dS, BF16, SPLIT, INTERP)
    tl.store(_bp(du, bos, L, i_h, row0, i_v * BV, H, V, C, BV), _cast(dUt, du.dtype.element_ty, INTERP),
             boundary_check=(0,))
    return (_state_mm(tl.trans(Qg), dO, BF16, SPLIT, INTERP) + tl.exp(g_end)[:, None] * dS
            - _state_mm(tl.trans(W), dUt, BF16, SPLIT, INTERP)), g_next


@triton.jit
def _state_bwd(qg, kd, aqk, w, gc, do, dht, du, dse, dh0, cu, chunk_off,
               H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
               USE_DHT: tl.constexpr, BF16: tl.constexpr, SPLIT: tl.constexpr, QPRIME: tl.constexpr,
               INTERP: tl.constexpr):
    """One (value block, sequence, head): the state gradient, last chunk first.

    Writes dŨ [TT, H, V] (with QPRIME its part Kd·dS_end, qg holding Q′: `_state_bwd_step`), the state gradient at
    every chunk end (dse) and at the start (dh0).
    """
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_h, bos, L, c0, n_chunks = _sequence_coords(cu, chunk_off, i_nh, H, C)
    off_s = tl.arange(0, K)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :]
    if USE_DHT:
        dS = tl.load(dht + i_nh.to(tl.int64) * K * V + off_s).to(tl.float32)
    else:
        dS = tl.zeros([K, BV], dtype=tl.float32)
    g_end = _load_gamma(gc, c0, n_chunks - 1, i_h, H, K, n_chunks > 0)
    if INTERP:
        j = n_chunks - 1
        while j >= 0:
            dS, g_end = _state_bwd_step(dS, g_end, j, qg, kd, aqk, w, gc, do, du, dse, bos, L, c0, i_h, i_v, off_s,
                                        H, K, V, BV, C, BF16, SPLIT, QPRIME, INTERP)
            j -= 1
    else:
        for jj in range(n_chunks):
            dS, g_end = _state_bwd_step(dS, g_end, n_chunks - 1 - jj, qg, kd, aqk, w, gc, do, du, dse, bos, L, c0,
                                        i_h, i_v, off_s, H, K, V, BV, C, BF16, SPLIT, QPRIME, INTERP)
    tl.store(dh0 + i_nh.to(tl.int64) * K * V + off_s, dS)


@triton.jit
def _bwd_vk(q, k, b, g_in, gc_in, qn_in, kn_in, cu, chunk_idx, t_in, hs, dse, do, du, ut, aqk,
            dqh_out, dkh_out, dg_out, dbk_out, nd_out, v, at_in, dv, daqk_out, dakk_out, db_out, nrm_out, done,
            scale, H, K: tl.constexpr, V: tl.constexpr, SK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
            QPRIME: tl.constexpr, ROW_DOTS: tl.constexpr, VV: tl.constexpr, BVV: tl.constexpr,
            INTERP: tl.constexpr):
    """Value side, part 1: one (key slice of SK columns, chunk, head), the value-dim gradients that are
    elementwise in the key column, from the forward's Ũ = U − W·S (no W, no W·S).

    Looping over value blocks, on the slice's rows of S and dS_end: dQg = dO·Sᵀ, dW = −dŨ·Sᵀ, dKd = Ũ·dS_endᵀ and
    dΓ_C = Σ_v S ⊙ dS_end. Then, per key column, the finished value-side dq̂ = dQg⊙Γ, dk̂ = dKd⊙exp(G_C − G) +
    β·(Tᵀ·dW)⊙Γ and dG (with G_C's gradient on the last row) into the scratch `_bwd_k_block` reads (dG fp32; dq̂
    and dk̂ bf16 for bf16 inputs, `bwd_scratch_bf16`). The one term that sums over K leaves as this slice's partial, for
    `_bwd_vv`: dβ_k = Σ_k (Tᵀ·dW)⊙K⊙Γ (dbk_out [NT, H, NS, C]); T's gradient needs no key side (`_bwd_vv`). G
    and G_C are the prepare's (g_in [TT, H, K], gc_in [NT, H, K]; G reads 0 past the document end, where every
    factor it enters multiplies a zero row). ‖q‖, ‖k‖ come from qn_in, kn_in ([TT, H], `_load_norm`). T, G, q̂ and
    k̂ (and Aqk with QPRIME), which only the part after the loop reads, are loaded before it: one program of 255
    registers per SM has no neighbour to hide their latency, the loop's products do (no spills offline; 2.63 →
    2.32 ms at the K3 shape, session 24 run 2; T and G alone 2.57). S, dS_end, dŨ and Ũ arrive as
    `TUNING["bwd_storage_bf16"]` stored them and multiply as stored (`_dot_stored`): all bf16 by default, plain bf16
    products on value blocks of 64 (2.27 → 2.07 ms, session 26; with split-bf16 products on bf16 storage, session
    13: slower, 2.91 → 2.99). With QPRIME, du holds only dŨ's part Kd·dS_end (`_state_bwd_step`); the rest,
    Aqkᵀ·dO, enters dW after the loop as −Aqkᵀ·(dO·Sᵀ) = −Aqkᵀ·dQg, one product on the accumulator the loop builds
    anyway. ROW_DOTS (`TUNING["norms_from_scores"]`): also this slice's part of ⟨q̂, dq̂⟩ and ⟨k̂, dk̂⟩ per row, from
    dq̂, dk̂ as stored (nd_out [NT, H, NS, 2, C]), which `_bwd_vv` completes for the norm backward.

    VV (`TUNING["bwd_vv_fused"]`): the last of a chunk's NS slice programs to finish runs `_bwd_vv`'s work for the
    chunk (`_vv_chain` on value blocks of BVV, the other slices' partials read from L2), so no `_bwd_vv` launch
    follows and dO, dŨ, Ũ come back from L2 rather than memory: each slice counts itself in `done` ([NT, H] int32,
    zeros) after its stores, as `_bwd_k_block` does with the gate chain.
    """
    NS: tl.constexpr = K // SK
    pid = tl.program_id(0)
    i_c = pid // NS
    s = pid % NS
    c0 = s * SK
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    rows = tl.arange(0, C)
    cs = tl.arange(0, SK)
    s_base = (i_c * H + i_h).to(tl.int64) * K * V
    beta = _load_beta(b, bos, L, row0, i_h, H, C)
    gc = tl.load(gc_in + (i_c * H + i_h).to(tl.int64) * K + c0 + cs)
    dQg = tl.zeros([C, SK], dtype=tl.float32)
    dW = tl.zeros([C, SK], dtype=tl.float32)
    dKd = tl.zeros([C, SK], dtype=tl.float32)
    dgc = tl.zeros([SK], dtype=tl.float32)
    # read only after the loop: loaded before it, their latency hides behind its products
    Tm = tl.load(_bp(t_in, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
    G = tl.load(_bp(g_in, bos, L, i_h, row0, c0, H, K, C, SK), boundary_check=(0,), padding_option="zero")
    qh, kh = _unit_cols(q, k, qn_in, kn_in, bos, L, row0, c0, i_h, scale, H, K, SK, C)
    if QPRIME:
        Aq = tl.load(_bp(aqk, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
    for i_v in range(0, V // BV):
        off_s = (c0 + cs)[:, None] * V + i_v * BV + tl.arange(0, BV)[None, :]
        S = tl.load(hs + s_base + off_s)
        dSe = tl.load(dse + s_base + off_s)
        dO = tl.load(_bp(do, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
        dU = tl.load(_bp(du, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
        Ut = tl.load(_bp(ut, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
        dQg += _dot_stored(dO, tl.trans(S), INTERP)
        dW -= _dot_stored(dU, tl.trans(S), INTERP)
        dKd += _dot_stored(Ut, tl.trans(dSe), INTERP)
        dgc += tl.sum(S.to(tl.float32) * dSe.to(tl.float32), 1)
    if QPRIME:
        dW -= tl.dot(tl.trans(Aq.to(tl.float32)), dQg)
    dXk = tl.dot(tl.trans(Tm), dW)
    gam = tl.exp(G)
    Kg = kh * gam
    p_part = ((i_c * H + i_h) * NS + s).to(tl.int64)
    tl.store(dbk_out + p_part * C + rows, tl.sum(dXk * Kg, 1))
    dKg = beta[:, None] * dXk * gam
    dqh = dQg * gam
    dKd = dKd * tl.exp(gc[None, :] - G)
    dG = -kh * dKd
    # G_C feeds Γ_C and every exp(G_C − G_i): its gradient lands on the last row, spread back by the cumsum.
    dG_end = tl.exp(gc) * dgc + tl.sum(kh * dKd, 0)
    dG = tl.where(rows[:, None] == C - 1, dG + dG_end[None, :], dG) + qh * dqh + kh * dKg
    dqh = _cast(dqh, dqh_out.dtype.element_ty, INTERP)
    dkh = _cast(dKd + dKg, dkh_out.dtype.element_ty, INTERP)
    tl.store(_bp(dqh_out, bos, L, i_h, row0, c0, H, K, C, SK), dqh, boundary_check=(0,))
    tl.store(_bp(dkh_out, bos, L, i_h, row0, c0, H, K, C, SK), dkh, boundary_check=(0,))
    if ROW_DOTS:
        tl.store(nd_out + p_part * 2 * C + rows, tl.sum(qh * dqh.to(tl.float32), 1))
        tl.store(nd_out + (p_part * 2 + 1) * C + rows, tl.sum(kh * dkh.to(tl.float32), 1))
    tl.store(dg_out + (i_c * H + i_h).to(tl.int64) * C * K + rows[:, None] * K + (c0 + cs)[None, :], dG)
    if VV:
        if _last_to_finish(done + i_c * H + i_h, NS):
            _vv_chain(v, b, t_in, do, du, ut, aqk, dbk_out, at_in, nd_out, dv, daqk_out, dakk_out, db_out, nrm_out,
                      bos, L, row0, i_c, i_h, H, V, NS, BVV, C, QPRIME, ROW_DOTS, True, INTERP)


@triton.jit
def _last_to_finish(counter, n):
    """Counts this program in `counter` (int32, zeroed before the launch) once its stores are issued, and says
    whether it is the last of the n programs counting there: the split-K pattern, in CUTLASS's semaphore's order. A
    CTA barrier puts every thread's stores before one thread's acq_rel atomic (the release); Triton broadcasts that
    thread's result through shared memory and a barrier, so the acquire comes before every thread's later loads of
    the others' stores."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel") == n - 1


@triton.jit
def _load_partial(ptr, L2_ONLY: tl.constexpr):
    """A partial sum another program wrote: past L1 (`.cg`) when it was written in the same launch."""
    if L2_ONLY:
        x = tl.load(ptr, cache_modifier=".cg")
    else:
        x = tl.load(ptr)
    return x


@triton.jit
def _vv_chain(v, b, t_in, do, du, ut, aqk, dbk_in, at_in, nd_in, dv, daqk_out, dakk_out, db_out, nrm_out,
              bos, L, row0, i_c, i_h, H, V: tl.constexpr, NS: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
              QPRIME: tl.constexpr, NORMS: tl.constexpr, L2_ONLY: tl.constexpr, INTERP: tl.constexpr):
    """`_bwd_vv`'s work on one (chunk, head); L2_ONLY: `_bwd_vk`'s partials (dβ's and, with NORMS, the row dots)
    were written in the same launch (`bwd_vv_fused`)."""
    rows = tl.arange(0, C)
    beta = _load_beta(b, bos, L, row0, i_h, H, C)
    Tm = tl.load(_bp(t_in, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
    TmT = tl.trans(Tm)
    dAqk = tl.zeros([C, C], dtype=tl.float32)
    dUU = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    p_part = ((i_c * H + i_h) * NS).to(tl.int64)
    for s in tl.static_range(NS):
        dbeta += _load_partial(dbk_in + (p_part + s) * C + rows, L2_ONLY)
    if QPRIME:
        Aq = tl.load(_bp(aqk, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,),
                     padding_option="zero").to(tl.float32)
        AqT = tl.trans(Aq)
    for i_v in range(0, V // BV):
        dO = tl.load(_bp(do, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
        dU = tl.load(_bp(du, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
        Ut = tl.load(_bp(ut, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
        vb = tl.load(_bp(v, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
        vb = vb.to(tl.float32)
        dAqk += _dot_stored(dO, tl.trans(Ut), INTERP)
        dUU += _dot_stored(dU, tl.trans(Ut), INTERP)
        if QPRIME:
            dXv = tl.dot(TmT, dU.to(tl.float32) + tl.dot(AqT, dO.to(tl.float32)))
        else:
            dXv = tl.dot(TmT, dU.to(tl.float32))
        tl.store(_bp(dv, bos, L, i_h, row0, i_v * BV, H, V, C, BV),
                 _cast(beta[:, None] * dXv, dv.dtype.element_ty, INTERP), boundary_check=(0,))
        dbeta += tl.sum(dXv * vb, 1)
    if QPRIME:
        dUU += tl.dot(AqT, dAqk)
    dAkk = -tl.dot(TmT, dUU)
    below = rows[:, None] > rows[None, :]
    dAqk = _cast(tl.where(rows[:, None] >= rows[None, :], dAqk, 0.0), daqk_out.dtype.element_ty, INTERP)
    dAkk = _cast(tl.where(below, dAkk, 0.0), dakk_out.dtype.element_ty, INTERP)
    tl.store(_bp(daqk_out, bos, L, i_h, row0, 0, H, C, C, C), dAqk, boundary_check=(0,))
    tl.store(_bp(dakk_out, bos, L, i_h, row0, 0, H, C, C, C), dAkk, boundary_check=(0,))
    p_db = tl.make_block_ptr(db_out + bos * H + i_h, (L,), (H,), (row0,), (C,), (0,))
    if NORMS:
        if not QPRIME:
            Aq = tl.load(_bp(aqk, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,),
                         padding_option="zero").to(tl.float32)
        # Ã's diagonal blocks hold zeros on and above their diagonal, right of them nothing was written
        At = tl.where(below, tl.load(_bp(at_in, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,),
                                     padding_option="zero").to(tl.float32), 0.0)
        Pq = dAqk.to(tl.float32) * Aq
        dAt = dAkk.to(tl.float32) * At
        dAt_rows = tl.sum(dAt, 1)
        nq = tl.sum(Pq, 1)
        # dAkk⊙Akk = diag(β)·(dAkk⊙Ã): its row sums are β times dAt's
        nk = tl.sum(Pq + beta[:, None] * dAt, 0) + beta * dAt_rows
        for s in tl.static_range(NS):
            nq += _load_partial(nd_in + ((p_part + s) * 2) * C + rows, L2_ONLY)
            nk += _load_partial(nd_in + ((p_part + s) * 2 + 1) * C + rows, L2_ONLY)
        p_n = nrm_out + ((bos + row0 + rows) * H + i_h).to(tl.int64) * 2
        valid = row0 + rows < L
        tl.store(p_n, nq, mask=valid)
        tl.store(p_n + 1, nk, mask=valid)
        dbeta += dAt_rows
        tl.store(p_db, _cast(dbeta * beta * (1.0 - beta), db_out.dtype.element_ty, INTERP), boundary_check=(0,))
    else:
        tl.store(p_db, dbeta, boundary_check=(0,))


@triton.jit
def _bwd_vv(v, b, cu, chunk_idx, t_in, do, du, ut, aqk, dbk_in, at_in, nd_in,
            dv, daqk_out, dakk_out, db_out, nrm_out,
            H, V: tl.constexpr, NS: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, QPRIME: tl.constexpr,
            NORMS: tl.constexpr, INTERP: tl.constexpr):
    """Value side, part 2: one (chunk, head), the gradients that contract over the value dim within the chunk:
    dAqk, dAkk (through dŨ·Ũᵀ), dv and dβ (with `_bwd_vk`'s dβ partials).

    Looping over value blocks: dAqk = dO·Ũᵀ, dŨ·Ũᵀ and, through U = T·diag(β)·V, dv = β·Tᵀ·dŨ and
    dβ_v = Σ_v (Tᵀ·dŨ)⊙V, on top of `_bwd_vk`'s NS partials of dβ, summed first (in slice order: deterministic).
    Then dAkk = −Tᵀ·(dŨ·Ũᵀ): Ũ = T·X with X = β·V − (β·K⊙Γ)·S and T = (I + Akk)⁻¹, so Akk's gradient is
    −Tᵀ·dŨ·Ũᵀ (below the diagonal). It equals the chain through W and U, −Tᵀ·dT·Tᵀ with dT = dŨ·Xᵀ, without X's
    two cancelling halves, one of which (dW·(β·K⊙Γ)ᵀ) sums over K in `_bwd_vk`'s slices (session 27; docs
    §7 item 57). Writes dv, and dAqk, dAkk (masked to their lower triangles) and dβ for `_bwd_k_block` /
    `_bwd_norms`. With QPRIME, du holds only dŨ's part Kd·dS_end (`_state_bwd_step`): each value block adds
    Aqkᵀ·dO before T's product, and dŨ·Ũᵀ takes the rest after the loop as Aqkᵀ·(dO·Ũᵀ), on the unmasked dAqk.

    NORMS (`TUNING["norms_from_scores"]`): the sums over K that the norm backward and dβ need, from the scores by
    Euler's identity instead of from the finished dq̂, dk̂ (so `_bwd_k_block` can finish dq, dk and no `_bwd_norms`
    runs). Aqk is linear in q̂_r through its row r and in k̂_i through its column i, Ã (Akk = diag(β)·Ã) in k̂ through
    its row and its column, so the score side's ⟨q̂_r, dq̂_r⟩ = Σ_i dAqk[r, i]·Aqk[r, i] and ⟨k̂_r, dk̂_r⟩ = the
    column sum of dAqk⊙Aqk plus the row and column sums of dAkk⊙Akk, on the dAqk, dAkk as stored (those
    `_bwd_k_block` multiplies); dβ's score part is the row sum of dAkk⊙Ã. With `_bwd_vk`'s value-side partials
    (nd_in) the two sums go to nrm_out ([TT, H, 2] fp32) and dβ, times σ', to db_out as the logit's gradient (b's
    dtype). Ã comes from the prepare (at_in, `store_at`).
    """
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    _vv_chain(v, b, t_in, do, du, ut, aqk, dbk_in, at_in, nd_in, dv, daqk_out, dakk_out, db_out, nrm_out, bos, L, row0,
              i_c, i_h, H, V, NS, BV, C, QPRIME, NORMS, False, INTERP)


@triton.jit
def _bwd_k_block(q, k, b, g_in, qn_in, kn_in, cu, chunk_idx, dqh_in, dkh_in, dg_in, daqk_in, dakk_in, db_part,
                 nrm_in, dq_out, dk_out, z, A_log, dt_bias, dz, dA_part, dbias_part, done,
                 scale, H, K: tl.constexpr, SK: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, NORMS: tl.constexpr,
                 GATE: tl.constexpr, G_MIN: tl.constexpr, INTERP: tl.constexpr):
    """The score backward of one (BC-row block R, key slice of SK columns, chunk, head): everything that lands on
    block R's rows, so no program waits for another and nothing is carried across blocks. BC is 16, or 32
    (`TUNING["bwd_k_rows"]`, below).

    Block (R, J) of Aqk = Σ_k q̂[r]k̂[i]·exp(G[r] − G[i]) (and of Ã, Akk = diag(β)·Ã) is a product of 16-row tiles
    around anchors, every factor within fp32's range because g ≥ −5 (docs/kda.md §4):
    - the diagonal block around a_R (G at R's first row): row factor exp(G_r − a_R), column factor exp(a_R − G_i);
    - a block (R, J < R), R's row side: Σ_i dA[r, i]·k̂_i⊙exp(e_J − G_i) (e_J: G at J's last row), times
      exp(a_R − e_J) and the row factor;
    - a block (J > R, R), R's column side: Σ_r dA[r, i]·(q̂_r or β_r k̂_r)⊙exp(G_r − a_J), times exp(a_J − e_R) and
      finished with exp(e_R − G_i) ≤ 1.
    dq̂, dk̂ and dG come out of 16×16 by 16×SK matmuls; the gate gets +x⊙dx on the row factor's side and −x⊙dx on
    the column's (if a quantity depends on G only through x⊙exp(±G), dG = ±x⊙dx).

    On top of the value side's dq̂, dk̂ and dG (scratch from `_bwd_vk`; dq̂, dk̂ bf16 for bf16 inputs,
    `bwd_scratch_bf16`) it writes block R's finished dq̂ and dk̂, its dG before the reverse cumsum (`_bwd_gate`
    does that and the gate chain) and this slice's dβ partial (db_part: [TT, H, NS]); dAqk and dAkk arrive in
    bf16 for bf16 inputs (`bwd_da_bf16`). `_bwd_norms` finishes dq̂, dk̂ and dβ, which reduce over K. G is the
    prepare's ([TT, H, K], `_g_block`), ‖q‖ and ‖k‖ too (`_load_norm`). NORMS (`TUNING["norms_from_scores"]`):
    with ⟨q̂, dq̂⟩ and ⟨k̂, dk̂⟩ per row from `_bwd_vv` (nrm_in [TT, H, 2]) it finishes the norm backward itself and
    writes dq and dk (dq_out, dk_out), no dq̂, dk̂ and no dβ partial. GATE (`TUNING["bwd_gate_fused"]`): the last of
    a chunk's row blocks (inside the document) to finish on this key slice runs `_bwd_gate`'s reverse cumsum and
    gate chain for the chunk and slice (`_gate_chain`), so no `_bwd_gate` launch follows: each block counts itself
    in `done` ([NT, H, NS] int32, zeros) after its dG stores, and the one that finds the others counted reads their
    dG from L2. A block wholly past the document end does nothing: its dG rows (G_C's gradient may sit on the
    chunk's last row) pass through unchanged. The products are tf32 (bf16 operands: 3.51 → 3.40 ms at the K3 shape,
    but ddt_bias 4.0e-4 → 6.5e-3 from fp64 in the interpreter, near its 8e-3 limit; session 13 run 2).

    32-row blocks (MID; docs/kda-kernels.md §7 item 67) halve the neighbours' loads (one block pair per chunk
    instead of six, each loaded by both its programs). From the first row a 32-row block's factors would reach
    e^160, so the diagonal block anchors at its middle row (a_R = G at row 16: e^±80), and the row side is finished
    per block: the diagonal's rows times the row factor (> 1 above the anchor) at once, the block (R, J)'s times
    exp(G_r − e_J) ≤ 1, and the column side's factor is exp(G_r − e_R) ≤ 1 in one exp. Every factor that can
    underflow then multiplies only factors ≤ 1, so a flushed product is one below fp32's range anyway.
    """
    NS: tl.constexpr = K // SK
    NB: tl.constexpr = C // BC
    # 32-row blocks anchor at their middle row (factors within e^±80, as 16-row blocks' at their first); their
    # row side is finished per block (`MID` below)
    MID: tl.constexpr = BC > 16
    AO: tl.constexpr = BC // 2 if MID else 0
    pid = tl.program_id(0)
    R = pid % NB
    s = (pid // NB) % NS
    i_c = pid // (NB * NS)
    c0 = s * SK
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    r0 = row0 + R * BC
    if r0 < L:
        qh, kh = _unit_cols(q, k, qn_in, kn_in, bos, L, r0, c0, i_h, scale, H, K, SK, BC)
        beta = _load_beta(b, bos, L, r0, i_h, H, BC)
        G, a, e = _g_block(g_in, bos, L, i_h, r0, c0, H, K, SK, BC, AO)
        rf = _exp(G - a[None, :], INTERP)
        ec = _exp(a[None, :] - G, INTERP)
        qs = qh * rf
        ks = kh * rf
        kc = kh * ec
        # the diagonal block; dAqk, dAkk arrive masked to their lower triangles
        daq = _load_block(daqk_in, bos, L, i_h, r0, R * BC, H, C, BC).to(tl.float32)
        dak = _load_block(dakk_in, bos, L, i_h, r0, R * BC, H, C, BC).to(tl.float32)
        rowq = tl.dot(daq, kc)
        rowk = tl.dot(dak, kc)
        if MID:
            # finished here: rf reaches e^80 above the anchor, where a block before R's factor exp(a − e_J) may
            # have underflowed; each block (R, J) takes exp(G − e_J) ≤ 1 instead
            rowq = rf * rowq
            rowk = rf * rowk
        cs = tl.dot(tl.trans(daq), qs) + tl.dot(tl.trans(beta[:, None] * dak), ks)
        co = tl.zeros([BC, SK], dtype=tl.float32)
        for J in tl.static_range(NB):
            rJ = row0 + J * BC
            if J < R:
                # block (R, J): R's row side (J lies wholly before R, so inside the document)
                _, kJ = _unit_cols(q, k, qn_in, kn_in, bos, L, rJ, c0, i_h, scale, H, K, SK, BC)
                GJ, _, eJ = _g_block(g_in, bos, L, i_h, rJ, c0, H, K, SK, BC, AO)
                kend = kJ * _exp(eJ[None, :] - GJ, INTERP)
                if MID:
                    d = _exp(G - eJ[None, :], INTERP)
                else:
                    d = _exp(a - eJ, INTERP)[None, :]
                rowq += d * tl.dot(_load_block(daqk_in, bos, L, i_h, r0, J * BC, H, C, BC).to(tl.float32), kend)
                rowk += d * tl.dot(_load_block(dakk_in, bos, L, i_h, r0, J * BC, H, C, BC).to(tl.float32), kend)
            if J > R and rJ < L:
                # block (J, R): R's column side
                qJ, kJ = _unit_cols(q, k, qn_in, kn_in, bos, L, rJ, c0, i_h, scale, H, K, SK, BC)
                bJ = _load_beta(b, bos, L, rJ, i_h, H, BC)
                GJ, aJ, _ = _g_block(g_in, bos, L, i_h, rJ, c0, H, K, SK, BC, AO)
                if MID:
                    fJ = _exp(GJ - e[None, :], INTERP)
                else:
                    fJ = _exp(GJ - aJ[None, :], INTERP) * _exp(aJ - e, INTERP)[None, :]
                daqJ = _load_block(daqk_in, bos, L, i_h, rJ, R * BC, H, C, BC).to(tl.float32)
                dakJ = _load_block(dakk_in, bos, L, i_h, rJ, R * BC, H, C, BC).to(tl.float32)
                co += tl.dot(tl.trans(daqJ), qJ * fJ) + tl.dot(tl.trans(bJ[:, None] * dakJ), kJ * fJ)
        p_dqh = _bp(dqh_in, bos, L, i_h, r0, c0, H, K, BC, SK)
        p_dkh = _bp(dkh_in, bos, L, i_h, r0, c0, H, K, BC, SK)
        p_dg = dg_in + (i_c * H + i_h).to(tl.int64) * C * K + (R * BC + tl.arange(0, BC))[:, None] * K + c0 + \
            tl.arange(0, SK)[None, :]
        ce = _exp(e[None, :] - G, INTERP) * co
        # the row side: MID's rowq, rowk carry the row factor already (above), the 16-row form's take it last
        if MID:
            qr, kr = qh, kh
        else:
            qr, kr = qs, ks
        # rowk was taken with dAkk; Akk = diag(β)·Ã, so Σ_i dAkk·Ã = Σ_k ks⊙rowk, and Ã's own gradient is β·rowk
        if not NORMS:
            dbeta = tl.sum(kr * rowk, 1)
        rowk = beta[:, None] * rowk
        if MID:
            fq, fk = rowq, rowk
        else:
            fq, fk = rf * rowq, rf * rowk
        dqh = tl.load(p_dqh, boundary_check=(0,), padding_option="zero").to(tl.float32) + fq
        if NORMS:
            # y = q/‖q‖ = q̂/scale and dy = scale·dq̂ (k: y = k̂, dy = dk̂): dx = (dy − y·⟨y, dy⟩)/‖x‖, where
            # ⟨y, dy⟩ = ⟨q̂, dq̂⟩ (⟨k̂, dk̂⟩) over all of K, as `_bwd_vv` summed it
            p_n = nrm_in + ((bos + r0 + tl.arange(0, BC)) * H + i_h).to(tl.int64) * 2
            valid = r0 + tl.arange(0, BC) < L
            nq = tl.load(p_n, mask=valid, other=0.0)
            q_n = _load_norm(qn_in, bos, L, r0, i_h, H, BC)
            dq = _unit_norm_bwd(scale * dqh, qh / scale, nq, q_n)
            tl.store(_bp(dq_out, bos, L, i_h, r0, c0, H, K, BC, SK), _cast(dq, dq_out.dtype.element_ty, INTERP),
                     boundary_check=(0,))
        dkh = tl.load(p_dkh, boundary_check=(0,), padding_option="zero").to(tl.float32) + fk + ec * cs + ce
        if NORMS:
            nk = tl.load(p_n + 1, mask=valid, other=0.0)
            k_n = _load_norm(kn_in, bos, L, r0, i_h, H, BC)
            dk = _unit_norm_bwd(dkh, kh, nk, k_n)
            tl.store(_bp(dk_out, bos, L, i_h, r0, c0, H, K, BC, SK), _cast(dk, dk_out.dtype.element_ty, INTERP),
                     boundary_check=(0,))
        # padding rows keep their dG: the last row carries G_C's gradient into the chunk (`_bwd_vk`)
        dG = tl.load(p_dg) + qr * rowq + kr * rowk - kc * cs - kh * ce
        if not NORMS:
            tl.store(p_dqh, _cast(dqh, dqh_in.dtype.element_ty, INTERP), boundary_check=(0,))
            tl.store(p_dkh, _cast(dkh, dkh_in.dtype.element_ty, INTERP), boundary_check=(0,))
            tl.store(tl.make_block_ptr(db_part + (bos * H + i_h) * NS + s, (L,), (H * NS,), (r0,), (BC,), (0,)),
                     dbeta, boundary_check=(0,))
        tl.store(p_dg, dG)
        # the chunk's blocks inside the document count (a block past its end returned above)
        if GATE:
            if _last_to_finish(done + (i_c * H + i_h) * NS + s, tl.minimum(tl.cdiv(L - row0, BC), NB)):
                _gate_chain(z, A_log, dt_bias, dg_in, dz, dA_part, dbias_part, bos, L, row0, i_c, i_h, s, H, K, SK,
                            C, G_MIN, True, INTERP)


@triton.jit
def _unit_norm_bwd(dy, y, y_dy, n):
    """dx = (dy − y·⟨y, dy⟩)/‖x‖ for y = x/‖x‖, on rows; y_dy is ⟨y, dy⟩ per row over all of K (`_norm_bwd_rows`
    sums it on its tile, `_bwd_k_block` gets it from `_bwd_vv` with NORMS)."""
    return (dy - y * y_dy[:, None]) / n[:, None]


@triton.jit
def _gate_chain(z, A_log, dt_bias, dg_in, dz, dA_part, dbias_part, bos, L, row0, i_c, i_h, s,
                H, K: tl.constexpr, SK: tl.constexpr, C: tl.constexpr, G_MIN: tl.constexpr, L2_ONLY: tl.constexpr,
                INTERP: tl.constexpr):
    """Key slice s of one (chunk, head): dG → dg by the reverse cumsum over the chunk, then the gate chain: dz, and
    this chunk's partial sums of dA_log (dA_part: [NT, H, NS]) and dt_bias (dbias_part: [NT, H, K]), reduced by the
    caller. L2_ONLY: dG is read past L1 (`.cg`), as other programs of the launch have just written it."""
    NS: tl.constexpr = K // SK
    c0 = s * SK
    rows = tl.arange(0, C)
    g_base = (i_c * H + i_h).to(tl.int64) * C * K
    valid = row0 + rows < L
    z_raw, a_exp, bias = _gate_inputs(z, A_log, dt_bias, bos, L, row0, c0, i_h, H, K, C, SK)
    _, x = _gate_from(z_raw, a_exp, bias, valid, G_MIN)
    p_dg = dg_in + g_base + rows[:, None] * K + c0 + tl.arange(0, SK)[None, :]
    if L2_ONLY:
        dG = tl.load(p_dg, cache_modifier=".cg")
    else:
        dG = tl.load(p_dg)
    dg = tl.cumsum(dG, 0, reverse=True)
    sg = tl.sigmoid(x)
    dx = tl.where(valid[:, None], dg * G_MIN * sg * (1.0 - sg), 0.0)
    dzv = dx * a_exp
    tl.store(_bp(dz, bos, L, i_h, row0, c0, H, K, C, SK), _cast(dzv, dz.dtype.element_ty, INTERP),
             boundary_check=(0,))
    tl.store(dA_part + (i_c * H + i_h) * NS + s, tl.sum(tl.sum(dx * x, 1), 0))
    tl.store(dbias_part + (i_c * H + i_h).to(tl.int64) * K + c0 + tl.arange(0, SK), tl.sum(dzv, 0))


@triton.jit
def _bwd_gate(z, A_log, dt_bias, cu, chunk_idx, dg_in, dz, dA_part, dbias_part,
              H, K: tl.constexpr, SK: tl.constexpr, C: tl.constexpr, G_MIN: tl.constexpr, INTERP: tl.constexpr):
    """After `_bwd_k_block`, one (key slice of SK columns, chunk, head): the reverse cumsum and the gate chain
    (`_gate_chain`)."""
    NS: tl.constexpr = K // SK
    pid = tl.program_id(0)
    i_c = pid // NS
    i_h = tl.program_id(1)
    bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, C)
    _gate_chain(z, A_log, dt_bias, dg_in, dz, dA_part, dbias_part, bos, L, row0, i_c, i_h, pid % NS, H, K, SK, C,
                G_MIN, False, INTERP)


@triton.jit
def _norm_bwd_rows(x, dxh, dx, n_in, row_off, off, m, sc, INTERP: tl.constexpr):
    """The L2-norm backward (`_unit_norm_bwd`) on a [BT, K] tile, y = x/‖x‖ and dy = sc·dx̂; ‖x‖ from n_in (the
    prepare's)."""
    xr = tl.load(x + off, mask=m[:, None], other=0.0).to(tl.float32)
    n = tl.load(n_in + row_off, mask=m, other=1.0)
    y = xr / n[:, None]
    dy = tl.load(dxh + off, mask=m[:, None], other=0.0).to(tl.float32) * sc
    tl.store(dx + off, _cast(_unit_norm_bwd(dy, y, tl.sum(y * dy, 1), n), dx.dtype.element_ty, INTERP),
             mask=m[:, None])


@triton.jit
def _bwd_norms(q, k, b, qn_in, kn_in, dqh, dkh, db_in, db_part, dq, dk, dbl, TT, scale,
               H, K: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr, INTERP: tl.constexpr):
    """After `_bwd_k_block`, per (BT tokens, head): the L2-norm backward of q and k from the finished
    dq̂, dk̂ (y = x/‖x‖ → dx = (dy − y·⟨y, dy⟩)/‖x‖; q̂ = scale·y) and dβ's logit (the value side's dβ
    plus the NS slices' partials, times σ')."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    i_h = tl.program_id(1)
    m = rows < TT
    row_off = rows.to(tl.int64) * H + i_h
    off = row_off[:, None] * K + tl.arange(0, K)[None, :]
    _norm_bwd_rows(q, dqh, dq, qn_in, row_off, off, m, scale, INTERP)
    _norm_bwd_rows(k, dkh, dk, kn_in, row_off, off, m, 1.0, INTERP)
    parts = tl.load(db_part + row_off[:, None] * NS + tl.arange(0, NS)[None, :], mask=m[:, None], other=0.0)
    dbeta = tl.load(db_in + row_off, mask=m, other=0.0) + tl.sum(parts, 1)
    beta = tl.sigmoid(tl.load(b + row_off, mask=m, other=0.0).to(tl.float32))
    tl.store(dbl + row_off, _cast(dbeta * beta * (1.0 - beta), dbl.dtype.element_ty, INTERP), mask=m)


# host side


class Prepared(NamedTuple):
    """The chunk-local operands `_fwd_prepare` returns (None where not asked for)."""

    W: torch.Tensor  # T·diag(β)(K⊙Γ) [TT, H, K]
    U: torch.Tensor  # T·diag(β)V [TT, H, V]
    Qg: torch.Tensor  # Q⊙Γ (Q′ with qprime "over") [TT, H, K]
    Kd: torch.Tensor  # K⊙exp(G_C − G) [TT, H, K]
    Aqk: torch.Tensor  # [TT, H, C], zeros above the diagonal
    gc: torch.Tensor  # G_C [NT, H, K] fp32
    T: torch.Tensor | None  # (I + Akk)⁻¹ [TT, H, C] fp32, zeros above the diagonal (store_t)
    norms: tuple[torch.Tensor, torch.Tensor] | None  # (‖q‖, ‖k‖) [TT, H] fp32 (store_norms)
    G: torch.Tensor | None  # the in-chunk cumulative gate [TT, H, K] fp32 (store_t)
    Qp: torch.Tensor | None  # Q′ = Q⊙Γ − Aqk·W (qprime)
    At: torch.Tensor | None  # Ã = Akk before its β scaling [TT, H, C], W's dtype; only below the diagonal (store_at)


def _fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, scale, plan, dtypes, store_t=False, store_norms=False,
                 qprime=None, store_at=False) -> Prepared:
    """Launch `_prep_gate`, `_prep_intra`, `_prep_solve` and `_prep_wu` on flattened [TT, H, ·] inputs; returns the
    chunk-local operands (`Prepared`): the backward reads T, the norms and G, an inference forward does not store
    ‖q‖ and frees G before `_state`. Q′ = Q⊙Γ − Aqk·W (`_state_bwd` with `TUNING["state_bwd_qprime"]`) is None
    unless qprime is "apart" (a tensor of its own) or "over" (written over Q⊙Γ, which is then returned as Q′ in both
    places). Ã (store_at, bf16 for bf16 inputs) is for the backward's sums from the scores
    (`TUNING["norms_from_scores"]`); only its strictly lower triangle is meaningful (`_bwd_vv` masks it)."""
    TT, H, K = q.shape
    V = v.shape[-1]
    lo, hi = dtypes
    W = torch.empty(TT, H, K, dtype=lo, device=q.device)
    Qg, Kd = torch.empty_like(W), torch.empty_like(W)
    U = torch.empty(TT, H, V, dtype=hi, device=q.device)
    Aqk = torch.empty(TT, H, CHUNK, dtype=hi, device=q.device)
    gc = torch.empty(max(plan.NT, 1), H, K, dtype=torch.float32, device=q.device)
    Tm = torch.empty(TT, H, CHUNK, dtype=torch.float32, device=q.device)
    kn = torch.empty(TT, H, dtype=torch.float32, device=q.device)  # ‖k‖ per row
    qn = torch.empty_like(kn) if store_norms else None
    if qprime not in (None, "apart", "over"):
        raise ValueError(f"qprime is None, 'apart' or 'over', not {qprime!r}")
    Qp = torch.empty_like(Qg) if qprime == "apart" else (Qg if qprime == "over" else None)
    At = torch.empty_like(Aqk, dtype=lo) if store_at else None
    G = None
    if plan.NT > 0:
        interp = interpreting()
        # the in-chunk cumulative gate: 4·TT·H·K bytes (384 MiB at the K3 shape), freed before `_state` unless a
        # backward reads it
        G = torch.empty(TT, H, K, dtype=torch.float32, device=q.device)
        _prep_gate[(plan.NT, H)](k, z, A_log, dt_bias, plan.cu, plan.chunk_idx, G, gc, kn, H=H, K=K, C=CHUNK, BC=SUB,
                                 G_MIN=g_min, **_launch_options("prep_gate"))
        _prep_intra[(plan.NT * (CHUNK // SUB), H)](q, k, b, G, kn, plan.cu, plan.chunk_idx, Qg, Aqk, Tm,
                                                     qn if store_norms else kn, Aqk if At is None else At, scale,
                                                     H=H, K=K, C=CHUNK, BC=SUB, SCORES_BF16=lo == torch.bfloat16,
                                                     STORE_QN=store_norms,
                                                     INVERSE=_inverse_precision("prep", q.dtype),
                                                     STORE_AT=At is not None, INTERP=interp,
                                                     **_launch_options("prep_intra"))
        _prep_solve[(plan.NT, H)](Tm, plan.cu, plan.chunk_idx, H=H, C=CHUNK, BC=SUB, INTERP=interp,
                                  **_launch_options("prep_solve"))
        SK, SV = min(K, 64), min(V, 64)
        _prep_wu[(plan.NT * (K // SK + V // SV), H)](k, v, b, G, gc, plan.cu, plan.chunk_idx, Tm, kn, W, U, Kd,
                                                       Qg, Aqk, Qg if Qp is None else Qp,
                                                       H=H, K=K, V=V, C=CHUNK, SK=SK, SV=SV, QPRIME=Qp is not None,
                                                       INTERP=interp, **_launch_options("prep_wu"))
    return Prepared(W, U, Qg, Kd, Aqk, gc, Tm if store_t else None, (qn, kn) if store_norms else None,
                    G if store_t else None, Qp, At)


def _state_products(state_bf16: bool, training: bool) -> tuple[bool, bool]:
    """(BF16, SPLIT) for the products of `_state` and of `_fwd_o`, which computes the same o apart from it: plain
    bf16 with `state_bf16` (the call's or TUNING's), else split bf16 as TUNING says for a forward that a backward
    can follow (`state_split`) or not (`state_split_inference`), else tf32."""
    state_bf16 = state_bf16 or TUNING["state_bf16"]
    return state_bf16, TUNING["state_split" if training else "state_split_inference"] and not state_bf16


def _fwd_state(W, U, Qg, Kd, Aqk, gc, h0, plan, out_dtype, write_o=True, want_ht=False, want_hs=False,
               state_bf16=False, want_ut=False, training=False, hs_dtype=torch.float32, ut_dtype=None):
    """Launch `_state`; returns (o [TT, H, V] or None, final state [N, H, K, V] or None, chunk-start states or None,
    Ũ = U − W·S [TT, H, V] if want_ut else None). training: a backward can follow (a training forward, the
    backward's recompute), so the products are the `state_split` ones (else `state_split_inference`). hs_dtype,
    ut_dtype: the dtypes of the chunk-start states and of Ũ (None: U's)."""
    TT, H, K = W.shape
    V = U.shape[-1]
    dev = W.device
    key = "state_ut" if want_ut else "state"
    BV = min(V, TUNING[f"{key}_bv"])
    o = torch.empty(TT, H, V, dtype=out_dtype, device=dev) if write_o else None
    ht = torch.empty(plan.N, H, K, V, dtype=torch.float32, device=dev) if want_ht else None
    hs = torch.empty(max(plan.NT, 1), H, K, V, dtype=hs_dtype, device=dev) if want_hs else None
    ut = torch.empty_like(U, dtype=ut_dtype) if want_ut else None
    state_bf16, split = _state_products(state_bf16, training)
    dummy = gc
    _state[(V // BV, plan.N * H)](W, U, Qg, Kd, Aqk, gc, h0 if h0 is not None else dummy,
                                  o if o is not None else dummy, ht if ht is not None else dummy,
                                  hs if hs is not None else dummy, ut if ut is not None else dummy,
                                  plan.cu, plan.chunk_off,
                                  H=H, K=K, V=V, BV=BV, C=CHUNK, USE_H0=h0 is not None, STORE_HT=want_ht,
                                  STORE_HS=want_hs, WRITE_O=write_o, STORE_UT=want_ut, BF16=state_bf16, SPLIT=split,
                                  INTERP=interpreting(), **_launch_options(key))
    return o, ht, hs, ut


def output_apart(dtype: torch.dtype, u_dtype: torch.dtype, keep: bool, want_hs: bool) -> bool:
    """Whether a forward on inputs of `dtype` (U stored in `u_dtype`) computes o apart from `_state`, from the
    chunk-start states and Ũ it keeps for the backward (`_fwd_o`, `TUNING["state_o_apart"]`): where it keeps them
    and both are bf16 (not where it returns the states, in fp32, for prefix caching)."""
    return (keep and not want_hs and TUNING["state_o_apart"]
            and backward_storage(dtype, "hs") == backward_storage(dtype, "ut", u_dtype) == torch.bfloat16)


def _fwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan, want_ht, want_hs, dtypes, state_bf16,
         keep=False, training=False, qprime=False, norms_from_scores=False):
    """The forward: (o, final state or None, chunk-start states if want_hs else None, kept). training: a backward
    can follow (`_fwd_state`'s products).

    keep: also return what the backward would recompute, (W, Qg, Kd, Aqk, gc, T, hs, Ũ, G, Ã, ‖q‖, ‖k‖), for
    `_bwd(inter=…)`, with Q′ = Qg − Aqk·W in Qg's place if qprime (`_prep_wu`; the forward still reads Qg for o)
    and Ã only with norms_from_scores (else None); else kept is None. The states and Ũ = U − W·S (in
    `backward_storage`'s dtypes; the value-side backward reads Ũ instead of recomputing W·S) come from the `_state`
    launch, with the same `state_bf16` as `_bwd`'s recompute: storing them does not change the arithmetic, so the
    gradients are bit-identical either way.
    o too, except where `output_apart` says the kept forward computes it from the stored bf16 states and Ũ
    (`_fwd_o`); then it carries their rounding, and a forward that keeps nothing computes it inside `_state`.
    """
    W, U, Qg, Kd, Aqk, gc, Tm, norms, G, Qp, At = _fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, scale, plan,
                                                               dtypes, store_t=keep, store_norms=keep,
                                                               qprime="apart" if keep and qprime else None,
                                                               store_at=keep and norms_from_scores)
    # the returned chunk-start states are fp32; kept only for the backward, in its storage dtype
    hs_dtype = backward_storage(q.dtype, "hs") if keep and not want_hs else torch.float32
    o_apart = output_apart(q.dtype, U.dtype, keep, want_hs) and plan.NT > 0
    o, ht, hs, ut = _fwd_state(W, U, Qg, Kd, Aqk, gc, h0, plan, v.dtype, write_o=not o_apart, want_ht=want_ht,
                               want_hs=want_hs or keep, state_bf16=state_bf16, want_ut=keep, training=training,
                               hs_dtype=hs_dtype, ut_dtype=backward_storage(q.dtype, "ut", U.dtype))
    if o_apart:
        TT, H, K = q.shape
        V = v.shape[-1]
        o = torch.empty_like(v)
        BV = min(V, TUNING["fwd_o_bv"])
        bf16, split = _state_products(state_bf16, training=True)
        loop = bool(TUNING["fwd_o_loop"])
        _fwd_o[(plan.NT * (1 if loop else V // BV), H)](Qg, Aqk, hs, ut, o, plan.cu, plan.chunk_idx, H=H, K=K, V=V,
                                                        BV=BV, C=CHUNK, BF16=bf16, SPLIT=split, LOOP=loop,
                                                        INTERP=interpreting(), **_launch_options("fwd_o"))
    # U is not needed by the backward
    kept = (W, Qg if Qp is None else Qp, Kd, Aqk, gc, Tm, hs, ut, G, At) + norms if keep else None
    return o, ht, (hs if want_hs else None), kept


def _bwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan, do, dht, dtypes, state_bf16, inter=None,
         qprime=False, norms_from_scores=False):
    """All gradients from the raw inputs and dO (and dht): recompute if needed, the state pass, the chunk passes.

    inter: the forward's (W, Qg, Kd, Aqk, gc, T, hs, Ũ, G, Ã, ‖q‖, ‖k‖) (`_fwd(keep=True)`); then nothing is recomputed
    and h0 is not used. Without it the prepare kernels and `_state` (storing G, the chunk-start states, Ũ and the
    norms) run again here. Then `_state_bwd`, the value side over key slices (`_bwd_vk`, `_bwd_vv`), the
    score backward per 16-row block and key slice (`_bwd_k_block`), the cumsum and gate chains per key slice and
    chunk (`_bwd_gate`) and the row-wise norm and σ' chains (`_bwd_norms`).
    The backward state pass multiplies as TUNING["state_bwd_products"] says (split bf16), whatever
    state_bf16 is: state_bf16 only changes the forward and the recomputed states. qprime: `_state_bwd` on Q′ =
    Qg − Aqk·W (inter's Qg is Q′ then, `_fwd(qprime=True)`), without Aqk's tile and product in its chain; the value
    side adds dŨ's Aqkᵀ·dO (`_state_bwd_step`). norms_from_scores: the norm backward's and dβ's sums over K from
    the scores in `_bwd_vv` (Euler's identity, on the prepare's Ã), so `_bwd_k_block` writes dq and dk and
    `_bwd_norms` does not run (`TUNING["norms_from_scores"]`). `TUNING["bwd_gate_fused"]`: `_bwd_gate`'s work in
    `_bwd_k_block` (`_gate_chain`, by the last row block of each chunk and key slice to finish).
    `TUNING["bwd_vv_fused"]`: `_bwd_vv`'s work in `_bwd_vk` (`_vv_chain`, by the last slice of each chunk).
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    # checked first: a refused setting should not cost a recompute or the passes before it
    products = TUNING["state_bwd_products"]
    if products not in ("tf32", "split", "bf16"):
        raise ValueError(f"TUNING['state_bwd_products'] is tf32, split or bf16, not {products!r}")
    launch = _launch_options("state_bwd")
    if products != "tf32" and (launch["num_warps"] != 4 or launch.get("num_stages", 3) not in (2, 3)):
        raise ValueError(f"`_state_bwd` with {products} products was measured correct on the H200 at 4 warps and "
                         f"2-3 stages only, not {launch} (TUNING): with 1 stage the build computed wrong gradients "
                         "or faulted (docs/kda-kernels.md §7 item 20)")
    BCK = TUNING["bwd_k_rows"]
    if BCK not in (16, 32):
        raise ValueError(f"TUNING['bwd_k_rows'] is 16 or 32, not {BCK!r}")
    gate_fused = bool(TUNING["bwd_gate_fused"])
    if inter is None:
        # with qprime, Q′ over Qg: `_state` reads neither without o
        W, U, Qg, Kd, Aqk, gc, Tm, norms, G, _, At = _fwd_prepare(q, k, v, z, b, A_log, dt_bias, g_min, scale,
                                                                  plan, dtypes, store_t=True, store_norms=True,
                                                                  qprime="over" if qprime else None,
                                                                  store_at=norms_from_scores)
        _, _, hs, ut = _fwd_state(W, U, Qg, Kd, Aqk, gc, h0, plan, v.dtype, write_o=False, want_hs=True,
                                  state_bf16=state_bf16, want_ut=True, training=True,
                                  hs_dtype=backward_storage(q.dtype, "hs"),
                                  ut_dtype=backward_storage(q.dtype, "ut", U.dtype))
        del U
    else:
        W, Qg, Kd, Aqk, gc, Tm, hs, ut, G, At, *norms = inter
        del inter
        if norms_from_scores and At is None:
            raise ValueError("norms_from_scores needs the forward's Ã: `_fwd(keep=True, norms_from_scores=True)`")
        # chunk-start states the forward returned (fp32), rounded as the recompute would have stored them
        hs = hs.to(backward_storage(q.dtype, "hs"))
    BV = min(V, TUNING["state_bwd_bv"])
    NT = max(plan.NT, 1)
    du = torch.empty(TT, H, V, dtype=backward_storage(q.dtype, "du"), device=dev)
    dse = torch.empty(NT, H, K, V, dtype=backward_storage(q.dtype, "dse"), device=dev)
    dh0 = torch.empty(plan.N, H, K, V, dtype=torch.float32, device=dev)
    interp = interpreting()
    qn, kn = norms
    _state_bwd[(V // BV, plan.N * H)](Qg, Kd, Aqk, W, gc, do, dht if dht is not None else dh0, du, dse, dh0,
                                      plan.cu, plan.chunk_off, H=H, K=K, V=V, BV=BV, C=CHUNK,
                                      USE_DHT=dht is not None, BF16=products == "bf16", SPLIT=products == "split",
                                      QPRIME=qprime, INTERP=interp, **launch)
    aqk = Aqk if qprime or norms_from_scores else gc  # the value side reads Aqk only with these
    del W, Qg, Kd, Aqk  # (kept ones live on in the autograd context until the backward returns)
    dv = torch.empty_like(v)
    # the value side's dq̂, dk̂, finished by the score side (`bwd_scratch_bf16`)
    dqh = torch.empty(TT, H, K, dtype=backward_scratch(q.dtype, "bwd_scratch_bf16"), device=dev)
    dkh = torch.empty_like(dqh)
    dG = torch.empty(NT, H, CHUNK, K, dtype=torch.float32, device=dev)
    daqk = torch.empty(TT, H, CHUNK, dtype=backward_scratch(q.dtype, "bwd_da_bf16"), device=dev)
    dakk = torch.empty_like(daqk)
    dq, dk, dz = torch.empty_like(q), torch.empty_like(k), torch.empty_like(z)
    db = torch.empty_like(b)
    SK = min(K, TUNING["bwd_k_cols"])
    NS = K // SK
    # the gate chain on `_bwd_k_block`'s key slices when it runs there (bwd_gate_fused)
    SKG = SK if gate_fused else min(K, TUNING["bwd_gate_cols"])
    NSG = K // SKG
    dA_part = torch.zeros(NT, H, NSG, dtype=torch.float32, device=dev)
    dbias_part = torch.zeros(NT, H, K, dtype=torch.float32, device=dev)
    if plan.NT > 0:
        # the value side over key slices from Ũ (docs/kda-kernels.md §7 item 13); dβ leaves each slice as a
        # partial for `_bwd_vv`
        SKV = min(K, TUNING["bwd_vk_cols"])
        NSV = K // SKV
        dbk = torch.empty(plan.NT, H, NSV, CHUNK, dtype=torch.float32, device=dev)
        # with norms_from_scores: the value side's parts of ⟨q̂, dq̂⟩ and ⟨k̂, dk̂⟩ per slice, then `_bwd_vv`'s sums
        # and the β logit's gradient; else dβ before σ' for `_bwd_norms`
        nd = torch.empty(plan.NT, H, NSV, 2, CHUNK, dtype=torch.float32, device=dev) if norms_from_scores else dbk
        nrm = torch.empty(TT, H, 2, dtype=torch.float32, device=dev) if norms_from_scores else dbk
        dbeta = db if norms_from_scores else torch.empty(TT, H, dtype=torch.float32, device=dev)
        # fp32 loop tiles take twice the shared memory per stage: their own launch (TUNING)
        fp32_tiles = torch.float32 in (hs.dtype, dse.dtype, du.dtype, ut.dtype)
        vk_launch = _launch_options("bwd_vk")
        if fp32_tiles:
            vk_launch["num_stages"] = TUNING["bwd_vk_fp32_stages"]
        # K = 16 with BV = 32 faulted (illegal address, in the value-side kernel of the time) on the H200; BV = 16
        # runs (docs/kda-kernels.md, runs 8-9)
        BVK = min(V, TUNING["bwd_vk_fp32_bv" if fp32_tiles else "bwd_vk_bv"]) if K > 16 else 16
        # with bwd_vv_fused, the key slices of a chunk count themselves here (`_bwd_vk`)
        vv_fused = bool(TUNING["bwd_vv_fused"])
        slices_done = torch.zeros(plan.NT, H, dtype=torch.int32, device=dev) if vv_fused else dbk
        at = aqk if At is None else At
        BVV = min(V, TUNING["bwd_vv_bv"])
        _bwd_vk[(plan.NT * NSV, H)](q, k, b, G, gc, qn, kn, plan.cu, plan.chunk_idx, Tm, hs, dse, do, du, ut, aqk,
                                    dqh, dkh, dG, dbk, nd, v, at, dv, daqk, dakk, dbeta, nrm, slices_done, scale,
                                    H=H, K=K, V=V, SK=SKV, BV=BVK, C=CHUNK, QPRIME=qprime,
                                    ROW_DOTS=norms_from_scores, VV=vv_fused, BVV=BVV, INTERP=interp, **vk_launch)
        if not vv_fused:
            _bwd_vv[(plan.NT, H)](v, b, plan.cu, plan.chunk_idx, Tm, do, du, ut, aqk, dbk, at, nd, dv, daqk, dakk,
                                  dbeta, nrm, H=H, V=V, NS=NSV, BV=BVV, C=CHUNK, QPRIME=qprime,
                                  NORMS=norms_from_scores, INTERP=interp, **_launch_options("bwd_vv"))
        del dbk, nd, ut, aqk, At, at, slices_done
        # per (16-row block, key slice): the score side (docs/kda-kernels.md §7 item 22); then per (key slice,
        # chunk) the reverse cumsum and the gate chain, and per row the norm and σ' chains (in `_bwd_k_block` and
        # `_bwd_vv` with norms_from_scores)
        db_part = nrm if norms_from_scores else torch.empty(TT, H, NS, dtype=torch.float32, device=dev)
        # with bwd_gate_fused, the blocks of a chunk count themselves per key slice here (`_bwd_k_block`)
        blocks_done = torch.zeros(plan.NT, H, NS, dtype=torch.int32, device=dev) if gate_fused else db_part
        _bwd_k_block[(plan.NT * NS * (CHUNK // BCK), H)](q, k, b, G, qn, kn, plan.cu, plan.chunk_idx, dqh, dkh, dG,
                                                         daqk, dakk, db_part, nrm, dq, dk, z, A_log, dt_bias, dz,
                                                         dA_part, dbias_part, blocks_done, scale, H=H, K=K, SK=SK,
                                                         C=CHUNK, BC=BCK, NORMS=norms_from_scores, GATE=gate_fused,
                                                         G_MIN=g_min, INTERP=interp, **_launch_options("bwd_k"))
        del G, blocks_done
        if not gate_fused:
            _bwd_gate[(plan.NT * NSG, H)](z, A_log, dt_bias, plan.cu, plan.chunk_idx, dG, dz, dA_part, dbias_part,
                                          H=H, K=K, SK=SKG, C=CHUNK, G_MIN=g_min, INTERP=interp,
                                          **_launch_options("bwd_gate"))
        if not norms_from_scores:
            BT = TUNING["bwd_norms_rows"]
            _bwd_norms[(triton.cdiv(TT, BT), H)](q, k, b, qn, kn, dqh, dkh, dbeta, db_part, dq, dk, db, TT, scale,
                                                 H=H, K=K, NS=NS, BT=BT, INTERP=interp,
                                                 **_launch_options("bwd_norms"))
    else:
        dv.zero_()
    dA_log = dA_part.sum((0, 2)).to(A_log.dtype)
    ddt_bias = dbias_part.sum(0).reshape(-1).to(dt_bias.dtype)
    return dq, dk, dv, dz, db, dA_log, ddt_bias, dh0


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd wrapper. With `keep` it saves the raw inputs and the forward's chunk operands, chunk-start
    states and Ũ (`_fwd(keep=True)`; not h0), and the backward recomputes nothing; without, only the raw inputs and
    h0, and the backward recomputes them. Everything goes through `save_for_backward`, so saved-tensor hooks
    (non-reentrant activation checkpointing, offloading) and the in-place checks cover it."""

    @staticmethod
    def forward(ctx, q, k, v, z, b, A_log, dt_bias, h0, g_min, scale, plan, want_ht, want_hs, dtypes, state_bf16,
                keep, training):
        # decided once for both passes: the kept operands are Q′ or Q⊙Γ, with Ã or without, by them
        qprime = bool(TUNING["state_bwd_qprime"])
        norms_from_scores = bool(TUNING["norms_from_scores"])
        o, ht, hs, kept = _fwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan, want_ht, want_hs, dtypes,
                               state_bf16, keep=keep, training=training, qprime=qprime,
                               norms_from_scores=norms_from_scores)
        if kept is None:
            ctx.save_for_backward(q, k, v, z, b, A_log, dt_bias, h0)
        else:
            ctx.save_for_backward(q, k, v, z, b, A_log, dt_bias, *kept)
        ctx.cfg = (g_min, scale, plan, dtypes, state_bf16, kept is not None, h0 is not None, qprime,
                   norms_from_scores)
        ctx.mark_non_differentiable(*(x for x in (hs,) if x is not None))
        return o, ht, hs

    @staticmethod
    def backward(ctx, do, dht, dhs):
        g_min, scale, plan, dtypes, state_bf16, kept, has_h0, qprime, norms_from_scores = ctx.cfg
        saved = ctx.saved_tensors
        q, k, v, z, b, A_log, dt_bias = saved[:7]
        h0, inter = (None, saved[7:]) if kept else (saved[7], None)
        del saved
        dq, dk, dv, dz, db, dA_log, ddt_bias, dh0 = _bwd(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan,
                                                          do.contiguous(),
                                                          None if dht is None else dht.contiguous(),
                                                          dtypes, state_bf16, inter=inter, qprime=qprime,
                                                          norms_from_scores=norms_from_scores)
        return (dq, dk, dv, dz, db, dA_log, ddt_bias, dh0 if has_h0 else None) + (None,) * 9


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    z: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    gate_lower_bound: float = -5.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_host: Sequence[int] | None = None,
    return_chunk_states: bool = False,
    all_bf16: bool = False,
    state_bf16: bool = False,
    save_intermediates: bool = True,
):
    """Chunked KDA on raw inputs, with the gate, q/k L2 norms and β sigmoid fused in. Differentiable.

    q, k: [B, T, H, K] after the short conv + SiLU, not normalised; v: [B, T, H, V]; z: [B, T, H, K] decay
    logits before dt_bias; beta_logits: [B, T, H]; A_log: [H]; dt_bias: [H*K] (or [H, K]); bf16 or fp32.
    gate_lower_bound: g_min ∈ [−5, 0). scale multiplies q̂ (default K**-0.5). initial_state:
    [N, H, K, V] (N = B, or the number of documents with cu_seqlens [N+1], B = 1).
    Returns o [B, T, H, V] in v's dtype and the final state [N, H, K, V] fp32 (None unless
    output_final_state); with return_chunk_states also the states at every 64-token chunk start,
    [NT, H, K, V] fp32, chunks numbered document by document (not differentiable).
    cu_seqlens_host: the same offsets as host ints when the caller has them (`SequenceLayout.offsets`):
    planning then never reads `cu_seqlens` back from the GPU (a sync per call).
    all_bf16 / state_bf16 select the faster, less accurate variants measured in docs/kda-kernels.md.
    When no backward can follow, the forward runs the 32- or 16-token inference kernels (`triton_prefill`, docs §9) if
    `prefill_applies` (enough programs to fill the GPU), else the 64-token ones; both return the same things.

    save_intermediates (the model's `kda_save_intermediates`) trades memory for
    backward time. Only when a backward can follow (grad mode on and some input requires grad; never for
    inference or prefill) the forward keeps, until the backward has run, what the backward would otherwise
    recompute with the prepare kernels and `_state` (same kernels, same inputs: bit-identical gradients).
    Per call, with TT = B·T tokens and NT chunks (NT = ⌈T/64⌉·B dense; per document with cu_seqlens):
      W, Q⊙Γ, K⊙exp(G_C − G)   3 × [TT, H, K]    bf16 (fp32 for fp32 inputs)
      Aqk                      [TT, H, 64]       fp32 (bf16 with all_bf16)
      T = (I + Akk)⁻¹          [TT, H, 64]       fp32
      G_C                      [NT, H, K]        fp32
      G (in-chunk cumsum)      [TT, H, K]        fp32
      chunk-start states       [NT, H, K, V]     bf16 (TUNING["bwd_storage_bf16"]; fp32 for fp32 inputs, and
                                                 the returned fp32 ones if return_chunk_states)
      Ũ = U − W·S              [TT, H, V]        bf16 (the same switch; else U's dtype)
      ‖q‖, ‖k‖                 2 × [TT, H]       fp32
      Ã (Akk before β)         [TT, H, 64]       bf16 (fp32 for fp32 inputs); only with
                                                 TUNING["norms_from_scores"] (+96 MiB below)
    At the K3 shape (T = 8192, H = 96, K = V = 128, bf16, no all_bf16) that is 576 + 192 + 192 + 6 + 384 + 384 +
    192 MiB ≈ 1.88 GiB per layer (the states are the largest part: 2·K·V/64 = 512 B per token and head), in
    exchange for the recompute: ~6.5 ms of the then ~32 ms forward + backward (docs/kda-kernels.md §7 item 9).
    (G since session 13: the backward reads it instead of recomputing the gate, §7 item 23.)
    initial_state is then not saved. The kept W, Q⊙Γ, K⊙exp(G_C − G), Aqk and Ũ are released when the
    backward returns (autograd frees saved tensors only then), not after the state pass as the recomputed ones
    are. With return_chunk_states the returned states are the saved ones: modifying them in place before the
    backward makes autograd raise instead of computing wrong gradients. Keeping also changes how o is computed
    for bf16 inputs (`TUNING["state_o_apart"]`): from the kept bf16 states and Ũ after `_state`, which is faster
    and rounds o's inputs once more (3.1 → 3.8e-3 from fp64 at the K3 shape's heads); so o with and without
    save_intermediates agrees to that tolerance, not to the bit, while the gradients stay bit-identical.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or z.shape != q.shape:
        raise ValueError(f"k and z must match q {tuple(q.shape)}, got {tuple(k.shape)} and {tuple(z.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta_logits.shape != q.shape[:3]:
        raise ValueError(f"beta_logits must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta_logits.shape)}")
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(f"A_log must have {H} and dt_bias {H * K} entries, got {A_log.numel()}, {dt_bias.numel()}")
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"{name} must be a power of two in [16, 256], got {d}")
    if not -5.0 <= gate_lower_bound < 0.0:
        raise ValueError(f"gate_lower_bound must be in [-5, 0) (16-token tiles stay in range), got {gate_lower_bound}")
    _check_device(q, k, v, z, beta_logits, A_log, dt_bias)
    plan = make_plan(B, T, cu_seqlens, q.device, cu_seqlens_host)
    if initial_state is not None and initial_state.shape != (plan.N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = [{plan.N}, {H}, {K}, {V}], "
                         f"got {tuple(initial_state.shape)}")
    scale = K**-0.5 if scale is None else float(scale)

    def flat(x):
        return x.reshape(B * T, *x.shape[2:]).contiguous()

    h0 = None if initial_state is None else initial_state.float().contiguous()
    training = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, z, beta_logits, A_log, dt_bias, initial_state))
    keep = bool(save_intermediates) and training
    raw = (flat(q), flat(k), flat(v), flat(z), flat(beta_logits), A_log.contiguous(), dt_bias.reshape(-1).contiguous())
    dtypes = inter_dtypes(q.dtype, all_bf16)
    # the inference forward in 32- or 16-token chunks (docs §9)
    if not training and prefill_applies(plan, H, V, q.device):
        o, ht, hs = prefill_forward(*raw, float(gate_lower_bound), scale, h0, plan, output_final_state,
                                    return_chunk_states, dtypes, state_bf16)
    else:
        o, ht, hs = ChunkKDAFunction.apply(*raw, h0, float(gate_lower_bound), scale, plan, output_final_state,
                                           return_chunk_states, dtypes, state_bf16, keep, training)
    o = o.view(B, T, H, V)
    if return_chunk_states:
        return o, ht, hs[: plan.NT]
    return o, ht
