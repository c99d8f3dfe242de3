"""ModelConfig: presets keep K3's structural rules; config.json round-trips; bad configs are refused."""

import dataclasses
import json

import pytest

from k3.config import PRESETS, ModelConfig, get_preset, hybrid_layer_schedule


def test_k3_schedule_matches_release():
    kda, full = hybrid_layer_schedule(93)
    assert full == list(range(4, 93, 4)) + [93]
    assert len(kda) == 69 and len(full) == 24
    cfg = get_preset("k3")
    assert cfg.mla_layer_ids == [n - 1 for n in full]
    assert cfg.attn_res_block_size == 12 and cfg.routed_expert_hidden_size == 3584


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_keep_k3_invariants(name):
    cfg = get_preset(name)
    L = cfg.num_hidden_layers
    assert not cfg.is_kda_layer(L - 1), "last layer is Gated MLA"
    assert all(cfg.is_kda_layer(i) for i in range(3)), "first three layers are KDA"
    assert [i for i in range(L) if not cfg.is_kda_layer(i)] == [i for i in range(L) if (i + 1) % 4 == 0 or i == L - 1]
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, L))
    assert cfg.routed_expert_hidden_size * 2 == cfg.hidden_size
    assert cfg.num_shared_experts * cfg.moe_intermediate_size == 2 * cfg.moe_intermediate_size
    assert cfg.intermediate_size == 11 * cfg.moe_intermediate_size
    assert cfg.qk_nope_head_dim == cfg.v_head_dim == cfg.head_dim
    assert cfg.qk_rope_head_dim == cfg.head_dim // 2
    assert cfg.mla_use_nope and cfg.linear_attn_config.gate_lower_bound == -5.0
    assert cfg.routed_expert_hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0


def test_config_json_round_trip(tmp_path):
    cfg = get_preset("tiny").replace(kda_impl="recurrent")
    cfg.save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "kimi_k3"
    assert data["text_config"]["linear_attn_config"]["kda_layers"][:3] == [1, 2, 3]
    assert "kda_impl" not in data["text_config"], "runtime switches are not part of config.json"
    assert data["vision_config"]["_attn_implementation"] == "flash_attention_2"
    loaded = ModelConfig.load(tmp_path)
    assert loaded == cfg.replace(kda_impl="torch")
    assert ModelConfig.load(tmp_path, kda_impl="recurrent") == cfg


def test_release_style_config_loads():
    """The K3 config.json as released (nested, with generic transformers keys we ignore)."""
    data = get_preset("k3").to_config_json()
    data["text_config"]["rope_theta"] = 50000.0  # re-serialised configs carry loader defaults
    data["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors"}
    cfg = ModelConfig.from_config_json(data)
    assert cfg.hidden_size == 7168 and cfg.num_experts == 896 and cfg.media_placeholder_token_id == 163605
    assert cfg.quantization_config == {"quant_method": "compressed-tensors"}
    # a flat text-only config also loads
    assert ModelConfig.from_config_json(data["text_config"]).hidden_size == 7168


def _broken(mutate):
    data = get_preset("debug").to_config_json()
    mutate(data["text_config"])
    return data


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.pop("hidden_size"), "missing required fields"),
    (lambda t: t["linear_attn_config"].pop("kda_layers"), "missing required fields"),
    (lambda t: t["linear_attn_config"]["full_attn_layers"].append(1), "both"),
    (lambda t: t["linear_attn_config"]["kda_layers"].remove(2), "missing"),
    (lambda t: t.update(num_experts_per_token=16), "num_experts_per_token"),
    (lambda t: t.update(num_key_value_heads=1), "num_key_value_heads"),
    (lambda t: t["linear_attn_config"].update(num_heads=3), "num_heads"),
    (lambda t: t.update(hidden_size=-4), "positive"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.update(mla_use_nope=False), "NoPE"),
])
def test_bad_config_json_is_refused(mutate, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_config_json(_broken(mutate))


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("huge")
    with pytest.raises(ValueError, match="no config file"):
        ModelConfig.load(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.load(tmp_path)


def test_triton_kda_limits_are_checked():
    for name in ("debug", "tiny", "small", "k3"):
        get_preset(name).replace(kda_impl="triton")  # every preset fits the kernels
    lin = get_preset("debug").linear_attn_config
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        get_preset("debug").replace(kda_impl="triton", linear_attn_config=dataclasses.replace(lin, head_dim=48))
    with pytest.raises(ValueError, match="gate_lower_bound >= -5"):
        get_preset("debug").replace(kda_impl="triton",
                                    linear_attn_config=dataclasses.replace(lin, gate_lower_bound=-8.0))
