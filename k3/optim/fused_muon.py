"""Muon's elementwise passes as two multi-tensor Triton kernels, beside the foreach reference in `muon.py`.

Legend: T tensors (the Muon parameters of a step), n elements of one tensor, BLOCK elements per program.

    muon_momentum:  M ← lerp(M, G, 1 − μ);  N ← lerp(G, M, μ) stored in the Newton–Schulz dtype
    muon_update:    W ← W·(1 − ηλ) + α_t·O,  α_t = −η·0.2·√max(rows, cols) of tensor t

The reference (`MuonAdamW(impl="reference")`) runs `_foreach_lerp_`, `_foreach_lerp`, the cast inside the
Newton–Schulz stacking, then `mul_` and `add_` per parameter: per element 30 bytes for the momentum and
18 for the update (fp32 W, M, G; bf16 N, O). The kernels move 14 and 10: G and M are read once, M and N
written once, and the decayed W never goes back to memory between the two ops.

One launch covers every tensor, as torch's foreach kernels do: the tensors' data pointers go to the GPU
as a table [k, T] (one small copy per call), and a work list of (tensor, chunk) tiles — fixed by the
tensors' sizes, so built once per layout and cached — gives each program its BLOCK elements.

Exactness: every op is the one torch's kernels run. lerp is ATen's two-branch form (Lerp.h) as an fma
(nvcc contracts it; the CPU kernel calls fmadd); `mul_` rounds W·(1 − ηλ) to W's dtype before `add_`
reads it; `add_` is fma(α, O, W); scalars are fp32 as torch passes them; bf16 stores round to nearest
even. On CUDA both kernels equal the reference bit for bit (tests/optim/test_fused_step.py). The Triton
interpreter evaluates fma as a product then a sum and truncates fp32 → bf16, so on CPU the test allows
one unit in the last place.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: MuonAdamW keeps the foreach reference
    triton = None

BLOCK = 4096
NUM_WARPS = 8

if triton is not None:
    _TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _lerp(a, b, w):
        # torch.lerp op for op (ATen/native/Lerp.h): |w| < 0.5 → a + w·(b − a), else b − (b − a)·(1 − w)
        d = b - a
        return tl.where(tl.abs(w) < 0.5, tl.fma(d, w, a), tl.fma(-d, 1.0 - w, b))

    @triton.jit
    def _tile(NUMEL, TILE_T, TILE_C, BLOCK: tl.constexpr):
        """This program's tile of the work list: (tensor index t, element offsets in it, in-bounds mask)."""
        tile = tl.program_id(0)
        t = tl.load(TILE_T + tile)
        offs = tl.load(TILE_C + tile).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        return t, offs, offs < tl.load(NUMEL + t)

    @triton.jit
    def _muon_momentum_kernel(PTRS, NUMEL, TILE_T, TILE_C, T, w_m, w_n, G_TY: tl.constexpr, N_TY: tl.constexpr,
                              BLOCK: tl.constexpr):
        t, offs, mask = _tile(NUMEL, TILE_T, TILE_C, BLOCK)
        g_ptr = tl.load(PTRS + t).to(tl.pointer_type(G_TY))
        m_ptr = tl.load(PTRS + T + t).to(tl.pointer_type(tl.float32))
        n_ptr = tl.load(PTRS + 2 * T + t).to(tl.pointer_type(N_TY))
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = _lerp(tl.load(m_ptr + offs, mask=mask), g, w_m)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(n_ptr + offs, _lerp(g, m, w_n).to(N_TY), mask=mask)

    @triton.jit
    def _muon_update_kernel(PTRS, ALPHA, NUMEL, TILE_T, TILE_C, T, decay, W_TY: tl.constexpr, O_TY: tl.constexpr,
                            BLOCK: tl.constexpr):
        t, offs, mask = _tile(NUMEL, TILE_T, TILE_C, BLOCK)
        w_ptr = tl.load(PTRS + t).to(tl.pointer_type(W_TY))
        o_ptr = tl.load(PTRS + T + t).to(tl.pointer_type(O_TY))
        # mul_ stores W·(1 − ηλ) in W's dtype before add_ reads it back
        w = (tl.load(w_ptr + offs, mask=mask).to(tl.float32) * decay).to(W_TY).to(tl.float32)
        o = tl.load(o_ptr + offs, mask=mask).to(tl.float32)
        tl.store(w_ptr + offs, tl.fma(o, tl.load(ALPHA + t), w).to(W_TY), mask=mask)


@functools.lru_cache(maxsize=16)
def _tiles(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(numel [T] int64, tensor of each tile, chunk of each tile) on `device`; tiles in tensor order."""
    numel = torch.tensor(numels, dtype=torch.int64)
    chunks = (numel + BLOCK - 1) // BLOCK
    tile_t = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), chunks)
    starts = torch.cumsum(chunks, 0) - chunks
    tile_c = (torch.arange(len(tile_t), dtype=torch.int64) - torch.repeat_interleave(starts, chunks)).to(torch.int32)
    return numel.to(device), tile_t.to(device), tile_c.to(device)


def _pointer_table(lists: list[list[Tensor]], device: torch.device) -> Tensor:
    # pageable → device without a stream sync: the driver stages the few bytes before returning
    return torch.tensor([t.data_ptr() for ts in lists for t in ts], dtype=torch.int64).to(device, non_blocking=True)


def _check(tensors: list[Tensor]) -> None:
    if not triton_runs_on(tensors[0]):
        raise RuntimeError("the fused Muon kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1")
    assert all(t.is_contiguous() for t in tensors), "the multi-tensor kernels index flat storage"


def muon_momentum(bufs: list[Tensor], grads: list[Tensor], momentum: float, dtype: torch.dtype) -> list[Tensor]:
    """Momentum and Nesterov look-ahead of every Muon tensor in one pass.

    bufs: fp32 momentum, updated in place; grads: same shapes, fp32/bf16/fp16. Returns N per tensor in
    `dtype` (views of one buffer): `lerp(g.float(), m, μ).to(dtype)` after `m.lerp_(g.float(), 1 − μ)`.
    """
    assert triton is not None, "muon_momentum needs triton"
    _check(bufs + grads)
    assert all(b.dtype == torch.float32 and b.shape == g.shape for b, g in zip(bufs, grads))
    device = bufs[0].device
    numels = [g.numel() for g in grads]
    out = [n.view(g.shape) for n, g in zip(torch.empty(sum(numels), dtype=dtype, device=device).split(numels), grads)]
    for g_dtype in {g.dtype for g in grads}:
        idx = [i for i, g in enumerate(grads) if g.dtype == g_dtype]
        numel, tile_t, tile_c = _tiles(tuple(numels[i] for i in idx), device)
        if len(tile_t) == 0:
            continue
        ptrs = _pointer_table([[grads[i] for i in idx], [bufs[i] for i in idx], [out[i] for i in idx]], device)
        _muon_momentum_kernel[(len(tile_t),)](ptrs, numel, tile_t, tile_c, len(idx), 1 - momentum, momentum,
                                              G_TY=_TL[g_dtype], N_TY=_TL[dtype], BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def muon_update(weights: list[Tensor], updates: list[Tensor], decay: float, alphas: list[float]) -> None:
    """W ← W·decay + α·O for every tensor in one pass: `w.mul_(decay); w.add_(o, alpha=α)` per tensor.

    weights: fp32/bf16, updated in place; updates: same shapes, any float dtype, any strides (a transposed
    update is made contiguous first); alphas: one per tensor.
    """
    assert triton is not None, "muon_update needs triton"
    updates = [o.contiguous() for o in updates]
    _check(weights + updates)
    assert all(w.shape == o.shape for w, o in zip(weights, updates))
    device = weights[0].device
    for w_dtype, o_dtype in {(w.dtype, o.dtype) for w, o in zip(weights, updates)}:
        idx = [i for i, (w, o) in enumerate(zip(weights, updates)) if (w.dtype, o.dtype) == (w_dtype, o_dtype)]
        numel, tile_t, tile_c = _tiles(tuple(weights[i].numel() for i in idx), device)
        if len(tile_t) == 0:
            continue
        ptrs = _pointer_table([[weights[i] for i in idx], [updates[i] for i in idx]], device)
        # fp32, as torch passes a Python scalar alpha to its kernels
        alpha = torch.tensor([alphas[i] for i in idx], dtype=torch.float32).to(device, non_blocking=True)
        _muon_update_kernel[(len(tile_t),)](ptrs, alpha, numel, tile_t, tile_c, len(idx), decay,
                                            W_TY=_TL[w_dtype], O_TY=_TL[o_dtype], BLOCK=BLOCK, num_warps=NUM_WARPS)
