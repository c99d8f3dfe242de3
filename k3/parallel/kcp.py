"""KDA context parallelism (KCP) as single-process reference math: segment transitions and the fold.

Follows the Kimi K3 report §5.1.2 (Eq. 17) and docs/distributed.md. Under CP, rank i holds a contiguous
segment of the packed sequence. Per head the KDA recurrence is affine in the state,

    S_t = M_t S_{t−1} + β_t k_t v_tᵀ,    M_t = (I − β_t k_t k_tᵀ) Diag(α_t),    S: [K, V], M_t: [K, K],

so a whole segment acts on its incoming state as S_out = M·S_in + S̃, with M the product of its M_t and
S̃ its final state from a zero incoming state. A document start inside the segment resets the state
(to the document's initial state, zero by default), so the map forgets S_in: M = 0 from that point, and
S̃ is the final state of the segment's last fragment. Both come out of one run of the recurrence on the
augmented state [S | X] started at [0 | I] with values [v | 0]: the map is linear in the initial state,
so the X columns end as M. Folding S ← M_j S + S̃_j over the segments in order gives every segment's
true incoming state (the reset M_j = 0 makes the fold start over at each document), and running each
segment from it reproduces the single-pass output and final states.

This file is the oracle for the distributed version (`k3.parallel.context_parallel`): there each rank
computes its own (M_i, S̃_i), one all-gather of [H, K, K + V] replaces the Python list, the fold runs
locally, and autograd through the all-gather gives the mirrored backward fold.

Dimensions: T tokens, H heads, K key dim, V value dim, N documents, R segments (ranks).
"""

from dataclasses import dataclass

import torch

from k3.ops.kda import naive_recurrent_kda


@dataclass(frozen=True)
class Fragment:
    """A piece of document `doc` inside one segment: local tokens [start, end); `continues` is True when
    the document began in an earlier segment (so the piece starts from the folded state)."""

    doc: int
    start: int
    end: int
    continues: bool


def split_fragments(cu_seqlens: list[int], segment_bounds: list[int]) -> list[list[Fragment]]:
    """Cut the documents at the segment boundaries.

    cu_seqlens: [N+1] document offsets, 0 … T. segment_bounds: [R+1] segment offsets, 0 … T.
    Returns, per segment, its non-empty fragments in token order, with local offsets.
    """
    frags: list[list[Fragment]] = [[] for _ in range(len(segment_bounds) - 1)]
    for i, (s0, s1) in enumerate(zip(segment_bounds[:-1], segment_bounds[1:])):
        for n, (bos, eos) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            a, b = max(bos, s0), min(eos, s1)
            if a < b:
                frags[i].append(Fragment(doc=n, start=a - s0, end=b - s0, continues=bos < s0))
    return frags


def kda_transition(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map of one run of tokens without document boundaries: S_out = M·S_in + S̃.

    k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]. initial_state: [H, K, V] used as the start of S̃
    (zero if None). Returns M [H, K, K] = M_T ⋯ M_1 and S̃ [H, K, V], in float64 for float64 inputs,
    else float32. Computed by the recurrence on the augmented state [S | X] = [initial | I] with
    values [v | 0].
    """
    T, H, K = k.shape
    V = v.shape[-1]
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    S0 = k.new_zeros(H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    eye = torch.eye(K, dtype=dtype, device=k.device).expand(H, K, K)
    aug0 = torch.cat((S0, eye), -1)  # [H, K, V+K]
    v_aug = torch.cat((v.to(dtype), v.new_zeros(T, H, K, dtype=dtype)), -1)  # [T, H, V+K]
    # q is not read for the state; k stands in for it.
    _, S = naive_recurrent_kda(
        k[None], k[None], v_aug[None], g[None], beta[None], initial_state=aug0[None], output_final_state=True
    )
    S_tilde, M = S[0].split((V, K), -1)  # [H, K, V], [H, K, K]
    return M, S_tilde


def segment_transitions(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    fragments: list[list[Fragment]],
    segment_bounds: list[int],
    initial_state: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each segment's (M_i [H, K, K], S̃_i [H, K, V]), what rank i contributes to the all-gather.

    k, g: [T, H, K]; v: [T, H, V]; beta: [T, H], the whole packed sequence (rank i only reads its
    segment). initial_state: [N, H, K, V] per-document initial states, or None for zeros.
    A segment whose last fragment continues an earlier document gets its true transition; one with a
    document start inside it gets M = 0 and S̃ = that last fragment's final state from its document's
    initial state. An empty segment is the identity map.
    """
    _, H, K = k.shape
    V = v.shape[-1]
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    out = []
    for i, frags in enumerate(fragments):
        if not frags:
            out.append((torch.eye(K, dtype=dtype).expand(H, K, K).clone(), k.new_zeros(H, K, V, dtype=dtype)))
            continue
        last = frags[-1]
        sl = slice(segment_bounds[i] + last.start, segment_bounds[i] + last.end)
        S0 = None if (last.continues or initial_state is None) else initial_state[last.doc]
        M, S_tilde = kda_transition(k[sl], v[sl], g[sl], beta[sl], S0)
        if not last.continues:
            # The document start resets the state: nothing of the incoming state survives.
            M = torch.zeros_like(M)
        out.append((M, S_tilde))
    return out


def fold_states(transitions: list[tuple[torch.Tensor, torch.Tensor]], initial: torch.Tensor) -> list[torch.Tensor]:
    """Every segment's incoming state: S_in,0 = initial, S_in,i+1 = M_i S_in,i + S̃_i.

    transitions: per segment (M [H, K, K], S̃ [H, K, V]). initial: [H, K, V]. Returns R states [H, K, V].
    """
    states, S = [], initial
    for M, S_tilde in transitions:
        states.append(S)
        S = M @ S + S_tilde
    return states


def kcp_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segment_bounds: list[int],
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`naive_recurrent_kda` computed segment by segment the way R context-parallel ranks would.

    Same arguments and results as naive_recurrent_kda (q, k, g: [B, T, H, K]; v: [B, T, H, V];
    beta: [B, T, H]; initial_state [N, H, K, V]; cu_seqlens [N+1] with B = 1), plus segment_bounds:
    [R+1] increasing-or-equal offsets 0 … T, the contiguous segment of each rank. Without cu_seqlens
    each batch row is one document cut at the same bounds.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    bounds = [int(b) for b in segment_bounds]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"segment_bounds must be non-decreasing offsets from 0 to T={T}, got {bounds}")
    if cu_seqlens is None:
        if initial_state is not None and initial_state.shape[0] != B:
            raise ValueError(f"initial_state must be [B={B}, H, K, V], got {tuple(initial_state.shape)}")
        outs, finals = [], []
        for b in range(B):
            S0 = None if initial_state is None else initial_state[b : b + 1]
            o_b, S_b = kcp_kda(
                q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], bounds, scale, S0,
                True, torch.tensor([0, T]),
            )
            outs.append(o_b)
            finals.append(S_b)
        return torch.cat(outs, 0), (torch.cat(finals, 0) if output_final_state else None)
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed documents), got B={B}")
    offsets = cu_seqlens.tolist()
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to T={T}, got {offsets}")
    N = len(offsets) - 1
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    S0 = q.new_zeros(N, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)

    frags = split_fragments(offsets, bounds)
    # Rank i: (M_i, S̃_i) of its segment; then the all-gather (here: the list) and the fold.
    transitions = segment_transitions(k[0], v[0], g[0], beta[0], frags, bounds, S0)
    incoming = fold_states(transitions, q.new_zeros(H, K, V, dtype=dtype))

    # Rank i: one local varlen run, the first fragment from the folded state if it continues a document.
    outs = []
    finals = list(S0)  # empty documents keep their initial state
    for i, seg_frags in enumerate(frags):
        if not seg_frags:
            continue
        s0 = bounds[i]
        local_cu = torch.tensor([0] + [f.end for f in seg_frags])
        local_S0 = torch.stack([incoming[i] if f.continues else S0[f.doc] for f in seg_frags])  # [n, H, K, V]
        sl = slice(s0, s0 + seg_frags[-1].end)
        o_i, S_i = naive_recurrent_kda(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale, local_S0, True, local_cu
        )
        outs.append(o_i)
        for f, S_f in zip(seg_frags, S_i):
            if s0 + f.end == offsets[f.doc + 1]:
                finals[f.doc] = S_f
    o = torch.cat(outs, 1) if outs else v.new_zeros(1, 0, H, V)
    return o, (torch.stack(finals) if output_final_state else None)
