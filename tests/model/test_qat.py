"""QAT in the model (config `qat: mxfp4`): only the routed experts' GEMM operands are quantized; the MXFP4 export of a
QAT model decodes to exactly the weights its forward used and loads back (k3, transformers) to the same logits; without
QAT the same export moves the logits; `k3 train` runs with QAT on and `k3 convert to-release --mxfp4` exports the run.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from k3.config import ModelConfig, get_preset
from k3.convert.release import load_release, save_release
from k3.model.model import build_model
from k3.model.moe import LatentExperts
from k3.ops import qat
from k3.ops.mx import mx_fake_quantize

QAT_DEBUG = get_preset("debug").replace(qat="mxfp4")


def tokens(seed: int, B: int = 2, T: int = 24, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def as_released(model):
    """A copy of `model` with the dtypes a release stores: bf16, the fp32-pinned tensors kept exactly."""
    out = copy.deepcopy(model)
    keep = set(out.fp32_tensor_names())
    for name, t in list(out.named_parameters()) + list(out.named_buffers()):
        if name not in keep and t.is_floating_point():
            t.data = t.data.bfloat16()
    return out


def trained_like(config: ModelConfig, seed: int = 0):
    """A debug model whose expert weights are spread like trained ones (N(0, 0.02) with heavier rows)."""
    model = build_model(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LatentExperts):
                for w in (m.w1, m.w3, m.w2):
                    w.mul_(torch.exp(0.5 * torch.randn(w.shape[:-1] + (1,), generator=g)))
    return model.eval()


def test_config_records_qat_only_when_on():
    plain = get_preset("debug")
    text = plain.to_config_json()["text_config"]
    assert "qat" not in text and "qat_scale_mode" not in text  # a plain config is the released schema
    text = QAT_DEBUG.to_config_json()["text_config"]
    assert text["qat"] == "mxfp4" and text["qat_scale_mode"] == "rceil"  # the default recorded
    assert ModelConfig.from_config_json(QAT_DEBUG.replace(qat_scale_mode="even").to_config_json()) == \
        QAT_DEBUG.replace(qat_scale_mode="even")
    with pytest.raises(ValueError, match="qat must be none"):
        QAT_DEBUG.replace(qat="mxfp8")
    with pytest.raises(ValueError, match="qat_scale_mode"):
        QAT_DEBUG.replace(qat_scale_mode="nearest")
    with pytest.raises(ValueError, match="multiples of 32"):
        QAT_DEBUG.replace(moe_intermediate_size=48)


def test_only_the_routed_experts_are_quantized(monkeypatch):
    """Every fake quantization of a forward is one of the routed experts' operands: W1, W3, W2 (E2M1) and the latent
    rows and activations entering them (E4M3); nothing else in the model."""
    model = build_model(QAT_DEBUG, seed=1)
    seen = []
    original = qat._FakeQuantizeSTE.forward

    def recording(ctx, x, elem, mode):
        seen.append((tuple(x.shape), elem, mode))
        return original(ctx, x, elem, mode)

    monkeypatch.setattr(qat._FakeQuantizeSTE, "forward", staticmethod(recording))
    ids = tokens(0)
    model(ids)
    c = QAT_DEBUG
    E, I, L, N = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size, ids.numel()
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    weights = [s for s in seen if s[1] == "e2m1"]
    inputs = [s for s in seen if s[1] == "e4m3"]
    assert sorted(weights) == sorted([((E, I, L), "e2m1", "rceil")] * 2 * moe_layers
                                     + [((E, L, I), "e2m1", "rceil")] * moe_layers)
    # per MoE layer: the N latent rows entering W1/W3, and the activation blocks [experts, capacity, I] entering W2
    # (the CPU path's buckets of experts of similar load: together at most the E experts of each layer)
    assert sorted(s[0] for s in inputs if len(s[0]) == 2) == [(N, L)] * moe_layers
    blocks = [s[0] for s in inputs if len(s[0]) == 3]
    assert len(blocks) >= moe_layers and sum(b[0] for b in blocks) <= E * moe_layers
    assert all(s[0][-1] == I for s in inputs)


def test_qat_expert_paths_never_wait_for_the_device():
    """The grouped path's training step and the gathered decode-size forward under QAT make no host sync (the
    recorder of tests/model/test_host_sync.py; the CPU-only grouped GEMM loops excepted, as there)."""
    from tests.model.test_host_sync import ALLOWED, CPU_ONLY, SyncRecorder

    model = build_model(QAT_DEBUG.replace(moe_impl="grouped"), seed=0)
    recorder = SyncRecorder()
    with recorder:
        ids = tokens(5, T=40)
        model(ids, labels=ids).loss.backward()
        with torch.no_grad():
            model(tokens(6, B=2, T=1))  # 2 tokens × k = 2 pairs ≤ E/2: the gathered path
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n)
    per_layer = [h for h in recorder.hits if (h[0], h[1]) not in ALLOWED | CPU_ONLY]
    assert not per_layer, "host syncs inside the layers:\n" + "\n".join(map(str, per_layer))


@torch.no_grad()
def test_engine_serves_the_qat_forward():
    """The inference engine (paged cache, chunked prefill through the grouped path, decode steps through the gathered
    one) on a QAT model: its greedy tokens are the argmax decoding of the same weights on the QAT reference path, so
    rollouts and serving see training's quantization."""
    from k3.infer.engine import Engine
    from tests.infer.test_engine import CFG, greedy, prompt, reference_greedy

    model = trained_like(QAT_DEBUG.replace(moe_impl="grouped"), seed=6)
    reference = copy.deepcopy(model)
    for m in reference.modules():
        if isinstance(m, LatentExperts):
            m.impl = "reference"
    engine = Engine(model, CFG)
    for n, seed in ((5, 1), (37, 2)):
        ids = prompt(n, seed)
        want, _ = reference_greedy(reference, ids, 10)
        assert engine.generate(ids, greedy(10)).new_token_ids == want


def test_qat_model_trains_every_parameter():
    model = build_model(QAT_DEBUG, seed=2)
    ids = tokens(1)
    model(ids, labels=ids).loss.backward()
    # layer 0's mixer reads the raw embedding (no AttnRes read yet): its query has no effect (tests/model/test_model.py)
    no_effect = {"model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"}
    for name, p in model.named_parameters():
        if name not in no_effect:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    plain = build_model(get_preset("debug"), seed=2)
    assert not torch.equal(plain(ids).logits, model(ids).logits)  # the quantizers are in the forward


@pytest.mark.parametrize("mode", ["floor", "ceil", "even", "rceil"])
def test_mxfp4_export_decodes_to_the_qat_forward_weights(tmp_path, mode):
    """save_release(mxfp4) of a QAT model (fp32 master weights) quantizes with the run's scale mode, so the loaded
    experts are bit for bit the dequantized weights its forward used; another mode is refused; QAT stays on."""
    model = trained_like(QAT_DEBUG.replace(qat_scale_mode=mode), seed=3)
    save_release(model, tmp_path / "qat", mxfp4=True)
    with pytest.raises(ValueError, match="would change the expert weights"):
        save_release(model, tmp_path / "other", mxfp4=True, scale_mode="ceil" if mode != "ceil" else "floor")
    assert json.loads((tmp_path / "qat" / "config.json").read_text())["text_config"]["qat_scale_mode"] == mode
    loaded = load_release(tmp_path / "qat").model
    assert loaded.config.qat == "mxfp4" and loaded.config.qat_scale_mode == mode
    params = dict(loaded.named_parameters())
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
            assert torch.equal(params[name], mx_fake_quantize(p.detach(), "e2m1", 32, mode).bfloat16()), name


def test_mxfp4_export_of_a_qat_model_loads_to_the_same_logits(tmp_path):
    """With weights the release stores exactly (bf16 values; the fp32-pinned ones in fp32), the MXFP4 export of a QAT
    model loads to the QAT forward's logits bit for bit, in fp32 and in bf16: the export adds no error. The same
    weights without QAT lose accuracy in the same export (their forward never saw the MXFP4 rounding)."""
    model = trained_like(QAT_DEBUG, seed=4)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name not in set(model.fp32_tensor_names()):
                t.copy_(t.bfloat16())
    ids = tokens(2)
    save_release(model, tmp_path / "qat", mxfp4=True)
    with torch.no_grad():
        assert torch.equal(load_release(tmp_path / "qat", dtype=torch.float32).model(ids).logits, model(ids).logits)
        assert torch.equal(load_release(tmp_path / "qat").model(ids).logits, as_released(model)(ids).logits)

        plain = build_model(get_preset("debug"), seed=0)
        plain.load_state_dict(model.state_dict())
        save_release(plain, tmp_path / "plain", mxfp4=True)
        drop = rel_rms(load_release(tmp_path / "plain", dtype=torch.float32).model(ids).logits, plain(ids).logits)
    assert drop > 0.01, drop


def test_transformers_wrapper_gives_the_same_logits(tmp_path):
    pytest.importorskip("transformers")
    import logging

    from transformers import AutoModelForCausalLM

    from k3.hf import register

    register()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = trained_like(QAT_DEBUG, seed=4)
    save_release(model, tmp_path / "qat", mxfp4=True)
    ids = tokens(3)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "qat")
    assert hf.k3.config.qat == "mxfp4"
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, load_release(tmp_path / "qat").model(ids).logits)


def test_k3_train_with_qat_then_export(tmp_path, monkeypatch):
    """A few `k3 train` steps of the debug preset with QAT on, then `k3 convert to-release --mxfp4` of the run: the
    run's config.json keeps QAT, the loss falls, the export's experts decode to the trained forward's, and loaded in
    fp32 it gives the trained QAT forward's logits bit for bit once the other weights are rounded as stored (bf16)."""
    from k3.checkpoint import load_trained
    from k3.convert.cli import main as convert_main
    from k3.train import loop
    from tests.train.test_loop import small_config

    # no TrainConfig knob turns QAT on yet: a preset with it is what `--qat mxfp4` would build
    monkeypatch.setattr(loop, "get_preset", lambda name: QAT_DEBUG if name == "debug" else get_preset(name))
    cfg = small_config(tmp_path, max_steps=4, eval_every=4, checkpoint_every=4)
    summary = loop.train(cfg, log=lambda *_: None, progress=False)
    run = Path(cfg.out)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 4 and losses[-1] < losses[0] and summary.steps == 4
    assert json.loads((run / "config.json").read_text())["text_config"]["qat"] == "mxfp4"

    assert convert_main(["convert", "to-release", str(run), str(tmp_path / "release"), "--mxfp4"]) == 0
    trained, _, _ = load_trained(run)
    loaded = load_release(tmp_path / "release", dtype=torch.float32).model
    ids = tokens(4, vocab=trained.config.vocab_size)
    params = dict(loaded.named_parameters())
    keep = set(trained.fp32_tensor_names())
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
                assert torch.equal(params[name], mx_fake_quantize(p, "e2m1", 32, "rceil").bfloat16().float()), name
            elif name not in keep:
                p.copy_(p.bfloat16())  # what the release stores; the experts stay the fp32 masters
        assert torch.equal(loaded(ids).logits, trained(ids).logits)
