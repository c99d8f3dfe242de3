"""The one mapping between k3 tensor names and the released Kimi K3 checkpoint layout (docs/architecture.md §9.2).

Legend: E routed experts, I expert hidden width (`moe_intermediate_size`), L latent width
(`routed_expert_hidden_size`), H heads, K head dim.

k3 (`K3ForCausalLM.state_dict()`)                  -> release
- `X` (every text tensor but the two below)         -> `language_model.X`, same shape
- `model.layers.ℓ.block_sparse_moe.experts.w1` [E, I, L] (w3 alike)
      -> `language_model.model.layers.ℓ.block_sparse_moe.experts.{e}.w1.weight` [I, L]
      or, packed (MXFP4, group 32), `….{e}.w1.weight_packed` [I, L/2] + `….{e}.w1.weight_scale` [I, L/32] uint8
- `….experts.w2` [E, L, I]                          -> `….experts.{e}.w2.weight` [L, I] (packed [L, I/2], [L, I/32])
- `model.layers.ℓ.self_attn.A_log` [H]              -> `language_model.….A_log` [max(H, K)], zero tail
- `vision_tower.…`, `mm_projector.…` (k3.vision)     -> the same names and shapes (`vision_layout`)

So every name k3 has is `language_model.` + the k3 name, except that the stacked routed experts split
into one tensor per expert and kind (`w1` = gate, `w3` = up, `w2` = down). Router
(`gate.weight`, `gate.e_score_correction_bias`), latent projections and norm
(`routed_expert_{down,up}_proj`, `routed_expert_norm`), shared experts (`shared_experts.{gate,up,down}_proj`),
the dense layer-0 FFN (`mlp.{gate,up,down}_proj`), AttnRes (`{self_attention,mlp}_res_{norm,proj}`,
`model.output_attn_res_{norm,proj}`), MLA and KDA tensors all carry the same names in both layouts.
Dtypes as released: the model dtype (bf16), fp32 for `model.fp32_tensor_names()` (KDA convs, `dt_bias`,
`A_log`, `o_norm`, router bias), uint8 for packed experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from k3.config import ModelConfig, VisionConfig

TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
EXPERT_KINDS = ("w1", "w2", "w3")
# the field suffixes of one released expert matrix
PACKED_FIELDS = ("weight_packed", "weight_scale")
PLAIN_FIELDS = ("weight",)
MXFP4_GROUP = 32

# k3 stacked expert parameter: model.layers.{l}.block_sparse_moe.experts.{w1,w2,w3}
_K3_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")
# release per-expert tensor: language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{w}.{field}
_RELEASE_EXPERT = re.compile(r"^language_model\.(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\."
                             r"(weight|weight_packed|weight_scale)$")

# The MXFP4 `quantization_config` of the release (docs/architecture.md §8.1), written into text_config when
# experts are saved packed.
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {
                "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                "dynamic": False, "observer": "minmax", "scale_dtype": "torch.uint8", "zp_dtype": None,
                "actorder": None, "block_structure": None,
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "kv_cache_scheme": None,
    "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def experts_are_packed(config: ModelConfig) -> bool:
    """Whether a release config declares MXFP4-packed routed experts."""
    q = config.quantization_config
    return bool(q) and q.get("format") == "mxfp4-pack-quantized"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ReleaseName:
    """Where a released text tensor lives in k3: `k3_name`, and for routed experts the expert index and field."""

    k3_name: str
    expert: int | None = None
    field: Literal["weight", "weight_packed", "weight_scale"] | None = None


def is_vision_name(release_name: str) -> bool:
    return release_name.startswith(VISION_PREFIXES)


def is_expert_name(k3_name: str) -> bool:
    """Whether a k3 name is a stacked routed-expert parameter (`….experts.w1` etc.)."""
    return _K3_EXPERT.match(k3_name) is not None


def to_release(k3_name: str, num_experts: int = 0, packed: bool = False) -> list[str]:
    """k3 name -> its release name(s): one, or E × (1 or 2) per-expert names for a stacked expert tensor."""
    if is_vision_name(k3_name):  # k3.vision's modules carry the release names
        return [k3_name]
    m = _K3_EXPERT.match(k3_name)
    if m is None:
        return [TEXT_PREFIX + k3_name]
    module, kind = m.groups()
    fields = PACKED_FIELDS if packed else PLAIN_FIELDS
    return [f"{TEXT_PREFIX}{module}.{e}.{kind}.{f}" for e in range(num_experts) for f in fields]


def from_release(release_name: str) -> ReleaseName | None:
    """Release name -> ReleaseName; None for vision tower / projector names (not in the text model: they keep
    their names in `k3.vision`'s multimodal model, and `load_release` returns them in `ReleaseCheckpoint.vision`).

    Raises ValueError for a name outside both the text stack (`language_model.`) and vision prefixes.
    """
    if is_vision_name(release_name):
        return None
    m = _RELEASE_EXPERT.match(release_name)
    if m is not None:
        module, e, kind, field = m.groups()
        return ReleaseName(f"{module}.{kind}", int(e), field)
    if not release_name.startswith(TEXT_PREFIX):
        raise ValueError(f"tensor {release_name!r} is neither under {TEXT_PREFIX!r} nor a vision tower/projector "
                         "tensor; not part of the K3 release layout")
    return ReleaseName(release_name[len(TEXT_PREFIX):])


def packed_k3_name(k3_name: str, field: str) -> str:
    """Kept-packed stacked expert key: `….experts.w1`, `weight_packed` -> `….experts.w1.weight_packed`."""
    return f"{k3_name}.{field}"


def expert_release_shapes(stacked_shape: tuple[int, ...], packed: bool) -> dict[str, tuple[int, ...]]:
    """Per-expert release shapes of one stacked k3 expert tensor [E, N, Kin]: field -> shape."""
    _, N, Kin = stacked_shape
    if not packed:
        return {"weight": (N, Kin)}
    if Kin % MXFP4_GROUP:
        raise ValueError(f"expert input width {Kin} is not a multiple of the MXFP4 group {MXFP4_GROUP}")
    return {"weight_packed": (N, Kin // 2), "weight_scale": (N, Kin // MXFP4_GROUP)}


def a_log_release_length(config: ModelConfig) -> int:
    """The release zero-pads A_log [H] to head_dim (docs/architecture.md §9.4); K3: 96 -> 128."""
    return max(config.num_attention_heads, config.linear_attn_config.head_dim)


def pad_a_log(a_log: torch.Tensor, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """k3's A_log [H] -> the release's [length] with a zero tail (on the CPU, in `dtype`)."""
    t = a_log.detach().to("cpu", dtype)
    return torch.cat([t, t.new_zeros(length - t.shape[0])])


def unpad_a_log(a_log: torch.Tensor, num_heads: int, name: str = "A_log") -> torch.Tensor:
    """The release's A_log [n ≥ H] -> k3's [H]; ValueError if the tail is not zero."""
    if a_log[num_heads:].any():
        raise ValueError(f"{name} has nonzero entries beyond the {num_heads} heads")
    return a_log[:num_heads]


def text_layout(k3_specs: dict[str, TensorSpec], config: ModelConfig, packed: bool) -> dict[str, TensorSpec]:
    """Release names/shapes/dtypes of the text stack, from k3's own (name -> TensorSpec), in k3 order.

    `k3_specs` holds every k3 tensor with the dtype it has in the release (see `release_layout`).
    """
    out: dict[str, TensorSpec] = {}
    E = config.num_experts
    for name, spec in k3_specs.items():
        if is_expert_name(name):
            shapes = list(expert_release_shapes(spec.shape, packed).values())  # in field order
            dtype = torch.uint8 if packed else spec.dtype
            for i, release_name in enumerate(to_release(name, E, packed)):
                out[release_name] = TensorSpec(shapes[i % len(shapes)], dtype)
        elif name.endswith(".A_log"):
            out[TEXT_PREFIX + name] = TensorSpec((a_log_release_length(config),), spec.dtype)
        else:
            out[TEXT_PREFIX + name] = spec
    return out


def vision_layout(vision: VisionConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, TensorSpec]:
    """Release names and shapes of MoonViT-V2 and the patchmergerv2 projector (docs/architecture.md §7, §9.2)."""
    D, Q, F = vision.vt_hidden_size, vision.qkv_hidden_size, vision.vt_intermediate_size
    p = vision.patch_size
    merged = vision.mm_hidden_size * vision.merge_kernel_size[0] * vision.merge_kernel_size[1]
    specs: dict[str, tuple[int, ...]] = {
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.2.weight": (vision.text_hidden_size, merged),
        "mm_projector.post_norm.weight": (vision.text_hidden_size,),
        "vision_tower.patch_embed.proj.weight": (D, 3, p, p),
        "vision_tower.patch_embed.pos_emb.weight": (vision.init_pos_emb_height, vision.init_pos_emb_width, D),
    }
    for b in range(vision.vt_num_hidden_layers):
        blk = f"vision_tower.encoder.blocks.{b}"
        specs |= {f"{blk}.wqkv.weight": (3 * Q, D), f"{blk}.wo.weight": (D, Q), f"{blk}.mlp.fc0.weight": (F, D),
                  f"{blk}.mlp.fc1.weight": (D, F), f"{blk}.norm0.weight": (D,), f"{blk}.norm1.weight": (D,)}
    specs["vision_tower.encoder.final_layernorm.weight"] = (D,)
    return {name: TensorSpec(shape, dtype) for name, shape in specs.items()}


def k3_release_specs(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Every k3 tensor of `model` (meta is fine) -> TensorSpec with its released dtype: fp32 for
    `model.fp32_tensor_names()`, else `dtype`."""
    fp32 = set(model.fp32_tensor_names())
    # a multimodal model's tower and projector are listed by `vision_layout`, not as text tensors
    return {name: TensorSpec(tuple(t.shape), torch.float32 if name in fp32 else dtype)
            for name, t in model.state_dict(keep_vars=True).items() if not is_vision_name(name)}


def release_layout(model: torch.nn.Module, packed: bool, dtype: torch.dtype = torch.bfloat16,
                   vision: bool = True) -> dict[str, TensorSpec]:
    """The full release listing for `model`'s config: text stack (k3 order), then vision tower and projector
    when `vision` and the config has a `vision_config`."""
    config = model.config
    out = text_layout(k3_release_specs(model, dtype), config, packed)
    if vision and config.vision_config is not None:
        out |= vision_layout(config.vision_config, dtype)
    return out


# The speculative draft (`k3.spec.draft.Draft`, docs/speculative.md). The release has no MTP layer; the draft is
# stored as one would be in DeepSeek-V3's convention, the layer after the backbone's (`model.layers.{L}.…`, L =
# num_hidden_layers), with the draft's own tensor names under it, in a file of its own beside the release's shards.
DRAFT_FILE = "draft.safetensors"
DRAFT_CONFIG_FILE = "draft_config.json"


def draft_to_release(draft_name: str, config: ModelConfig, packed: bool = False) -> list[str]:
    """A draft tensor name (`Draft.state_dict()`) -> its release name(s): `language_model.model.layers.{L}.` + the
    name; the stacked routed experts split per expert as the backbone's (`to_release`)."""
    return to_release(f"model.layers.{config.num_hidden_layers}.{draft_name}", config.num_experts, packed)


def draft_from_release(release_name: str, config: ModelConfig) -> ReleaseName:
    """A release name of the draft layer -> where it lives in the draft (`k3_name` is the draft's own tensor name);
    ValueError for a name outside that layer."""
    prefix = f"model.layers.{config.num_hidden_layers}."
    found = from_release(release_name)
    if found is None or not found.k3_name.startswith(prefix):
        raise ValueError(f"tensor {release_name!r} is not in the draft layer ({TEXT_PREFIX}{prefix}…)")
    return ReleaseName(found.k3_name[len(prefix):], found.expert, found.field)
