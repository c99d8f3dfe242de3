"""The sd2_tpool merge and the patchmergerv2 projector (docs/architecture.md §7.4).

Legend: N packed patches, M merged tokens, t frames, h × w patches per frame, D tower width, T text width.

    tower output [N, D] ─ sd2_tpool ─▶ [M, 4D] ─ proj.0 (4D→4D) ─ GELU ─ proj.2 (4D→T) ─ post_norm ─▶ [M, T]

sd2_tpool views an item's tokens as (t, h/2, 2, w/2, 2, D), averages over t, and concatenates each 2 × 2
neighbourhood in (dy, dx) row-major order: feature (2·dy + dx)·D + c; merged tokens are row-major, M = Σ (h/2)(w/2).
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import VisionConfig
from k3.model.norm import RMSNorm


def sd2_tpool(x: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
    """x [N, D] (items back to back, each t·h·w row-major patches) → [M, 4D]."""
    out, start = [], 0
    D = x.shape[-1]
    for t, h, w in grid_thw:
        if h % 2 or w % 2:
            raise ValueError(f"sd2_tpool merges 2 × 2 patches; a {h} × {w} patch grid has an odd side")
        item = x[start:start + t * h * w].view(t, h // 2, 2, w // 2, 2, D).mean(0)  # [h/2, dy, w/2, dx, D]
        out.append(item.permute(0, 2, 1, 3, 4).reshape((h // 2) * (w // 2), 4 * D))
        start += t * h * w
    return torch.cat(out)


class PatchMergerV2(nn.Module):
    """`mm_projector`: Linear 4D→4D, exact GELU, Linear 4D→T, then `post_norm` RMSNorm(T, projector_ln_eps)."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        width = vc.mm_hidden_size * vc.merge_kernel_size[0] * vc.merge_kernel_size[1]
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, vc.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(vc.text_hidden_size, vc.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """merged [M, 4D] → [M, T]."""
        return self.post_norm(self.proj(merged))
