"""QK-Clip for the Gated MLA layers (docs/optimizer.md; K2 report §2.1, kept by K3 §3.3).

Legend: H heads, N nope dim, R rope dim (never rotated: NoPE), Vd value dim, Q q_lora_rank, C kv_lora_rank.

After the optimizer step, every MLA head h whose max scaled logit S_h (over the step's unmasked pairs,
all micro-batches and ranks) exceeds τ is shrunk by γ = τ/S_h:
    q_b_proj nope rows ×√γ, kv_b_proj K rows ×√γ      →  q_nope·k_nope scales by γ
    q_b_proj "rope" rows ×γ, shared k_pe unchanged     →  q_pe·k_pe scales by γ
so every logit of that head scales by exactly γ and its max becomes τ. The shared k_pe rows of
kv_a_proj_with_mqa (used by all heads), the V rows and the optimizer state are left alone.
KDA layers (L2-normalised q/k, no softmax) are exempt.
"""

from __future__ import annotations

import torch

from k3.model.model import K3ForCausalLM


@torch.no_grad()
def qk_clip_stats(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """What `qk_clip_` needs on the host, as one float64 vector on max_logits' device: [NaN-or-+inf flag,
    clipped heads per MLA layer…, largest S_h]. A training step reads it back with its loss before the optimizer
    step, so that nothing after the update waits for the GPU."""
    S = max_logits.detach().to(torch.float64)
    invalid = (torch.isnan(S).any() | (S == float("inf")).any()).double()
    return torch.cat([invalid[None], (S > tau).sum(dim=1).double(), S.max()[None]])


@torch.no_grad()
def qk_clip_(model: K3ForCausalLM, max_logits: torch.Tensor, tau: float = 100.0,
             stats: list[float] | None = None) -> dict:
    """Rescale offending MLA heads in place. max_logits [n_mla, H] (MLA layers in layer order), any float dtype;
    stats: `qk_clip_stats(max_logits, tau)` already read back (else read here, one wait for the GPU).

    Returns {"clipped_heads": how many heads were rescaled, "max_logit": the largest S_h before clipping}.
    """
    config = model.config
    mla_ids = config.mla_layer_ids
    H, N, R, Vd = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    if tuple(max_logits.shape) != (len(mla_ids), H):
        raise ValueError(f"max_logits must be [{len(mla_ids)}, {H}] (MLA layers × heads), "
                         f"got {tuple(max_logits.shape)}")
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if stats is None:
        stats = qk_clip_stats(max_logits, tau).tolist()
    if len(stats) != len(mla_ids) + 2:
        raise ValueError(f"stats must hold {len(mla_ids) + 2} numbers (qk_clip_stats), got {len(stats)}")
    invalid, clipped_per_layer, max_logit = stats[0], stats[1:-1], stats[-1]
    if invalid:
        raise ValueError("max_logits holds NaN or +inf: skip this step instead of clipping")
    S = max_logits.detach().to(torch.float64)
    gamma = torch.where(S > tau, tau / S, torch.ones_like(S))  # [n_mla, H]
    for j, layer_idx in enumerate(mla_ids):
        if not clipped_per_layer[j]:
            continue
        attn = model.model.layers[layer_idx].self_attn
        g = gamma[j][:, None]  # [H, 1]; heads not clipped have γ = 1: multiplying by 1.0 is exact
        # per-row factors in each weight's row layout: q_b rows h·(N+R) + [nope | rope], kv_b h·(N+Vd) + [k | v]
        q_scale = torch.cat([g.sqrt().expand(H, N), g.expand(H, R)], dim=1).reshape(-1)
        kv_scale = torch.cat([g.sqrt().expand(H, N), torch.ones_like(g).expand(H, Vd)], dim=1).reshape(-1)
        for weight, scale in ((attn.q_b_proj.weight, q_scale), (attn.kv_b_proj.weight, kv_scale)):
            rows = _local_rows(weight)
            local = weight.to_local() if hasattr(weight, "to_local") else weight  # a shard when distributed
            local.mul_(scale[rows].to(device=local.device, dtype=local.dtype)[:, None])
    return {"clipped_heads": int(sum(clipped_per_layer)), "max_logit": max_logit}


def _local_rows(weight: torch.Tensor) -> slice:
    """The rows of the full matrix held here: all of them, or a DTensor's Shard(0) piece."""
    if not hasattr(weight, "to_local"):
        return slice(0, weight.shape[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return slice(offset[0], offset[0] + shape[0])
