"""Multimodal rows → samples → packed batches, the generated data set, and a joint training step."""

import base64
import io
import json

import pytest
import torch
from PIL import Image

from k3.config import get_preset
from k3.optim import MuonAdamW, cosine_schedule
from k3.tokenizer import byte_tokenizer
from k3.train.config import TrainConfig
from k3.train.loop import train_step
from k3.vision.data import MultimodalBatches, SampleBuilder, read_samples
from k3.vision.model import build_vlm
from k3.vision.optim import add_vision_param_groups, vision_block_view
from k3.vision.prompt import media_prompt
from k3.vision.synthetic import make_vision_dataset

TOK = byte_tokenizer(512)
PAD = TOK.special_id("<|media_pad|>")


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def folder(tmp_path):
    Image.new("RGB", (40, 30), (200, 0, 0)).save(tmp_path / "red.png")
    Image.new("RGB", (56, 28), (0, 0, 200)).save(tmp_path / "blue.png")
    return tmp_path


def test_image_text_rows(folder):
    path = write_rows(folder / "d.jsonl", [{"image": "red.png", "text": "red", "task": "x"},
                                           {"images": ["red.png", "blue.png"], "text": "two"},
                                           {"text": "just text"}])
    a, b, c = read_samples(path, TOK)
    red = media_prompt(TOK, 40, 30, 4)  # 40 × 30 → 56 × 56 → 4 merged tokens
    assert a.ids == [TOK.bos_id, *red, *TOK.encode("red"), TOK.document_end_id]
    # the loss is on the text and [EOS] only: not on the media prompt, never on a pad
    text_start = 1 + len(red)
    assert a.labels == [-100] * (text_start - 1) + a.ids[text_start:] + [-100]
    assert [ref.num_tokens for ref in b.media] == [4, 2] and b.ids.count(PAD) == 6
    assert c.media == [] and c.ids == [TOK.bos_id, *TOK.encode("just text"), TOK.document_end_id]


def test_conversation_rows_with_image_parts(folder):
    data = io.BytesIO()
    Image.new("RGB", (28, 28), (0, 255, 0)).save(data, "PNG")
    url = "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image_url", "image_url": {"url": "red.png"}},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "which colour?"}]},
                {"role": "assistant", "content": "red"}]
    (sample,) = read_samples(write_rows(folder / "c.jsonl", [{"messages": messages}]), TOK)
    template = SampleBuilder(TOK).template
    user = (template.open_tag("message", role="user") + TOK.encode("Look: ") + media_prompt(TOK, 40, 30, 4)
            + media_prompt(TOK, 28, 28, 1) + TOK.encode("which colour?") + [TOK.eos_id])
    assistant = template.render_message(messages[1], thinking=False)
    assert sample.ids == [TOK.bos_id] + user + assistant
    trained = [t for t, label in zip(sample.ids[1:], sample.labels) if label != -100]
    # the assistant's written tokens: its reply, the close of its response channel and <|end_of_msg|>
    assert TOK.decode(trained).startswith("red") and trained[-1] == TOK.eos_id
    assert len(trained) < len(assistant) and [r.width for r in sample.media] == [40, 28]


@pytest.mark.parametrize("row, message", [
    ({"image": "missing.png", "text": "x"}, "missing.png' does not exist"),
    ({"image": "bad.png", "text": "x"}, "cannot be decoded as an image"),
    ({"image": "https://example.com/a.png", "text": "x"}, "network fetch"),
    ({"image": "red.png"}, "needs a \"text\" string"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "a"}]},
     "type 'audio' is not supported"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message to train on"),
    ({"video": ["red.png", "blue.png"], "text": "x"}, "share one size"),
])
def test_clear_errors_name_the_line(folder, row, message):
    (folder / "bad.png").write_bytes(b"\x89PNG broken")
    path = write_rows(folder / "e.jsonl", [{"text": "fine"}, row])
    with pytest.raises(ValueError, match=message) as e:
        read_samples(path, TOK)
    assert f"{path}:2" in str(e.value)


def samples(folder, n=12):
    rows = [{"image": "red.png" if i % 2 else "blue.png", "text": "x" * (i % 5 + 1)} for i in range(n)]
    return read_samples(write_rows(folder / "d.jsonl", rows), TOK)


def test_batches_pack_whole_samples_and_media_in_pad_order(folder):
    data = samples(folder)
    batches = MultimodalBatches(data, batch_size=2, seq_len=64, seed=1, pad_id=TOK.pad_id)
    for _ in range(5):
        batch = next(batches)
        flat, cu = batch.input_ids.flatten(), batch.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == flat.numel() and 64 in cu  # every row end is a segment end
        assert batch.num_tokens == int((batch.labels != -100).sum())
        # the pixels come in the order of their pads: red (4 tokens) or blue (2 tokens) per sample
        sizes = [4 if int(g[1]) == 4 else 2 for g in batch.media["grid_thw"]]
        runs, i = [], 0
        while i < flat.numel():
            if flat[i] == PAD:
                j = i
                while j < flat.numel() and flat[j] == PAD:
                    j += 1
                runs.append(j - i)
                i = j
            else:
                i += 1
        assert runs == sizes
        assert not bool((batch.labels == PAD).any())
    with pytest.raises(ValueError, match="do not fit a 16-token row"):
        MultimodalBatches(data, 1, 16, pad_id=TOK.pad_id)


def test_resume_continues_exactly_and_workers_change_nothing(folder):
    data = samples(folder)
    first = MultimodalBatches(data, 2, 64, seed=3, pad_id=TOK.pad_id)
    seen = [next(first) for _ in range(3)]
    state = first.state_dict()
    later = [next(first) for _ in range(4)]  # crosses into the next epoch
    resumed = MultimodalBatches(data, 2, 64, seed=3, pad_id=TOK.pad_id)
    resumed.load_state_dict(state)
    workers = MultimodalBatches(data, 2, 64, seed=3, pad_id=TOK.pad_id, loader_workers=2)
    for a, b in zip(later, [next(resumed) for _ in range(4)]):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.media["pixel_values"], b.media["pixel_values"])
    for a, b in zip(seen + later, [next(workers) for _ in range(7)]):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.media["grid_thw"], b.media["grid_thw"])
    assert workers.state_dict() == first.state_dict()
    with pytest.raises(ValueError, match="does not fit this data"):
        resumed.load_state_dict({**state, "num_samples": 5})


def test_generated_data_set(tmp_path):
    meta = make_vision_dataset(tmp_path / "a", train_images=8, heldout_images=4, size=56, seed=5, progress=False)
    again = make_vision_dataset(tmp_path / "b", train_images=8, heldout_images=4, size=56, seed=5, progress=False)
    assert meta == again and meta["splits"]["heldout"]["images"] == 4
    for name in ("train.jsonl", "heldout.jsonl", "images/train-000003.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "a" / "heldout.jsonl").read_text().splitlines()]
    assert {r["task"] for r in rows} == {"shape", "count", "chart", "code"}
    assert all(r["text"] == f"Q: {r['question']} A: {r['answer']}" and "image" in r for r in rows)
    train = read_samples(tmp_path / "a" / "train.jsonl", TOK)
    assert len(train) == meta["splits"]["train"]["rows"] and all(len(s.media) == 1 for s in train)
    make_vision_dataset(tmp_path / "c", 4, 2, size=56, chat=True, progress=False)
    chat = read_samples(tmp_path / "c" / "heldout.jsonl", TOK)
    assert all(s.ids.count(PAD) == 4 for s in chat)
    with pytest.raises(ValueError, match="unknown or no tasks"):
        make_vision_dataset(tmp_path / "d", 2, 2, tasks=("poetry",), progress=False)


def test_vision_routing_table():
    assert vision_block_view("vision_tower.encoder.blocks.3.wqkv.weight", (288, 64), 2) == (6, 48, 64)
    assert vision_block_view("vision_tower.patch_embed.proj.weight", (64, 3, 14, 14), 2) == (1, 64, 588)
    assert vision_block_view("mm_projector.proj.2.weight", (128, 256), 2) == (1, 128, 256)
    assert vision_block_view("vision_tower.patch_embed.pos_emb.weight", (8, 8, 64), 2) is None
    with pytest.raises(ValueError, match="vision routing table"):
        vision_block_view("vision_tower.encoder.blocks.0.extra.weight", (4, 4), 2)


def test_joint_training_step_moves_tower_and_text(folder):
    """k3.train's own step on a multimodal batch: Muon/AdamW with the tower at its own learning rate."""
    config = get_preset("debug").replace(media_placeholder_token_id=PAD)
    model = build_vlm(config, seed=0)
    optimizer = MuonAdamW(model.text_named_parameters(), config, lr=1e-2)
    add_vision_param_groups(optimizer, model, lr=3e-3)
    assert [g["kind"] for g in optimizer.param_groups] == ["muon", "adamw", "muon", "adamw"]
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2, 1e-2, 3e-3, 3e-3]
    scheduler = cosine_schedule(optimizer, 10)
    batch = next(MultimodalBatches(samples(folder), 2, 64, pad_id=TOK.pad_id))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(model, optimizer, scheduler, [batch], TrainConfig(preset="debug"), torch.device("cpu"))
    assert metrics["tokens"] == batch.num_tokens and not metrics.get("skipped")
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {"vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.patch_embed.pos_emb.weight",
            "mm_projector.proj.0.weight", "model.embed_tokens.weight"} <= moved
    # a checkpoint's optimizer state loads back into the same construction
    state = optimizer.state_dict()
    other = MuonAdamW(model.text_named_parameters(), config, lr=1e-2)
    add_vision_param_groups(other, model, lr=3e-3)
    other.load_state_dict(state)
