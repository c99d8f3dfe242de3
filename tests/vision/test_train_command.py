"""`k3 train` on multimodal rows: the tower and projector train from scratch with the language model through the
training loop (`k3.train.loop.train` with `k3.vision.data.MultimodalRows`), at their own learning rate, and a
resumed run continues exactly where the uninterrupted one goes (the same rows and images)."""

import json

import pytest
import torch

from k3.checkpoint import load_trained
from k3.train.config import ContextStage, TrainConfig
from k3.train.data import PackedBatches
from k3.train.loop import prepare_data, train
from k3.vision.data import MediaBatches, MultimodalRows
from k3.vision.model import K3VisionLanguageModel, build_vlm
from k3.vision.synthetic import make_vision_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision-train")
    make_vision_dataset(root, train_images=24, heldout_images=2, size=56, seed=0, progress=False)
    return root / "train.jsonl"


def config(data, out, **changes) -> TrainConfig:
    cfg = TrainConfig(preset="debug", data=str(data), out=str(out), data_format="multimodal", tokens_per_step=64,
                      stages=[ContextStage(64, 1.0)], max_steps=2, eval_every=2, eval_tokens=64,
                      checkpoint_every=1, vocab_size=600, heldout_fraction=0.1, lr=1e-2, vision_lr=3e-3,
                      device="cpu", data_streams=2)
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


def run(cfg: TrainConfig, resume: bool = False):
    return train(cfg, resume=resume, log=lambda *a: None, progress=False, source=MultimodalRows(cfg.data))


def test_rows_are_detected(data, tmp_path):
    assert MultimodalRows.holds_media(data) and MultimodalRows.holds_media(data.parent)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "no pictures"}) + "\n")
    assert not MultimodalRows.holds_media(text)


@pytest.mark.slow
def test_joint_training_and_exact_resume(data, tmp_path):
    whole = run(config(data, tmp_path / "whole"))
    assert whole.steps == 2 and whole.final_eval_loss == whole.final_eval_loss  # finite
    model, _, _ = load_trained(tmp_path / "whole")
    assert isinstance(model, K3VisionLanguageModel)
    start = build_vlm(model.config, seed=0)
    for name in ("vision_tower.patch_embed.proj.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
                 "mm_projector.proj.0.weight", "vision_tower.patch_embed.pos_emb.weight"):
        assert not torch.equal(model.state_dict()[name], start.state_dict()[name]), name  # it learnt
    # stopped after a step and resumed: the same weights as the run that never stopped
    run(config(data, tmp_path / "split", max_steps=1))
    run(config(data, tmp_path / "split", max_steps=2), resume=True)
    resumed, _, _ = load_trained(tmp_path / "split")
    for name, tensor in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_batches_carry_their_rows_images_in_pad_order(data, tmp_path):
    cfg = config(data, tmp_path)
    tokenizer, corpus, _ = prepare_data(cfg, 600, tmp_path, lambda *a: None, MultimodalRows(data))
    assert corpus.media is not None and len(corpus.media) == corpus.num_documents
    batches = MediaBatches(PackedBatches(corpus, 2, 128, seed=0), corpus.media)
    batch = next(batches)
    grid = batch.media["grid_thw"]
    pads = int((batch.input_ids == tokenizer.special_id("<|media_pad|>")).sum())
    assert pads == int((grid[:, 1] // 2 * (grid[:, 2] // 2)).sum()) > 0
    # the images are those of the rows' documents, in order
    docs = [d for row in batches.batches.last_documents for d in row]
    assert [tuple(g) for g in grid.tolist()] == [(1, 4, 4) for d in docs for _ in corpus.media[d]]
    state = batches.state_dict()
    again = MediaBatches(PackedBatches(corpus, 2, 128, seed=0), corpus.media)
    again.load_state_dict(state)
    assert torch.equal(next(again).media["pixel_values"], next(batches).media["pixel_values"])


@pytest.mark.slow  # ~15 s idle: a byte-level tokenizer's 256-token rows
def test_sft_gives_a_text_run_its_tower(tmp_path):
    from k3.checkpoint import save_checkpoint
    from k3.config import get_preset
    from k3.model.model import build_model
    from k3.posttrain.sft import sft, sft_config
    from k3.tokenizer import byte_tokenizer

    make_vision_dataset(tmp_path / "chat", train_images=6, heldout_images=2, size=56, seed=1, tasks=("shape",),
                        chat=True, progress=False)
    tokenizer = byte_tokenizer(512)
    tokenizer.save(tmp_path / "tokenizer")
    base_config = get_preset("debug").replace(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                                              pad_token_id=tokenizer.pad_id,
                                              media_placeholder_token_id=tokenizer.special_id("<|media_pad|>"))
    base = build_model(base_config, seed=1)
    save_checkpoint(tmp_path / "base" / "checkpoints", 1, base.state_dict(), {},
                    {"config.json": json.dumps(base_config.to_config_json())}, {"tokenizer": tmp_path / "tokenizer"})
    cfg = sft_config(str(tmp_path / "base"), str(tmp_path / "chat" / "train.jsonl"), str(tmp_path / "sft"),
                     seq_len=256, max_steps=1, tokens_per_step=256, eval_every=1, eval_tokens=256, checkpoint_every=1,
                     device="cpu", data_streams=1)
    assert cfg.data_format == "multimodal"
    sft(cfg, log=lambda *a: None, progress=False)
    tuned, _, _ = load_trained(tmp_path / "sft")
    assert isinstance(tuned, K3VisionLanguageModel)
    start = build_vlm(base_config, seed=cfg.seed).state_dict()
    state = tuned.state_dict()
    assert not torch.equal(state["mm_projector.proj.2.weight"], start["mm_projector.proj.2.weight"])
    assert not torch.equal(state["model.embed_tokens.weight"], base.state_dict()["model.embed_tokens.weight"])
