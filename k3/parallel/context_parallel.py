"""Context parallelism: KDA through KCP transitions, MLA through a latent all-gather (docs/distributed.md).

Legend: cp ranks, B_l rows per rank, T global row length, T_l = T/cp tokens per rank, H heads,
K = V head dim, W short-conv width, C + R latent width.

Each cp rank holds the contiguous slice [c·T_l, (c+1)·T_l) of every row of its data shard
(`k3.parallel.runtime.shard_batch`). Everything in a K3 layer is per token except three things, which
`apply_context_parallel` takes over by switching the class of the existing modules (parameters and
names unchanged, model code untouched; the subclasses override the layers' seams):

- ShortConv (`short_conv`): the first W−1 taps of a rank read the previous rank's last W−1 inputs
  (the *halo*) when the document continues across the edge. One autograd all-gather of the tails
  [B_l, W−1, P]; the backward returns the halo gradient to its owner.
- KDA (`recurrence`, KCP, report §5.1.2 Eq. 17): every rank computes, per row, the affine map of its
  last fragment, S_out = M·S_in + S̃ (M = 0 when a document starts inside the slice), by one run of
  the layer's own recurrence on the augmented state [S | X] = [0 | I] with values [v | 0]; one
  fixed-size autograd all-gather of [B_l, H, K, K + V]; the fold S ← M_j S + S̃_j over the earlier
  ranks gives the incoming state of the row's first fragment, and the local varlen recurrence runs from
  it. The backward is autograd's: it is the mirrored fold (the all-gather's backward is a
  reduce-scatter of the state gradients), so no hand-written backward can drift from the forward.
- MLA (`forward` for training): one autograd all-gather of the new latents [B_l, T_l, C + R] along the
  sequence; local queries at global positions attend all gathered keys with causal and document masks
  through the layer's own attention backends (flex/flash on GPU, the reference on CPU).

The per-batch layout (global document ids, this rank's offset) comes from a shared `CPContext`, set
by the training step before each forward. Caching (inference) is not supported under CP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA


@dataclass
class BatchShard:
    """Where a rank's piece sits in the global batch; what context-parallel layers need to know.

    global_segment_ids: [B_local, T] document index of every token of this rank's rows (all cp pieces).
    offset: first global position of this rank's tokens within each row (c·T/cp); seq_len: T.
    """

    global_segment_ids: torch.Tensor
    offset: int
    seq_len: int
    cp: int
    cp_rank: int


class CPContext:
    """What the context-parallel layers of one process share: the group and the current batch's shard."""

    def __init__(self, group, cp: int, cp_rank: int):
        self.group, self.cp, self.cp_rank = group, cp, cp_rank
        self.shard: BatchShard | None = None

    def set_batch(self, shard: BatchShard, cu_seqlens: torch.Tensor, device: torch.device) -> None:
        """Where this rank's piece sits, and the fragment bookkeeping every CP layer needs, computed once per
        batch on the host from the local `cu_seqlens` [N+1] (so no layer syncs with the device for it).

        first/last: [B_l] local document index of each row's first and last fragment; continues: [B_l]
        the row's first token continues a document from an earlier rank; carries: the row's last fragment
        is that same continuing one (its map keeps M); frag_idx/frag_cu: the last fragments' tokens and
        offsets, one varlen batch.
        """
        seg = shard.global_segment_ids.cpu()
        B_l, t_local = seg.shape[0], shard.seq_len // shard.cp
        starts = cu_seqlens[:-1].cpu().to(torch.int64)
        row_starts = torch.arange(B_l) * t_local
        first = torch.searchsorted(starts, row_starts)
        last = torch.searchsorted(starts, row_starts + t_local) - 1
        if shard.offset == 0:
            continues = torch.zeros(B_l, dtype=torch.bool)
        else:
            continues = seg[:, shard.offset] == seg[:, shard.offset - 1]
        cu = cu_seqlens.cpu().to(torch.int64)
        frag_start, frag_end = cu[last], cu[last + 1]
        frag_idx = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(frag_start, frag_end)])
        frag_cu = torch.cat([torch.zeros(1, dtype=torch.int64), (frag_end - frag_start).cumsum(0)])
        to = dict(device=device, non_blocking=True)
        self.shard = shard
        self.first, self.continues_ = first.to(**to), continues.to(**to)
        self.carries = ((last == first) & continues).to(**to)
        self.frag_idx, self.frag_cu = frag_idx.to(**to), frag_cu.to(**to)
        self.frag_offsets = tuple(frag_cu.tolist())  # host copy: the fused KDA kernels plan from it

    def current(self) -> BatchShard:
        if self.shard is None:
            raise RuntimeError("context parallelism: call CPContext.set_batch for this batch before the forward")
        return self.shard

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Autograd all-gather along a new leading dim: [*] -> [cp, *] (backward: reduce-scatter).

        Every rank must use all of the result (multiply unused parts by zero rather than drop them):
        a rank whose graph skipped the gather's backward would leave the others waiting in it.
        """
        # torch >= 2.13 renames it (the old name warns); 2.11, our floor, has only the old one
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        return gather(t.contiguous(), 0, self.group).view(self.cp, *t.shape)

    def earlier_ranks(self, device) -> torch.Tensor:
        """[cp] 1.0 for the ranks before this one, else 0.0."""
        return (torch.arange(self.cp, device=device) < self.cp_rank).to(torch.float64)




class ContextParallelKDA(KimiDeltaAttention):
    cp_context: CPContext

    def short_conv(self, pre, weight, conv_state, cu_seqlens):
        ctx = self.cp_context
        if conv_state is not None or cu_seqlens is None:
            raise ValueError("context-parallel KDA runs packed training batches only (no cache)")
        shard = ctx.current()
        B_l, T_l = shard.global_segment_ids.shape[0], pre.shape[1] // shard.global_segment_ids.shape[0]
        halo = weight.shape[-1] - 1
        rows = pre.view(B_l, T_l, -1)
        tails = ctx.gather(rows[:, T_l - halo:])  # [cp, B_l, W-1, P]
        pick = torch.zeros(ctx.cp, dtype=tails.dtype, device=tails.device)
        if ctx.cp_rank > 0:
            pick[ctx.cp_rank - 1] = 1
        previous = (tails * pick[:, None, None, None]).sum(0)  # the previous rank's tails (zeros on rank 0)
        seg = shard.global_segment_ids
        positions = torch.arange(shard.offset - halo, shard.offset, device=seg.device)
        same_doc = seg[:, positions.clamp(min=0)] == seg[:, shard.offset, None]  # [B_l, W-1]
        same_doc &= positions[None] >= 0
        previous = previous * same_doc[..., None].to(previous.dtype)
        N = cu_seqlens.numel() - 1
        state = pre.new_zeros(N, halo, pre.shape[-1]).index_copy(0, ctx.first, previous.to(pre.dtype))
        return super().short_conv(pre, weight, state, cu_seqlens)

    def recurrence(self, q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens,
                   cu_seqlens_host=None):
        ctx = self.cp_context
        if initial_state is not None or output_final_state or cu_seqlens is None:
            raise ValueError("context-parallel KDA runs packed training batches only (no cache)")
        B_l = ctx.current().global_segment_ids.shape[0]
        H, K, V = q.shape[2], q.shape[3], v.shape[3]
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # states are fp32 (fp64 in tests)
        eye = torch.eye(K, device=q.device, dtype=state_dtype).expand(1, H, K, K)

        # 1. the affine map of each row's last fragment, all rows in one varlen run of the layer's recurrence
        #    on the augmented state [S | X] from [0 | I] with values [v | 0]
        idx = ctx.frag_idx
        v_aug = torch.cat([v[:, idx], v.new_zeros(1, idx.numel(), H, K)], dim=-1)  # [1, n, H, V + K]
        aug0 = torch.cat([eye.new_zeros(1, H, K, V), eye], dim=-1).expand(B_l, H, K, V + K)
        # only the final state is used; k stands in for the queries, whose outputs are discarded
        _, S = super().recurrence(k[:, idx], k[:, idx], v_aug, z[:, idx], beta_logits[:, idx], aug0, True,
                                  ctx.frag_cu, ctx.frag_offsets)
        S_tilde, M = S.to(state_dtype).split((V, K), dim=-1)  # [B_l, H, K, V], [B_l, H, K, K]
        # a document start inside the slice forgets the incoming state (M = 0); only a last fragment that
        # is also the row's first and continues from the previous rank carries it
        maps = torch.cat([M * ctx.carries[:, None, None, None].to(state_dtype), S_tilde], dim=-1)
        gathered = ctx.gather(maps)  # [cp, B_l, H, K, K + V]

        # 2. fold the earlier ranks' maps into this rank's incoming state per row
        # later ranks enter as the identity map (times zero, so their gradients are zero, not missing)
        earlier = ctx.earlier_ranks(q.device)
        S_in = q.new_zeros(B_l, H, K, V, dtype=state_dtype)
        for j in range(ctx.cp):
            M_j, S_j = (gathered[j] * earlier[j].to(state_dtype)).split((K, V), dim=-1)
            S_in = (M_j + (1 - earlier[j]).to(state_dtype) * eye[0]) @ S_in + S_j
        S_in = S_in * ctx.continues_[:, None, None, None].to(S_in.dtype)

        # 3. the local varlen recurrence from it (zeros for documents that start on this rank)
        N = cu_seqlens.numel() - 1
        init = S_in.new_zeros(N, H, K, V).index_copy(0, ctx.first, S_in)
        o, _ = super().recurrence(q, k, v, z, beta_logits, init, False, cu_seqlens, cu_seqlens_host)
        return o, None


class ContextParallelMLA(GatedMLA):
    cp_context: CPContext

    def forward(self, x, layout, state=None, use_cache=False, impl=None, max_logits=None):
        if state is not None or use_cache or layout.past_lengths is not None:
            raise ValueError("context-parallel MLA runs packed training batches only (no cache)")
        ctx = self.cp_context
        shard = ctx.current()
        B, T_l, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T_l, H, -1)
        gathered = ctx.gather(self.latent(x))  # [cp, B, T_l, C + R]
        latent = gathered.permute(1, 0, 2, 3).reshape(B, ctx.cp * T_l, -1)  # [B, T, C + R] in global order
        seg = shard.global_segment_ids  # [B, T]
        q_seg = seg[:, shard.offset:shard.offset + T_l]
        # queries at global positions offset + t; causal and same-document masks (the layer's backends)
        o = self.attention(q, latent, shard.offset, q_seg, seg, max_logits)
        o = o.reshape(B, T_l, H * self.v_dim).to(x.dtype)
        return self.o_proj(torch.sigmoid(self.g_proj(x)) * o), None


def apply_context_parallel(model: nn.Module, context: CPContext) -> None:
    """Switch every KDA and MLA mixer of `model` to its context-parallel class (in place)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            attn.__class__ = ContextParallelKDA
        elif isinstance(attn, GatedMLA):
            attn.__class__ = ContextParallelMLA
        else:
            raise TypeError(f"layer {layer.layer_idx}: no context-parallel version of {type(attn).__name__}")
        attn.cp_context = context
