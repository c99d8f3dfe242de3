"""`torch_chunk_kda`: the chunked KDA form with factorised decays, in plain PyTorch (the CPU fast path).

Same arguments and results as `naive_chunk_kda` (reference.py), same UT-transform algebra (docs/kda.md).
The difference is how the intra-chunk decay exp(G[r] − G[i]) is formed. The naive form builds it for every
(r, i, channel) triple, a [C, C, K] tensor per chunk that dominates its time and memory. Here it is
factorised around an anchor a (the cumulative gate at the chunk's first token):

    exp(G[r,c] − G[i,c]) = exp(G[r,c] − a_c) · exp(a_c − G[i,c])

so both score matrices become ordinary [C, K] @ [K, C] matmuls. This is exact algebra; what it costs is
range. Because K3's gate is bounded below (g ≥ g_min = −5), a chunk of C tokens spans at most 5·(C−1)
nats past its first token: the row factors lie in [e^−75, 1] and the column factors in [1, e^75] for
C = 16, and the products above the diagonal (computed, then masked) stay below K·e^75 < e^88.7, inside
fp32/bf16 range. A larger chunk could overflow, so it is refused. This is what the lower bound buys
(K3 report §2.1.1; docs/kda.md §4). Anchoring at the first token, not the middle, keeps outputs
bitwise causal: no earlier position's arithmetic depends on a later gate.

Legend: B batch, T tokens, H heads, K key dim, V value dim, NT chunks, C chunk size.
"""

from __future__ import annotations

import torch

from k3.ops.kda.reference import chunk_form, chunk_packed_documents, prepare_kda_inputs

MAX_CHUNK = 16  # 16 tokens × |g_min| = 80 nats: the factorised exponents stay inside fp32 range


def torch_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
    gate_lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Factorised chunked KDA. Arguments as `naive_chunk_kda`; g must be ≥ gate_lower_bound ≥ −5·16/chunk_size."""
    if not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"torch_chunk_kda needs 1 <= chunk_size <= {MAX_CHUNK} (factorised decays would "
                         f"overflow beyond that), got {chunk_size!r}")
    if chunk_size * abs(gate_lower_bound) > 80.0:
        raise ValueError(f"chunk_size {chunk_size} × |gate_lower_bound| {abs(gate_lower_bound)} exceeds 80 nats")
    v_dtype = v.dtype
    q, k, v, g, beta, S0, bounds = prepare_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if bounds is None:
        o, S = chunk_form(q, k, v, g, beta, S0, chunk_size, _factorised_scores)
    else:
        o, S = chunk_packed_documents(q, k, v, g, beta, S0, bounds, chunk_size, _factorised_scores)
    return o.to(v_dtype), (S if output_final_state else None)


def _factorised_scores(q, k, beta, G):
    """Akk and Aqk as [C, K] @ [K, C] matmuls, anchored at each chunk's first token (see module docstring)."""
    anchor = G[..., :1, :]  # [B, H, NT, 1, K]
    rows_scale = (G - anchor).exp()  # exp(G[r] − a) ∈ [e^−75, 1]
    cols_scale = (anchor - G).exp()  # exp(a − G[i]) ∈ [1, e^75]
    k_cols = k * cols_scale  # [B, H, NT, C, K]
    Akk = (beta * ((k * rows_scale) @ k_cols.transpose(-1, -2))).tril(-1)  # [B, H, NT, C, C]
    Aqk = ((q * rows_scale) @ k_cols.transpose(-1, -2)).tril()  # diagonal kept: read after write
    return Akk, Aqk
