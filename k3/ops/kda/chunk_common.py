"""What the chunked KDA kernels share (`chunk_*.py`, 64-token chunks; `chunk_prefill.py`, 16- and 32-token chunks):
the chunk sizes, the device helpers (products at a chosen precision, round-to-nearest casts, block pointers, the
gate, the 16×16 inverse), the chunk plan of packed documents and the storage dtypes.

The helpers' numerics are described in docs/kda-kernels.md, "Numerics".

Legend: TT tokens of all documents, H heads, K key dim, V value dim, N documents, NT chunks, C chunk size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from k3.ops import triton_runs_on
from k3.ops.kda.reference import document_offsets
from k3.ops.kda.tuning import TUNING

# the training kernels' chunk, and their row blocks: over 16 rows with g ≥ −5 every anchored decay factor stays
# within e^±80, inside fp32's range
CHUNK = 64
SUB = 16


@triton.jit
def _exp(x, INTERP: tl.constexpr):
    """exp(x) flushed to zero below fp32's normal range (ex2.approx.ftz, `libdevice.fast_expf`; tl.exp in the
    interpreter): it skips tl.exp's denormal scaling, three of its five instructions. The anchored factors are
    within e^±80, so a flushed result is a product that is below fp32's range anyway."""
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
    converts them to fp32 in shared memory."""
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
    waiting for it was the state passes' largest stall."""
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
    """A 16×16 product at a chosen precision: "ieee" (exact FMA, whose operand reads are bank-conflicted) or "tf32"
    (tensor cores, 10-bit operands, faster)."""
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
