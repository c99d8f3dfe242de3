"""Model configuration: the released `config.json` schema as typed dataclasses, presets, load/save.

Field names are exactly those of the released Kimi K3 `config.json` (docs/architecture.md §8.1), so a
config written here is readable by the release's own loaders and vice versa. A few fields are k3's
runtime switches (which implementation of an op to run); they are never written to `config.json`.

Presets (docs/architecture.md §8.3) keep K3's structural rules at every size: 3 KDA : 1 Gated MLA with
an extra MLA as the last layer, layer 0 dense, latent width D/2, shared experts at full width,
AttnRes blocks, NoPE.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

KDAImpl = Literal["torch", "naive", "recurrent", "triton"]
MLAImpl = Literal["auto", "naive", "absorb"]
AttnResImpl = Literal["auto", "direct", "two_phase", "triton"]
MoEImpl = Literal["auto", "reference", "grouped"]
AttentionBackend = Literal["auto", "reference", "flash", "flex", "sdpa"]
FusedOpImpl = Literal["auto", "reference", "triton"]
RouterImpl = Literal["auto", "reference", "fast"]
LossImpl = Literal["auto", "reference", "chunked", "triton"]
ResidualDtype = Literal["activation", "float32"]
# The baselines K3's choices replaced, for `k3 ablate` (docs/ablations.md): written to config.json only when set
Residual = Literal["block_attn_res", "plain"]
KDAGate = Literal["lower_bounded", "unbounded"]
ABLATION_FIELDS = {"residual": "block_attn_res", "kda_gate": "lower_bounded"}
# Quantization-aware training of the routed experts (k3.ops.qat, docs/qat.md) and the E8M0 scale rounding it uses
QATFormat = Literal["none", "mxfp4"]
MXScaleMode = Literal["floor", "ceil", "even", "rceil"]

# Fields of ModelConfig that are k3 runtime choices, not part of the released schema.
RUNTIME_FIELDS = ("kda_impl", "kda_chunk_size", "kda_save_intermediates", "mla_impl", "attn_res_impl", "moe_impl",
                  "router_impl", "attention_backend", "situ_impl", "norm_impl", "loss_impl", "residual_dtype")

# "auto" resolves to the fast path on CUDA and to the reference elsewhere (docs/fast-paths.md).
RUNTIME_CHOICES = {
    "attn_res_impl": ("auto", "direct", "two_phase", "triton"),
    "moe_impl": ("auto", "reference", "grouped"),
    "router_impl": ("auto", "reference", "fast"),
    "attention_backend": ("auto", "reference", "flash", "flex", "sdpa"),
    "situ_impl": ("auto", "reference", "triton"),
    "norm_impl": ("auto", "reference", "triton"),
    "loss_impl": ("auto", "reference", "chunked", "triton"),
    "residual_dtype": ("activation", "float32"),
}


def hybrid_layer_schedule(num_layers: int) -> tuple[list[int], list[int]]:
    """1-based (kda_layers, full_attn_layers): layer n is Gated MLA iff n % 4 == 0 or n == L."""
    full = [n for n in range(1, num_layers + 1) if n % 4 == 0 or n == num_layers]
    kda = [n for n in range(1, num_layers + 1) if n not in full]
    return kda, full


@dataclass
class LinearAttnConfig:
    """`text_config.linear_attn_config`: the KDA layers."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = True
    kda_layers: list[int] = field(default_factory=list)  # 1-based
    full_attn_layers: list[int] = field(default_factory=list)  # 1-based


@dataclass
class VisionConfig:
    """`vision_config` (MoonViT-V2 + patchmergerv2 projector, docs/architecture.md §7.1). Kept for round trips."""

    patch_size: int = 14
    vt_hidden_size: int = 1024
    vt_num_hidden_layers: int = 27
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536
    vt_intermediate_size: int = 4096
    activation_func: str = "gelu_pytorch_tanh"
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    pos_emb_type: str = "divided_fixed"
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_interpolation_mode: str = "bilinear"
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int = 1024
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    mlp_type: str = "mlp2"
    # ε of the tower's RMSNorms; None (not written to config.json) is the activation dtype's epsilon, the default
    # of torch.nn.RMSNorm that the release's tower uses (docs/vision.md); unverified on the real weights
    norm_eps: float | None = None
    # Keys of the file we do not model (e.g. `_attn_implementation`), preserved verbatim.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    """The K3 text stack (`text_config`) plus the top-level and vision fields of `config.json`."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    attn_res_block_size: int
    linear_attn_config: LinearAttnConfig
    num_shared_experts: int = 2
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    max_position_embeddings: int = 1_048_576
    tie_word_embeddings: bool = False
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    num_nextn_predict_layers: int = 0
    use_cache: bool = True
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None
    # Top level of config.json.
    media_placeholder_token_id: int = 163605
    image_placeholder: str = "<|kimi_image_placeholder|>"
    ignore_index: int = -100
    vision_config: VisionConfig | None = None
    # k3 runtime switches (RUNTIME_FIELDS): never serialised.
    kda_impl: KDAImpl = "torch"
    kda_chunk_size: int = 16
    # kda_impl "triton" in training: the forward keeps its chunk operands, cumulative gate and chunk-start states
    # for the backward (~1.9 GiB per layer at K3's shape buys a shorter backward; docs/kda-kernels.md), or
    # the backward recomputes them (False)
    kda_save_intermediates: bool = True
    mla_impl: MLAImpl = "auto"
    # Block AttnRes wiring (k3.model.attn_res): direct reads (reference), the direct wiring with the fused
    # Triton read (the CUDA default under "auto"), or the two-phase form (fused Triton kernels where they fit)
    attn_res_impl: AttnResImpl = "auto"
    moe_impl: MoEImpl = "auto"  # reference: padded-batch dispatch; grouped: grouped GEMMs (k3.ops.moe)
    # routing (k3.ops.router): reference = one fp32 GEMM for the logits and torch.topk; fast = the fp32 logits from
    # bf16 GEMMs on the weight split in three (exact products, tensor-core fp32 sums; for bf16 inputs) and the
    # top-k + cutoff in one Triton kernel
    router_impl: RouterImpl = "auto"
    attention_backend: AttentionBackend = "auto"  # MLA training/prefill attention (k3.ops.attention)
    situ_impl: FusedOpImpl = "auto"  # SiTU-GLU: autograd formula or fused Triton kernels
    norm_impl: FusedOpImpl = "auto"  # RMSNorm: autograd formula or fused Triton kernels
    # lm_head + cross-entropy: full logits, chunked, or chunked with the Triton row kernel (k3.ops.cross_entropy)
    loss_impl: LossImpl = "auto"
    # AttnRes block representations and the partial sum (docs/architecture.md §4.3): in the activation dtype (autocast's
    # under autocast, else the embedding's), as the released code keeps them, or in fp32 (the embedding upcast)
    residual_dtype: ResidualDtype = "activation"
    # ablation baselines (ABLATION_FIELDS): plain residuals instead of Block AttnRes (the read becomes the sum of its
    # sources); the unbounded KDA gate g = -exp(A)·softplus(z + dt_bias) instead of the lower-bounded one
    residual: Residual = "block_attn_res"
    kda_gate: KDAGate = "lower_bounded"
    # "mxfp4": the routed experts' GEMMs run on MXFP4 weights and MXFP8 (E4M3) inputs in training and inference,
    # straight-through gradients; scales rounded by `qat_scale_mode` (the report does not say which: RCEIL, the
    # cuBLAS/Blackwell rule, is ours), also the export's. Both written to config.json only when QAT is on
    qat: QATFormat = "none"
    qat_scale_mode: MXScaleMode = "rceil"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.linear_attn_config.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_kda_layer(self, layer_idx: int) -> bool:
        """0-based layer index -> True for KDA, False for Gated MLA."""
        return (layer_idx + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    def validate(self) -> None:
        """Raise ValueError on a config the model cannot run or that breaks K3's invariants."""
        lin = self.linear_attn_config
        L = self.num_hidden_layers
        problems = []
        for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                     "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "intermediate_size", "num_experts", "num_experts_per_token",
                     "moe_intermediate_size", "routed_expert_hidden_size", "attn_res_block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))
        kda, full = set(lin.kda_layers), set(lin.full_attn_layers)
        if kda & full:
            problems.append(f"layers {sorted(kda & full)} are in both kda_layers and full_attn_layers")
        if kda | full != set(range(1, L + 1)):
            missing = sorted(set(range(1, L + 1)) - (kda | full))
            extra = sorted((kda | full) - set(range(1, L + 1)))
            problems.append(f"kda_layers ∪ full_attn_layers must be exactly 1..{L} "
                            f"(missing {missing}, out of range {extra})")
        if lin.num_heads != self.num_attention_heads:
            problems.append(f"linear_attn_config.num_heads ({lin.num_heads}) != num_attention_heads "
                            f"({self.num_attention_heads}); K3 shares heads between KDA and MLA")
        if self.num_key_value_heads != self.num_attention_heads:
            problems.append("num_key_value_heads must equal num_attention_heads (MLA has no GQA)")
        if not (lin.gate_lower_bound < 0):
            problems.append(f"gate_lower_bound must be negative, got {lin.gate_lower_bound}")
        if lin.short_conv_kernel_size < 1:
            problems.append("short_conv_kernel_size must be >= 1")
        if not lin.use_full_rank_gate:
            problems.append("use_full_rank_gate=false is not supported (K3 uses the full-rank gate)")
        if self.num_experts_per_token >= self.num_experts:
            problems.append(f"num_experts_per_token ({self.num_experts_per_token}) must be < "
                            f"num_experts ({self.num_experts}); Quantile Balancing needs a (k+1)-th expert")
        if not 0 <= self.first_k_dense_replace <= L:
            problems.append("first_k_dense_replace out of range")
        if self.moe_layer_freq != 1:
            problems.append("moe_layer_freq != 1 is not supported (K3 uses 1)")
        if self.moe_router_activation_func != "sigmoid":
            problems.append("only the sigmoid router is supported")
        if self.hidden_act not in ("situ", "silu"):
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (K3 uses 'situ'; 'silu' is SwiGLU)")
        if self.num_expert_group != 1 or self.topk_group != 1:
            problems.append("grouped top-k with more than one group is not supported (K3 uses 1)")
        if not self.mla_use_nope:
            problems.append("mla_use_nope=false (rotary MLA) is not supported; K3 is NoPE")
        if not self.mla_use_output_gate:
            problems.append("mla_use_output_gate=false is not supported")
        if self.tie_word_embeddings:
            problems.append("tie_word_embeddings=true is not supported (K3's head is untied)")
        if self.num_nextn_predict_layers != 0:
            problems.append("MTP layers (num_nextn_predict_layers > 0) are not supported")
        if self.qk_rope_head_dim < 0:
            problems.append("qk_rope_head_dim must be >= 0")
        if self.kda_impl not in ("torch", "naive", "recurrent", "triton"):
            problems.append(f"kda_impl must be torch|naive|recurrent|triton, got {self.kda_impl!r}")
        if not isinstance(self.kda_save_intermediates, bool):
            problems.append(f"kda_save_intermediates must be True or False, got {self.kda_save_intermediates!r}")
        if self.kda_impl == "torch" and (not 1 <= self.kda_chunk_size <= 16
                                         or self.kda_chunk_size * abs(lin.gate_lower_bound) > 80):
            problems.append(f"kda_impl 'torch' needs kda_chunk_size in [1, 16] with chunk × |gate_lower_bound| "
                            f"<= 80 nats (factorised decays stay in fp32 range), got {self.kda_chunk_size}")
        if self.kda_impl == "triton":
            d = lin.head_dim
            if lin.gate_lower_bound < -5:
                problems.append(f"kda_impl 'triton' needs gate_lower_bound >= -5 (its 16-token tiles rely on it), "
                                f"got {lin.gate_lower_bound}")
            if not (16 <= d <= 256 and d & (d - 1) == 0):
                problems.append(f"kda_impl 'triton' needs a power-of-two head_dim in [16, 256], got {d}")
        if self.mla_impl not in ("auto", "naive", "absorb"):
            problems.append(f"mla_impl must be auto|naive|absorb, got {self.mla_impl!r}")
        if self.residual not in ("block_attn_res", "plain"):
            problems.append(f"residual must be block_attn_res|plain, got {self.residual!r}")
        if self.kda_gate not in ("lower_bounded", "unbounded"):
            problems.append(f"kda_gate must be lower_bounded|unbounded, got {self.kda_gate!r}")
        if self.kda_gate == "unbounded" and self.kda_impl not in ("naive", "recurrent"):
            problems.append("kda_gate 'unbounded' needs kda_impl 'naive' or 'recurrent' (the other forms rely on the "
                            "lower bound to keep factorised decays finite)")
        if self.qat not in ("none", "mxfp4") or self.qat_scale_mode not in ("floor", "ceil", "even", "rceil"):
            problems.append(f"qat must be none|mxfp4 and qat_scale_mode floor|ceil|even|rceil, got {self.qat!r}, "
                            f"{self.qat_scale_mode!r}")
        if self.qat == "mxfp4" and (self.routed_expert_hidden_size % 32 or self.moe_intermediate_size % 32):
            problems.append("qat 'mxfp4' needs routed_expert_hidden_size and moe_intermediate_size to be multiples "
                            "of 32 (the MX block runs along both GEMMs' reduction dims)")
        for name, choices in RUNTIME_CHOICES.items():
            if getattr(self, name) not in choices:
                problems.append(f"{name} must be {'|'.join(choices)}, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_config_json(self) -> dict[str, Any]:
        """The released nested layout: top level + `text_config` + `vision_config`."""
        text: dict[str, Any] = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}
        top_level = {"media_placeholder_token_id", "image_placeholder", "ignore_index", "vision_config"}
        for f in fields(self):
            if f.name in RUNTIME_FIELDS or f.name in top_level:
                continue
            value = getattr(self, f.name)
            if f.name == "linear_attn_config":
                value = dataclasses.asdict(value)
            if f.name == "quantization_config" and value is None:
                continue
            if f.name in ABLATION_FIELDS and value == ABLATION_FIELDS[f.name]:
                continue
            if f.name in ("qat", "qat_scale_mode") and self.qat == "none":
                continue
            text[f.name] = value
        out: dict[str, Any] = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "auto_map": {
                "AutoConfig": "configuration_kimi_k3.KimiK3Config",
                "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            },
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "ignore_index": self.ignore_index,
            "image_placeholder": self.image_placeholder,
            "media_placeholder_token_id": self.media_placeholder_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.dtype,
            "text_config": text,
        }
        if self.vision_config is not None:
            vision = dataclasses.asdict(self.vision_config)
            vision.update(vision.pop("extra"))
            if vision["norm_eps"] is None:
                del vision["norm_eps"]
            out["vision_config"] = vision
        return out

    @classmethod
    def from_config_json(cls, data: dict[str, Any], **runtime: Any) -> ModelConfig:
        """Read the released nested layout, or a flat text-only (`kimi_linear`) config."""
        if not isinstance(data, dict):
            raise ValueError("config.json must hold a JSON object")
        text = data.get("text_config", data)
        known = {f.name for f in fields(cls)} - set(RUNTIME_FIELDS) - {"vision_config"}
        required = [f.name for f in fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in text]
        if missing:
            raise ValueError(f"config.json text_config is missing required fields: {missing}")
        kwargs = {k: v for k, v in text.items() if k in known}
        for top in ("media_placeholder_token_id", "image_placeholder", "ignore_index"):
            if top in data and data is not text:
                kwargs[top] = data[top]
        lin = dict(text["linear_attn_config"])
        lin_known = {f.name for f in fields(LinearAttnConfig)}
        lin_missing = [k for k in ("num_heads", "head_dim", "kda_layers", "full_attn_layers") if k not in lin]
        if lin_missing:
            raise ValueError(f"config.json linear_attn_config is missing required fields: {lin_missing}")
        kwargs["linear_attn_config"] = LinearAttnConfig(**{k: v for k, v in lin.items() if k in lin_known})
        if "vision_config" in data and data["vision_config"] is not None:
            vis = dict(data["vision_config"])
            vis_known = {f.name for f in fields(VisionConfig)} - {"extra"}
            extra = {k: v for k, v in vis.items() if k not in vis_known}
            kwargs["vision_config"] = VisionConfig(**{k: v for k, v in vis.items() if k in vis_known}, extra=extra)
        try:
            return cls(**kwargs, **runtime)
        except TypeError as e:
            raise ValueError(f"config.json has fields of the wrong type: {e}") from e

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_config_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, **runtime: Any) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ValueError(f"no config file at {path}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_config_json(data, **runtime)


def _preset(*, hidden_size: int, num_layers: int, num_heads: int, head_dim: int, q_lora_rank: int,
            kv_lora_rank: int, num_experts: int, top_k: int, moe_intermediate_size: int,
            vocab_size: int, block_size: int | None = None, vision: VisionConfig | None = None,
            special_ids: tuple[int, int, int] | None = None) -> ModelConfig:
    """A K3-shaped config. Every K3 invariant is derived here, so presets only choose sizes."""
    kda, full = hybrid_layer_schedule(num_layers)
    bos, eos, pad = special_ids if special_ids is not None else (vocab_size - 256, vocab_size - 254, vocab_size - 1)
    return ModelConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        vocab_size=vocab_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        intermediate_size=11 * moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_token=top_k,
        num_shared_experts=2,
        moe_intermediate_size=moe_intermediate_size,
        routed_expert_hidden_size=hidden_size // 2,
        attn_res_block_size=block_size if block_size is not None else math.ceil(num_layers / 8),
        linear_attn_config=LinearAttnConfig(num_heads=num_heads, head_dim=head_dim,
                                            kda_layers=kda, full_attn_layers=full),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        media_placeholder_token_id=(vocab_size - 256) + 21,
        vision_config=vision,
    )


def _vision(hidden: int, layers: int, heads: int, grid: int, text_hidden: int) -> VisionConfig:
    return VisionConfig(vt_hidden_size=hidden, vt_num_hidden_layers=layers, vt_num_attention_heads=heads,
                        qkv_hidden_size=hidden * 3 // 2, vt_intermediate_size=4 * hidden,
                        init_pos_emb_height=grid, init_pos_emb_width=grid, mm_hidden_size=hidden,
                        text_hidden_size=text_hidden, extra={"_attn_implementation": "flash_attention_2"})


def debug() -> ModelConfig:
    """~2M parameters: unit tests. Block size 2 exercises both full and partial AttnRes blocks."""
    return _preset(hidden_size=128, num_layers=5, num_heads=2, head_dim=64, q_lora_rank=64, kv_lora_rank=64,
                   num_experts=16, top_k=2, moe_intermediate_size=64, vocab_size=512, block_size=2,
                   vision=_vision(64, 2, 2, 8, 128))


def tiny() -> ModelConfig:
    """~30M parameters: trains on a laptop CPU in minutes."""
    return _preset(hidden_size=256, num_layers=9, num_heads=6, head_dim=64, q_lora_rank=128, kv_lora_rank=128,
                   num_experts=64, top_k=4, moe_intermediate_size=96, vocab_size=8192,
                   vision=_vision(256, 4, 6, 16, 256))


def small() -> ModelConfig:
    """~0.85B total / 0.32B active with the release vocabulary: one GPU."""
    return _preset(hidden_size=768, num_layers=21, num_heads=8, head_dim=128, q_lora_rank=256, kv_lora_rank=256,
                   num_experts=64, top_k=8, moe_intermediate_size=320, vocab_size=163840,
                   vision=_vision(512, 12, 6, 32, 768), special_ids=(163584, 163586, 163839))


def k3() -> ModelConfig:
    """The released Kimi K3 configuration (2.78T total / 104.2B active)."""
    return _preset(hidden_size=7168, num_layers=93, num_heads=96, head_dim=128, q_lora_rank=1536, kv_lora_rank=512,
                   num_experts=896, top_k=16, moe_intermediate_size=3072, vocab_size=163840, block_size=12,
                   vision=_vision(1024, 27, 12, 64, 7168), special_ids=(163584, 163586, 163839))


PRESETS = {"debug": debug, "tiny": tiny, "small": small, "k3": k3}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[name]()
    return config.replace(**overrides) if overrides else config
