"""Per-Head Muon + AdamW, QK-Clip and the cosine schedule (docs/optimizer.md; docs/optimizer.md)."""

from k3.optim.muon import (
    NS_COEFFICIENTS,
    ROUTING_TABLE,
    MuonAdamW,
    ParamRule,
    muon_block_view,
    newton_schulz,
    orthogonalize_blocks,
    param_rule,
)
from k3.optim.qk_clip import qk_clip_, qk_clip_stats
from k3.optim.schedule import cosine_schedule, lr_multiplier, warmup_steps

__all__ = [
    "NS_COEFFICIENTS",
    "ROUTING_TABLE",
    "MuonAdamW",
    "ParamRule",
    "cosine_schedule",
    "lr_multiplier",
    "muon_block_view",
    "newton_schulz",
    "orthogonalize_blocks",
    "param_rule",
    "qk_clip_",
    "qk_clip_stats",
    "warmup_steps",
]
