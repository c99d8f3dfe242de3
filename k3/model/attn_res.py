"""Block Attention Residuals (docs/architecture.md §4; K3 report §2.2; AttnRes paper arXiv 2603.15031).

Legend: n sources, J queries, B batch, T tokens, D model width.

A read AR(w; v_1..v_n) softmax-averages earlier block representations over *depth*: keys are the
sources RMS-normalised without gain, logits s_i = w·k_i, result Σ α_i v_i (values not normalised).
The pseudo-query w is stored factorised as res_norm.weight ⊙ res_proj.weight[0], zero-initialised so
every read starts as a uniform average. All of it in fp32, cast back once.

Two exact forms:
- `attn_res_read`: the direct form, one read over a list of sources;
- `attn_res_phase1` + `attn_res_merge`: the two-phase form. Queries do not depend on the
  input, so all reads of a block are batched over its sealed sources once (phase 1), and each read then
  merges the running partial sum with an online-softmax step (phase 2).
Both forms have fused Triton kernels (`k3.ops.attn_res`) that never stack the sources. `attn_res_impl`:
- "direct": the direct form in torch; "triton": the direct form with the fused read (`select_read`);
- "two_phase": the two-phase form, fused (`block_reads`) where Triton runs and the block's J queries fit
  (`two_phase_fits`), else in torch; it refuses layers checkpointed with `apply_activation_checkpointing`
  (the checkpoint wraps one layer of the direct wiring) while a backward can follow;
- "auto": the fused direct read on CUDA, the direct form in torch elsewhere.
Under the fused direct read each sealed source is `seal`ed: the reads' backward kernels add its gradient into
one buffer, where the autograd engine would add one gradient per read.
The fused two-phase form reads each sealed source once per block forward and writes one gradient per source
and block, where the direct read touches it once per read and the autograd engine sums one gradient per read;
it was not faster on an H200 (docs/fast-paths.md), so "auto" keeps the direct read.
"""

from __future__ import annotations

import torch

from k3.ops.attn_res import (attn_res_merge_triton, attn_res_phase1_triton, attn_res_read_triton,
                             fused_attn_res_available, seal_source, two_phase_fits)

EPS = 1e-5


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _keys(v: torch.Tensor, eps: float) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def pseudo_query(norm_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """[D] gain and [1, D] projection -> the effective query w [D] (fp32)."""
    dtype = torch.float64 if proj_weight.dtype == torch.float64 else torch.float32
    return norm_weight.to(dtype) * proj_weight[0].to(dtype)


def attn_res_read(w: torch.Tensor, sources: list[torch.Tensor], eps: float = EPS) -> torch.Tensor:
    """w [D]; sources: n tensors [B, T, D]. Returns [B, T, D] in the sources' dtype."""
    if len(sources) == 1:
        return sources[0]
    compute = _compute_dtype(sources[0])
    v = torch.stack(sources).to(compute)  # [n, B, T, D]
    logits = _keys(v, eps) @ w.to(compute)  # [n, B, T]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


def attn_res_phase1(queries: torch.Tensor, sealed: list[torch.Tensor], eps: float = EPS):
    """queries [J, D]; sealed: n tensors [B, T, D].

    Returns (o1 [J, B, T, D], m1 [J, B, T], l1 [J, B, T]) in fp32: the normalised read over the sealed
    sources, its max logit and its softmax denominator relative to that max.
    """
    compute = _compute_dtype(sealed[0])
    v = torch.stack(sealed).to(compute)  # [n, B, T, D]
    logits = torch.einsum("nbtd,jd->jnbt", _keys(v, eps), queries.to(compute))  # [J, n, B, T]
    m1 = logits.amax(dim=1)  # [J, B, T]
    p = torch.exp(logits - m1.unsqueeze(1))
    l1 = p.sum(dim=1)
    o1 = torch.einsum("jnbt,nbtd->jbtd", p, v) / l1.unsqueeze(-1)
    return o1, m1, l1


def attn_res_merge(o1: torch.Tensor, m1: torch.Tensor, l1: torch.Tensor, w: torch.Tensor,
                   partial: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Phase 2 for one query: merge phase-1 statistics (o1 [B, T, D], m1, l1 [B, T]) with the partial sum."""
    compute = o1.dtype
    p = partial.to(compute)
    s2 = _keys(p, eps) @ w.to(compute)  # [B, T]
    m = torch.maximum(m1, s2)
    a1 = torch.exp(m1 - m) * l1
    a2 = torch.exp(s2 - m)
    return ((a1.unsqueeze(-1) * o1 + a2.unsqueeze(-1) * p) / (a1 + a2).unsqueeze(-1)).to(partial.dtype)


def select_read(impl: str, x: torch.Tensor):
    """The read function for the direct wiring: the fused kernel for "triton" (or "auto" on CUDA)."""
    if impl == "triton" or (impl == "auto" and fused_attn_res_available(x)):
        return attn_res_read_triton
    return attn_res_read


def plain_residual_read(w: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """The read of plain residuals (`residual: plain`, the ablation baseline): the sources' sum, which in the direct
    wiring is the usual residual stream h_0 + Σ sublayer outputs; the query is unused."""
    return sources[0] if len(sources) == 1 else torch.stack(sources).sum(0)


def seal(source: torch.Tensor, read) -> torch.Tensor:
    """A finished block (or the embedding) as a source of the later reads. Under the fused read its gradient is
    summed inside the reads' backward kernels (`k3.ops.attn_res.seal_source`), not by the autograd engine."""
    return seal_source(source) if read is attn_res_read_triton else source


def fused_two_phase_available(x: torch.Tensor, num_queries: int) -> bool:
    """The fused phase 1 and merge run here for blocks of up to `num_queries` reads of width x.shape[-1]."""
    return fused_attn_res_available(x) and two_phase_fits(num_queries, x.shape[-1])


def block_reads(queries: torch.Tensor, sealed: list[torch.Tensor], fused: bool, eps: float = EPS):
    """Phase 1 of one block for its queries [J, D] over the sealed sources -> `read(j, w, partial)`: query j's
    read, merged with the partial sum (partial None: the phase-1 read alone, in the sources' dtype)."""
    dtype = sealed[0].dtype
    if fused:
        # o1 are views of one [J, ...] buffer (autograd refuses in-place changes to them; no mixer makes any)
        o1, lse1 = attn_res_phase1_triton(queries, sealed, eps)

        def read(j, w, partial):
            return o1[j].to(dtype) if partial is None else attn_res_merge_triton(o1[j], lse1[j], w, partial, eps)
    else:
        o1, m1, l1 = attn_res_phase1(queries, sealed, eps)

        def read(j, w, partial):
            return o1[j].to(dtype) if partial is None else attn_res_merge(o1[j], m1[j], l1[j], w, partial, eps)
    return read
