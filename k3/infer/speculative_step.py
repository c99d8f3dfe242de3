"""The engine's step with speculative decoding: what `Engine.step` runs in place of its decode step when the engine
has a drafter (docs/speculative.md, "In the engine"; K3 report §4.1.4, §5.4.2).

Legend: N scheduled sequences, T packed tokens of the verify pass, k drafted tokens, V vocabulary, F feature width.

    one ragged target pass: each decode runs [last token, d1 … dk], prefill pieces ride along (VerifyCapture)
        ─► verify_drafts: exact acceptance per decode (`accept`), cut at a stop
        ─► VerifyCapture.commit: KDA states and conv tails ← those after the last verified position
        ─► after_forward over the verified tokens only ─► outputs
        ─► draft_next: the drafter takes the verified positions' features and drafts the next k tokens

The pieces it runs (the `Drafter` protocol, `accept`, `forward_with_features`, `VerifyCapture`) are in
speculative.py. Functions taking the engine, not a class: the step keeps no state of its own, and it records tokens,
outputs and stops through the engine's own bookkeeping, as the plain step does.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import torch

from k3.infer.api import RequestOutput
from k3.infer.cache import gather, scatter
from k3.infer.sampling import target_distribution, token_logprob
from k3.infer.scheduler import Batch
from k3.infer.sequence import Sequence, SequenceStatus
from k3.infer.speculative import VerifyCapture, accept, draw, forward_with_features

if TYPE_CHECKING:
    from k3.infer.engine import Engine


def speculative_step(engine: Engine, batch: Batch) -> list[RequestOutput]:
    """One step with speculative decoding (docs/speculative.md): decodes verify their drafts in the ragged
    pass beside the prefill pieces; each verify emits its accepted drafts plus one token; KDA states roll back
    to the last verified position; the drafter takes the verified positions and drafts the next tokens."""
    m, model, pool = engine.metrics_state, engine.model, engine.pool
    seqs, counts = batch.seqs, batch.counts
    starts = [s.num_computed for s in seqs]
    ready = [i for i, (s, n) in enumerate(zip(seqs, counts)) if s.num_computed + n == len(s.tokens)]
    verify = [bool(s.draft_tokens) for s in seqs]
    assert all(n == 1 for v, n in zip(verify, counts) if v), "only decodes carry drafts"
    plain = [i for i in ready if not verify[i]]
    masks = engine._grammar_masks([seqs[i] for i in plain])
    ids, cu = [], [0]
    for s, n in zip(seqs, counts):
        ids += s.tokens[s.num_computed : s.num_computed + n] + s.draft_tokens
        cu.append(len(ids))
    rows_of = {}  # batch index -> its logits rows
    logits_at = []
    for i in ready:
        first = cu[i] if verify[i] else cu[i + 1] - 1
        rows_of[i] = list(range(len(logits_at), len(logits_at) + cu[i + 1] - first))
        logits_at += range(first, cu[i + 1])
    blocks, kda = [s.blocks for s in seqs], [s.kda_pages for s in seqs]
    cache = gather(pool, blocks, kda, starts)
    dev = pool.device
    with torch.inference_mode(), VerifyCapture(model, cu, verify, engine.config.spec_rollback) as capture:
        logits, features = forward_with_features(model, torch.tensor(ids, device=dev)[None], cu, cache,
                                                 torch.tensor(logits_at, dtype=torch.long, device=dev),
                                                 engine.drafter.feature_blocks)
        scatter(pool, cache, blocks, kda, starts, [b - a for a, b in itertools.pairwise(cu)])
        verified = {i: verify_drafts(engine, seqs[i], logits[rows_of[i]]) for i in ready if verify[i]}
        advanced = list(counts)  # verified tokens each sequence moves by
        for i, (tokens, _) in verified.items():
            advanced[i] = len(tokens)
        capture.commit(pool, kda, {i: advanced[i] for i in verified})
    spec_rows = list(verified)
    for i, s in enumerate(seqs):
        if i not in verified:
            engine.scheduler.after_forward(s, counts[i])
    if plain:
        plain_rows = torch.tensor([rows_of[i][-1] for i in plain], device=logits.device)
        tokens, lps = engine._sample([seqs[i] for i in plain], logits[plain_rows], masks)
        for i, tok, lp in zip(plain, tokens, lps):
            verified[i] = ([tok], [lp])
    now = time.monotonic()
    for i in ready:
        engine._record(seqs[i], *verified[i], now)
    for i in spec_rows:  # hashed only now: the verified tokens must be in `tokens`
        engine.scheduler.after_forward(seqs[i], advanced[i], decoding=True)
    outputs = [engine._output(seqs[i]) for i in ready]
    with torch.inference_mode():
        draft_next(engine, batch, starts, advanced, cu, features)
    m.inc("steps_total")
    m.inc("forward_tokens_total", len(ids))
    generated = sum(len(verified[i][0]) for i in ready)
    m.inc("generation_tokens_total", generated)
    m.record_step(generated, len(ids))
    return outputs


def verify_drafts(engine: Engine, seq: Sequence, logits: torch.Tensor) -> tuple[list[int], list]:
    """Accept or reject one sequence's drafts against the target's logits [k + 1, V] at the verified positions;
    -> (emitted tokens up to the first stop, their logprobs). Counts acceptance."""
    drafts, sp, m = seq.draft_tokens, seq.sampling, engine.metrics_state
    k = len(drafts)
    histories = [seq.output_ids + drafts[:j] for j in range(k + 1)]
    p = target_distribution(logits, [sp] * (k + 1), [seq.prompt_ids] * (k + 1), histories)
    tokens, a = accept(p, seq.draft_probs[:k], drafts, seq.generator, sp.temperature <= 0)
    for j in range(k):
        engine.spec_position_drafted[j] += 1
        engine.spec_position_accepted[j] += j < a
    m.inc("spec_verifies_total")
    m.inc("spec_draft_tokens_total", k)
    m.inc("spec_accepted_tokens_total", a)
    n_out, n_tok = len(seq.output_ids), len(seq.tokens)
    for j, tok in enumerate(tokens):  # a stop ends the emission there
        if engine._stop_reason(seq, tok, n_out + j + 1, n_tok + j + 1) is not None:
            tokens = tokens[: j + 1]
            break
    m.inc("spec_emitted_tokens_total", len(tokens))
    kept = min(a, len(tokens))
    seq.accepted_tokens += kept
    seq.rejected_tokens += k - kept
    seq.draft_tokens, seq.draft_probs = [], None
    lps = [None] * len(tokens)
    if sp.logprobs is not None:
        raw = torch.log_softmax(logits.float(), dim=-1)
        lps = [token_logprob(raw[j], tok, sp.logprobs) for j, tok in enumerate(tokens)]
    return tokens, lps


def draft_next(engine: Engine, batch: Batch, starts: list[int], advanced: list[int], cu: list[int],
               features: torch.Tensor) -> None:
    """Give the drafter the positions this step verified (their features [T, F] and the tokens after them) and
    draft the next step's tokens for every sequence that decodes next."""
    k = engine.config.speculative_tokens
    live = [i for i, s in enumerate(batch.seqs) if s.status is SequenceStatus.RUNNING]
    if not live:
        return
    seqs = [batch.seqs[i] for i in live]
    q_logits = engine.drafter.extend(
        [s.request_id for s in seqs], [starts[i] for i in live],
        [features[cu[i] : cu[i] + advanced[i]] for i in live],
        [s.tokens[starts[i] + 1 : starts[i] + advanced[i] + 1] for s, i in zip(seqs, live)])
    want = [speculative_positions(k, s.sampling.max_tokens - len(s.output_ids))
            if s.remaining == 1 and s.matcher is None else 0 for s in seqs]
    rows = [r for r, w in enumerate(want) if w]
    if not rows:
        return
    q_logits = q_logits[torch.tensor(rows, device=q_logits.device)]
    drafts: dict[int, list[int]] = {r: [] for r in rows}
    probs: dict[int, list[torch.Tensor]] = {r: [] for r in rows}
    for j in range(max(want)):
        # rows: the sequences still drafting, in q_logits' order
        ss = [seqs[r] for r in rows]
        q = target_distribution(q_logits, [s.sampling for s in ss], [s.prompt_ids for s in ss],
                                [s.output_ids + drafts[r] for s, r in zip(ss, rows)])
        for n, (s, r) in enumerate(zip(ss, rows)):
            tok = int(q[n].argmax()) if s.sampling.temperature <= 0 else draw(q[n], s.generator)
            drafts[r].append(tok)
            probs[r].append(q[n])
        rows = [r for r in rows if want[r] > j + 1]
        if rows:
            q_logits = engine.drafter.propose([seqs[r].request_id for r in rows], [drafts[r][-1] for r in rows])
    for r, tokens in drafts.items():
        seqs[r].draft_tokens, seqs[r].draft_probs = tokens, torch.stack(probs[r])


def speculative_positions(k: int, max_tokens_left: int) -> int:
    """Drafts for a sequence with max_tokens_left tokens still allowed: never more than can be emitted (the k
    drafts plus the corrected or bonus token)."""
    return max(0, min(k, max_tokens_left - 1))
