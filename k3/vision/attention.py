"""Non-causal attention within each item of a packed batch (NaViT), with a plain reference beside the fast paths.

Legend: N packed tokens, H heads, K head dim, n items; `cu_seqlens` [n+1] are item offsets into N.

- `naive_varlen_attention`: per item, fp32 scores, softmax, weighted sum (the reference).
- `sdpa`: `scaled_dot_product_attention` once per distinct item length, the items of that length stacked as a
  batch (a batch of equal-size images is one call; no [N, N] mask is ever built).
- `flash`: `flash_attn_varlen_func(causal=False)` when the `flash_attn` package is installed.
`varlen_attention(..., backend)` picks one; "auto" is flash (installed) or sdpa on CUDA, the reference elsewhere.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # optional dependency
    flash_attn_varlen_func = None


def resolve_backend(backend: str, device: torch.device) -> str:
    """The model's `attention_backend` → "reference" | "sdpa" | "flash" for the tower (flex maps to sdpa)."""
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        return "flash" if flash_attn_varlen_func is not None else "sdpa"
    if backend == "flash" and flash_attn_varlen_func is None:
        raise ValueError("attention_backend 'flash' needs the flash_attn package")
    if backend not in ("reference", "sdpa", "flex", "flash"):
        raise ValueError(f"attention_backend must be auto|reference|flash|flex|sdpa, got {backend!r}")
    return "sdpa" if backend == "flex" else backend


def naive_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                           scale: float) -> torch.Tensor:
    """q, k, v [N, H, K] → [N, H, K] in q's dtype: softmax(q kᵀ · scale) v within each item, in fp32 (or fp64)."""
    out, dtype = [], torch.promote_types(q.dtype, torch.float32)
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        scores = torch.einsum("thd,shd->hts", q[a:b].to(dtype), k[a:b].to(dtype)) * scale  # [H, L, L]
        out.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v[a:b].to(dtype)))
    return torch.cat(out).to(q.dtype)


def _sdpa(q, k, v, cu_seqlens: list[int], scale: float) -> torch.Tensor:
    by_length: dict[int, list[int]] = defaultdict(list)  # item length -> item start offsets
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        by_length[b - a].append(a)
    pieces: dict[int, torch.Tensor] = {}
    for length, starts in by_length.items():
        index = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        qs, ks, vs = (x[index].unflatten(0, (len(starts), length)).transpose(1, 2) for x in (q, k, v))  # [n, H, L, K]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)  # [n, L, H, K]
        pieces |= dict(zip(starts, o.unbind(0)))
    return torch.cat([pieces[a] for a in cu_seqlens[:-1]])


def _flash(q, k, v, cu_seqlens: list[int], scale: float) -> torch.Tensor:
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=False)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float,
                     backend: str = "reference") -> torch.Tensor:
    """q, k, v [N, H, K] (one dtype), `cu_seqlens` host ints [n+1] → [N, H, K]; backend as `resolve_backend`."""
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != q.shape[0] or any(b <= a for a, b in zip(cu_seqlens, cu_seqlens[1:])):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to {q.shape[0]}, got {cu_seqlens}")
    if backend == "reference":
        return naive_varlen_attention(q, k, v, cu_seqlens, scale)
    if backend == "flash":
        return _flash(q, k, v, cu_seqlens, scale)
    return _sdpa(q, k, v, cu_seqlens, scale)
