"""Images through the engine (debug preset with its vision config, fp32): greedy output equals the multimodal
model's own decoding, the tower runs once per distinct image, and two different images never share a cached
prefix (k3/infer/media.py)."""

import pytest
import torch
from PIL import Image

from k3.config import get_preset
from k3.infer.api import MediaInput, RequestOutput, SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine, merge_output
from k3.infer.media import RequestMedia
from k3.tokenizer import byte_tokenizer
from k3.vision.model import build_vlm
from k3.vision.preprocess import preprocess_image
from k3.vision.prompt import media_prompt

TOK = byte_tokenizer(512)
PAD = TOK.special_id("<|media_pad|>")
CFG = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=16, checkpoint_every_blocks=2,
                   num_pages=160, max_step_tokens=64, max_running=8, eos_token_ids=())


@pytest.fixture(scope="module")
def vlm():
    model = build_vlm(get_preset("debug").replace(media_placeholder_token_id=PAD), seed=5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random AttnRes queries, so the image rows reach the logits along every path
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def image(colour, size=(168, 140)):
    picture = Image.new("RGB", size, colour)
    picture.paste((255, 255, 255), (20, 30, 70, 90))
    return preprocess_image(picture)


def request(item, text="what is it?", before="look: "):
    """[BOS] text, the image's media prompt, text → (ids, the engine's MediaInput)."""
    ids = ([TOK.bos_id] + TOK.encode(before) + media_prompt(TOK, item.width, item.height, item.num_tokens())
           + TOK.encode(text))
    return ids, MediaInput(item.pixel_values, item.grid_thw, item.num_tokens())


@torch.no_grad()
def reference(model, ids, item, n):
    """The model's own greedy decoding: the prefill with the pixels, then one token per step on its cache."""
    cache = model.new_cache(1)
    logits = model(torch.tensor([ids]), cache=cache, pixel_values=item.pixel_values,
                   grid_thw=torch.tensor([item.grid_thw])).logits[0, -1]
    tokens = []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
    return tokens


def generate(engine, ids, media, n=6):
    engine.add_request(f"r{len(engine.requests)}-{id(ids)}", ids, SamplingParams(max_tokens=n, temperature=0.0),
                       media=media)
    total = None
    while engine.has_unfinished():
        for out in engine.step():
            if total is None:
                total = RequestOutput(out.request_id, [])
            merge_output(total, out)
    return total


def test_greedy_with_an_image_equals_the_model(vlm):
    item = image((200, 40, 40))
    ids, media = request(item)
    engine = Engine(vlm, CFG)
    out = generate(engine, ids, [media])
    assert out.prompt_tokens == len(ids)  # the image's pads count as prompt tokens
    assert out.new_token_ids == reference(vlm, ids, item, 6)
    assert engine.media_cache.encoded == 1


def test_two_images_never_share_a_cached_prefix(vlm):
    red, blue = image((200, 40, 40)), image((40, 40, 200))
    engine = Engine(vlm, CFG)
    ids_red, media_red = request(red)
    ids_blue, media_blue = request(blue)
    assert ids_red == ids_blue  # the same tokens: only the image tells them apart
    first_pad = ids_red.index(PAD)
    generate(engine, ids_red, [media_red])
    out = generate(engine, ids_blue, [media_blue])
    assert out.cached_tokens <= first_pad // CFG.hash_block_size * CFG.hash_block_size
    assert out.new_token_ids == reference(vlm, ids_blue, blue, 6)
    # the first image again: its prefix is cached through the image, and the tower does not run for it
    again = generate(engine, ids_red, [media_red])
    assert again.cached_tokens > len(ids_red) - 1 - CFG.hash_block_size
    assert again.new_token_ids == reference(vlm, ids_red, red, 6)
    assert engine.media_cache.encoded == 2


def test_a_repeated_image_is_not_encoded_again(vlm):
    item = image((40, 160, 40))
    engine = Engine(vlm, CFG.replace(enable_prefix_caching=False))
    ids, media = request(item)
    first = generate(engine, ids, [media])
    ids2, media2 = request(item, text="and the colour?", before="again: ")
    second = generate(engine, ids2, [media2])
    assert engine.media_cache.encoded == 1 and engine.media_cache.hits >= 1
    assert first.new_token_ids == reference(vlm, ids, item, 6)
    assert second.new_token_ids == reference(vlm, ids2, item, 6)
    # one prompt with the image twice: one tower run
    engine = Engine(vlm, CFG.replace(enable_prefix_caching=False))
    twice = ids + media_prompt(TOK, item.width, item.height, item.num_tokens())
    generate(engine, twice, [media, media], n=2)
    assert engine.media_cache.encoded == 1


def test_rows_follow_new_weights(vlm):
    item = image((120, 120, 30))
    engine = Engine(vlm, CFG)
    ids, media = request(item)
    generate(engine, ids, [media], n=1)
    engine.load_weights(vlm.state_dict())
    assert engine.media_cache.rows == {} and engine.media_cache.encoded == 1
    generate(engine, ids, [media], n=1)
    assert engine.media_cache.encoded == 2


def test_bad_media_requests(vlm):
    from k3.model.model import build_model

    item = image((10, 10, 10))
    ids, media = request(item)
    text_only = Engine(build_model(get_preset("debug"), seed=0), CFG)
    assert not text_only.accepts_media
    with pytest.raises(ValueError, match="text-only"):
        text_only.add_request("a", ids, SamplingParams(max_tokens=1), media=[media])
    engine = Engine(vlm, CFG)
    assert engine.accepts_media
    with pytest.raises(ValueError, match="hold 30 <\\|media_pad\\|> token\\(s\\) but the 0 media item\\(s\\) fill 0"):
        engine.add_request("b", ids, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="fill 60"):
        engine.add_request("c", ids, SamplingParams(max_tokens=1), media=[media, media])
    assert not engine.has_unfinished()


def test_request_media_spans():
    pixels = torch.zeros(16, 3, 14, 14)
    a = MediaInput(pixels, (1, 4, 4), 4, key=b"A")
    b = MediaInput(pixels, (1, 4, 4), 4, key=b"B")
    ids = [0, PAD, PAD, PAD, PAD, 5, 6, PAD, PAD, PAD, PAD, 7]
    media = RequestMedia.build(ids, [a, b], PAD)
    assert media.spans(0, 3) == [(0, 0, 2)]
    assert media.spans(3, 9) == [(0, 2, 4), (1, 0, 2)]
    assert media.spans(5, 7) == []
    assert media.block_extra(0, 4) == b"A" and media.block_extra(4, 8) == b"AB" and media.block_extra(8, 12) == b"B"
    assert media.is_pad(4, 8) == [True, False, False, True]


def test_a_generated_pad_is_a_plain_token(vlm):
    """The prompt's pads take the image's rows; a `<|media_pad|>` the model writes is embedded as a token."""
    from k3.model.model import K3ForCausalLM

    item = image((90, 20, 160))
    ids, media = request(item)
    model = build_vlm(vlm.config, seed=5).eval()
    first = reference(model, ids, item, 1)[0]
    with torch.no_grad():  # the pad's row: ten times the row the model would pick first, so it writes a pad
        model.lm_head.weight[PAD] = 10 * model.lm_head.weight[first]
    out = generate(Engine(model, CFG), ids, [media], n=3)
    cache = model.new_cache(1)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache, pixel_values=item.pixel_values,
                       grid_thw=torch.tensor([item.grid_thw])).logits[0, -1]
        expected = []
        for _ in range(3):
            expected.append(int(logits.argmax()))
            logits = K3ForCausalLM.forward(model, torch.tensor([[expected[-1]]]), cache=cache).logits[0, -1]
    assert out.new_token_ids[0] == PAD and out.new_token_ids == expected
