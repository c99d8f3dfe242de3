"""`/v1/completions` with `echo` and prompt `logprobs` as OpenAI's legacy completions API defines them, checked
with the official client against the engine's own log-likelihoods; and vLLM's `/tokenize`, `/detokenize` and
`/tokenizer_info`, which evaluation harnesses tokenize with."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from k3.infer.generate import generate
from k3.infer.score import PromptScorer
from tests.serve.conftest import MODEL_NAME, real_engine_available, serve
from tests.serve.fake_engine import FakeEngine

pytestmark = pytest.mark.skipif(not real_engine_available(), reason="needs the engine")

LOGPROB_TOL = 1e-4  # docs/inference.md: engine vs model, batch vs alone


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def scores(model, ids, top=0):
    return PromptScorer(model).score([ids], top)[0]


def test_echo_only_scores_the_prompt(live, model, tokenizer):
    """max_tokens 0 with echo: the prompt's text and its teacher-forced logprobs, nothing generated."""
    _, url = live
    prompt = "the cat sat on a mat"
    r = client(url).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.tokens[0] == "[BOS]" and "".join(lp.tokens[1:]) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = scores(model, ids, 2)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), ref.logprobs[1:], atol=LOGPROB_TOL, rtol=0)
    for top, best in zip(lp.top_logprobs[1:], ref.top_logprobs[1:, 0].tolist()):
        assert len(top) == 2 and max(top.values()) == pytest.approx(best, abs=LOGPROB_TOL)
    # offsets index the returned text: [BOS] is not in it, so the first two tokens start at 0
    assert lp.text_offset[:2] == [0, 0]
    for token, start in zip(lp.tokens[1:], lp.text_offset[1:]):
        assert prompt[start : start + len(token)] == token


def test_echo_with_generation_matches_the_engines_logprobs(live, model, tokenizer):
    """The echoed logprobs are the prompt's, then exactly the generated tokens' (the engine's own); scoring the
    whole text again gives the engine's log-likelihood of what it wrote."""
    _, url = live
    c = client(url)
    prompt = "hello world"
    plain = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    echoed = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=1, echo=True)
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    n = len(ids)
    lp, gen = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert lp.tokens[n:] == gen.tokens and len(lp.tokens) == n + plain.usage.completion_tokens
    assert lp.token_logprobs[n:] == gen.token_logprobs
    assert lp.text_offset[n:] == [o + len(prompt) for o in gen.text_offset]
    # what the server wrote (greedy: the plain loop's argmax tokens), then all of it scored as one prompt of
    # token ids: the same numbers as the engine's own logprobs of the tokens it generated
    gen_ids = list(generate(model, ids, 6, temperature=0.0, stop_ids=set(tokenizer.stop_ids)))
    assert len(gen_ids) == len(gen.tokens)
    rescored = c.completions.create(model=MODEL_NAME, prompt=ids + gen_ids, max_tokens=0, echo=True, logprobs=0)
    again = rescored.choices[0].logprobs
    assert again.tokens[n:] == gen.tokens and again.top_logprobs is None  # logprobs 0: no alternatives
    torch.testing.assert_close(torch.tensor(again.token_logprobs[n:]), torch.tensor(gen.token_logprobs),
                               atol=LOGPROB_TOL, rtol=0)


def test_lm_eval_style_request(live, model, tokenizer):
    """What lm-evaluation-harness's local-completions sends for a log-likelihood: token ids, max_tokens 1, echo,
    logprobs 1; its sum over the continuation (token_logprobs[ctxlen:-1]) is the model's log p(cont | ctx)."""
    _, url = live
    ctx, cont = tokenizer.encode("the model sat"), tokenizer.encode(" on a mat")
    body = {"model": MODEL_NAME, "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + 1
    total = sum(lp["token_logprobs"][len(ctx):-1])
    assert total == pytest.approx(scores(model, ctx + cont).total(len(ctx)), abs=1e-3)


def test_stream_echo(live):
    _, url = live
    c = client(url)
    kw = {"model": MODEL_NAME, "prompt": ["one two", "three"], "max_tokens": 3, "temperature": 0, "logprobs": 1,
          "echo": True}
    whole = c.completions.create(**kw)
    texts, tokens = {}, {}
    for chunk in c.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.logprobs:
                tokens[ch.index] = tokens.get(ch.index, []) + ch.logprobs.tokens
    assert [texts[i] for i in range(2)] == [ch.text for ch in whole.choices]
    assert [tokens[i] for i in range(2)] == [ch.logprobs.tokens for ch in whole.choices]
    assert whole.choices[0].text.startswith("one two") and whole.choices[1].text.startswith("three")
    only = list(c.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=0, echo=True, logprobs=0, stream=True))
    assert "".join(ch.text for chunk in only for ch in chunk.choices) == "abc"
    assert only[-1].choices[0].finish_reason == "length"


def test_stop_strings_apply_to_the_generated_text_only(live):
    """A stop string inside the echoed prompt does not end the completion (OpenAI's semantics)."""
    _, url = live
    c = client(url)
    kw = {"model": MODEL_NAME, "prompt": "the cat and the cat", "max_tokens": 5, "temperature": 0, "stop": ["cat"]}
    plain = c.completions.create(**kw)
    echoed = c.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == "the cat and the cat" + plain.choices[0].text


def test_refusals(live, tokenizer):
    _, url = live
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL_NAME, prompt=[65] * 1100, max_tokens=0, echo=True, logprobs=0)
    assert e.value.body["code"] == "context_length_exceeded"
    # an engine without a model to score with cannot echo logprobs, and says so
    with serve(FakeEngine(None, tokenizer.vocab_size), tokenizer) as server, \
            pytest.raises(openai.BadRequestError) as e:
        client(server.base_url).completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, echo=True, logprobs=1)
    assert e.value.body["param"] == "logprobs"


def test_tokenize_endpoints(live, tokenizer):
    _, url = live
    r = httpx.post(url + "/tokenize", json={"prompt": "hello world"}).json()
    assert r["tokens"] == [tokenizer.bos_id] + tokenizer.encode("hello world")
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    bare = httpx.post(url + "/tokenize", json={"prompt": "a[EOS]b", "add_special_tokens": False}).json()["tokens"]
    assert bare == tokenizer.encode("a") + [tokenizer.document_end_id] + tokenizer.encode("b")
    detok = httpx.post(url + "/detokenize", json={"tokens": tokenizer.encode("hi there")}).json()
    assert detok == {"prompt": "hi there"}
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "[EOS]" and info["bos_token"] == "[BOS]" and info["model_max_length"] == 1024
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", json={"prompt": 3}).status_code == 400


def test_lm_eval_detects_the_remote_tokenizer(live, tokenizer):
    utils = pytest.importorskip("lm_eval.utils")
    _, url = live
    assert utils.check_remote_tokenizer_support(url + "/v1/completions")
    remote = utils.RemoteTokenizer(url + "/v1/completions")
    assert remote.eos_token_id == tokenizer.document_end_id and remote.bos_token_id == tokenizer.bos_id
    assert remote.encode("the cat") == tokenizer.encode("the cat")
