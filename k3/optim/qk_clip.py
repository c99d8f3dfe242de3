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
    if torch.isnan(S).any() or (S == float("inf")).any():
        raise ValueError("max_logits holds NaN or +inf: skip this step instead of clipping")
    clip = S > tau  # [n_mla, H]
    gamma = torch.where(clip, tau / S, torch.ones_like(S))  # [n_mla, H]
    clipped_layers = clip.any(dim=1).tolist()
    for j, layer_idx in enumerate(mla_ids):
        if not clipped_layers[j]:
            continue
        attn = model.model.layers[layer_idx].self_attn
        wq = attn.q_b_proj.weight.view(H, N + R, -1)  # [H, N + R, Q]: rows h·(N+R) + [nope | rope]
        wkv = attn.kv_b_proj.weight.view(H, N + Vd, -1)  # [H, N + Vd, C]: rows h·(N+Vd) + [k | v]
        g = gamma[j][:, None, None]  # heads not clipped have γ = 1: multiplying by 1.0 is exact
        wq[:, :N].mul_(g.sqrt().to(wq.dtype))
        wq[:, N:].mul_(g.to(wq.dtype))
        wkv[:, :N].mul_(g.sqrt().to(wkv.dtype))
    return {"clipped_heads": int(clip.sum()), "max_logit": float(S.max())}
