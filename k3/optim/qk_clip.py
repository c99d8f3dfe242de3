"""QK-Clip for the Gated MLA layers (systems.md §1.1; K2 report §2.1, kept by K3 §3.3).

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
def qk_clip_(model: K3ForCausalLM, max_logits: torch.Tensor, tau: float = 100.0) -> dict:
    """Rescale offending MLA heads in place. max_logits [n_mla, H] (MLA layers in layer order), any float dtype.

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
    S = max_logits.detach().to(torch.float64)
    clip = S > tau  # [n_mla, H]
    gamma = torch.where(clip, tau / S, torch.ones_like(S))  # [n_mla, H]
    # everything the host needs in one read (one wait for the GPU): validity, clipped heads per layer, the max
    read = torch.cat([(torch.isnan(S).any() | (S == float("inf")).any()).double()[None],
                      clip.sum(dim=1).double(), S.max()[None]]).tolist()
    invalid, clipped_per_layer, max_logit = read[0], read[1:-1], read[-1]
    if invalid:
        raise ValueError("max_logits holds NaN or +inf: skip this step instead of clipping")
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
