"""The inference forward of `chunk_kda` (no backward can follow: prefill, `torch.no_grad` forwards) in 16-token
chunks, or 32-token chunks made of 16-token halves (`TUNING["prefill_chunk"]`).

Why a second forward: the training forward (64-token chunks) writes what its backward reads, W, U, T, Aqk and G
(~5.8 GB of intermediates at the K3 shape), far above an inference forward's memory floor. This one keeps none of
it, and the lower-bounded gate allows a smaller chunk: over 16 tokens with g ≥ −5 the in-chunk decay
exp(G_r − G_i) lies in [e^−80, e^80], inside fp32's and bf16's range, so one anchor, the chunk's start, serves every
score of the chunk (no row blocks, no 64×64 solve). The design follows Moonshot's FlashKDA forward (CUDA);
docs/kda-kernels.md, "Kernels by stage", says what was taken over and what differs.

- `_prefill_prepare`, one program per (16-token chunk, head), all chunks in parallel: the gate, its in-chunk
  cumulative sum G (inclusive), the q/k L2 norms and β; then, with Γ = exp(G) and Γ_C its last row,
  Q_d = q̂⊙Γ, K_d = k̂⊙Γ, K_r = k̂⊙Γ_C/Γ, the in-chunk scores M = lower(Q_d·(k̂/Γ)ᵀ) (diagonal included),
  P = (I + diag(β)·strict_lower(K_d·(k̂/Γ)ᵀ))⁻¹·diag(β) (the 16×16 inverse, `_inv16`, in tf32 for 16-bit inputs),
  W = P·K_d and U = P·V. It stores Q_d, W, K_r, U, M and Γ_C. For 32-token chunks it runs twice, once per half:
  the second launch joins each chunk's second half to its first (the algebra is in its docstring), so no program
  holds more than one half and no factor leaves e^±80.
- `_prefill_state`, one program per (value block, sequence, head), the chunks of a sequence in order. With S the
  state at the chunk's start: Ũ = U − W·S, O = Q_d·S + M·Ũ, S ← Diag(Γ_C)·S + K_rᵀ·Ũ. 32-token chunks halve its
  sequential steps.
- For one sequence whose state pass fits in one wave (latency-bound, a few programs per SM) and that has enough
  work, the two run as a pipeline of segments of chunks (`pipelined`, `prefill_segments_for`): each segment's state
  pass, on a high-priority side stream, beside the next segment's prepare. With more state programs than SMs the
  segments end in shorter ones (`prefill_segment_tail`): the last state pass runs alone after the whole prepare.

The state is kept transposed, X = Sᵀ [BV, K] fp32 in registers, so that it is the left operand of both products
that read it (X·Wᵀ, X·Q_dᵀ) and the accumulator of the one that writes it (X·Γ_C + Ũᵀ·K_r): it never goes through
shared memory. For bf16 inputs its products take plain bf16 operands (`TUNING["prefill_state_bf16"]`, FlashKDA's
choice); for fp32 inputs, and with that switch off, products with an fp32 operand are split bf16 (`_state_mm`, as
the training forward's state pass).

Legend: TT tokens, H heads, K key dim, V value dim, N sequences, BV value block; here C = 16 or 32 and NT counts
C-token chunks.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from k3.ops import interpreting
from k3.ops.kda.chunk_common import (CHUNK, _bp, _cast, _chunk_coords, _exp, _gate_tile, _inv16, _inverse_precision,
                                     _load_beta, _load_gamma, _mm, _mm_split, _sequence_coords, _state_mm, _store_block,
                                     plan_for)
from k3.ops.kda.tuning import TUNING, _launch_options


@triton.jit
def _store_rows(x, out, bos, L, i_h, row0, H, W: tl.constexpr, C: tl.constexpr, INTERP: tl.constexpr):
    """x [C, W] into rows row0 … row0+C−1 of one document in out [TT, H, W], in out's dtype; none past its end."""
    tl.store(_bp(out, bos, L, i_h, row0, 0, H, W, C, W), _cast(x, out.dtype.element_ty, INTERP), boundary_check=(0,))


@triton.jit
def _block16(q, k, v, z, b, A_log, dt_bias, bos, L, row0, i_h, scale, H, K: tl.constexpr, V: tl.constexpr,
             G_MIN: tl.constexpr, SCORES_BF16: tl.constexpr, INVERSE: tl.constexpr, INTERP: tl.constexpr):
    """The 16 rows at row0 as a chunk of their own (anchored at its start): (Q_d fp32, Q_d as the score operand,
    W, K_r, U (fp32), M, Γ_C). Rows past the document end have g = 0 and q̂ = k̂ = β = 0: their rows are zero."""
    g, _, _ = _gate_tile(z, A_log, dt_bias, bos, L, row0, 0, i_h, H, K, 16, K, G_MIN)
    G = tl.cumsum(g, 0)
    r = tl.arange(0, 16)
    # G at the chunk's last row (g_end) is G at its last valid row (g = 0 past the document end)
    g_end = tl.sum(tl.where((r == 15)[:, None], G, 0.0), 0)
    q_raw = tl.load(_bp(q, bos, L, i_h, row0, 0, H, K, 16, K), boundary_check=(0,), padding_option="zero")
    k_raw = tl.load(_bp(k, bos, L, i_h, row0, 0, H, K, 16, K), boundary_check=(0,), padding_option="zero")
    q_raw = q_raw.to(tl.float32)
    k_raw = k_raw.to(tl.float32)
    qh = q_raw * (scale / tl.sqrt(tl.sum(q_raw * q_raw, 1) + 1e-6))[:, None]
    kh = k_raw * (1.0 / tl.sqrt(tl.sum(k_raw * k_raw, 1) + 1e-6))[:, None]
    beta = _load_beta(b, bos, L, row0, i_h, H, 16)
    # G ∈ [−80, 0] (16 rows of g ≥ −5): every factor below is within e^±80; K_r = k̂⊙exp(−G)·Γ_C, one exp less
    gamma_end = _exp(g_end, INTERP)
    gamma = _exp(G, INTERP)
    ki = kh * _exp(-G, INTERP)
    kr = ki * gamma_end[None, :]
    qd32 = qh * gamma
    qd = qd32
    kd = kh * gamma
    if SCORES_BF16:
        qd = _cast(qd, tl.bfloat16, INTERP)
        kd = _cast(kd, tl.bfloat16, INTERP)
    kiT = tl.trans(ki)
    A = tl.where(r[:, None] > r[None, :], beta[:, None] * _mm(kd, kiT, SCORES_BF16, INTERP), 0.0)
    M = tl.where(r[:, None] >= r[None, :], _mm(qd, kiT, SCORES_BF16, INTERP), 0.0)
    P = _inv16(A, 16, INVERSE) * beta[None, :]
    # W and U formed here, not P·(V − K_d·S) in the state pass: one product less on its chain
    v_t = tl.load(_bp(v, bos, L, i_h, row0, 0, H, V, 16, V), boundary_check=(0,), padding_option="zero")
    return qd32, qd, _mm_split(P, kd, INTERP), kr, _mm_split(P, v_t, INTERP), M, gamma_end


@triton.jit
def _prefill_prepare(q, k, v, z, b, A_log, dt_bias, cu, chunk_idx, qd_out, w_out, kr_out, u_out, m_out, gc_out,
                     scale, H, K: tl.constexpr, V: tl.constexpr, G_MIN: tl.constexpr, SCORES_BF16: tl.constexpr,
                     INVERSE: tl.constexpr, HALF: tl.constexpr, INTERP: tl.constexpr):
    """One (16-token chunk, head), or one half of a (32-token chunk, head): Q_d, W, K_r ([TT, H, K]; bf16 for bf16
    inputs (SCORES_BF16), else fp32), U ([TT, H, V] fp32), M ([TT, H, C]: row r holds row r of the chunk's C×C
    block) and Γ_C ([NT, H, K]).

    HALF 0: 16-token chunks. HALF 1 and 2 (`TUNING["prefill_chunk"]` 32: half the state pass's steps), two launches:
    HALF 1 writes each 32-token chunk's first 16 rows as a 16-token chunk; HALF 2 its last 16 rows as a 16-token
    chunk of their own, then joins them to the first from what HALF 1 wrote. With ' for a half taken alone
    (anchored at its own start) and S the state at the 32-token chunk's start, the half-step
    S₁ = Diag(Γ_C0')·S + K_r0'ᵀ·(U0' − W0'·S) gives
        W1 = W1'·Diag(Γ_C0') − X·W0',  U1 = U1' − X·U0',  with X = W1'·K_r0'ᵀ (16×16),
        Q_d1 = Q_d1'·Diag(Γ_C0'),  M = [[M0', 0], [Q_d1'·K_r0'ᵀ, M1']],
        K_r0 = K_r0'·Diag(Γ_C1'),  K_r1 = K_r1',  Γ_C = Γ_C0'·Γ_C1'.
    Every factor stays within e^±80 (each half is anchored at its own start), and a 32-token chunk's program
    holds one half's tiles at a time: the register pressure of the 16-token prepare."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    if HALF == 0:
        bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, 16)
    else:
        bos, L, row0 = _chunk_coords(cu, chunk_idx, i_c, 32)
    r1 = row0
    if HALF == 2:
        r1 = row0 + 16
    qd32, qd, W, kr, U, M, gamma_end = _block16(q, k, v, z, b, A_log, dt_bias, bos, L, r1, i_h, scale, H, K, V,
                                                G_MIN, SCORES_BF16, INVERSE, INTERP)
    gc_ptr = gc_out + (i_c * H + i_h).to(tl.int64) * K + tl.arange(0, K)
    if HALF == 2:
        # each input of the join loaded where it is first used and each output stored when done: a short
        # live range per tile (250 registers when the loads come first)
        gamma0 = tl.load(gc_ptr)
        _store_rows(kr, kr_out, bos, L, i_h, r1, H, K, 16, INTERP)
        _store_block(M, m_out, bos, L, i_h, r1, 16, H, 32, 16, INTERP)
        _store_rows(qd32 * gamma0[None, :], qd_out, bos, L, i_h, r1, H, K, 16, INTERP)
        tl.store(gc_ptr, gamma_end * gamma0)
        kr0 = tl.load(_bp(kr_out, bos, L, i_h, row0, 0, H, K, 16, K), boundary_check=(0,), padding_option="zero")
        kr0T = tl.trans(kr0)
        _store_block(_mm(qd, kr0T, SCORES_BF16, INTERP), m_out, bos, L, i_h, r1, 0, H, 32, 16, INTERP)
        X = _mm_split(W, kr0T, INTERP)
        _store_rows(kr0.to(tl.float32) * gamma_end[None, :], kr_out, bos, L, i_h, row0, H, K, 16, INTERP)
        W0 = tl.load(_bp(w_out, bos, L, i_h, row0, 0, H, K, 16, K), boundary_check=(0,), padding_option="zero")
        _store_rows(W * gamma0[None, :] - _mm_split(X, W0, INTERP), w_out, bos, L, i_h, r1, H, K, 16, INTERP)
        U0 = tl.load(_bp(u_out, bos, L, i_h, row0, 0, H, V, 16, V), boundary_check=(0,), padding_option="zero")
        _store_rows(U - _mm_split(X, U0, INTERP), u_out, bos, L, i_h, r1, H, V, 16, INTERP)
    else:
        if HALF == 1:
            _store_block(M, m_out, bos, L, i_h, row0, 0, H, 32, 16, INTERP)
            _store_block(tl.zeros([16, 16], dtype=tl.float32), m_out, bos, L, i_h, row0, 16, H, 32, 16, INTERP)
        else:
            _store_block(M, m_out, bos, L, i_h, row0, 0, H, 16, 16, INTERP)
        _store_rows(qd32, qd_out, bos, L, i_h, row0, H, K, 16, INTERP)
        _store_rows(W, w_out, bos, L, i_h, row0, H, K, 16, INTERP)
        _store_rows(kr, kr_out, bos, L, i_h, row0, H, K, 16, INTERP)
        _store_rows(U, u_out, bos, L, i_h, row0, H, V, 16, INTERP)
        tl.store(gc_ptr, gamma_end)


@triton.jit
def _prefill_step(X, g_end, j, qd, w, kr, u, m_in, gc, o, hs, bos, L, c0, n_chunks, hs0, i_h, i_v, off_x,
                  H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, STORE_HS: tl.constexpr,
                  EVERY: tl.constexpr, BF16: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    """Chunk j of one sequence in `_prefill_state`, on the transposed state X = Sᵀ [BV, K]; returns X after it:
    Ũᵀ = Uᵀ − X·Wᵀ, Oᵀ = X·Q_dᵀ + Ũᵀ·Mᵀ, X ← X·Diag(Γ_C) + Ũᵀ·K_r."""
    row0 = j * C
    W = tl.load(_bp(w, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    Qd = tl.load(_bp(qd, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    Kr = tl.load(_bp(kr, bos, L, i_h, row0, 0, H, K, C, K), boundary_check=(0,), padding_option="zero")
    U = tl.load(_bp(u, bos, L, i_h, row0, i_v * BV, H, V, C, BV), boundary_check=(0,), padding_option="zero")
    M = tl.load(_bp(m_in, bos, L, i_h, row0, 0, H, C, C, C), boundary_check=(0,), padding_option="zero")
    g_next = _load_gamma(gc, c0, tl.minimum(j + 1, n_chunks - 1), i_h, H, K, True)
    if STORE_HS:
        # the state at every 64-token chunk start (prefix caching), numbered as the training forward's chunks
        if j % EVERY == 0:
            tl.store(hs + ((hs0 + j // EVERY) * H + i_h).to(tl.int64) * K * V + off_x, X)
    Ut = tl.trans(U).to(tl.float32) - _state_mm(X, tl.trans(W), BF16, SPLIT, INTERP)
    out = _state_mm(X, tl.trans(Qd), BF16, SPLIT, INTERP) + _state_mm(Ut, tl.trans(M), BF16, SPLIT, INTERP)
    X = X * g_end[None, :] + _state_mm(Ut, Kr, BF16, SPLIT, INTERP)
    tl.store(_bp(o, bos, L, i_h, row0, i_v * BV, H, V, C, BV), _cast(tl.trans(out), o.dtype.element_ty, INTERP),
             boundary_check=(0,))
    return X, g_next


# c_lo and c_hi not specialised on (divisibility by 16 would compile a variant per segment bound's residue)
@triton.jit(do_not_specialize=["c_lo", "c_hi"])
def _prefill_state(qd, w, kr, u, m_in, gc, h0, o, ht, hs, cu, chunk_off, hs_off, c_lo, c_hi,
                   H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                   USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_HS: tl.constexpr, EVERY: tl.constexpr,
                   BF16: tl.constexpr, SPLIT: tl.constexpr, SEGMENT: tl.constexpr, INTERP: tl.constexpr):
    """One (value block, sequence, head): the C-token chunks in order, the transposed state in registers. Writes o,
    the final state (ht) and, with STORE_HS, the state at every 64-token chunk start (hs, indexed by hs_off, the
    64-token plan's first chunk per document).

    SEGMENT (`prefill_forward`'s pipeline): only the sequence's chunks whose global index lies in [c_lo, c_hi); the
    state starts from h0 (or zero) at the sequence's first chunk and from ht otherwise, and goes back to ht. A
    sequence with no chunk in the range does nothing, except an empty one in the first segment (c_lo = 0), which
    writes its initial state to ht."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_h, bos, L, c0, n_chunks = _sequence_coords(cu, chunk_off, i_nh, H, C)
    hs0 = tl.load(hs_off + i_nh // H).to(tl.int64)
    # X[v, k] = S[k, i_v·BV + v] in the [N, H, K, V] state layout
    off_x = (i_v * BV + tl.arange(0, BV))[:, None] + tl.arange(0, K)[None, :] * V
    j_lo = 0
    j_hi = n_chunks
    if SEGMENT:
        # j stays int32, as the block pointers' offsets need
        j_lo = tl.maximum(c_lo - c0.to(tl.int32), 0)
        j_hi = tl.minimum(c_hi - c0.to(tl.int32), n_chunks)
    if (j_lo < j_hi) | ((n_chunks == 0) & (c_lo == 0)):
        if j_lo > 0:
            X = tl.load(ht + i_nh.to(tl.int64) * K * V + off_x)
        elif USE_H0:
            X = tl.load(h0 + i_nh.to(tl.int64) * K * V + off_x).to(tl.float32)
        else:
            X = tl.zeros([BV, K], dtype=tl.float32)
        g_end = _load_gamma(gc, c0, j_lo, i_h, H, K, n_chunks > 0)  # then each step loads the next one's
        # The interpreter cannot take a loaded scalar as a `range` bound; compiled code needs `for` to pipeline
        # loads.
        if INTERP:
            j = j_lo
            while j < j_hi:
                X, g_end = _prefill_step(X, g_end, j, qd, w, kr, u, m_in, gc, o, hs, bos, L, c0, n_chunks, hs0,
                                         i_h, i_v, off_x, H, K, V, BV, C, STORE_HS, EVERY, BF16, SPLIT, INTERP)
                j += 1
        else:
            for j in range(j_lo, j_hi):
                X, g_end = _prefill_step(X, g_end, j, qd, w, kr, u, m_in, gc, o, hs, bos, L, c0, n_chunks, hs0,
                                         i_h, i_v, off_x, H, K, V, BV, C, STORE_HS, EVERY, BF16, SPLIT, INTERP)
        if STORE_HT:
            tl.store(ht + i_nh.to(tl.int64) * K * V + off_x, X)


# the value block in which the dispatch thresholds (TUNING's prefill_*_programs) were measured
DISPATCH_BV = 64


def _state_programs(plan, H: int, V: int) -> int:
    """`_prefill_state`'s work in (value block of DISPATCH_BV columns, sequence, head) units: its programs at that
    value block whatever BV it launches with (at BV 128 one program holds two units on two warpgroups), so that
    every shape keeps the path it was measured on."""
    return plan.N * H * max(V // DISPATCH_BV, 1)


def prefill_applies(plan, H: int, V: int, device: torch.device) -> bool:
    """Whether these kernels are the faster inference forward here: their state pass walks each sequence in 2× (4×
    at 16-token chunks) the steps of the 64-token one with half its value blocks, so it needs enough (value block,
    sequence, head) programs, counted at BV 64 (`_state_programs`), to fill the GPU, or, with fewer, enough work
    (`TUNING["prefill_few_programs"]`, in 32-token chunks)."""
    if not TUNING["prefill"]:
        return False
    programs = _state_programs(plan, H, V)
    if programs >= TUNING["prefill_min_programs"]:
        return True
    if programs > _one_wave(TUNING["prefill_chunk32_max_programs"], device):
        return False  # the tiers were measured in 32-token chunks; 16-token ones at these counts lose or tie
    work = plan.offsets[-1] * H
    regular, tail = prefill_segments_for(plan, H, V, device)
    piped = regular + len(tail) > 1
    return any(programs >= least and work >= least_work and (piped or not only_piped)
               for least, least_work, only_piped in TUNING["prefill_few_programs"])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _one_wave(limit, device: torch.device) -> int:
    return 2 * _sm_count(device) if limit is None else limit


def prefill_chunk_for(plan, H: int, V: int, device: torch.device) -> int:
    """The inference forward's chunk: 32 while the state pass's (value block, sequence, head) programs (counted at
    BV 64, `_state_programs`) are at most `TUNING["prefill_chunk32_max_programs"]` (None: two per SM) and
    `TUNING["prefill_chunk"]` is 32; 16 beyond, or always with `prefill_chunk` 16. Few programs are latency-bound,
    and 32-token chunks halve their sequential steps; more are throughput-bound, and there the 16-token chunks'
    smaller products and the join they skip win."""
    C = TUNING["prefill_chunk"]
    if C not in (16, 32):
        raise ValueError(f"TUNING['prefill_chunk'] must be 16 or 32, got {C}")
    limit = _one_wave(TUNING["prefill_chunk32_max_programs"], device)
    return C if C == 16 or _state_programs(plan, H, V) <= limit else 16


def prefill_segments_for(plan, H: int, V: int, device: torch.device) -> tuple[int, tuple[float, ...]]:
    """The inference forward's pipeline (`pipelined`) as (regular segments, the shorter tail segments' sizes as
    fractions of a regular one; `segment_bounds`). One segment per `TUNING["prefill_segment_tokens"]` tokens, at
    most `prefill_segments`, for one sequence whose state pass fits in one wave (`prefill_pipeline_max_programs`
    programs counted at BV 64, None: two per SM) and has at least `prefill_pipeline_min_work` token-heads; else
    (1, ()) (segments cut the chunks in global order: several sequences would take turns). Where such a pipeline
    has at least `prefill_tail_min_programs` state programs (None: more than the GPU has SMs), one per
    `prefill_tail_segment_tokens` tokens instead, followed by `prefill_segment_tail`."""
    TT = plan.offsets[-1]
    programs = _state_programs(plan, H, V)
    if (plan.N > 1 or programs > _one_wave(TUNING["prefill_pipeline_max_programs"], device)
            or TT * H < TUNING["prefill_pipeline_min_work"]):
        return 1, ()
    segments = max(1, min(TUNING["prefill_segments"], TT // TUNING["prefill_segment_tokens"]))
    least = TUNING["prefill_tail_min_programs"]
    if segments == 1 or programs < (_sm_count(device) + 1 if least is None else least):
        return segments, ()
    regular = max(1, min(TUNING["prefill_segments"], TT // TUNING["prefill_tail_segment_tokens"]))
    return regular, tuple(TUNING["prefill_segment_tail"])


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


def prefill_forward(q, k, v, z, b, A_log, dt_bias, g_min, scale, h0, plan, want_ht, want_hs, dtypes,
                    state_bf16=False):
    """The inference forward on flattened [TT, H, ·] inputs: (o [TT, H, V] in v's dtype, the final state
    [N, H, K, V] fp32 or None, the states at every 64-token chunk start [max(NT, 1), H, K, V] fp32 or None).

    plan: the 64-token plan of `chunk_kda` (its chunk numbering is the one of the returned states); the C-token
    plan of the same offsets is built here. dtypes: `inter_dtypes`, (Q_d, W, K_r storage) and (M storage); U is
    fp32. The intermediates take TT·H·(3·K·2 + V·4 + C·4) bytes (bf16 inputs; 2.6 GB at the K3 shape, C = 16) and
    are freed on return. state_bf16: plain bf16 state products (also TUNING's `state_bf16`, and
    `prefill_state_bf16` for bf16 inputs).
    """
    TT, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    lo, hi = dtypes
    o = torch.empty(TT, H, V, dtype=v.dtype, device=dev)
    ht = torch.empty(plan.N, H, K, V, dtype=torch.float32, device=dev) if want_ht else None
    hs = torch.empty(max(plan.NT, 1), H, K, V, dtype=torch.float32, device=dev) if want_hs else None
    interp = interpreting()
    BV = min(V, TUNING["prefill_state_bv"])
    state_bf16 = state_bf16 or TUNING["state_bf16"] or (TUNING["prefill_state_bf16"] and lo == torch.bfloat16)
    C = prefill_chunk_for(plan, H, V, dev)
    plan_c = plan_for(plan.offsets, dev, C)
    qd = torch.empty(TT, H, K, dtype=lo, device=dev)
    W, kr = torch.empty_like(qd), torch.empty_like(qd)
    U = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    M = torch.empty(TT, H, C, dtype=hi, device=dev)
    gc = torch.empty(max(plan_c.NT, 1), H, K, dtype=torch.float32, device=dev)
    ht_run = ht
    segments = segment_bounds(plan_c.NT, *prefill_segments_for(plan, H, V, dev))
    if len(segments) > 1 and ht is None:
        ht_run = torch.empty(plan.N, H, K, V, dtype=torch.float32, device=dev)  # the state between segments
    common = dict(H=H, K=K, V=V, G_MIN=g_min, SCORES_BF16=lo == torch.bfloat16,
                  INVERSE=_inverse_precision("prefill", q.dtype), INTERP=interp)
    dummy = gc

    def prepare(i):
        c_lo, c_hi = segments[i]
        # a segment's chunks: the chunk table and Γ_C sliced at its first chunk (the rows come from the table)
        args = (q, k, v, z, b, A_log, dt_bias, plan_c.cu, plan_c.chunk_idx[c_lo:c_hi], qd, W, kr, U, M,
                gc[c_lo:c_hi], scale)
        if C == 16:
            _prefill_prepare[(c_hi - c_lo, H)](*args, HALF=0, **common, **_launch_options("prefill_prepare"))
        else:
            _prefill_prepare[(c_hi - c_lo, H)](*args, HALF=1, **common, **_launch_options("prefill_prepare"))
            _prefill_prepare[(c_hi - c_lo, H)](*args, HALF=2, **common, **_launch_options("prefill_join"))

    def state(i):
        c_lo, c_hi = segments[i] if plan_c.NT > 0 else (0, 0)
        _prefill_state[(V // BV, plan.N * H)](qd, W, kr, U, M, gc, h0 if h0 is not None else dummy, o,
                                              ht_run if ht_run is not None else dummy,
                                              hs if hs is not None else dummy, plan_c.cu, plan_c.chunk_off,
                                              plan.chunk_off, c_lo, c_hi, H=H, K=K, V=V, BV=BV, C=C,
                                              USE_H0=h0 is not None, STORE_HT=ht_run is not None,
                                              STORE_HS=want_hs, EVERY=CHUNK // C, BF16=state_bf16,
                                              SPLIT=not state_bf16, SEGMENT=len(segments) > 1, INTERP=interp,
                                              **_launch_options("prefill_state", BV))

    if plan_c.NT == 0:
        state(0)
    else:
        pipelined(dev, len(segments), prepare, state)
    return o, ht, hs
