"""The speculative draft: one decoder block on fused target features, its unrolled training-time test and the LK
loss (docs/speculative.md; K3 report §4.1.4, §5.4.2).

Legend: B rows, T tokens, D model width, V vocabulary, H heads, N + R query/key head dim, Vd value head dim,
C + R the MLA latent width, K unrolled steps.

    target (frozen): AttnRes blocks b_low, b_mid and the output read h (before its final norm)
    f_t = W_E3 [b_low; b_mid; h]_t                       `fc`, 3D → D, no bias, initialised [0 0 I]
    u_t = eh_proj [enorm e(x_{t+1}); hnorm f_t]          the MTP layer's input projection (embedding first)
    g_t = u_t + MLA(input_layernorm u)_t;  g_t += MoE(post_attention_layernorm g)_t      one residual block
    q_t = softmax(lm_head(norm g_t))                     the target's frozen final norm and head: predicts x_{t+2}

Training-time test, unrolled K steps: step 1 runs the block over every position on the target's features; at step
k > 1 the newest position t takes the draft's own previous output g^{k-1}_{t-1} instead of f_t, and attends to the
step-1 states of positions ≤ t − k + 1 (its anchor's verified prefix) plus the states of its own chain (step j at
position t − k + j), exactly as the draft's cache holds them when it drafts k tokens at inference. Every step
compares q^k_t with the target's p_{t+1} on the same text (teacher-forced tokens, the draft's own states).

Loss: L_LK = −log Σ_x min(p(x), q(x)) per position and step at temperature 1 (no cross-entropy term); Σ min(p, q) is
the probability that speculative sampling accepts the draft's token (Leviathan et al.).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3.config import ModelConfig
from k3.model.mla import GatedMLA
from k3.model.model import Collector, K3ForCausalLM
from k3.model.moe import StableLatentMoE
from k3.model.norm import RMSNorm
from k3.model.sequence import SequenceLayout


def feature_blocks(config: ModelConfig) -> tuple[int, int]:
    """The AttnRes blocks (1-based; b_0 is the embedding) whose outputs feed W_E3 beside the output read: 1 and 4
    (K3's 8 blocks), or for presets with fewer blocks 1 and the middle one, ⌈n/2⌉ of n."""
    n = math.ceil(config.num_hidden_layers / config.attn_res_block_size)
    return 1, min(4, math.ceil(n / 2))


def target_features(target: K3ForCausalLM, input_ids: Tensor, layout: SequenceLayout,
                    blocks: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """One forward of the target: (features [B, T, 3D] = [b_low; b_mid; output read], logits [B, T, V]).

    input_ids [B, T] on the target's device. Run it under `torch.inference_mode()` when the target is frozen."""
    collected = Collector()
    h = target.model(input_ids, layout, blocks=collected)
    reps = list(collected)  # b_0 … b_n, then the output read
    low, mid = blocks
    return torch.cat([reps[low], reps[mid], reps[-1]], dim=-1), target.lm_head(h)


def draft_logits(target: K3ForCausalLM, g: Tensor) -> Tensor:
    """The draft's logits: its hidden states g [..., D] through the target's final norm and head -> [..., V]."""
    return target.lm_head(target.model.norm(g))


def log_acceptance(p_logp: Tensor, q_logits: Tensor) -> Tensor:
    """log Σ_x min(p(x), q(x)) per row, at temperature 1: p_logp [..., V] the target's log-probabilities, q_logits
    [..., V] the draft's logits. At most 0, and 0 exactly when q = p. Computed in log space (a logsumexp of the
    smaller log-probability), so it needs no epsilon."""
    q_logp = torch.log_softmax(q_logits.to(torch.promote_types(q_logits.dtype, torch.float32)), dim=-1)
    return torch.logsumexp(torch.minimum(p_logp.to(q_logp.dtype), q_logp), dim=-1)


def lk_loss(p_logp: Tensor, q_logits: Tensor) -> Tensor:
    """L_LK = −log Σ_x min(p(x), q(x)) per row (the negative log acceptance probability)."""
    return -log_acceptance(p_logp, q_logits)


def shift_right(x: Tensor, n: int, fill: float = 0) -> Tensor:
    """x [B, T, ...] moved n positions later along T: row t holds x[t − n], the first n rows `fill`."""
    if n == 0:
        return x
    T = x.shape[1]
    head = x.new_full((x.shape[0], min(n, T), *x.shape[2:]), fill)
    return torch.cat([head, x[:, : max(T - n, 0)]], dim=1)


def _gate_and_project(attn: GatedMLA, x: Tensor, o: Tensor) -> Tensor:
    """o [B, T, H, Vd] -> o_proj(σ(g_proj x) ⊙ o), as `GatedMLA.forward` ends."""
    B, T = x.shape[:2]
    o = o.reshape(B, T, -1).to(x.dtype)
    return attn.o_proj(torch.sigmoid(attn.g_proj(x)) * o)


def _queries(attn: GatedMLA, x: Tensor) -> Tensor:
    B, T, _ = x.shape
    return attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(B, T, attn.num_heads, -1)  # [B, T, H, N + R]


def ttt_attention(attn: GatedMLA, x: Tensor, latents: list[Tensor], segment_ids: Tensor) -> Tensor:
    """The draft's attention at unrolled step k = len(latents): x [B, T, D] (input_layernorm'ed) -> [B, T, D].

    latents[j] [B, T, C + R]: the latents of step j + 1 at every position (the last one is x's). Query t sees the
    step-1 latents at s ≤ t − (k − 1) of its own document (segment_ids [B, T]) and, for j = 2 … k, the step-j latent
    at t − (k − j): k − 1 extra keys per query, so a step costs one causal attention plus a diagonal, not k of them.
    Scores and softmax in fp32 (fp64 for fp64 inputs), as `GatedMLA.attend`. `ttt_attention_reference` is the same
    attention over the concatenated latents with an explicit mask.
    """
    T = x.shape[1]
    k = len(latents)
    q = _queries(attn, x)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q = q.to(compute)
    keys, values = attn.expand_latent(latents[0])  # [B, T, H, N + R], [B, T, H, Vd]
    scores = torch.einsum("bthd,bshd->bhts", q, keys.to(compute)) * attn.softmax_scale  # [B, H, T, T]
    pos = torch.arange(T, device=x.device)
    visible = (pos[None, :] <= pos[:, None] - (k - 1)) & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    chain_scores, chain_values = [], []
    for j in range(2, k + 1):
        lag = k - j
        key_j, value_j = attn.expand_latent(shift_right(latents[j - 1], lag))  # row t: the step-j latent at t − lag
        s = torch.einsum("bthd,bthd->bht", q, key_j.to(compute)) * attn.softmax_scale  # [B, H, T]
        chain_scores.append(s.masked_fill(pos < lag, float("-inf")))
        chain_values.append(value_j.to(compute))
    if chain_scores:
        scores = torch.cat([scores, torch.stack(chain_scores, dim=-1)], dim=-1)  # [B, H, T, T + k − 1]
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhts,bshv->bthv", probs[..., :T], values.to(compute))  # [B, T, H, Vd]
    for j, value_j in enumerate(chain_values):
        o = o + probs[..., T + j].transpose(1, 2).unsqueeze(-1) * value_j
    return _gate_and_project(attn, x, o)


def ttt_attention_reference(attn: GatedMLA, x: Tensor, latents: list[Tensor], segment_ids: Tensor) -> Tensor:
    """`ttt_attention` as one `GatedMLA.attend` over the concatenated latents [B, k·T, C + R] with the explicit
    [B, T, k·T] mask (the test oracle; k times the score memory)."""
    B, T, _ = x.shape
    k = len(latents)
    pos = torch.arange(T, device=x.device)
    masks = [(pos[None, :] <= pos[:, None] - (k - 1)) & (segment_ids[:, :, None] == segment_ids[:, None, :])]
    for j in range(2, k + 1):
        masks.append((pos[None, :] == pos[:, None] - (k - j)).expand(B, T, T))
    o = attn.attend(_queries(attn, x), torch.cat(latents, dim=1), torch.cat(masks, dim=-1), "naive", None)
    return _gate_and_project(attn, x, o)


class Draft(nn.Module):
    """The draft model: W_E3 (`fc`), the MTP input projection (`enorm`, `hnorm`, `eh_proj`) and one decoder block
    (Gated MLA + Stable LatentMoE, as the backbone's MLA layers) whose tensors carry the backbone layer's names. The
    target's embedding, final norm and head are used, frozen, and are not part of the draft. Build with
    `build_draft` for the seeded initialisation."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        # the index an MTP layer takes in the release layout: right after the backbone's layers
        self.layer_idx = config.num_hidden_layers
        self.feature_blocks = feature_blocks(config)
        self.fc = nn.Linear(3 * D, D, bias=False)
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = GatedMLA(config, self.layer_idx)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.block_sparse_moe = StableLatentMoE(config)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.impl = config.norm_impl

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """The backbone's rules per module type, seeded per tensor name (`K3ForCausalLM.init_weights`), then W_E3 =
        [0 0 I]: at initialisation the fused feature is the output read, the feature an MTP layer is trained on."""
        K3ForCausalLM.init_weights(self, seed)
        D = self.config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * D:] = torch.eye(D, dtype=self.fc.weight.dtype, device=self.fc.weight.device)

    def fuse(self, features: Tensor) -> Tensor:
        """features [..., 3D] ([b_low; b_mid; output read]) -> f [..., D]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def project(self, hidden: Tensor, embeds: Tensor) -> Tensor:
        """The block's input u = eh_proj [enorm e; hnorm hidden]; hidden and embeds [..., D]."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1))

    def _ffn(self, h: Tensor, router_infos) -> Tensor:
        return h + self.block_sparse_moe(self.post_attention_layernorm(h), router_infos)

    def forward(self, hidden: Tensor, embeds: Tensor, layout: SequenceLayout, state=None, use_cache: bool = False,
                router_infos=None):
        """The block over a sequence, causal (step 1, and drafting with a cache): hidden [B, T, D] (`fuse`d target
        features, or the draft's own previous outputs), embeds [B, T, D] (the target's embedding of the next
        tokens). Returns (g [B, T, D], the MLA cache state as `GatedMLA.forward` returns it)."""
        u = self.project(hidden, embeds)
        y, state = self.self_attn(self.input_layernorm(u), layout, state, use_cache)
        return self._ffn(u + y, router_infos), state

    def unrolled_step(self, hidden: Tensor, embeds: Tensor, latents: list[Tensor], segment_ids: Tensor,
                      router_infos=None, attention=ttt_attention) -> Tensor:
        """Step k = len(latents) + 1 of the training-time test (module docstring): appends this step's latents
        and returns g [B, T, D]."""
        u = self.project(hidden, embeds)
        x = self.input_layernorm(u)
        latents.append(self.self_attn.latent(x))
        return self._ffn(u + attention(self.self_attn, x, latents, segment_ids), router_infos)


def build_draft(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Draft:
    """Construct on the meta device, materialise on `device`, initialise from `seed` (`Draft.init_weights`)."""
    with torch.device("meta"):
        draft = Draft(config)
    draft.to_empty(device=device)
    draft.init_weights(seed)
    return draft.to(dtype)


def unroll(draft: Draft, features: Tensor, embeds: Tensor, segment_ids: Tensor, steps: int,
           router_infos=None) -> list[Tensor]:
    """The training-time test's hidden states, one [B, T, D] per step: features [B, T, 3D] and embeds [B, T, D]
    at positions t (the features of token t, the embedding of token t + 1), segment_ids [B, T]."""
    hidden = draft.fuse(features)
    latents: list[Tensor] = []
    outputs = []
    for _ in range(steps):
        g = draft.unrolled_step(hidden, embeds, latents, segment_ids, router_infos)
        outputs.append(g)
        hidden = shift_right(g, 1)  # position t's next input: the draft's own output at t − 1
    return outputs


@dataclass
class UnrolledLoss:
    """What one batch of the training-time test gives: `loss` (Σ L_LK over the steps and valid positions, with
    gradients), and per step k (detached, [K]): Σ L_LK, Σ α = Σ_x min(p, q), and the valid positions; plus each
    step's valid positions [B·(T−1)] bool (for the draft router's balancing)."""

    loss: Tensor
    loss_sums: Tensor
    acceptance_sums: Tensor
    counts: Tensor
    token_masks: list[Tensor]


def unrolled_loss(draft: Draft, target: K3ForCausalLM, input_ids: Tensor, labels: Tensor,
                  cu_seqlens: Tensor | None = None, steps: int = 7, router_infos=None) -> UnrolledLoss:
    """The training-time test on one batch: input_ids [B, T] (packed rows, `cu_seqlens` as the model takes them),
    labels [B, T] (`ignore_index` where token t + 1 is not in token t's document, as `k3.train.data` makes them).

    The frozen target runs once in inference mode: its features, its p_{t+1} at temperature 1 and its embedding of
    x_{t+1}. Position t (0 … T − 2) counts at step k iff positions t − k + 1 … t + 1 are one document.
    """
    B, T = input_ids.shape
    if T < 2:
        raise ValueError(f"the training-time test needs at least 2 tokens per row, got {T}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = draft.fc.weight.device
    input_ids, labels = input_ids.to(device), labels.to(device)
    layout = SequenceLayout.build(B, T, cu_seqlens, device)
    with torch.inference_mode():
        features, logits = target_features(target, input_ids, layout, draft.feature_blocks)
        p_logp = torch.log_softmax(logits[:, 1:].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        embeds = target.model.embed_tokens(input_ids[:, 1:])  # [B, T−1, D]: e(x_{t+1})
    # inference tensors cannot be saved for backward: plain copies
    features, p_logp, embeds = features[:, :-1].clone(), p_logp.clone(), embeds.clone()
    segments = layout.segment_ids if layout.segment_ids is not None else torch.zeros_like(input_ids)
    segments = segments[:, :-1]
    valid = labels[:, :-1] != target.config.ignore_index
    pos = torch.arange(T - 1, device=device)
    hidden = draft.fuse(features)
    latents: list[Tensor] = []
    total, loss_sums, acceptance_sums, counts, masks = 0, [], [], [], []
    for k in range(steps):
        in_document = valid & (pos >= k) & (segments == shift_right(segments, k, fill=-1))
        g = draft.unrolled_step(hidden, embeds, latents, segments, router_infos)
        log_acc = log_acceptance(p_logp, draft_logits(target, g))  # [B, T−1]
        step_loss = -torch.where(in_document, log_acc, 0).sum()
        total = total + step_loss
        loss_sums.append(step_loss.detach())
        acceptance_sums.append(torch.where(in_document, log_acc.detach().exp(), 0).sum())
        counts.append(in_document.sum())
        masks.append(in_document.reshape(-1))
        hidden = shift_right(g, 1)
    return UnrolledLoss(total, torch.stack(loss_sums), torch.stack(acceptance_sums), torch.stack(counts), masks)


def tokens_per_verify(acceptance: list[float], k: int | None = None) -> float:
    """Expected tokens per target verification when drafting k tokens, from the per-step acceptance rates α_1 …:
    1 + Σ_{j ≤ k} Π_{i ≤ j} α_i (the accepted prefix plus the corrected or bonus token). With one rate α for every
    step this is (1 − α^{k+1}) / (1 − α)."""
    k = len(acceptance) if k is None else k
    if not 0 <= k <= len(acceptance):
        raise ValueError(f"k must be in [0, {len(acceptance)}], got {k}")
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total
