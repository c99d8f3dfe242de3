"""Cosine learning-rate schedule with 1% linear warmup (docs/optimizer.md; K3 report §3.2–3.3).

The report found cosine beats WSD for K3. With S total optimizer steps and W = ⌈warmup_frac·S⌉:
    η(t) = η_peak·(t+1)/W                                          for t < W
    η(t) = η_min + ½(η_peak − η_min)(1 + cos(π(t−W)/(S−W)))         for W ≤ t ≤ S, η_min after S
η_min is not reported; the default 0.1·η_peak is ours. One multiplier scales every param group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_steps(total_steps: int, warmup_frac: float) -> int:
    """W = ⌈warmup_frac·S⌉ (a tiny slack keeps 0.01·700 = 7.000000000000001 at 7)."""
    return max(0, math.ceil(warmup_frac * total_steps - 1e-9))


def lr_multiplier(step: int, total_steps: int, warmup_frac: float = 0.01, min_lr_ratio: float = 0.1) -> float:
    """η(step)/η_peak for optimizer step `step` (0-based) of `total_steps`."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_frac < 1:
        raise ValueError(f"warmup_frac must be in [0, 1), got {warmup_frac}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    W = warmup_steps(total_steps, warmup_frac)
    if step < W:
        return (step + 1) / W
    progress = min(1.0, (step - W) / (total_steps - W)) if total_steps > W else 1.0
    return min_lr_ratio + 0.5 * (1 - min_lr_ratio) * (1 + math.cos(math.pi * progress))


@dataclass
class CosineMultiplier:
    """The LambdaLR callable; a plain object so LambdaLR's state_dict records its three fields."""

    total_steps: int
    warmup_frac: float = 0.01
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self.total_steps, self.warmup_frac, self.min_lr_ratio)


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.01,
                    min_lr_ratio: float = 0.1) -> LambdaLR:
    """LambdaLR applying `lr_multiplier` to every group's initial lr; call `.step()` after each optimizer step."""
    lr_multiplier(0, total_steps, warmup_frac, min_lr_ratio)  # validate now, not at the first step
    return LambdaLR(optimizer, CosineMultiplier(total_steps, warmup_frac, min_lr_ratio))
