"""Activation checkpointing per decoder layer, applied to a built model (like every transform, outside
the model code).

`apply_activation_checkpointing(model)` wraps every `DecoderLayer.forward` (one layer of the direct
AttnRes wiring) in non-reentrant `torch.utils.checkpoint`: the forward keeps only each layer's inputs
(the running partial sum; the sealed blocks are shared) and the backward recomputes the layer. Parameter
names and the state dict are unchanged. The layer's side outputs (router statistics for Quantile
Balancing, MLA max logits for QK-Clip) are reported once, by the first run, never by the recomputation.
Calls with a cache (inference) or without gradients run the layer directly. The two-phase AttnRes
wiring does not go through `DecoderLayer.forward`: "two_phase" refuses a checkpointed model while a backward
can follow (k3.model.attn_res).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from k3.model.model import K3ForCausalLM


def _checkpointed(inner):
    def forward(sealed, partial, layout, cache=None, router_infos=None, mla_max_logits=None, read=None):
        if cache is not None or not torch.is_grad_enabled():
            return inner(sealed, partial, layout, cache, router_infos, mla_max_logits, read)
        first = [True]

        def run(sealed, partial):
            infos = [] if router_infos is not None else None
            logits = [] if mla_max_logits is not None else None
            out = inner(sealed, partial, layout, None, infos, logits, read)
            if first[0]:
                first[0] = False
                if infos:
                    router_infos.extend(infos)
                if logits:
                    mla_max_logits.extend(logits)
            return out

        return checkpoint(run, sealed, partial, use_reentrant=False)

    forward.k3_checkpointed = True
    return forward


def apply_activation_checkpointing(model: K3ForCausalLM) -> K3ForCausalLM:
    """Checkpoint every decoder layer of `model` (in place; idempotent). Returns the model."""
    for layer in model.model.layers:
        if not getattr(layer.forward, "k3_checkpointed", False):
            layer.forward = _checkpointed(layer.forward)
    return model
