"""The engine end to end on the debug preset (fp32): exactness against the model, batching, preemption,
stop tokens, aborts, admission, the async front end and metrics.

Tolerances: the engine's tokens must equal the reference tokens exactly. Logprobs are compared bitwise
where the two runs do the same arithmetic (same pieces in the same batches), and to LOGPROB_TOL where
they cannot: a different prefill split (whole prompt vs chunks) or a different batch. The reason is the
reference MoE, which runs each expert on however many rows were routed to it, and BLAS rounding depends
on that row count (docs/model.md); measured differences are ~1e-6.
"""

import asyncio

import pytest
import torch

from k3.infer.api import AdmissionError, ContextLengthError, RequestOutput, SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import AsyncEngine, Engine, merge_output
from k3.infer.metrics import render_prometheus

LOGPROB_TOL = 1e-4
CFG = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=16, checkpoint_every_blocks=2,
                   num_pages=160, max_step_tokens=64, max_running=8, eos_token_ids=())


def prompt(n, seed, V=512):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, **kw)


def run(engine, arrivals, on_step=None):
    """arrivals: (step, request_id, prompt, sampling) added when the step counter reaches `step`.
    Returns request_id -> merged RequestOutput."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outs, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, ids, sp = pending.pop(0)
            engine.add_request(rid, ids, sp)
            outs[rid] = RequestOutput(rid, [], logprobs=[] if sp.logprobs is not None else None)
        for out in engine.step():
            merge_output(outs[out.request_id], out)
        if on_step:
            on_step(engine)
        step += 1
        assert step < 5000
    return outs


@torch.no_grad()
def reference_greedy(model, ids, n):
    """The model's own argmax decoding: one prefill, then one token per step. -> (tokens, logprobs)."""
    cache = model.new_cache(1)
    logits = model(torch.tensor([ids]), cache=cache).logits[0, -1]
    tokens, lps = [], []
    for _ in range(n):
        lp = torch.log_softmax(logits.float(), -1)
        t = int(logits.argmax())
        tokens.append(t)
        lps.append(float(lp[t]))
        logits = model(torch.tensor([[t]]), cache=cache).logits[0, -1]
    return tokens, lps


def lps(out):
    return [lp.logprob for lp in out.logprobs]


def assert_all_free(engine):
    """Nothing but idle prefix-cache entries holds a page; evicting those frees the whole pool."""
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    while engine.prefix.evict_one():
        pass
    assert engine.pool.num_free == engine.pool.num_pages
    assert all(rc == 0 for rc in engine.pool.refcount)


@pytest.mark.parametrize("caching", [False, True])
def test_greedy_equals_model_argmax(model, caching):
    engine = Engine(model, CFG.replace(enable_prefix_caching=caching))
    for n, seed in ((5, 1), (37, 2)):  # one-piece prefill, and a chunked one (16 + 16 + 5)
        ids = prompt(n, seed)
        ref_tokens, ref_lps = reference_greedy(model, ids, 12)
        out = engine.generate(ids, greedy(12))
        assert out.new_token_ids == ref_tokens
        assert out.finish_reason == "length" and out.completion_tokens == 12 and out.prompt_tokens == n
        assert max(abs(a - b) for a, b in zip(lps(out), ref_lps)) < LOGPROB_TOL
    assert_all_free(engine)


def test_batch_equals_alone_and_budgets_hold(model):
    reqs = [(step, f"r{i}", prompt(n, 10 + i), greedy(m))
            for i, (step, n, m) in enumerate([(0, 30, 10), (0, 3, 14), (2, 45, 6), (3, 9, 12), (7, 20, 9),
                                              (7, 1, 5), (12, 33, 8)])]
    alone = {rid: Engine(model, CFG).generate(ids, sp) for _, rid, ids, sp in reqs}
    seen = []
    engine = Engine(model, CFG)
    real = engine.scheduler.schedule

    def schedule():
        batch = real()
        seen.append((batch.num_tokens, len(engine.scheduler.running)))
        return batch

    engine.scheduler.schedule = schedule
    together = run(engine, reqs)
    for rid, out in together.items():
        assert out.new_token_ids == alone[rid].new_token_ids, rid
        assert max(abs(a - b) for a, b in zip(lps(out), lps(alone[rid]))) < LOGPROB_TOL
    assert max(t for t, _ in seen) <= CFG.max_step_tokens
    assert max(r for _, r in seen) <= CFG.max_running
    assert max(len(b) for b in [engine.scheduler.running]) == 0
    assert_all_free(engine)


def test_preemption_resumes_with_same_output(model):
    reqs = [(0, f"r{i}", prompt(20 + 5 * i, 30 + i), greedy(20)) for i in range(4)]
    roomy = run(Engine(model, CFG), reqs)
    # 4 requests of up to 55 tokens need 4 x 4 x 2 MLA pages + 4 x 3 KDA pages; 24 pages forces preemption
    tight = Engine(model, CFG.replace(num_pages=24))
    out = run(tight, reqs)
    assert tight.metrics()["preemptions_total"] > 0
    for rid in roomy:
        assert out[rid].new_token_ids == roomy[rid].new_token_ids
        assert out[rid].finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(lps(out[rid]), lps(roomy[rid]))) < LOGPROB_TOL
    assert_all_free(tight)


def test_same_seed_same_output_regardless_of_batch(model):
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    ids = prompt(11, 40)
    alone = Engine(model, CFG).generate(ids, sp).new_token_ids
    others = [(0, f"o{i}", prompt(7 + i, 50 + i), SamplingParams(max_tokens=9, temperature=1.0)) for i in range(3)]
    mixed = run(Engine(model, CFG), others + [(1, "me", ids, sp)])
    assert mixed["me"].new_token_ids == alone
    assert Engine(model, CFG).generate(ids, sp.__class__(**{**sp.__dict__, "seed": 99})).new_token_ids != alone


def test_stop_tokens_and_max_tokens(model):
    engine = Engine(model, CFG)
    ids = prompt(9, 60)
    free = engine.generate(ids, greedy(10)).new_token_ids
    out = engine.generate(ids, greedy(10, stop_token_ids=(free[3],)))
    k = free.index(free[3])
    assert out.new_token_ids == free[: k + 1] and out.finish_reason == "stop"
    eos_engine = Engine(model, CFG.replace(eos_token_ids=(free[2],)))
    assert eos_engine.generate(ids, greedy(10)).finish_reason == "stop"
    # stop strings are text: matched above the engine (tests/chat/test_detokenize.py), never by it
    assert not hasattr(out, "new_text") and not hasattr(greedy(1), "stop")


def test_abort_frees_every_page_and_slot(model):
    engine = Engine(model, CFG)
    for i in range(6):
        engine.add_request(f"r{i}", prompt(10 + 7 * i, 70 + i), greedy(30))
    for _ in range(6):
        engine.step()
    assert engine.scheduler.running
    for i in range(6):
        assert engine.abort(f"r{i}")
    assert not engine.abort("r0")
    m = engine.metrics()
    assert m["requests_running"] == 0 and m["requests_waiting"] == 0 and m["kv_pages_used"] == 0
    assert_all_free(engine)


def test_admission_budgets_and_errors(model):
    engine = Engine(model, CFG.replace(long_request_tokens=100, long_budget_tokens=300, short_budget_tokens=200,
                                       long_max_requests=8, max_context=400))
    engine.add_request("l1", prompt(150, 1), greedy(50))
    with pytest.raises(AdmissionError) as err:
        engine.add_request("l2", prompt(150, 2), greedy(50))
    assert err.value.retry_after >= 1 and err.value.status in (429, 503)
    # the long class is full, the short class is not: long requests cannot starve short ones
    engine.add_request("s1", prompt(20, 3), greedy(20))
    engine.add_request("s2", prompt(20, 4), greedy(20))
    with pytest.raises(ContextLengthError):
        engine.add_request("big", prompt(390, 5), greedy(20))
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request("empty", [], greedy(2))
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request("oov", [512], greedy(2))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("t", [1], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("s1", [1], greedy(2))
    assert engine.metrics()["admission_rejections_total"] == 1


def test_long_prefill_does_not_stall_decoding(model):
    """A short request keeps decoding one token per step while a long prompt is prefilled in pieces."""
    engine = Engine(model, CFG.replace(max_step_tokens=24))
    engine.add_request("short", prompt(4, 5), greedy(8))
    engine.step()  # the short request's prefill; it decodes from now on
    engine.add_request("long", prompt(200, 6), greedy(2))
    short_steps = 0
    while "short" in engine.requests:
        outs = {o.request_id: o for o in engine.step()}
        assert "short" in outs  # a token every step
        short_steps += 1
    assert short_steps == 7 and engine.requests["long"].num_computed < 200


def test_async_engine_streams_and_cancels(model):
    engine = Engine(model, CFG)
    ids_a, ids_b = prompt(12, 80), prompt(25, 81)
    want_a = Engine(model, CFG).generate(ids_a, greedy(8)).new_token_ids
    want_b = Engine(model, CFG).generate(ids_b, greedy(8)).new_token_ids
    aeng = AsyncEngine(engine)

    async def collect(rid, ids, sp):
        toks = []
        async for out in aeng.stream(rid, ids, sp):
            toks += out.new_token_ids
        return toks, out.finish_reason

    async def cancel_early():
        gen = aeng.stream("c", prompt(30, 82), greedy(200))
        await gen.__anext__()
        await gen.aclose()  # a client disconnect

    async def main():
        got = await asyncio.gather(collect("a", ids_a, greedy(8)), collect("b", ids_b, greedy(8)), cancel_early())
        with pytest.raises(ContextLengthError):
            await collect("x", [1], greedy(10**7))
        assert (await collect("x", [1], greedy(2)))[1] == "length"  # a refused id is free to use again
        return got

    try:
        (a, ra), (b, rb), _ = asyncio.run(main())
        assert a == want_a and b == want_b and ra == rb == "length"
        for _ in range(200):
            if aeng.idle():
                break
            asyncio.run(asyncio.sleep(0.01))
        assert aeng.idle()
        text = render_prometheus(aeng.metrics())
    finally:
        aeng.shutdown()
    assert_all_free(engine)
    for name in ("k3_requests_running 0", "k3_requests_waiting 0", "# TYPE k3_preemptions_total counter",
                 "k3_time_to_first_token_seconds_count 4", 'k3_e2e_request_latency_seconds_bucket{le="+Inf"} 4'):
        assert name in text, name
