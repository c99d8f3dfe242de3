"""The backward kernels of chunked KDA after the state pass (`_state_bwd`, `chunk_state.py`), which writes dŨ and
the state gradient at every chunk end (fla's `chunk_bwd` and the backward of `chunk_intra`):

- the value side: `_bwd_vk`, per (key slice, chunk, head), the gradients that are elementwise in the key column
  (dq̂, dk̂ and dG from the states, dβ's key part); then `_bwd_vv`, per (chunk, head), the ones that contract over
  the value dim (dAqk, dAkk = −Tᵀ·(dŨ·Ũᵀ), dv, dβ);
- the score side: `_bwd_k_block`, per (16-row block, key slice, chunk, head), the gradients through the score
  blocks Aqk and Akk, in the prepare's blocks and anchors;
- `_bwd_gate`, per (key slice, chunk, head): the reverse cumsum dG → dg and the gate chain (dz, dA_log, dt_bias);
- `_bwd_norms`, per row: the q/k L2-norm backward and dβ's σ', which sum over K.

The derivations are in docs/kda-kernels.md, "Kernels by stage". The variant switches at the end of `TUNING` fuse
some of these launches; each kernel says where it branches for them.

Legend: TT tokens, H heads, K key dim, V value dim, NT chunks, C chunk size (64), BC row block, SK key slice,
NS key slices, BV value block.
"""

from __future__ import annotations

import triton
import triton.language as tl

from k3.ops.kda.chunk_common import (_bp, _cast, _chunk_coords, _dot_stored, _exp, _gate_from, _gate_inputs, _load_beta,
                                     _load_block)


@triton.jit
def _load_norm(n_in, bos, L, row0, i_h, H, BC: tl.constexpr):
    """The prepare's row norms ‖q‖ or ‖k‖ ([TT, H] fp32) of the BC rows at row0; 1 past the document end.

    Kept from the prepare (+8 bytes per token and head) for `_bwd_vk`, `_bwd_k_block` and `_bwd_norms`, instead of a
    full-row load per key slice."""
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
def _bwd_vk(q, k, b, g_in, gc_in, qn_in, kn_in, cu, chunk_idx, t_in, hs, dse, do, du, ut, aqk,
            dqh_out, dkh_out, dg_out, dbk_out, nd_out, v, at_in, dv, daqk_out, dakk_out, db_out, nrm_out, done,
            scale, H, K: tl.constexpr, V: tl.constexpr, SK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
            QPRIME: tl.constexpr, ROW_DOTS: tl.constexpr, VV: tl.constexpr, BVV: tl.constexpr,
            INTERP: tl.constexpr):
    """Value side, part 1: one (key slice of SK columns, chunk, head), the gradients that are elementwise
    in the key column, from the forward's Ũ = U − W·S (no W, no W·S).

    Looping over value blocks, on the slice's rows of S and dS_end: dQg = dO·Sᵀ, dW = −dŨ·Sᵀ, dKd = Ũ·dS_endᵀ and
    dΓ_C = Σ_v S ⊙ dS_end. Then, per key column, the value-side dq̂ = dQg⊙Γ, dk̂ = dKd⊙exp(G_C − G) + β·(Tᵀ·dW)⊙Γ
    and dG (with G_C's gradient on the last row) into the scratch `_bwd_k_block` reads (dG fp32; dq̂ and dk̂ in
    `backward_scratch`'s dtype). The one term that sums over K, dβ_k = Σ_k (Tᵀ·dW)⊙K⊙Γ, leaves as this slice's
    partial for `_bwd_vv` (dbk_out [NT, H, NS, C]). G, G_C, ‖q‖ and ‖k‖ are the prepare's (G reads 0 past the
    document end, where every factor it enters multiplies a zero row). T, G, q̂ and k̂, which only the part after
    the loop reads, are loaded before it: with one program per SM no neighbour hides their latency, the loop's
    products do. S, dS_end, dŨ and Ũ multiply as stored (`_dot_stored`, `TUNING["bwd_storage_bf16"]`).

    Variants (`TUNING`'s last section): QPRIME (`state_bwd_qprime`): du holds only dŨ's part Kd·dS_end
    (`_state_bwd_step`); the rest, Aqkᵀ·dO, enters dW after the loop as −Aqkᵀ·dQg. ROW_DOTS (`norms_from_scores`):
    also this slice's part of ⟨q̂, dq̂⟩ and ⟨k̂, dk̂⟩ per row (nd_out [NT, H, NS, 2, C]), which `_bwd_vv` completes.
    VV (`bwd_vv_fused`): the last of a chunk's NS slice programs to finish (counted in `done`, [NT, H] int32 zeros,
    `_last_to_finish`) runs `_bwd_vv`'s work for the chunk (`_vv_chain` on value blocks of BVV), and no `_bwd_vv`
    launch follows.
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
    """Value side, part 2: one (chunk, head), the gradients that contract over the value dim within
    the chunk: dAqk, dAkk, dv and dβ.

    Looping over value blocks: dAqk = dO·Ũᵀ, dŨ·Ũᵀ, and through U = T·diag(β)·V, dv = β·Tᵀ·dŨ and
    dβ_v = Σ_v (Tᵀ·dŨ)⊙V, on top of `_bwd_vk`'s NS partials of dβ, summed first in slice order (deterministic).
    Then dAkk = −Tᵀ·(dŨ·Ũᵀ): Ũ = T·X with T = (I + Akk)⁻¹, so Akk's gradient needs no key side (the derivation is
    in docs/kda-kernels.md, "Kernels by stage"). Writes dv, and dAqk, dAkk (masked to their lower triangles) and
    dβ for `_bwd_k_block` and `_bwd_norms`.

    Variants (`TUNING`'s last section): QPRIME (`state_bwd_qprime`): du holds only dŨ's part Kd·dS_end; each value
    block adds Aqkᵀ·dO before T's product, and dŨ·Ũᵀ takes Aqkᵀ·dAqk after the loop. NORMS (`norms_from_scores`):
    the sums over K that the norm backward and dβ need, from the scores by Euler's identity (⟨q̂_r, dq̂_r⟩'s score
    part is Σ_i dAqk[r, i]·Aqk[r, i], and so on), on the prepare's Ã (at_in) and `_bwd_vk`'s partials (nd_in), into
    nrm_out ([TT, H, 2] fp32), and dβ times σ' into db_out (b's dtype): `_bwd_k_block` then finishes dq and dk, and
    no `_bwd_norms` runs.
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
    """The score backward of one (BC-row block R, key slice of SK columns, chunk, head):
    everything that lands on block R's rows, so no program waits for another and nothing is carried across blocks.

    Block (R, J) of Aqk = Σ_k q̂[r]k̂[i]·exp(G[r] − G[i]) (and of Ã, Akk = diag(β)·Ã) is a product of 16-row tiles
    around anchors, every factor within fp32's range because g ≥ −5 (docs/kda.md §4):
    - the diagonal block around a_R (G at R's first row): row factor exp(G_r − a_R), column factor exp(a_R − G_i);
    - a block (R, J < R), R's row side: Σ_i dA[r, i]·k̂_i⊙exp(e_J − G_i) (e_J: G at J's last row), times
      exp(a_R − e_J) and the row factor;
    - a block (J > R, R), R's column side: Σ_r dA[r, i]·(q̂_r or β_r k̂_r)⊙exp(G_r − a_J), times exp(a_J − e_R) and
      finished with exp(e_R − G_i) ≤ 1.
    The gate gets +x⊙dx on the row factor's side and −x⊙dx on the column's (if a quantity depends on G only through
    x⊙exp(±G), dG = ±x⊙dx).

    On top of `_bwd_vk`'s dq̂, dk̂ and dG it writes block R's finished dq̂ and dk̂, its dG before the reverse cumsum
    (`_bwd_gate` does that and the gate chain) and this slice's dβ partial (db_part [TT, H, NS]); `_bwd_norms`
    finishes what reduces over K. A block wholly past the document end does nothing: its dG rows (G_C's gradient
    may sit on the chunk's last row) pass through unchanged. The products are tf32: with bf16 operands ddt_bias's
    error came near its tolerance.

    Variants (`TUNING`'s last section): NORMS (`norms_from_scores`): with ⟨q̂, dq̂⟩ and ⟨k̂, dk̂⟩ per row from
    `_bwd_vv` (nrm_in [TT, H, 2]) it finishes the norm backward and writes dq and dk, no dq̂, dk̂ and no dβ partial.
    GATE (`bwd_gate_fused`): the last of a chunk's row blocks inside the document to finish on this key slice
    (counted in `done`, [NT, H, NS] int32 zeros) runs `_bwd_gate`'s work for the chunk and slice (`_gate_chain`) on
    the dG its siblings have just written. BC 32 (`bwd_k_rows`): 32-row blocks, half the neighbours' loads; they
    anchor at their middle row (factors within e^±80) and finish their row side per block, so that every factor
    that can underflow multiplies only factors ≤ 1.
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
