"""The draft in the release layout: its tensor names both ways (the layer after the backbone's, routed experts per
expert), no collision with the released tensors, and a save/load round trip of `draft.safetensors`."""

import pytest
import torch

from k3.config import get_preset
from k3.convert import names as N
from k3.convert.release import load_draft_release, save_draft_release
from k3.model.model import K3ForCausalLM
from k3.spec.draft import Draft, build_draft


@pytest.fixture(scope="module")
def config():
    return get_preset("debug")


def test_draft_names_round_trip(config):
    with torch.device("meta"):
        draft = Draft(config)
    L, E = config.num_hidden_layers, config.num_experts
    seen = set()
    for name, t in draft.state_dict(keep_vars=True).items():
        release = N.draft_to_release(name, config)
        assert all(r.startswith(f"language_model.model.layers.{L}.") for r in release)
        if N.is_expert_name(f"model.layers.{L}.{name}"):
            kind = name.rsplit(".", 1)[1]
            assert release == [f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{kind}.weight"
                               for e in range(E)]
            assert [N.draft_from_release(r, config).expert for r in release] == list(range(E))
        else:
            assert release == [f"language_model.model.layers.{L}.{name}"]
        assert {N.draft_from_release(r, config).k3_name for r in release} == {name}
        seen |= set(release)
    assert N.draft_to_release("fc.weight", config) == [f"language_model.model.layers.{L}.fc.weight"]
    assert N.draft_to_release("eh_proj.weight", config) == [f"language_model.model.layers.{L}.eh_proj.weight"]
    # beside the released tensors, never among them
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    assert not seen & set(N.release_layout(model, packed=False))
    with pytest.raises(ValueError, match="not in the draft layer"):
        N.draft_from_release(f"language_model.model.layers.{L - 1}.self_attn.o_proj.weight", config)
    with pytest.raises(ValueError, match="not in the draft layer"):
        N.draft_from_release("vision_tower.encoder.final_layernorm.weight", config)


def test_draft_release_save_load_round_trip(config, tmp_path):
    draft = build_draft(config, seed=3)
    with torch.no_grad():
        draft.block_sparse_moe.gate.e_score_correction_bias.normal_()
    info = {"feature_blocks": list(draft.feature_blocks), "layer_index": draft.layer_idx}
    path = save_draft_release(draft.state_dict(), config, tmp_path, info=info)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([N.DRAFT_CONFIG_FILE, N.DRAFT_FILE])
    state, loaded_info = load_draft_release(tmp_path, config)
    assert loaded_info == info and path.name == N.DRAFT_FILE
    assert set(state) == set(draft.state_dict())
    for name, t in draft.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            assert state[name].dtype == torch.float32 and torch.equal(state[name], t)
        else:
            assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], t.to(torch.bfloat16)), name
    again = build_draft(config, seed=4)
    again.load_state_dict(state)
    assert torch.equal(again.fc.weight, draft.fc.weight)  # [0 0 I] is exact in bf16
