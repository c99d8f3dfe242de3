"""A multimodal run through the front ends: `load_trained` builds the multimodal model from a checkpoint with
vision tensors, `k3 generate --image` and `k3 chat`'s `/image` send images through the engine."""

import argparse
import asyncio
import io
import json

import pytest
import torch
from PIL import Image

from k3.checkpoint import load_trained, save_checkpoint
from k3.config import get_preset
from k3.infer.engine import AsyncEngine, Engine
from k3.tokenizer import byte_tokenizer
from k3.vision.model import K3VisionLanguageModel, build_vlm
from k3.vision.preprocess import pack, preprocess_image
from k3.vision.prompt import media_prompt

TOK = byte_tokenizer(512)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A checkpoint folder of the debug VLM (its tokenizer's pad id in the config), and a picture next to it."""
    root = tmp_path_factory.mktemp("vlm-run")
    TOK.save(root / "tokenizer")
    config = get_preset("debug").replace(media_placeholder_token_id=TOK.special_id("<|media_pad|>"),
                                         bos_token_id=TOK.bos_id, eos_token_id=TOK.eos_id, pad_token_id=TOK.pad_id)
    model = build_vlm(config, seed=2)
    save_checkpoint(root / "run" / "checkpoints", 1, model.state_dict(), {},
                    {"config.json": json.dumps(config.to_config_json())}, {"tokenizer": root / "tokenizer"})
    picture = Image.new("RGB", (70, 42), (250, 200, 0))
    picture.save(root / "picture.png")
    return root / "run", model, root / "picture.png"


def test_load_trained_builds_the_multimodal_model(run):
    folder, model, _ = run
    loaded, tokenizer, _ = load_trained(folder)
    assert isinstance(loaded, K3VisionLanguageModel) and tokenizer.vocab_size == 512
    state = loaded.state_dict()
    assert set(state) == set(model.state_dict())
    assert all(torch.equal(state[n], t) for n, t in model.state_dict().items())


def expected_greedy(model, ids, item, n):
    cache = model.new_cache(1)
    logits = model(torch.tensor([ids]), cache=cache, **pack([item]).as_inputs()).logits[0, -1]
    tokens = []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
    return tokens


def test_generate_with_an_image(run, capsys):
    from k3.cli import main

    folder, model, picture = run
    assert main(["generate", str(folder), "--image", str(picture), "--prompt", "A picture of", "--temperature",
                 "0", "--max-new-tokens", "5"]) == 0
    written = capsys.readouterr().out
    item = preprocess_image(picture)
    ids = [TOK.bos_id] + media_prompt(TOK, 70, 42, item.num_tokens()) + TOK.encode("A picture of")
    reply = []
    for t in expected_greedy(model.eval(), ids, item, 5):
        if t in TOK.stop_ids:
            break
        reply.append(t)
    assert written == "A picture of" + TOK.decode([t for t in reply if not TOK.is_special(t)]) + "\n"


def test_chat_image_command(run, monkeypatch):
    from k3.serve.cli import chat_loop

    folder, _, picture = run
    model, tokenizer, _ = load_trained(folder)
    engine = AsyncEngine(Engine(model))
    lines = iter(["/image /no/such.png", f"/image {picture}", "what is it?", "and now?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    out = io.StringIO()
    args = argparse.Namespace(reasoning_effort=None, system=None, max_tokens=3, temperature=0.0, top_p=1.0)
    try:
        asyncio.run(chat_loop(engine, tokenizer, args, out=out))
        text = out.getvalue()
        assert "no such file" in text and "attached" in text
        # two turns about one picture: the tower ran once, the second turn reused the first one's cache
        assert engine.engine.media_cache.encoded == 1
        assert engine.engine.metrics()["prefix_hit_requests_total"] == 1
    finally:
        engine.shutdown()
    text_only = AsyncEngine(Engine(build_model_text()))
    lines2 = iter([f"/image {picture}", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines2))
    out = io.StringIO()
    try:
        asyncio.run(chat_loop(text_only, tokenizer, args, out=out))
        assert "text-only" in out.getvalue()
    finally:
        text_only.shutdown()


def build_model_text():
    from k3.model.model import build_model

    return build_model(get_preset("debug"), seed=0)
