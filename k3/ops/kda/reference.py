"""Pure-PyTorch references for Kimi Delta Attention (KDA): the gate, the token recurrence, the chunked form.

`naive_recurrent_kda` is the ground truth: it runs the per-token recurrence of docs/kda.md §2 literally.
`naive_chunk_kda` is the UT-transform chunked form of docs/kda.md §3; it computes every intra-chunk
quantity for all chunks at once and loops in Python only over the inter-chunk state hand-off, so it is
fast enough to train small models on CPU with autograd. Both accept packed documents through `cu_seqlens`.
The chunked form computes the decay between positions r ≥ i as exp(G[r] − G[i]) directly (never the
factorised exp(G[r])·exp(−G[i]) that fast kernels use), so it is exact for any chunk size. The math is
derived in docs/kda.md. Follows the Kimi K3 report §2.1.1 and the Kimi Linear paper.

Dimensions: B batch, T tokens, H heads, K key dim, V value dim, N sequences, NT chunks, C chunk size.
"""

import torch
import torch.nn.functional as F


def naive_kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Lower-bounded log-decay g = lower_bound · σ(exp(A_log[h]) · (z + dt_bias)) (docs/kda.md §1).

    z: [..., H, K] raw decay logits, any float dtype. A_log: [H]. dt_bias: [H*K], [H, K] or None.
    Returns g with z's shape, in float32 (float64 if z is float64), within [lower_bound, 0].
    """
    if z.dim() < 2:
        raise ValueError(f"z must be [..., H, K], got shape {tuple(z.shape)}")
    H, K = z.shape[-2:]
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H={H} entries, got shape {tuple(A_log.shape)}")
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    x = z.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must have H*K={H * K} entries, got shape {tuple(dt_bias.shape)}")
        x = x + dt_bias.to(dtype).reshape(H, K)
    # σ saturates to exactly 0 or 1 for huge |z|, so g stays finite and inside [lower_bound, 0].
    return lower_bound * torch.sigmoid(A_log.to(dtype).exp().reshape(H, 1) * x)


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA, the ground truth.

    q, k: [B, T, H, K] (already L2-normalised); v: [B, T, H, V]; g: [B, T, H, K] log-decay ≤ 0;
    beta: [B, T, H] in (0, 1). scale multiplies q (default K**-0.5). initial_state: [N, H, K, V] with
    N = B, or N = number of documents when cu_seqlens ([N+1] int offsets into T, B = 1) is given.
    Computes in float64 if q is float64, else float32. Returns o [B, T, H, V] in v's dtype and the
    final state [N, H, K, V] in the compute dtype (None unless output_final_state).
    """
    v_dtype = v.dtype
    q, k, v, g, beta, S0, bounds = prepare_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if bounds is None:
        o, S = _recurrent(q, k, v, g, beta, S0)
    else:
        # Ground truth may be slow: one independent run per document.
        outs, states = [], []
        for n, (bos, eos) in enumerate(bounds):
            o_n, S_n = _recurrent(
                q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], g[:, bos:eos], beta[:, bos:eos], S0[n : n + 1]
            )
            outs.append(o_n)
            states.append(S_n)
        o, S = torch.cat(outs, 1), torch.cat(states, 0)
    return o.to(v_dtype), (S if output_final_state else None)


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA via the UT transform (docs/kda.md §3); same arguments and results as `naive_recurrent_kda`.

    chunk_size: any C ≥ 1; T need not be a multiple of it. With cu_seqlens the documents are gathered
    into a zero-padded batch [N, T_max, H, ·], run once, and scattered back.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    v_dtype = v.dtype
    q, k, v, g, beta, S0, bounds = prepare_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    o, S = run_padded_documents(chunk_form, q, k, v, g, beta, S0, bounds, chunk_size)
    return o.to(v_dtype), (S if output_final_state else None)


def run_padded_documents(fn, q, k, v, g, beta, S0, bounds, *args):
    """Run a batched KDA form `fn(q, k, v, g, beta, S0, *args) -> (o, S)` over packed documents.

    Without documents (bounds None) this is just `fn`. With documents, they are gathered into a zero-padded
    batch [N, T_max, H, ·], run once, and scattered back: trailing zeros (g = k = v = β = 0) leave every
    document's final state exactly unchanged.
    """
    if bounds is None:
        return fn(q, k, v, g, beta, S0, *args)
    N = len(bounds)
    lengths = torch.tensor([eos - bos for bos, eos in bounds], device=q.device)
    L = int(lengths.max())
    # mask[n, j]: position j of document n is real; the rest stays zero, which leaves the state unchanged.
    mask = torch.arange(L, device=q.device) < lengths[:, None]  # [N, L]
    padded = []
    for x in (q, k, v, g, beta):
        x_pad = x.new_zeros((N, L) + x.shape[2:])  # [N, L, H, ·]
        x_pad[mask] = x[0]
        padded.append(x_pad)
    o_pad, S = fn(*padded, S0, *args)
    # Documents are contiguous and in order, so the masked rows come back in token order.
    return o_pad[mask].unsqueeze(0), S  # [1, T, H, V]


def document_offsets(cu_seqlens: torch.Tensor, B: int, T: int) -> list[int]:
    """cu_seqlens [N+1] checked against a packed [B = 1, T] input; returns the offsets as ints."""
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed documents), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1] with N ≥ 1, got {cu_seqlens!r}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {offsets[0]} … {offsets[-1]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    return offsets


def prepare_kda_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Validate shapes and offsets, cast to the compute dtype, scale q, and build the initial state."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must match q {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    V = v.shape[-1]

    bounds = None
    N = B
    if cu_seqlens is not None:
        offsets = document_offsets(cu_seqlens, B, T)
        bounds = list(zip(offsets[:-1], offsets[1:]))
        N = len(bounds)

    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if initial_state is None:
        S0 = q.new_zeros(N, H, K, V, dtype=dtype)
    else:
        if initial_state.shape != (N, H, K, V):
            raise ValueError(
                f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}"
            )
        S0 = initial_state.to(dtype)
    scale = K**-0.5 if scale is None else scale
    q = q.to(dtype) * scale
    k, v, g, beta = k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype)
    return q, k, v, g, beta, S0, bounds


def _recurrent(q, k, v, g, beta, S):
    """The recurrence (docs/kda.md §2), one token at a time. Inputs [B, T, H, ·] (q scaled), S [B, H, K, V]."""
    B, T, H, _ = q.shape
    outs = []
    for t in range(T):
        S = S * g[:, t, :, :, None].exp()
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))  # [B, H, V]
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        # Read after the write: the token sees its own value.
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, v.shape[-1])  # [B, T, H, V]
    return o, S


def chunk_form(q, k, v, g, beta, S, C, scores=None):
    """The chunked form (docs/kda.md §3) for a batch: intra-chunk terms for all chunks at once, then the state
    hand-off chunk by chunk.

    Inputs [B, T, H, ·] (q scaled), S [B, H, K, V]. Returns o [B, T, H, V] and the final state.
    `scores(q, k, beta, G) -> (Akk, Aqk)` builds the two intra-chunk matrices; the default is the exact
    direct form below, torch_chunk.py supplies the factorised one.
    """
    B, T, H, _ = k.shape
    V = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, 0, H, V), S
    NT = -(-T // C)
    pad = NT * C - T
    # Padded tokens have g = k = v = beta = 0: no decay, no write, so the state passes through exactly.
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad))
    q, k, v, g = (x.transpose(1, 2).reshape(B, H, NT, C, -1) for x in (q, k, v, g))  # [B, H, NT, C, ·]
    beta = beta.transpose(1, 2).reshape(B, H, NT, C, 1)  # [B, H, NT, C, 1]
    o, S = chunk_hand_off(*chunk_intra(q, k, v, g, beta, scores), S)
    o = o.reshape(B, H, NT * C, V)[:, :, :T].transpose(1, 2)  # [B, T, H, V]
    return o, S


def chunk_intra(q, k, v, g, beta, scores=None):
    """Everything of the chunked form that is local to a chunk, for all chunks at once.

    Inputs [B, H, NT, C, ·] (beta [B, H, NT, C, 1]). Returns the hand-off's operands: U [B, H, NT, C, V],
    W [B, H, NT, C, K], q_in [B, H, NT, C, K], Aqk [B, H, NT, C, C], decay_chunk [B, H, NT, K, 1],
    k_out [B, H, NT, C, K].
    """
    K, C = k.shape[-1], k.shape[-2]
    G = g.cumsum(-2)  # [B, H, NT, C, K]
    Akk, Aqk = (scores or _direct_scores)(q, k, beta, G)  # [B, H, NT, C, C] each

    Gam = G.exp()
    # W = T·diag(β)(K⊙Γ) and U = T·diag(β)V with T = (I + Akk)^{-1}: one unit-lower-triangular solve for both.
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat((beta * k * Gam, beta * v), -1)  # [B, H, NT, C, K+V]
    W, U = torch.linalg.solve_triangular(eye + Akk, rhs, upper=False, unitriangular=True).split((K, v.shape[-1]), -1)

    q_in = q * Gam  # [B, H, NT, C, K], reads the incoming state
    k_out = k * (G[..., -1:, :] - G).exp()  # [B, H, NT, C, K], writes decayed to the chunk end
    decay_chunk = G[..., -1, :, None].exp()  # [B, H, NT, K, 1]
    return U, W, q_in, Aqk, decay_chunk, k_out


def chunk_hand_off(U, W, q_in, Aqk, decay_chunk, k_out, S):
    """The state hand-off, chunk by chunk (operands from `chunk_intra`, S [B, H, K, V]): o [B, H, NT, C, V] and
    the final state."""
    outs = []
    # unbind once: indexing chunk n inside the loop would make every backward step build and fill a gradient
    # the size of the whole tensor (quadratic in the number of chunks); unbind's backward is one stack
    chunks = zip(*(x.unbind(2) for x in (U, W, q_in, Aqk, decay_chunk, k_out)))
    for U_n, W_n, q_in_n, Aqk_n, decay_n, k_out_n in chunks:
        v_new = U_n - W_n @ S  # [B, H, C, V], the effective writes u_t
        outs.append(q_in_n @ S + Aqk_n @ v_new)
        S = decay_n * S + k_out_n.transpose(-1, -2) @ v_new
    return torch.stack(outs, 2), S


def chunk_packed_documents(q, k, v, g, beta, S0, bounds, C, scores=None):
    """`chunk_form` over packed documents without padding them to the longest: each document is padded only to a
    multiple of C and its chunks laid end to end, so the intra-chunk work is on the documents' own chunks; the
    hand-off then runs over a [documents, chunks of the longest] grid of them, whose empty cells are identity
    chunks (no output, state unchanged). Same results as `run_padded_documents(chunk_form, …)` (tested).

    Inputs [1, T, H, ·] (q scaled), S0 [N, H, K, V], bounds [(bos, eos)] × N. Returns o [1, T, H, V] and the
    final states [N, H, K, V].
    """
    H, V = k.shape[2], v.shape[-1]
    N = len(bounds)
    chunks = [-(-(eos - bos) // C) for bos, eos in bounds]
    M, longest = sum(chunks), max(chunks)
    if M == 0:
        return v.new_zeros(1, 0, H, V), S0
    # where every token goes in the end-to-end layout of M·C slots
    first = [0]
    for n in chunks[:-1]:
        first.append(first[-1] + n * C)
    slot = torch.cat([torch.arange(bos, eos, device=q.device) - bos + f for (bos, eos), f in zip(bounds, first)])

    def chunked(x):  # [1, T, H, ·] -> [1, H, M, C, ·], pad slots zero (no decay, no write)
        laid = x.new_zeros((M * C,) + x.shape[2:]).index_copy(0, slot, x[0])
        return laid.view(1, M, C, H, -1).permute(0, 3, 1, 2, 4)

    beta_c = beta.new_zeros(M * C, H).index_copy(0, slot, beta[0]).view(1, M, C, H).permute(0, 3, 1, 2)[..., None]
    parts = chunk_intra(chunked(q), chunked(k), chunked(v), chunked(g), beta_c, scores)
    # grid[n, j]: the compact index of document n's chunk j, or M (the identity chunk appended below)
    grid = torch.full((N, longest), M, dtype=torch.long)
    start = 0
    for n, c in enumerate(chunks):
        grid[n, :c] = torch.arange(start, start + c)
        start += c
    grid = grid.to(q.device)
    laid_out = []
    for i, x in enumerate(parts):
        # the identity chunk: decay 1, everything else 0
        pad = (torch.ones_like if i == 4 else torch.zeros_like)(x[:, :, :1])
        x = torch.cat((x, pad), 2)[0].index_select(1, grid.flatten())  # [H, N·longest, ·, ·]
        # contiguous, so each chunk of the hand-off is one strided batch of matrices (no copy per step)
        laid_out.append(x.view(H, N, longest, *x.shape[2:]).transpose(0, 1).contiguous())  # [N, H, longest, ·, ·]
    o_grid, S = chunk_hand_off(*laid_out, S0)  # [N, H, longest, C, V]
    real = torch.cat([torch.arange(c, device=q.device) + n * longest for n, c in enumerate(chunks)])
    o = o_grid.transpose(0, 1).reshape(H, N * longest, C, V).index_select(1, real)  # [H, M, C, V]
    o = o.permute(1, 2, 0, 3).reshape(M * C, H, V).index_select(0, slot)  # [T, H, V]
    return o.unsqueeze(0), S


def _direct_scores(q, k, beta, G):
    """Akk (strictly lower, β-weighted) and Aqk (lower incl. diagonal) with exp(G[r] − G[i]) formed directly."""
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [C(r), C(i)]
    # exp(G[r] − G[i]) ≤ 1 for i ≤ r; the upper triangle would overflow, so it is masked before the exp.
    diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, NT, C(r), C(i), K], G[r] − G[i]
    decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
    kd = decay * k[..., None, :, :]  # [B, H, NT, C(r), C(i), K]
    # Row r of both score matrices in one batched matmul (much cheaper to differentiate than two einsums).
    kq = torch.stack((k, q), -2) @ kd.transpose(-1, -2)  # [B, H, NT, C(r), 2, C(i)]
    Akk = (beta * kq[..., 0, :]).tril(-1)
    Aqk = kq[..., 1, :]  # diagonal kept: the output reads the post-write state
    return Akk, Aqk
