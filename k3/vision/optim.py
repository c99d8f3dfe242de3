"""The tower's and projector's optimizer routing, and their own learning rate (docs/vision.md, "Training").

`k3.optim.MuonAdamW` routes the language model by its name table; this table does the same for the vision
names, in the same two kinds (K3 report §2.5 applies Per-Head Muon to attention: the tower's `wqkv` is split
per head and per q/k/v like KDA's projections):

    vision_tower.encoder.blocks.b.wqkv       Muon, 3H blocks [K, D] (rows s·Q + h·K + i)
    ….wo, ….mlp.fc0, ….mlp.fc1               Muon, whole matrix
    vision_tower.patch_embed.proj            Muon, whole: the conv kernel [D, 3, p, p] as one [D, 3·p·p] matrix
    mm_projector.proj.0, proj.2              Muon, whole
    pos_emb, norm0, norm1, final_layernorm, post_norm   AdamW

`add_vision_param_groups(optimizer, model, lr)` adds them to a MuonAdamW built over
`model.text_named_parameters()` as two more groups ("muon", "adamw") with their own `lr`; a LambdaLR built
afterwards scales all four groups alike, so the tower keeps its ratio to the language model's rate.
"""

from __future__ import annotations

import math
import re

from torch import nn

VISION_ROUTING_TABLE: list[tuple[str, str | None]] = [
    (r"vision_tower\.encoder\.blocks\.\d+\.wqkv\.weight", "qkv_heads"),
    (r"vision_tower\.encoder\.blocks\.\d+\.(wo|mlp\.fc0|mlp\.fc1)\.weight", "whole"),
    (r"vision_tower\.patch_embed\.proj\.weight", "whole"),
    (r"mm_projector\.proj\.(0|2)\.weight", "whole"),
    (r"vision_tower\.patch_embed\.pos_emb\.weight", None),
    (r"vision_tower\.encoder\.blocks\.\d+\.norm(0|1)\.weight", None),
    (r"vision_tower\.encoder\.final_layernorm\.weight", None),
    (r"mm_projector\.post_norm\.weight", None),
]
_COMPILED = [(re.compile(p), view) for p, view in VISION_ROUTING_TABLE]


def vision_block_view(name: str, shape: tuple[int, ...], num_heads: int) -> tuple[int, int, int] | None:
    """(n_blocks, rows, cols) of a Muon vision parameter, None for AdamW; ValueError for a name not in the table."""
    hits = [view for pattern, view in _COMPILED if pattern.fullmatch(name)]
    if len(hits) != 1:
        raise ValueError(f"parameter {name!r} matches {len(hits)} rows of the vision routing table "
                         "(k3/vision/optim.py)")
    view = hits[0]
    if view is None:
        return None
    rows, cols = shape[0], math.prod(shape[1:])
    if view == "qkv_heads":
        return 3 * num_heads, rows // (3 * num_heads), cols
    return 1, rows, cols


def add_vision_param_groups(optimizer, model: nn.Module, lr: float) -> None:
    """Add the tower and projector of `model` (a `K3VisionLanguageModel`) to a `MuonAdamW` as a "muon" and an
    "adamw" group with learning rate `lr` (the other settings are the optimizer's defaults)."""
    heads = model.config.vision_config.vt_num_attention_heads
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not name.startswith(("vision_tower.", "mm_projector.")):
            continue
        view = vision_block_view(name, tuple(p.shape), heads)
        (muon if view is not None else adamw).append((name, p, view))
    for kind, entries in (("muon", muon), ("adamw", adamw)):
        optimizer.add_param_group({"params": [p for _, p, _ in entries], "param_names": [n for n, _, _ in entries],
                                   "kind": kind, "lr": lr})
        for _, p, view in entries:
            if view is not None:
                optimizer.block_shapes[p] = view
