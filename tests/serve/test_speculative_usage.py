"""Speculative decoding through the server (docs/speculative.md): the OpenAI usage fields
`completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens` in chat, completions and the
streamed final usage, read with the official `openai` client, and the acceptance metrics on `/metrics`.

The drafter is an oracle: it drafts the target's own greedy continuation (a plain forward per drafted token) and
corrupts every third proposal, so every reply has accepted and rejected drafts, and greedy replies must equal those
of the plain engine (`live`).
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from k3.infer.config import EngineConfig
from k3.infer.engine import AsyncEngine, Engine
from tests.serve.conftest import MODEL_NAME, serve

USER = [{"role": "user", "content": "Name three colours."}]


class OracleDrafter:
    """Drafts what the target would write greedily; every third proposal (by position) is corrupted. It rebuilds
    each request's tokens from what `extend` hands it (the first token is BOS), so the engine runs without prefix
    caching (a hit would skip positions)."""

    feature_blocks = (1, 2)

    def __init__(self, model, bos: int):
        self.model, self.bos = model, bos
        self.streams: dict[str, list[int]] = {}

    def _next(self, rids):
        out = torch.full((len(rids), self.model.config.vocab_size), -30.0)
        for r, rid in enumerate(rids):
            stream = self.streams[rid]
            with torch.no_grad():
                tok = int(self.model(torch.tensor([stream])).logits[0, -1].argmax())
            if len(stream) % 3 == 0:
                tok = (tok + 1) % self.model.config.vocab_size
            out[r, tok] = 30.0
            self.streams[rid] = stream + [tok]  # the chain continues from its own proposal
        return out

    def extend(self, rids, starts, features, next_tokens):
        for rid, start, tokens in zip(rids, starts, next_tokens):
            stream = self.streams.get(rid, [self.bos]) if start else [self.bos]
            self.streams[rid] = stream[: start + 1] + tokens
        return self._next(rids)

    def propose(self, rids, tokens):
        for rid, tok in zip(rids, tokens):
            self.streams[rid][-1] = tok  # the token actually drafted
        return self._next(rids)

    def release(self, rid):
        self.streams.pop(rid, None)


@pytest.fixture(scope="module")
def speculative(model, tokenizer):
    config = EngineConfig(max_context=1024, enable_prefix_caching=False, speculative_tokens=3)
    engine = AsyncEngine(Engine(model, config, drafter=OracleDrafter(model, tokenizer.bos_id)))
    try:
        with serve(engine, tokenizer) as server:
            yield engine, server.base_url
    finally:
        engine.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _check(usage):
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    assert details.accepted_prediction_tokens <= usage.completion_tokens


def test_chat_usage_reports_predictions(speculative, live):
    r = client(speculative[1]).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=24, temperature=0)
    _check(r.usage)
    plain = client(live[1]).chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_completions_and_streamed_usage(speculative):
    c = client(speculative[1])
    r = c.completions.create(model=MODEL_NAME, prompt="the cat", max_tokens=20, temperature=0)
    _check(r.usage)
    chunks = list(c.completions.create(model=MODEL_NAME, prompt="the cat", max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details == r.usage.completion_tokens_details
    chat = list(c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=24, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
    _check(chat[-1].usage)


def test_metrics_export_acceptance(speculative):
    _, url = speculative
    client(url).completions.create(model=MODEL_NAME, prompt="hello", max_tokens=12, temperature=0)
    text = httpx.get(url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("k3_spec_")}
    assert 0 < values["k3_spec_acceptance_rate"] < 1
    assert values["k3_spec_tokens_per_verify"] > 1
    assert values["k3_spec_accepted_tokens_total"] > 0
