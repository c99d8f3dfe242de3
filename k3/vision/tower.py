"""MoonViT-V2, the vision tower (docs/architecture.md §7.3; docs/vision.md, "The tower").

Legend: N packed patches (all items of a batch), n items, t frames, h × w patches per frame, p patch size,
D tower width, H heads, K head dim, Q = H·K (qkv width), F MLP width.

    pixel_values [N, 3, p, p] ─ patch_embed.proj (conv p×p, stride p, no bias) ─ + pos_emb ─▶ [N, D]
    pos_emb: the learnable [64, 64, D] grid, bilinearly resized to (h, w) (align_corners False), repeated over
             frames, plus a fixed sin-cos table over time when t > 1
    27 × block: x += wo(Attn(RoPE2D(split(wqkv(norm0 x)))));  x += fc1(GELU_tanh(fc0(norm1 x)))
    encoder.final_layernorm ─▶ [N, D]

Attention is non-causal within each item (an image, or all t·h·w patches of a video item) over the packed
batch (`cu_seqlens`), scale K^-1/2; `k3.vision.attention` holds the reference and the fast paths. 2-D RoPE pairs
channels (2j, 2j+1) as one complex number; pair 2i turns by x·f_i (the patch's column), pair 2i+1 by y·f_i (its
row), f_i = θ^(−4i/K), θ = 10000. Module and parameter names are the release's (`vision_tower.…` without the
prefix), so a state dict maps to the released checkpoint one to one.
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import VisionConfig
from k3.ops.norm import fused_norm_available, naive_rms_norm, rms_norm_triton
from k3.vision.attention import resolve_backend, varlen_attention

ROPE_THETA = 10000.0
TIME_TABLE_BASE = 10000.0


def check_vision_config(vc: VisionConfig) -> None:
    """ValueError for a `vision_config` this tower does not implement (k3 builds MoonViT-V2 only)."""
    problems = []
    for name in ("patch_size", "vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "qkv_hidden_size",
                 "vt_intermediate_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
                 "mm_hidden_size", "text_hidden_size"):
        if not isinstance(getattr(vc, name), int) or getattr(vc, name) < 1:
            problems.append(f"{name} must be a positive integer, got {getattr(vc, name)!r}")
    if problems:
        raise ValueError("invalid vision_config: " + "; ".join(problems))
    if vc.qkv_hidden_size % vc.vt_num_attention_heads or (vc.qkv_hidden_size // vc.vt_num_attention_heads) % 4:
        problems.append(f"qkv_hidden_size ({vc.qkv_hidden_size}) must split into vt_num_attention_heads "
                        f"({vc.vt_num_attention_heads}) heads of a width divisible by 4 (2-D RoPE)")
    if vc.vt_hidden_size % 2:
        problems.append("vt_hidden_size must be even (the sin-cos time table)")
    if vc.mm_hidden_size != vc.vt_hidden_size:
        problems.append(f"mm_hidden_size ({vc.mm_hidden_size}) must equal vt_hidden_size ({vc.vt_hidden_size})")
    expected = {"activation_func": "gelu_pytorch_tanh", "norm_type": "rmsnorm", "pos_emb_type": "divided_fixed",
                "pos_emb_interpolation_mode": "bilinear", "merge_type": "sd2_tpool",
                "mm_projector_type": "patchmergerv2", "projector_hidden_act": "gelu"}
    problems += [f"{name} {getattr(vc, name)!r} is not supported (MoonViT-V2 uses {want!r})"
                 for name, want in expected.items() if getattr(vc, name) != want]
    if list(vc.merge_kernel_size) != [2, 2]:
        problems.append(f"merge_kernel_size {vc.merge_kernel_size} is not supported (sd2_tpool merges 2 × 2)")
    if vc.attn_bias or vc.linear_bias or vc.patch_embed_proj_bias:
        problems.append("biases are not supported (MoonViT-V2 has none)")
    if problems:
        raise ValueError("invalid vision_config: " + "; ".join(problems))


class VisionRMSNorm(nn.Module):
    """RMSNorm with fp32 statistics; `eps` None is the activation dtype's machine epsilon, as the default of
    `torch.nn.RMSNorm` that the release's tower uses (2^-7 for bf16, about 1.2e-7 for fp32)."""

    def __init__(self, dim: int, eps: float | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if fused_norm_available(x):
            return rms_norm_triton(x, self.weight, eps)
        return naive_rms_norm(x, self.weight, eps)


def sincos_time_table(frames: int, dim: int, device=None) -> torch.Tensor:
    """[frames, dim] fp64: first half sin(t·ω_i), second half cos(t·ω_i), ω_i = 10000^(−2i/dim), t < frames."""
    omega = TIME_TABLE_BASE ** (-2.0 * torch.arange(dim // 2, device=device, dtype=torch.float64) / dim)
    angle = torch.arange(frames, device=device, dtype=torch.float64)[:, None] * omega  # [t, dim/2]
    return torch.cat([angle.sin(), angle.cos()], dim=1)


class PositionGrid(nn.Module):
    """`patch_embed.pos_emb`: the learnable [H0, W0, D] grid (`weight`), resized per item, plus the time table."""

    def __init__(self, height: int, width: int, dim: int, max_frames: int):
        super().__init__()
        self.max_frames = max_frames
        self.weight = nn.Parameter(torch.empty(height, width, dim))

    def grid(self, h: int, w: int) -> torch.Tensor:
        """[h·w, D]: the grid itself at its own size, else bilinearly resized (align_corners False), row-major."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        compute = torch.promote_types(self.weight.dtype, torch.float32)
        table = self.weight.permute(2, 0, 1)[None].to(compute)  # [1, D, H0, W0]
        resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False)
        return resized[0].permute(1, 2, 0).flatten(0, 1).to(self.weight.dtype)

    def forward(self, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[N, D] for the packed items: the 2-D grid repeated over each item's frames, + time(t) when t > 1."""
        parts = []
        for t, h, w in grid_thw:
            if t > self.max_frames:
                raise ValueError(f"a media item has {t} frames; the tower's time table holds {self.max_frames}")
            g = self.grid(h, w)
            if t > 1:
                time = sincos_time_table(t, g.shape[-1], g.device).to(g.dtype)
                g = (g[None] + time[:, None]).flatten(0, 1)  # [t·h·w, D]
            parts.append(g)
        return torch.cat(parts)


class PatchEmbed(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, vc.vt_hidden_size, vc.patch_size, stride=vc.patch_size, bias=False)
        self.pos_emb = PositionGrid(vc.init_pos_emb_height, vc.init_pos_emb_width, vc.vt_hidden_size,
                                    vc.init_pos_emb_time)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [N, 3, p, p] → [N, D]. A p×p convolution with stride p over one patch is a matmul with the
        flattened kernel; tests tie the two."""
        x = F.linear(pixel_values.flatten(1).to(self.proj.weight.dtype), self.proj.weight.flatten(1))
        return x + self.pos_emb(grid_thw).to(x.dtype)


def rope_2d_angles(grid_thw: list[tuple[int, int, int]], head_dim: int, device=None) -> torch.Tensor:
    """[N, K/2] fp64 rotation angles: pair 2i turns by column·f_i, pair 2i+1 by row·f_i, f_i = θ^(−4i/K);
    the same angles for every frame of an item."""
    freqs = ROPE_THETA ** (-4.0 * torch.arange(head_dim // 4, device=device, dtype=torch.float64) / head_dim)
    parts = []
    for t, h, w in grid_thw:
        rows = torch.arange(h, device=device, dtype=torch.float64).repeat_interleave(w)  # [h·w] row-major
        cols = torch.arange(w, device=device, dtype=torch.float64).repeat(h)
        angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).flatten(1)  # [h·w, K/2]
        parts.append(angles.repeat(t, 1))
    return torch.cat(parts)


def apply_rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, K] with channel pairs (2j, 2j+1) as (re, im), turned by angle j: cos, sin [N, K/2] in fp32
    (fp64 for an fp64 x); the result is in x's dtype."""
    pairs = x.to(cos.dtype).unflatten(-1, (-1, 2))  # [N, H, K/2, 2]
    re, im = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig, norm_eps: float | None):
        super().__init__()
        self.num_heads = vc.vt_num_attention_heads
        self.head_dim = vc.qkv_hidden_size // vc.vt_num_attention_heads
        self.norm0 = VisionRMSNorm(vc.vt_hidden_size, norm_eps)
        # rows s·Q + h·K + i for s in (q, k, v)
        self.wqkv = nn.Linear(vc.vt_hidden_size, 3 * vc.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(vc.qkv_hidden_size, vc.vt_hidden_size, bias=False)
        self.norm1 = VisionRMSNorm(vc.vt_hidden_size, norm_eps)
        self.mlp = VisionMLP(vc.vt_hidden_size, vc.vt_intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int],
                backend: str) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(N, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, K] each
        q, k = apply_rope_2d(q, cos, sin), apply_rope_2d(k, cos, sin)
        o = varlen_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5, backend)
        x = x + self.wo(o.reshape(N, -1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, vc: VisionConfig, norm_eps: float | None):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(vc, norm_eps) for _ in range(vc.vt_num_hidden_layers))
        self.final_layernorm = VisionRMSNorm(vc.vt_hidden_size, norm_eps)


class MoonViT(nn.Module):
    """The tower. `attention_backend` is the model config's (auto | reference | sdpa | flex | flash)."""

    def __init__(self, vc: VisionConfig, attention_backend: str = "auto"):
        super().__init__()
        check_vision_config(vc)
        self.config = vc
        self.attention_backend = attention_backend
        self.patch_embed = PatchEmbed(vc)
        self.encoder = VisionEncoder(vc, vc.norm_eps)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | list) -> torch.Tensor:
        """pixel_values [N, 3, p, p], grid_thw [n, 3] (t, h, w per item; t·h·w patches each, in order) → [N, D]."""
        grid = [tuple(int(v) for v in row) for row in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
        p = self.config.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [N, 3, {p}, {p}], got {list(pixel_values.shape)}")
        sizes = [t * h * w for t, h, w in grid]
        if not grid or any(len(g) != 3 or min(g) < 1 for g in grid) or sum(sizes) != pixel_values.shape[0]:
            raise ValueError(f"grid_thw {grid} does not describe the {pixel_values.shape[0]} patches of pixel_values")
        cu_seqlens = [0, *accumulate(sizes)]
        backend = resolve_backend(self.attention_backend, pixel_values.device)
        x = self.patch_embed(pixel_values, grid)
        angles = rope_2d_angles(grid, self.encoder.blocks[0].head_dim, x.device)
        rope_dtype = torch.promote_types(x.dtype, torch.float32)
        cos, sin = angles.cos().to(rope_dtype), angles.sin().to(rope_dtype)
        for block in self.encoder.blocks:
            x = block(x, cos, sin, cu_seqlens, backend)
        return self.encoder.final_layernorm(x)

    @torch.no_grad()
    def init_weights(self, generator_for) -> None:
        """The tensors the language model's init does not cover (it draws every linear): norms 1, the patch conv
        U(±1/√fan_in) as PyTorch's default, the position grid N(0, 0.02)."""
        for module in self.modules():
            if isinstance(module, VisionRMSNorm):
                module.weight.fill_(1.0)
        w = self.patch_embed.proj.weight
        bound = 1.0 / math.sqrt(w[0].numel())
        w.uniform_(-bound, bound, generator=generator_for("vision_tower.patch_embed.proj", w.device))
        g = self.patch_embed.pos_emb.weight
        g.normal_(0.0, 0.02, generator=generator_for("vision_tower.patch_embed.pos_emb", g.device))
