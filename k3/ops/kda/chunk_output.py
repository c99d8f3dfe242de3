"""The training forward's output apart from the state pass (fla's `chunk_o`): O = (Q⊙Γ)·S + Aqk·Ũ per (value block,
chunk, head), from the chunk-start states and Ũ that `_state` stores in bf16 for the backward
(`TUNING["state_o_apart"]`, `output_apart`). `_state` then walks the chunks without Q⊙Γ and Aqk, in less shared
memory, and o carries the bf16 rounding of S and Ũ. Elsewhere (inference, fp32 inputs, a forward that keeps
nothing) `_state` writes o itself.

Legend: TT tokens, H heads, K key dim, V value dim, C chunk size, BV value block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops.kda.chunk_common import _bp, _cast, _chunk_coords, _state_mm, backward_storage
from k3.ops.kda.tuning import TUNING


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
    LOOP (the variant `TUNING["fwd_o_loop"]`): one program per (chunk, head) walks the value blocks, Q⊙Γ and Aqk
    loaded once."""
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


def output_apart(dtype: torch.dtype, u_dtype: torch.dtype, keep: bool, want_hs: bool) -> bool:
    """Whether a forward on inputs of `dtype` (U stored in `u_dtype`) computes o apart from `_state`, from the
    chunk-start states and Ũ it keeps for the backward (`_fwd_o`, `TUNING["state_o_apart"]`): where it keeps them
    and both are bf16 (not where it returns the states, in fp32, for prefix caching)."""
    return (keep and not want_hs and TUNING["state_o_apart"]
            and backward_storage(dtype, "hs") == backward_storage(dtype, "ut", u_dtype) == torch.bfloat16)
