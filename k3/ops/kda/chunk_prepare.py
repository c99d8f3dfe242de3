"""The prepare of the chunked KDA forward: everything inside a chunk, all chunks in parallel (the UT transform of
docs/kda.md §3; fla's `chunk_intra` and `wy_fast`).

Per 64-token chunk, in four 16-row blocks R:
- `_prep_gate`: the gate g = g_min·σ(exp(A)·(z + dt_bias)), its in-chunk cumulative sum G (fp32), G_C (G at the
  chunk's last row) and ‖k‖ per row;
- `_prep_intra`, one program per row block: Q⊙Γ (Γ = exp(G)), Aqk, and T's storage: Akk left of the diagonal
  block, the inverse (I + Akk_RR)⁻¹ on it;
- `_prep_solve`: T = (I + Akk)⁻¹ in place, T_RJ = −T_RR·Σ_{J≤M<R} Akk_RM·T_MJ;
- `_prep_wu`, per column slice: W = T·diag(β)(K⊙Γ), U = T·diag(β)V and K⊙exp(G_C − G).

The q/k L2 norms (and q's scale) and β = σ(b) are computed from the raw inputs, never materialised. Every score
block is a tensor-core product: the decay exp(G[r] − G[i]) is factorised around the row block's first row, and
both factors stay within fp32's range because g ≥ −5 (docs/kda.md §4). The inverses use A nilpotent:
(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸) (`_inv16`).

Legend: TT tokens, H heads, K key dim, V value dim, NT chunks, C chunk size (64), BC row block (16), SK, SV
column slices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3.ops import interpreting
from k3.ops.kda.chunk_common import (CHUNK, SUB, _bp, _cast, _chunk_coords, _exp, _gate_tile, _inv16,
                                     _inverse_precision, _load_beta, _load_block, _mm, _mm32, _store_block)
from k3.ops.kda.tuning import _launch_options


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


@triton.jit
def _row_norm(x, bos, L, row0, i_h, H, K: tl.constexpr, BC: tl.constexpr):
    """sqrt(‖x_r‖² + 1e-6) for the BC rows at row0 (zero rows past the document end give 1e-3)."""
    xr = tl.load(_bp(x, bos, L, i_h, row0, 0, H, K, BC, K), boundary_check=(0,), padding_option="zero")
    xr = xr.to(tl.float32)
    return tl.sqrt(tl.sum(xr * xr, 1) + 1e-6)


@triton.jit
def _diag_scores(qs, ks, kc, BC: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr):
    """Diagonal 16×16 blocks of Ã (Akk before its β scaling, strictly lower) and Aqk (lower incl. the diagonal).

    With bf16 inputs the operands are bf16: a 16-row operand is replicated in every warp of the dot, and in tf32
    the kernel spilled registers; bf16 keeps e^±75 (fp32's exponent range).
    """
    r = tl.arange(0, BC)
    kcT = tl.trans(kc)
    At = tl.where(r[:, None] > r[None, :], _mm(ks, kcT, BF16, INTERP), 0.0)
    Aqk = tl.where(r[:, None] >= r[None, :], _mm(qs, kcT, BF16, INTERP), 0.0)
    return At, Aqk


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
def _gate_rows(g_in, kn_in, bos, L, row0, i_h, H, K: tl.constexpr, BC: tl.constexpr):
    """The 16 rows at row0 of G (zeros past the document end), G at their first row (zeros past the end) and
    ‖k‖ (1 past the end: k there is zero, and k̂ must be too). The backward's column-slice form (`_g_block`) also
    sets the past-the-end rows and loads the block's end, which the forward's off-diagonal walk does not need."""
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
    underflows to 0 (a_R − G[i] down to −5·48) bounds a true product that is below fp32's range anyway. (A second
    anchor at block J's last row, as `_bwd_k_block` takes, was slower here.)"""
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
    its diagonal blocks with zeros on and above their diagonal and nothing right of them, for the variant
    `TUNING["norms_from_scores"]` (`_bwd_vv`)."""
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
