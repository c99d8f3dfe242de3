"""Parameter and cache accounting of a config, computed from the real modules on the meta device.

"Active" parameters follow the K3 report's count: everything one token touches, excluding the input
embedding table; of the routed experts only top-k of E count (docs/architecture.md §8.2). The router's
`e_score_correction_bias` buffer is counted as a parameter, as in the release's tensor listing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3.config import ModelConfig, VisionConfig
from k3.model.model import K3ForCausalLM

# (component, active fraction) for each top-level piece of a parameter name
COMPONENTS = ("embedding", "lm_head", "kda", "mla", "dense_ffn", "moe_router", "moe_latent", "moe_shared",
              "moe_routed_experts", "norms_attn_res")


def component_of(name: str, model: K3ForCausalLM) -> str:
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    if not name.startswith("model.layers."):
        return "norms_attn_res"  # final norm and the output AttnRes query
    layer = model.model.layers[int(name.split(".")[2])]
    if ".self_attn." in name:
        return "kda" if layer.is_kda else "mla"
    if ".mlp." in name:
        return "dense_ffn"
    if ".block_sparse_moe.gate." in name:
        return "moe_router"
    if ".block_sparse_moe.experts." in name:
        return "moe_routed_experts"
    if ".block_sparse_moe.shared_experts." in name:
        return "moe_shared"
    if ".block_sparse_moe." in name:
        return "moe_latent"
    return "norms_attn_res"


@dataclass
class Accounting:
    preset: str | None
    total_params: int
    active_params: int
    components: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> {total, active}
    mla_cache_bytes_per_token: int = 0
    kda_state_bytes_per_sequence: int = 0
    kda_conv_bytes_per_sequence: int = 0
    weight_bytes_bf16: int = 0
    num_kda_layers: int = 0
    num_mla_layers: int = 0
    # MoonViT-V2 tower and projector (`vision_tower`, `mm_projector`): per image token, outside the text totals
    vision: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def account(config: ModelConfig, preset: str | None = None, cache_dtype_bytes: int = 2) -> Accounting:
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    k, E = config.num_experts_per_token, config.num_experts
    comps = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        c = component_of(name, model)
        n = t.numel()
        comps[c]["total"] += n
        if c == "embedding":
            active = 0
        elif c == "moe_routed_experts":
            active = n * k // E
        else:
            active = n
        comps[c]["active"] += active
    lin = config.linear_attn_config
    n_kda, n_mla = len(config.kda_layer_ids), len(config.mla_layer_ids)
    P = lin.num_heads * lin.head_dim
    total = sum(c["total"] for c in comps.values())
    return Accounting(
        preset=preset,
        total_params=total,
        active_params=sum(c["active"] for c in comps.values()),
        components=comps,
        mla_cache_bytes_per_token=n_mla * (config.kv_lora_rank + config.qk_rope_head_dim) * cache_dtype_bytes,
        kda_state_bytes_per_sequence=n_kda * lin.num_heads * lin.head_dim * lin.head_dim * 4,
        kda_conv_bytes_per_sequence=n_kda * 3 * (lin.short_conv_kernel_size - 1) * P * cache_dtype_bytes,
        weight_bytes_bf16=2 * total,
        num_kda_layers=n_kda,
        num_mla_layers=n_mla,
        vision=vision_param_counts(config.vision_config) if config.vision_config is not None else {},
    )


def vision_param_counts(vision: VisionConfig) -> dict[str, int]:
    """Parameters of the tower and the projector, from the vision_config's shapes (docs/architecture.md §7.3–7.4;
    K3: 401,214,464 and 46,144,512). The model package does not import k3.vision; tests/vision ties this
    arithmetic to the modules' own counts."""
    D, Q, F, p = vision.vt_hidden_size, vision.qkv_hidden_size, vision.vt_intermediate_size, vision.patch_size
    block = 3 * Q * D + Q * D + 2 * F * D + 2 * D  # wqkv, wo, fc0 + fc1, norm0 + norm1
    tower = 3 * p * p * D + vision.init_pos_emb_height * vision.init_pos_emb_width * D \
        + vision.vt_num_hidden_layers * block + D
    merged = vision.mm_hidden_size * vision.merge_kernel_size[0] * vision.merge_kernel_size[1]
    projector = merged * merged + vision.text_hidden_size * merged + vision.text_hidden_size
    return {"vision_tower": tower, "mm_projector": projector}
