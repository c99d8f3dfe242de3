"""Images through the server: `image_url` parts with the official `openai` client against a real server over the
multimodal debug model, image tokens in `usage.prompt_tokens`, and the 400s (network URLs, local files without
the flag, bad bytes, images on a text-only model)."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from k3.chat.template import ChatTemplate
from k3.config import get_preset
from k3.infer.config import EngineConfig
from k3.infer.engine import AsyncEngine, Engine
from k3.vision.chat import ImagePolicy, render_with_media
from k3.vision.model import build_vlm
from tests.serve.conftest import MODEL_NAME, serve


def png(colour=(200, 30, 30), size=(84, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def ask(url: str, text: str = "What colour is it?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def vision_engine(tokenizer):
    config = get_preset("debug").replace(media_placeholder_token_id=tokenizer.special_id("<|media_pad|>"))
    engine = AsyncEngine(Engine(build_vlm(config, seed=0).eval(), EngineConfig(max_context=1024)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def vision_url(vision_engine, tokenizer):
    with serve(vision_engine, tokenizer) as server:
        yield server.base_url


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


def test_image_request_through_the_openai_client(vision_engine, vision_url, tokenizer):
    image = data_url(png())
    messages = ask(image)
    r = client(vision_url).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                                   temperature=0)
    ids, items = render_with_media(ChatTemplate(tokenizer), messages, ImagePolicy())
    assert len(items) == 1 and items[0].num_tokens() == 6  # 84 × 56 px: 6 × 4 patches, 3 × 2 tokens
    assert r.usage.prompt_tokens == len(ids)
    text_only = client(vision_url).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What colour is it?"}], max_tokens=1)
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + items[0].num_tokens()
    encoded = vision_engine.engine.media_cache.encoded
    # the same conversation again: a prefix-cache hit through the image, and no tower run
    again = client(vision_url).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                                       temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert vision_engine.engine.media_cache.encoded == encoded
    # streamed, a different image: encoded once more
    chunks = list(client(vision_url).chat.completions.create(
        model=MODEL_NAME, messages=ask(data_url(png((10, 200, 10)))), max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert vision_engine.engine.media_cache.encoded == encoded + 1
    # /metrics exports the media cache's counters (the AsyncEngine's snapshot refreshes as steps finish)
    metrics = httpx.get(vision_url + "/metrics", timeout=30).text
    assert "# TYPE k3_media_items_encoded_total counter" in metrics and "k3_media_cache_bytes " in metrics


def _error(r: httpx.Response, param: str | None, words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("url,words", [
    ("https://example.com/cat.png", "network fetch"),
    ("/etc/hostname", "--allow-local-images"),
    ("data:image/png;base64,%%%", "invalid base64"),
    (data_url(b"not an image at all"), "cannot be decoded"),
    (data_url(png()[:40]), "cannot be decoded"),
    ("data:image/png,rawbytes", "not of the form"),
])
def test_bad_images_are_400s(vision_url, url, words):
    r = httpx.post(vision_url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": ask(url)}, timeout=30)
    _error(r, "messages[0].content[1].image_url", words)


def test_images_only_in_user_and_system_messages(vision_url):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(png())}}]}]
    r = httpx.post(vision_url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages}, timeout=30)
    _error(r, "messages[1]", "user and system messages only")


def test_local_files_behind_the_flag(vision_engine, tokenizer, tmp_path):
    path = tmp_path / "red.png"
    path.write_bytes(png())
    with serve(vision_engine, tokenizer, allow_local_images=True) as server:
        r = client(server.base_url).chat.completions.create(model=MODEL_NAME, messages=ask(str(path)), max_tokens=2)
        assert r.usage.prompt_tokens > 6
        missing = httpx.post(server.base_url + "/v1/chat/completions",
                             json={"model": MODEL_NAME, "messages": ask(str(tmp_path / "none.png"))}, timeout=30)
        _error(missing, "messages[0].content[1].image_url", "does not exist")


def test_a_text_only_model_refuses_images(live):
    _, url = live
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": ask(data_url(png()))},
                   timeout=30)
    _error(r, "messages[0].content[1]", "text-only")


def test_media_pad_must_match_the_tokenizer(tokenizer):
    from k3.serve.app import create_app

    # a config whose media pad is another id than this tokenizer's
    model = build_vlm(get_preset("debug").replace(media_placeholder_token_id=tokenizer.special_id("<|media_pad|>") + 1),
                      seed=0)
    engine = AsyncEngine(Engine(model.eval(), EngineConfig(max_context=256)))
    try:
        with pytest.raises(ValueError, match="media_placeholder_token_id"):
            create_app(engine, tokenizer, MODEL_NAME)
    finally:
        engine.shutdown()


def test_responses_input_image_through_the_openai_client(vision_url, live):
    """The Responses API's `input_image` parts reach the model as the chat path's images: the same prompt tokens as
    the chat request, and the same refusals (a bad image, a text-only model)."""
    image = data_url(png())
    parts = [{"type": "input_text", "text": "What colour is it?"}, {"type": "input_image", "image_url": image}]
    r = client(vision_url).responses.create(model=MODEL_NAME, input=[{"role": "user", "content": parts}],
                                            max_output_tokens=3, temperature=0)
    chat = client(vision_url).chat.completions.create(model=MODEL_NAME, messages=ask(image), max_tokens=3,
                                                      temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    bad = [{"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    r = httpx.post(vision_url + "/v1/responses", json={"model": MODEL_NAME, "input": [{"role": "user",
                                                                                      "content": bad}]}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(live[1] + "/v1/responses", json={"model": MODEL_NAME, "input": [{"role": "user",
                                                                                   "content": parts}]}, timeout=30)
    assert r.status_code == 400 and "text-only" in r.json()["error"]["message"]
