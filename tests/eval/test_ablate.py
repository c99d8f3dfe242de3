"""`k3 ablate`: each ablation's arms differ from the K3 arm in exactly the named component (a config diff), the
K3 arm is K3's defaults, the baselines' code paths do what they claim, a smoke run of every ablation at the debug
preset (a few steps), and the full runs (slow)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from k3.config import get_preset
from k3.eval.ablate import ABLATIONS, arm_configs, config_diff, run_ablation, verdict
from k3.train.config import ContextStage, TrainConfig


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_arms_differ_in_exactly_the_named_component(name):
    ablation = ABLATIONS[name]
    arms = arm_configs(ablation, "debug")
    _, k3_model, k3_train = arms[0]
    # the K3 arm is the preset and the training defaults, plus what every arm shares
    assert k3_model == get_preset("debug").replace(**ablation.common_model)
    defaults = TrainConfig(preset="debug", tokens_per_step=2048, stages=[ContextStage(256, 1.0)], max_steps=1,
                           **ablation.common_train)
    assert k3_train == defaults
    seen = set()
    for label, model, train in arms[1:]:
        diff = config_diff(k3_model, model) | config_diff(k3_train, train)
        assert diff and diff <= set(ablation.fields), (label, diff)
        seen |= diff
    assert seen == set(ablation.fields)


def test_hybrid_arms_are_all_mla_and_all_kda():
    _, k3, mla, kda = [c[1] for c in [(None, None)] + arm_configs(ABLATIONS["hybrid-ratio"], "debug")]
    L = k3.num_hidden_layers
    assert len(k3.mla_layer_ids) == 2 and mla.mla_layer_ids == list(range(L)) and kda.kda_layer_ids == list(range(L))


def test_baseline_code_paths():
    """Each baseline switch changes the computation it names, and only that."""
    from k3.model.model import build_model
    from k3.optim import MuonAdamW

    base = get_preset("debug")
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = build_model(base, seed=0)(ids).logits
    for change in ({"residual": "plain"}, {"hidden_act": "silu"}, {"latent_moe_use_norm": False},
                   {"kda_gate": "unbounded", "kda_impl": "naive"}):
        model = build_model(base.replace(**change), seed=0)
        assert not torch.allclose(model(ids).logits, ref), change
    # the unbounded gate with the naive chunk form equals the exact recurrence (no overflow without the bound)
    un = build_model(base.replace(kda_gate="unbounded", kda_impl="naive"), seed=0)
    rec = build_model(base.replace(kda_gate="unbounded", kda_impl="recurrent"), seed=0)
    torch.testing.assert_close(un(ids).logits, rec(ids).logits, atol=1e-4, rtol=1e-4)
    # plain residuals: the output read is h_0 + Σ sublayer outputs (the queries get no gradient)
    plain = build_model(base.replace(residual="plain"), seed=0)
    plain(ids, labels=ids).loss.backward()
    assert all(p.grad is None for n, p in plain.named_parameters() if "_res_" in n)
    model = build_model(base, seed=0)
    per_head = MuonAdamW(model.named_parameters(), base, lr=1e-3)
    whole = MuonAdamW(model.named_parameters(), base, lr=1e-3, muon_blocks="whole_matrix")
    adamw = MuonAdamW(model.named_parameters(), base, lr=1e-3, muon_blocks="none")
    q = model.model.layers[0].self_attn.q_proj.weight
    assert per_head.block_shapes[q][0] == base.num_attention_heads and whole.block_shapes[q][0] == 1
    assert not adamw.block_shapes and len(adamw.param_groups[0]["params"]) == 0


def test_sign_rule_moves_each_bias_by_the_rate():
    """One training step with the sign rule: every router bias moves by ±rate (0 where a load equals the mean)."""
    from k3.model.model import build_model
    from k3.optim import MuonAdamW, cosine_schedule
    from k3.train.data import Batch
    from k3.train.loop import moe_layers, train_step

    cfg = TrainConfig(preset="debug", router_balancing="sign", sign_update_rate=0.01)
    model = build_model(get_preset("debug"), seed=0)
    opt = MuonAdamW(model.named_parameters(), model.config, lr=1e-3)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    batch = Batch(ids, ids, torch.tensor([0, 64, 128]), 128)
    train_step(model, opt, cosine_schedule(opt, 4), [batch], cfg, torch.device("cpu"))
    for moe in moe_layers(model):
        b = moe.gate.e_score_correction_bias
        assert torch.all(((b.abs() - 0.01).abs() < 1e-7) | (b == 0)) and (b != 0).any()


def test_verdict_wording():
    def result(k3, base):
        arms = [{"label": "x", "summary": {"heldout_loss": {"mean": m, "std": s}}} for m, s in (k3, base)]
        return {"metric": "heldout_loss", "arms": arms}
    words = [verdict(result(k, b))["against"][0]["verdict"]
             for k, b in (((1.0, 0.01), (1.1, 0.01)), ((1.0, 0.1), (1.05, 0.1)), ((1.05, 0.1), (1.0, 0.1)),
                          ((1.5, 0.01), (1.0, 0.01)), ((1.0, 0.0), (float("nan"), 0.0)))]
    assert words == ["matches", "matches, within seed noise", "does not match (within seed noise)",
                     "does not match", "K3 arm finite, baseline diverged"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """40 standard library modules: enough for a 512-token BPE and a few steps."""
    folder = tmp_path_factory.mktemp("corpus")
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]:
        shutil.copy(f, folder / (f.name + ".txt"))
    return folder


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("ablations")


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_smoke_at_the_debug_preset(name, small_corpus, out):
    torch.set_num_threads(1)
    result = run_ablation(name, "debug", steps=2, seeds=1, out=out, data=str(small_corpus), progress=False,
                          eval_tokens=512, decode_contexts=(32,), log=lambda *_: None)
    assert len(result["arms"]) == len(ABLATIONS[name].arms)
    for arm in result["arms"]:
        assert len(arm["runs"]) == 1 and len(arm["runs"][0]["curve"]["loss"]) == 2
        assert arm["summary"]["heldout_loss"]["mean"] > 0
    saved = json.loads((out / f"{name}-debug.json").read_text())
    assert saved["verdict"]["against"] and (out / f"{name}-debug.png").stat().st_size > 1000
    if name == "hybrid-ratio":
        assert result["arms"][2]["cache_bytes_per_token"] == 0 and result["arms"][1]["decode_ms"]["32"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_full_run(name, tmp_path):
    """The documented run: the debug preset, the ablation's steps, three seeds, the standard library corpus."""
    result = run_ablation(name, "debug", seeds=3, out=tmp_path, progress=False)
    assert all(len(a["runs"]) == 3 for a in result["arms"])


def test_ablation_fields_in_config_json():
    """`residual` and `kda_gate` are written only when set, so K3's own config.json is unchanged; they round-trip."""
    from k3.config import ModelConfig

    base = get_preset("debug")
    assert not {"residual", "kda_gate"} & set(base.to_config_json()["text_config"])
    plain = base.replace(residual="plain", hidden_act="silu", latent_moe_use_norm=False)
    assert ModelConfig.from_config_json(plain.to_config_json()) == plain
    gate = base.replace(kda_gate="unbounded", kda_impl="naive")
    assert ModelConfig.from_config_json(gate.to_config_json(), kda_impl="naive") == gate
    with pytest.raises(ValueError, match="kda_impl"):
        base.replace(kda_gate="unbounded")
