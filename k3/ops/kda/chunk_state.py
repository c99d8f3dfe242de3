"""The inter-chunk state passes of chunked KDA, forward and backward (fla's `chunk_delta_h`). Each walks one
sequence's chunks in order with its state [K, BV] in fp32 registers, one program per (value block, sequence, head).

- `_state`, forward, per chunk: Ũ = U − W·S; O = (Q⊙Γ)·S + Aqk·Ũ (unless the output is computed apart,
  `chunk_output.py`); S ← Diag(Γ_C)·S + (K⊙exp(G_C − G))ᵀ·Ũ. On request it stores S at every chunk start and Ũ,
  which the backward reads instead of recomputing them.
- `_state_bwd`, backward, last chunk first: dŨ = Aqkᵀ·dO + Kd·dS_end; dS_start = Qgᵀ·dO + Diag(Γ_C)·dS_end − Wᵀ·dŨ.

Their products are split bf16 by default (`_mm_split`, ~16 mantissa bits: `TUNING["state_split"]`,
`TUNING["state_bwd_products"]`). The interpreter cannot take a loaded scalar as a `range` bound, so each chunk loop
has a `while` form for it; compiled code needs `for` to pipeline the loads.

Legend: TT tokens, H heads, K key dim, V value dim, N sequences, NT chunks, C chunk size, BV value block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops import interpreting
from k3.ops.kda.chunk_common import CHUNK, _bp, _cast, _load_gamma, _sequence_coords, _state_mm
from k3.ops.kda.tuning import TUNING, _launch_options


@triton.jit
def _state_step(S, j, w, u, qg, kd, aqk, gc, o, hs, ut, bos, L, c0, i_h, i_v, off_s,
                H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                STORE_HS: tl.constexpr, WRITE_O: tl.constexpr, STORE_UT: tl.constexpr, BF16: tl.constexpr,
                SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """Chunk j of one sequence in `_state`; returns the state after it. STORE_UT: also store Ũ (for the
    backward's `_bwd_vk` / `_bwd_vv`; a separate specialisation, so the inference forward compiles without it).
    G_C is loaded in the step, not one step ahead as `_state_bwd` and `_prefill_state` do (`_load_gamma`): here the
    load is already behind two products, and loading it ahead was slower."""
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
        # the chunk-start state, stored last and through a block pointer: stored first, through the offset tile,
        # it made the forward that also writes o spill registers
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
