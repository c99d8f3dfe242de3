"""The multimodal model: media prompt and pad expansion, row splicing, label masking, the released names both ways."""

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from k3.config import get_preset
from k3.convert import names as N
from k3.convert.release import load_release, save_release
from k3.model.model import build_model
from k3.tokenizer import byte_tokenizer
from k3.vision.model import K3VisionLanguageModel, build_vlm
from k3.vision.preprocess import pack, preprocess_image
from k3.vision.prompt import expand_media_pads, mask_media_labels, media_prompt

TOK = byte_tokenizer(512)
PAD = TOK.special_id("<|media_pad|>")


def config():
    return get_preset("debug").replace(media_placeholder_token_id=PAD)


@pytest.fixture(scope="module")
def vlm():
    return build_vlm(config(), seed=3)


def sample(sizes=((40, 30), (28, 56))):
    """Two images in one prompt: ids [1, T], labels [1, T] (shifted, -100 at the end), and their media."""
    items = [preprocess_image(Image.new("RGB", s, (30 * i, 200, 90))) for i, s in enumerate(sizes)]
    ids = [TOK.bos_id]
    for item in items:
        ids += media_prompt(TOK, item.width, item.height, item.num_tokens()) + TOK.encode("a picture. ")
    labels = ids[1:] + [-100]
    return torch.tensor([ids]), torch.tensor([labels]), pack(items), items


def test_media_prompt_and_pad_expansion():
    begin, content, end = (TOK.special_id(t) for t in ("<|media_begin|>", "<|media_content|>", "<|media_end|>"))
    ids = media_prompt(TOK, 640, 480, 3)
    assert ids == [begin, *TOK.encode("image 640x480"), content, PAD, PAD, PAD, end]
    assert media_prompt(TOK, 64, 48, 1, frames=2) == [begin, *TOK.encode("video 64x48x2"), content, PAD, end]
    one_pad = [7, PAD, 8, 9, PAD, 10]
    assert expand_media_pads(one_pad, [2, 3], PAD) == [7, PAD, PAD, 8, 9, PAD, PAD, PAD, 10]
    with pytest.raises(ValueError, match="holds 2 <\\|media_pad\\|> token\\(s\\) for 1 media item"):
        expand_media_pads(one_pad, [2], PAD)
    assert mask_media_labels([5, PAD, PAD, 6], PAD) == [5, -100, -100, 6]


def test_rows_replace_the_pads_in_order(vlm):
    ids, _, media, items = sample()
    rows = vlm.encode_media(media.pixel_values, media.grid_thw)
    assert rows.shape == (sum(it.num_tokens() for it in items), 128)
    embeds = vlm.splice_media(ids, rows)
    pads = (ids[0] == PAD).nonzero().flatten()
    assert torch.equal(embeds[0, pads], rows)
    others = (ids[0] != PAD).nonzero().flatten()
    assert torch.equal(embeds[0, others], vlm.model.embed_tokens(ids)[0, others])
    # the forward with pixels = the text model's forward on the spliced embeddings = the forward with the rows
    with torch.no_grad():
        out = vlm(ids, **media.as_inputs()).logits
        text = build_model(config(), seed=3)
        text.load_state_dict({k: v for k, v in vlm.state_dict().items() if k in text.state_dict()})
        assert torch.equal(text(ids, inputs_embeds=embeds).logits, out)
        assert torch.equal(vlm(ids, media_rows=rows).logits, out)
    # packing media per sample or per batch is the same: each image's rows depend on that image only
    first = vlm.encode_media(items[0].pixel_values, torch.tensor([items[0].grid_thw]))
    assert torch.allclose(first, rows[: items[0].num_tokens()], atol=1e-6)


def test_text_only_forward_is_the_text_model(vlm):
    text = build_model(config(), seed=3)
    assert all(torch.equal(p, vlm.state_dict()[n]) for n, p in text.state_dict().items())  # same seeded init
    ids = torch.tensor([TOK.encode("def f(x):\n    return x")])
    with torch.no_grad():
        assert torch.equal(vlm(ids).logits, text(ids).logits)


def test_labels_on_pads_are_ignored(vlm):
    ids, labels, media, _ = sample()
    assert bool((labels == PAD).any())
    with torch.no_grad():
        loss = vlm(ids, labels=labels, **media.as_inputs()).loss
        logits = vlm(ids, **media.as_inputs()).logits[0].float()
    keep = torch.tensor(mask_media_labels(labels[0].tolist(), PAD))
    want = F.cross_entropy(logits, keep, ignore_index=-100, reduction="sum")
    assert torch.allclose(loss, want, rtol=1e-5)
    assert int((keep != -100).sum()) < int((labels != -100).sum())


def test_every_parameter_learns(vlm):
    ids, labels, media, _ = sample()
    model = build_vlm(config(), seed=1)
    model(ids, labels=labels, **media.as_inputs()).loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert no_grad == ["model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"]
    # the tower and projector learn through the spliced rows: every one of their tensors moves
    assert all(bool(p.grad.abs().sum() > 0) for n, p in model.vision_state_dict(keep_vars=True).items())


def test_clear_errors(vlm):
    ids, labels, media, _ = sample()
    with pytest.raises(ValueError, match="no pixel_values / media_rows"):
        vlm(ids)
    with pytest.raises(ValueError, match="hold 9 <\\|media_pad\\|> token\\(s\\) but the media give 6 row"):
        vlm(torch.cat([ids, torch.tensor([[PAD] * 3])], 1), **media.as_inputs())
    with pytest.raises(ValueError, match="come together"):
        vlm(ids, pixel_values=media.pixel_values)
    with pytest.raises(ValueError, match="has no vision_config"):
        K3VisionLanguageModel(config().replace(vision_config=None))


@pytest.mark.parametrize("preset", ["debug", "tiny", "small", "k3"])
def test_names_and_shapes_are_the_release_layout(preset):
    """Every tower / projector tensor of the model is the released listing's (§9.2 rules, `vision_layout`)."""
    cfg = get_preset(preset)
    with torch.device("meta"):
        model = K3VisionLanguageModel(cfg)
    own = {n: tuple(t.shape) for n, t in model.vision_state_dict().items()}
    listing = {n: s.shape for n, s in N.vision_layout(cfg.vision_config).items()}
    assert own == listing
    assert all(N.to_release(n) == [n] and N.from_release(n) is None for n in own)
    # the full release listing of a multimodal model: text names mapped as before, then the vision ones
    layout = N.release_layout(model, packed=False)
    text_only = N.release_layout(model, packed=False, vision=False)
    assert set(layout) == set(text_only) | set(listing) and not set(text_only) & set(listing)


def test_k3_size_matches_the_released_table():
    with torch.device("meta"):
        model = K3VisionLanguageModel(get_preset("k3"))
    shapes = {n: tuple(t.shape) for n, t in model.vision_state_dict().items()}
    # docs/architecture.md §9.2, row by row
    table = {
        "mm_projector.proj.0.weight": (4096, 4096), "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
        "vision_tower.patch_embed.proj.weight": (1024, 3, 14, 14),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1024),
        "vision_tower.encoder.final_layernorm.weight": (1024,),
    }
    for b in range(27):
        table |= {f"vision_tower.encoder.blocks.{b}.wqkv.weight": (4608, 1024),
                  f"vision_tower.encoder.blocks.{b}.wo.weight": (1024, 1536),
                  f"vision_tower.encoder.blocks.{b}.mlp.fc0.weight": (4096, 1024),
                  f"vision_tower.encoder.blocks.{b}.mlp.fc1.weight": (1024, 4096),
                  f"vision_tower.encoder.blocks.{b}.norm0.weight": (1024,),
                  f"vision_tower.encoder.blocks.{b}.norm1.weight": (1024,)}
    assert shapes == table and len(table) == 168
    count = {p: sum(torch.Size(s).numel() for n, s in table.items() if n.startswith(p))
             for p in ("vision_tower.", "mm_projector.")}
    assert count == {"vision_tower.": 401_214_464, "mm_projector.": 46_144_512}


def test_release_round_trip(tmp_path, vlm):
    """save_release(vlm) → load_release → from_parts: the same model, the same logits, the same bytes again."""
    ids, _, media, _ = sample()
    save_release(vlm, tmp_path / "a", vision=vlm.vision_state_dict(), dtype=torch.float32, shard_size="200KB")
    ckpt = load_release(tmp_path / "a", dtype=torch.float32)
    assert set(ckpt.vision) == set(N.vision_layout(vlm.config.vision_config))
    back = K3VisionLanguageModel.from_parts(ckpt.model, ckpt.vision)
    assert back.model is ckpt.model.model  # shared, not copied
    with torch.no_grad():
        assert torch.equal(back(ids, **media.as_inputs()).logits, vlm(ids, **media.as_inputs()).logits)
    save_release(back, tmp_path / "b", vision=back.vision_state_dict(), dtype=torch.float32, shard_size="200KB")
    for f in sorted((tmp_path / "a").glob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes()
    bad = dict(ckpt.vision)
    bad.pop("mm_projector.post_norm.weight")
    with pytest.raises(ValueError, match="do not match the config's vision_config"):
        K3VisionLanguageModel.from_parts(ckpt.model, bad)


@pytest.mark.parametrize("preset", ["debug", "tiny", "small", "k3"])
def test_info_counts_the_tower_and_projector(preset):
    """`k3 info` (k3.model.accounting, which cannot import k3.vision) counts what the modules hold."""
    from k3.model.accounting import account

    cfg = get_preset(preset)
    with torch.device("meta"):
        model = K3VisionLanguageModel(cfg)
    own = {prefix: sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix + "."))
           for prefix in ("vision_tower", "mm_projector")}
    acc = account(cfg, preset)
    assert acc.vision == own
    if preset == "k3":
        assert own == {"vision_tower": 401_214_464, "mm_projector": 46_144_512}
        # the text totals are the model's tensors (router bias buffers included) less the tower and projector
        assert acc.total_params == sum(t.numel() for t in model.state_dict().values()) - sum(own.values())
