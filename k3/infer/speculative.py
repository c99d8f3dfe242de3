"""Speculative decoding in the engine: the drafter interface, exact acceptance, and KDA state rollback
(docs/speculative.md; K3 report §4.1.4, §5.4.2; Leviathan et al., Chen et al.).

Legend: N sequences, T packed tokens of a verify pass, k drafted tokens, V vocabulary, H heads, K = V' head dims,
P = H·K conv channels, W conv width, F feature width (3·D).

One engine step with speculation: every decoding sequence runs its last committed token plus its k drafts as one
document of a ragged target pass (prefill pieces ride along); the pass gives logits at each of the k + 1 positions
and the features of every position; `accept` decides each sequence's emitted tokens; the KDA layers' states and conv
tails are set to those after the last verified position (`VerifyCapture`); MLA caches truncate by length alone;
the drafter's cache takes the verified positions' features, and it drafts the next k tokens. That step, which the
engine runs in place of its decode step, is `speculative_step` (speculative_step.py); this file holds its pieces.

The drafter is passed in (`Drafter`): this package knows no draft model (k3.spec implements one).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Protocol, Self

import torch

from k3.infer.cache import CacheSpec, PagePool
from k3.model.kda import KimiDeltaAttention
from k3.model.model import Collector, K3ForCausalLM
from k3.model.sequence import SequenceLayout
from k3.ops.kda import naive_recurrent_kda

ROLLBACK_FORMS = ("snapshot", "replay")


class Drafter(Protocol):
    """What the engine needs from a draft model. Sequences are named by request id; positions are absolute.

    `extend` commits the draft's cache entries of verified positions start … start + n − 1 (features of those
    positions from the target's verify pass, and the token after each) and returns the draft's logits at the last
    one: q for the token after the next. A start below what the drafter holds truncates it (recompute after
    preemption); above it leaves a gap (a prefix-cache hit: those positions were never run). `propose` runs one
    chained step per sequence on its previous output and the token just drafted, held tentatively until the next
    `extend` or `release` drops it."""

    feature_blocks: tuple[int, int]  # the AttnRes blocks (1-based) whose outputs join the output read as features

    def extend(self, request_ids: list[str], starts: list[int], features: list[torch.Tensor],
               next_tokens: list[list[int]]) -> torch.Tensor: ...  # features[i] [n_i, F] -> logits [len, V]

    def propose(self, request_ids: list[str], tokens: list[int]) -> torch.Tensor: ...  # -> logits [len, V]

    def release(self, request_id: str) -> None: ...


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] (any nonnegative weights): the exponential race argmax(p / E), E ~ Exp(1), as the
    engine's sampler draws."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / race))


def accept(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator,
           greedy: bool) -> tuple[list[int], int]:
    """Exact speculative acceptance for one sequence.

    p [k + 1, V] float64: the target's processed distribution (penalties, temperature, top-k/p, min-p applied) at
    each verified position; q [k, V] float64: the draft's, processed the same way, from which drafts[i] was drawn.
    Returns (emitted tokens: the accepted drafts then one corrected or bonus token, the number accepted).

    Greedy: accept while the draft equals the target's argmax; nothing is drawn. Otherwise draft i is accepted iff
    u_i ≤ p_i(x_i) / q_i(x_i) with u_i ~ U[0, 1) in float64 from the request's generator (all k drawn at once);
    at the first rejection the token is drawn from norm(max(0, p_i − q_i)), and when all pass, from p_k.
    """
    k = len(drafts)
    if greedy:
        best = p.argmax(dim=-1).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        return drafts[:a] + [best[a]], a
    if k:
        u = torch.rand(k, dtype=torch.float64, generator=generator, device=p.device)
        d = torch.tensor(drafts, device=p.device)
        rows = torch.arange(k, device=p.device)
        # u ≤ p/q without dividing: q(x) > 0 for a drawn x
        ok = (u * q[rows, d] <= p[rows, d]).tolist()
        a = ok.index(False) if False in ok else k
    else:
        a = 0
    if a < k:
        residual = (p[a] - q[a]).clamp_min(0)
        # a rejection implies p(x) < q(x), so some mass is left; rounding may still leave none
        return drafts[:a] + [draw(residual if residual.sum() > 0 else p[a], generator)], a
    return drafts + [draw(p[k], generator)], k


# ------------------------------------------------------------------------------------------------- the verify pass


def forward_with_features(model: K3ForCausalLM, ids: torch.Tensor, cu_seqlens: list[int], cache,
                          logits_at: torch.Tensor, feature_blocks: tuple[int, int]):
    """A ragged incremental forward (documents continue the cache's sequences, as `K3ForCausalLM.forward` runs
    them) that also hands out the draft's features. ids [1, T] on the model's device; logits_at [n] flat positions.
    Returns (logits [n, V], features [T, F] = [b_low; b_mid; output read] at every position). The cache's lengths
    advance by each document's tokens."""
    T = ids.shape[1]
    layout = SequenceLayout.build(1, T, torch.tensor(cu_seqlens), ids.device)
    layout.past_lengths = list(cache.lengths)
    collected = Collector()
    h = model.model(ids, layout, cache, blocks=collected)
    reps = list(collected)  # b_0 … b_n, then the output read
    low, mid = feature_blocks
    features = torch.cat([reps[low], reps[mid], reps[-1]], dim=-1)[0]  # [T, F]
    logits = model.lm_head(h.reshape(T, -1)[logits_at])
    cache.lengths = [n + b - a for n, a, b in zip(cache.lengths, cu_seqlens, cu_seqlens[1:])]
    return logits, features


_KDA_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kda_layers(model: K3ForCausalLM) -> list[KimiDeltaAttention]:
    """The model's KDA layers, found once per model (walking every module costs about a millisecond a verify step)."""
    layers = _KDA_LAYERS.get(model)
    if layers is None:
        layers = _KDA_LAYERS[model] = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    return layers


class VerifyCapture:
    """Inside a verify pass, every KDA layer runs the verify documents with the token-by-token reference recurrence
    (a decode step's arithmetic, so a verified token's logits are a decode step's) and keeps what rolling back needs:

    - snapshot: the recurrent state and the three conv tails after every position of each verify document (the
      documents advance one position per call, batched);
    - replay: the state before the pass (the committed one), the recurrence inputs of every position (q, k after
      conv + SiLU, v, the decay logits z, the β logits) and the pre-conv inputs.

    `commit` then writes, per verify document, the state after its last verified position into its KDA pages:
    picked from the snapshots, or recomputed from the committed state over the verified positions' inputs.
    Other documents (prefill pieces) run the layer's own recurrence. Used as a context manager around the
    forward: it overrides the layers' `recurrence` and `short_conv` seams and restores them."""

    def __init__(self, model: K3ForCausalLM, offsets: list[int], verify: list[bool], form: str):
        if form not in ROLLBACK_FORMS:
            raise ValueError(f"rollback form must be one of {ROLLBACK_FORMS}, got {form!r}")
        self.layers = kda_layers(model)
        self.offsets, self.verify, self.form = offsets, verify, form
        self.docs = [n for n, v in enumerate(verify) if v]
        self.states: dict[int, dict[int, torch.Tensor]] = {}  # layer -> doc -> [T_n, H, K, V] (snapshot)
        self.inputs: dict[int, tuple] = {}  # layer -> packed raw recurrence inputs (replay)
        self.convs: dict[int, list] = {}  # layer -> [(pre-conv [T, P], tails before [N, W-1, P])] for q, k, v

    def __enter__(self) -> Self:
        for layer in self.layers:
            layer.recurrence = functools.partial(self._recurrence, layer, layer.recurrence)
            layer.short_conv = functools.partial(self._short_conv, layer, layer.short_conv)
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            del layer.recurrence, layer.short_conv

    def _short_conv(self, layer, original, pre, weight, conv_state, cu_seqlens):
        self.convs.setdefault(layer.layer_idx, []).append((pre.reshape(-1, pre.shape[-1]), conv_state))
        return original(pre, weight, conv_state, cu_seqlens)

    def _recurrence(self, layer, original, q, k, v, z, beta_logits, initial_state, output_final_state, cu_seqlens,
                    cu_seqlens_host=None):
        # one layout for both arrivals: [1, T, ...] packed (one_token_per_document arrives as [N, 1, ...])
        q, k, v, z, beta_logits = (t.reshape(1, -1, *t.shape[2:]) for t in (q, k, v, z, beta_logits))
        offsets = self.offsets
        N = len(offsets) - 1
        o = torch.empty(*v.shape[:3], v.shape[-1], dtype=v.dtype, device=v.device)
        final = initial_state.to(torch.float32, copy=True)
        others = [n for n in range(N) if not self.verify[n]]
        if others:
            rows = torch.cat([torch.arange(offsets[n], offsets[n + 1]) for n in others]).to(q.device)
            sub = [0]
            for n in others:
                sub.append(sub[-1] + offsets[n + 1] - offsets[n])
            idx = torch.tensor(others, device=q.device)
            o_sub, s_sub = original(*(t[:, rows] for t in (q, k, v, z, beta_logits)), initial_state[idx], True,
                                    torch.tensor(sub, dtype=torch.int32, device=q.device), tuple(sub))
            o[:, rows] = o_sub.to(o.dtype)
            final[idx] = s_sub.float()
        if self.docs:
            gq, gk, g, beta = layer.gate_inputs(q, k, z, beta_logits)
            lengths = [offsets[n + 1] - offsets[n] for n in self.docs]
            state = initial_state[torch.tensor(self.docs, device=q.device)].float()
            if self.form == "replay":
                # outputs only; the pages keep the committed state until `commit` replays the verified positions
                rows = torch.cat([torch.arange(offsets[n], offsets[n + 1]) for n in self.docs]).to(q.device)
                o[:, rows] = recurrent_outputs([t[:, rows] for t in (gq, gk, v, g, beta)], state, lengths).to(o.dtype)
                self.inputs[layer.layer_idx] = (q, k, v, z, beta_logits)
                return o, (final if output_final_state else None)
            T = max(lengths)
            if all(n == T for n in lengths):
                # every document verifies the same number of positions (the usual case): [docs, T, ...] views,
                # one batched decode step per position, no per-position index building
                rows = torch.cat([torch.arange(offsets[n], offsets[n + 1]) for n in self.docs]).to(q.device)
                batched = [t[0, rows].unflatten(0, (len(self.docs), T)) for t in (gq, gk, v, g, beta)]
                snaps, outs = [], []
                for j in range(T):
                    step = (t[:, j : j + 1].contiguous() for t in batched)  # [docs, 1, ...]: a decode step's batch
                    o_j, state = naive_recurrent_kda(*step, initial_state=state, output_final_state=True)
                    outs.append(o_j)
                    snaps.append(state)
                o[0, rows] = torch.cat(outs, 1).flatten(0, 1).to(o.dtype)
                per_doc = torch.stack(snaps, 1)  # [docs, T, H, K, V]
                self.states[layer.layer_idx] = {n: per_doc[i] for i, n in enumerate(self.docs)}
            else:
                snaps = [[] for _ in self.docs]
                for j in range(T):
                    live = [i for i, n in enumerate(lengths) if n > j]
                    pos = torch.tensor([offsets[self.docs[i]] + j for i in live], device=q.device)
                    li = torch.tensor(live, device=q.device)
                    step = [t[0, pos][:, None] for t in (gq, gk, v, g, beta)]  # [n, 1, ...]: a decode step's batch
                    o_j, s_j = naive_recurrent_kda(*step, initial_state=state[li], output_final_state=True)
                    o[0, pos] = o_j[:, 0].to(o.dtype)
                    state[li] = s_j
                    for r, i in enumerate(live):
                        snaps[i].append(s_j[r])
                self.states[layer.layer_idx] = {n: torch.stack(s) for n, s in zip(self.docs, snaps)}
            final[torch.tensor(self.docs, device=q.device)] = state
        return o, (final if output_final_state else None)

    def tails_after(self, layer_idx: int, n: int, m: int) -> torch.Tensor:
        """Document n's q, k, v conv tails after its first m tokens [3, W-1, P]: the last W-1 rows of its tail
        before the pass followed by its pre-conv inputs. Snapshot keeps every position's window; replay keeps the
        inputs; both read the same rows."""
        a = self.offsets[n]
        out = []
        for pre, before in self.convs[layer_idx][-3:]:
            W1 = before.shape[1]
            history = torch.cat([before[n], pre[a : a + m].to(before.dtype)])  # [W-1+m, P]
            if self.form == "snapshot":
                windows = history.unfold(0, W1, 1).transpose(1, 2)  # [m+1, W-1, P]: the tail after each position
                out.append(windows[m])
            else:
                out.append(history[-W1:])
        return torch.stack(out)

    def state_after(self, layer_idx: int, docs: list[int], counts: list[int], committed: torch.Tensor) -> torch.Tensor:
        """The recurrent states [len(docs), H, K, V] after counts[i] tokens of docs[i]; committed [len(docs), H, K,
        V]: their states before the pass (what replay starts from)."""
        if self.form == "snapshot":
            return torch.stack([self.states[layer_idx][n][m - 1] for n, m in zip(docs, counts)])
        layer = next(x for x in self.layers if x.layer_idx == layer_idx)
        q, k, v, z, beta_logits = self.inputs[layer_idx]
        state = committed.float().clone()
        for m in set(counts):  # documents that verified as many positions replay as one batch
            group = [i for i, c in enumerate(counts) if c == m]
            rows = torch.cat([torch.arange(self.offsets[docs[i]], self.offsets[docs[i]] + m) for i in group])
            rows = rows.to(q.device)
            gq, gk, g, beta = layer.gate_inputs(*(t[:, rows] for t in (q, k, z, beta_logits)))
            idx = torch.tensor(group, device=q.device)
            batched = [t[0].unflatten(0, (len(group), m)) for t in (gq, gk, v[:, rows], g, beta)]
            _, state[idx] = naive_recurrent_kda(*batched, initial_state=state[idx], output_final_state=True)
        return state

    def commit(self, pool: PagePool, kda_pages: list[list[int]], counts: dict[int, int]) -> None:
        """Write each verify document's KDA state and conv tails after its counts[n] verified tokens into its pages
        (kda_pages[n]: one page per KDA layer, in layer order)."""
        docs = [n for n in self.docs if n in counts]
        if not docs:
            return
        m = [counts[n] for n in docs]
        for j, layer in enumerate(sorted(x.layer_idx for x in self.layers)):
            pages = torch.tensor([kda_pages[n][j] for n in docs], device=pool.device)
            pool.kda_state[pages] = self.state_after(layer, docs, m, pool.kda_state[pages]).float()
            tails = torch.stack([self.tails_after(layer, n, c) for n, c in zip(docs, m)])
            pool.kda_conv[pages] = tails.to(pool.kda_conv.dtype)


def recurrent_outputs(inputs: list[torch.Tensor], state: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The token-by-token recurrence's outputs [1, T, H, V] over packed documents of `lengths` (inputs gq, gk, v,
    g, β [1, T, ...], states [N, H, K, V] before them): documents of one length run as one batch."""
    T = sum(lengths)
    if all(n == lengths[0] for n in lengths):
        batched = [t[0].unflatten(0, (len(lengths), lengths[0])) for t in inputs]
        o, _ = naive_recurrent_kda(*batched, initial_state=state)
        return o.reshape(1, T, *o.shape[2:])
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=state.device)
    return naive_recurrent_kda(*inputs, initial_state=state, cu_seqlens=cu)[0]


def rollback_bytes(spec: CacheSpec, k: int, form: str) -> int:
    """What a sequence holds per verify step to roll its KDA layers back, in bytes, drafting k tokens (k + 1
    positions): snapshot, a recurrent state [H, K, V] fp32 and three conv tails [W-1, P] per position; replay, the
    recurrence inputs per position (q, k, v, z: 4·P values, β logits: H) and the three pre-conv inputs (3·P); the
    committed state it replays from stays in the sequence's pages. Per KDA layer, summed over them."""
    P, H = spec.num_heads * spec.head_dim, spec.num_heads
    positions = k + 1
    if form == "snapshot":
        per_layer = positions * (spec.kda_state_bytes + spec.kda_conv_bytes)
    elif form == "replay":
        per_layer = positions * ((4 * P + H) + 3 * P) * spec.elt
    else:
        raise ValueError(f"rollback form must be one of {ROLLBACK_FORMS}, got {form!r}")
    return per_layer * len(spec.kda_layers)

