"""Absorbed MLA decode attention over a paged latent cache (docs/inference.md "The decode step").

Legend: B sequences, H heads, C = kv_lora_rank (values), R = qk_rope_head_dim, Dk = C + R (keys), P pages,
pt page tokens, nb block-table width, S splits.

In absorbed form every head attends over the same cached latents, MQA-style: the query is [q_nope·W_UK ; q_pe]
(Dk wide), a key is a cached row [ĉ ; k_pe] and a value is its first C channels ĉ. Sequence b's row t lives in
page block_table[b, t // pt] at offset t % pt, so the kernel reads the pages in place (no gather copy).

The Triton kernel is split-KV ("flash decoding"): program (b, s) runs an online softmax over its share of the
sequence's rows for all heads at once (one [H, Dk] × [Dk, n] dot per block of rows), and the partial maxima,
sums and outputs of the S splits are combined afterwards. S is fixed by the batch size and nb, not by the
lengths, so a step's launch shapes stay static (CUDA graphs); splits past a sequence's end return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3.ops import interpreting, triton_runs_on


def paged_latent_attention_reference(q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
                                     lengths: torch.Tensor, scale: float, value_dim: int) -> torch.Tensor:
    """q [B, H, Dk]; pages [P, pt, Dk]; block_table [B, nb]; lengths [B] (rows attended, ≥ 1) -> [B, H, C] fp32
    (fp64 for fp64 q): softmax(q·kᵀ · scale) · ĉ over rows 0 … lengths[b]-1 of each sequence's pages."""
    B, H, Dk = q.shape
    nb, pt = block_table.shape[1], pages.shape[1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = pages[block_table.long()].reshape(B, nb * pt, Dk).to(compute)  # [B, nb·pt, Dk]
    scores = torch.einsum("bhd,bsd->bhs", q.to(compute), rows) * scale
    valid = torch.arange(nb * pt, device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsc->bhc", torch.softmax(scores, dim=-1), rows[..., :value_dim])


@triton.jit
def _rows_block(t0, end, b, m, lsum, acc, q_c, q_r, pages, table, nb, page_stride, row_stride, scale,
                C: tl.constexpr, R: tl.constexpr, PT: tl.constexpr, BN: tl.constexpr, LOW: tl.constexpr):
    """One block of BN rows starting at t0 (BN divides PT: a block never crosses a page) into the online softmax."""
    cc = tl.arange(0, C)
    cr = tl.arange(0, R)
    page = tl.load(table + b.to(tl.int64) * nb + t0 // PT).to(tl.int64)
    tm = t0 + tl.arange(0, BN) < end
    row = page * page_stride + ((t0 % PT) + tl.arange(0, BN)).to(tl.int64) * row_stride
    kc = tl.load(pages + row[:, None] + cc[None, :], mask=tm[:, None], other=0.0)  # [BN, C]
    kr = tl.load(pages + row[:, None] + C + cr[None, :], mask=tm[:, None], other=0.0)  # [BN, R]
    if LOW:
        sc = tl.dot(q_c, tl.trans(kc)) + tl.dot(q_r, tl.trans(kr))
    else:
        sc = tl.dot(q_c, tl.trans(kc), input_precision="ieee") + tl.dot(q_r, tl.trans(kr), input_precision="ieee")
    sc = tl.where(tm[None, :], sc * scale, float("-inf"))  # [BH, BN]
    m_new = tl.maximum(m, tl.max(sc, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(sc - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    if LOW:
        acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, kc, input_precision="ieee")
    return m_new, lsum, acc


@triton.jit
def _paged_decode(q, pages, table, lengths, o_part, m_part, l_part, scale,
                  nb, page_stride, row_stride, split_rows,
                  H: tl.constexpr, BH: tl.constexpr, C: tl.constexpr, R: tl.constexpr, PT: tl.constexpr,
                  BN: tl.constexpr, S: tl.constexpr, LOW: tl.constexpr, INTERP: tl.constexpr):
    """Program (b, s, head block): online softmax over rows [s·split_rows, (s+1)·split_rows) ∩ [0, lengths[b])."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    n_rows = tl.load(lengths + b)
    start = s * split_rows
    end = tl.minimum(start + split_rows, n_rows)
    h = tl.program_id(2) * BH + tl.arange(0, BH)
    hm = h < H
    cc = tl.arange(0, C)
    cr = tl.arange(0, R)
    out = ((b * S + s) * H + h).to(tl.int64)
    if start >= end:  # past this sequence's end: an empty partial (weight 0 in the combine, but finite)
        tl.store(m_part + out, tl.full([BH], float("-inf"), tl.float32), mask=hm)
        tl.store(l_part + out, tl.zeros([BH], tl.float32), mask=hm)
        tl.store(o_part + out[:, None] * C + cc[None, :], tl.zeros([BH, C], tl.float32), mask=hm[:, None])
        return
    qrow = (b * H + h).to(tl.int64) * (C + R)
    q_c = tl.load(q + qrow[:, None] + cc[None, :], mask=hm[:, None], other=0.0)  # [BH, C]
    q_r = tl.load(q + qrow[:, None] + C + cr[None, :], mask=hm[:, None], other=0.0)  # [BH, R]
    if LOW:  # bf16/fp16 pages: the dots take the query in the cache's dtype, accumulate in fp32
        q_c = q_c.to(pages.dtype.element_ty)
        q_r = q_r.to(pages.dtype.element_ty)
    m = tl.full([BH], float("-inf"), tl.float32)
    lsum = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, C], tl.float32)
    # the interpreter cannot take a loaded bound in `range`; compiled code wants `for` to pipeline the loads
    if INTERP:
        t0 = start
        while t0 < end:
            m, lsum, acc = _rows_block(t0, end, b, m, lsum, acc, q_c, q_r, pages, table, nb, page_stride,
                                       row_stride, scale, C, R, PT, BN, LOW)
            t0 += BN
    else:
        for t0 in range(start, end, BN):
            m, lsum, acc = _rows_block(t0, end, b, m, lsum, acc, q_c, q_r, pages, table, nb, page_stride,
                                       row_stride, scale, C, R, PT, BN, LOW)
    tl.store(m_part + out, m, mask=hm)
    tl.store(l_part + out, lsum, mask=hm)
    tl.store(o_part + out[:, None] * C + cc[None, :], acc, mask=hm[:, None])


def kernel_supports(value_dim: int, rope_dim: int, page_tokens: int) -> bool:
    """The kernel's shape rule: power-of-two value (kv_lora_rank) and rope widths of at least 16, and pages of a
    multiple of 16 rows (the dots' smallest block)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (value_dim, rope_dim)) and page_tokens % 16 == 0


def num_splits(batch_size: int, max_rows: int, block_rows: int, programs: int = 264) -> int:
    """Splits per sequence: about `programs` programs in all (two per SM of an H100/H200), at least one block of
    rows each. Depends on the batch size and the block table's width only, never on the lengths."""
    return max(1, min(triton.cdiv(programs, batch_size), triton.cdiv(max_rows, block_rows)))


def paged_latent_attention(q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                           scale: float, value_dim: int, block_rows: int | None = None,
                           splits: int | None = None) -> torch.Tensor:
    """The Triton kernel: same contract as `paged_latent_attention_reference` (q fp32; pages in the cache dtype
    with rows contiguous). Returns [B, H, C] fp32. No host sync: lengths stay on the device."""
    B, H, Dk = q.shape
    C, R = value_dim, Dk - value_dim
    pt = pages.shape[1]
    nb = block_table.shape[1]
    if not kernel_supports(C, R, pt):
        raise ValueError(f"the paged MLA decode kernel needs kv_lora_rank and qk_rope_head_dim powers of two ≥ 16 "
                         f"and page_tokens a multiple of 16, got {C}, {R} and {pt}")
    if pages.stride(2) != 1 or q.dtype != torch.float32:
        raise ValueError("pages need contiguous rows and q must be fp32")
    if not triton_runs_on(q):
        raise RuntimeError("paged_latent_attention runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1")
    BN = block_rows or min(pt, 32 if C >= 512 else 64)
    if pt % BN or BN < 16:
        raise ValueError(f"block_rows {BN} must divide page_tokens {pt} and be at least 16 (the dots' minimum)")
    S = splits or num_splits(B, nb * pt, BN)
    split_rows = triton.cdiv(triton.cdiv(nb * pt, S), BN) * BN
    o_part = torch.empty(B, S, H, C, dtype=torch.float32, device=q.device)
    m_part = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    low = pages.dtype in (torch.bfloat16, torch.float16)
    # heads per program: the fp32 accumulator [BH, C] must stay in registers
    BH = max(16, min(triton.next_power_of_2(H), 32 if C >= 512 else 64))
    _paged_decode[(B, S, triton.cdiv(H, BH))](q.contiguous(), pages, block_table.to(torch.int32).contiguous(),
                          lengths.to(torch.int32).contiguous(), o_part, m_part, l_part, float(scale), nb,
                          pages.stride(0), pages.stride(1), split_rows, H=H, BH=BH,
                          C=C, R=R, PT=pt, BN=BN, S=S, LOW=low, INTERP=interpreting(), num_warps=4 if interpreting() or C <= 256 else 8)
    # combine the splits: empty ones have m = -inf and weigh exp(-inf) = 0
    m = m_part.amax(dim=1, keepdim=True)  # [B, 1, H]; finite: split 0 always holds row 0
    w = torch.exp(m_part - m)  # [B, S, H]
    num = (o_part * w[..., None]).sum(dim=1)  # [B, H, C]
    return num / (l_part * w).sum(dim=1)[..., None]
