"""The k3 <-> release name table: covers the full K3 listing of docs/architecture.md §9.2 (meta device), both ways."""

import pytest
import torch

from k3.config import get_preset
from k3.convert import names as N
from k3.model.model import K3ForCausalLM


def spec_release_names(config) -> set[str]:
    """The release listing generated from §9.2's rules alone (text stack under `language_model.`)."""
    lm = "language_model.model"
    out = {f"{lm}.embed_tokens.weight", f"{lm}.norm.weight", f"{lm}.output_attn_res_norm.weight",
           f"{lm}.output_attn_res_proj.weight", "language_model.lm_head.weight"}
    for layer in range(config.num_hidden_layers):
        L = f"{lm}.layers.{layer}"
        out |= {f"{L}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                                             "mlp_res_norm", "self_attention_res_proj", "mlp_res_proj",
                                             "self_attn.g_proj", "self_attn.o_proj")}
        if (layer + 1) % 4 and layer + 1 != config.num_hidden_layers:  # KDA
            out |= {f"{L}.self_attn.{n}" for n in (
                "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "dt_bias", "A_log",
                "o_norm.weight")}
        else:  # Gated MLA
            out |= {f"{L}.self_attn.{n}.weight" for n in (
                "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")}
        if layer == 0:
            out |= {f"{L}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
            continue
        m = f"{L}.block_sparse_moe"
        out |= {f"{m}.gate.weight", f"{m}.gate.e_score_correction_bias", f"{m}.routed_expert_down_proj.weight",
                f"{m}.routed_expert_up_proj.weight", f"{m}.routed_expert_norm.weight"}
        out |= {f"{m}.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
        out |= {f"{m}.experts.{e}.{w}.{f}" for e in range(config.num_experts) for w in ("w1", "w2", "w3")
                for f in ("weight_packed", "weight_scale")}
    return out


def spec_vision_names(layers: int) -> set[str]:
    out = {"mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.post_norm.weight",
           "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
           "vision_tower.encoder.final_layernorm.weight"}
    for b in range(layers):
        out |= {f"vision_tower.encoder.blocks.{b}.{n}.weight" for n in ("wqkv", "wo", "mlp.fc0", "mlp.fc1", "norm0",
                                                                         "norm1")}
    return out


@pytest.fixture(scope="module")
def k3_meta():
    with torch.device("meta"):
        return K3ForCausalLM(get_preset("k3"))


def test_full_k3_listing(k3_meta):
    config = k3_meta.config
    # §9.2's count: 69 KDA × 12 + 93 × 8 + 3 (dense) + 92 × 8 (MoE fixed) + 24 × 6 (MLA) + 5 + 3 (projector)
    # + 165 (vision tower) + 92 × 896 × 6 (experts)
    assert 69 * 12 + 93 * 8 + 3 + 92 * 8 + 24 * 6 + 5 + 3 + 165 + 92 * 896 * 6 == 497_220
    text_count = 497_220 - 3 - 165  # the projector's 3 tensors are not text either
    assert text_count == 497_052

    mapped = [r for name in k3_meta.state_dict() for r in N.to_release(name, config.num_experts, packed=True)]
    assert len(mapped) == len(set(mapped)) == text_count
    assert set(mapped) == spec_release_names(config)

    vision = N.vision_layout(config.vision_config)
    assert set(vision) == spec_vision_names(27) and len(vision) == 168

    layout = N.release_layout(k3_meta, packed=True)
    assert len(layout) == 497_220 and set(layout) == set(mapped) | set(vision)
    # shapes and dtypes of §9.2 (K3 size)
    L = "language_model.model.layers"
    expect = {
        "language_model.model.embed_tokens.weight": ((163840, 7168), torch.bfloat16),
        f"{L}.0.self_attention_res_proj.weight": ((1, 7168), torch.bfloat16),
        f"{L}.0.self_attn.q_proj.weight": ((12288, 7168), torch.bfloat16),
        f"{L}.0.self_attn.q_conv1d.weight": ((12288, 1, 4), torch.float32),
        f"{L}.0.self_attn.f_a_proj.weight": ((128, 7168), torch.bfloat16),
        f"{L}.0.self_attn.f_b_proj.weight": ((12288, 128), torch.bfloat16),
        f"{L}.0.self_attn.b_proj.weight": ((96, 7168), torch.bfloat16),
        f"{L}.0.self_attn.dt_bias": ((12288,), torch.float32),
        f"{L}.0.self_attn.A_log": ((128,), torch.float32),
        f"{L}.0.self_attn.o_norm.weight": ((128,), torch.float32),
        f"{L}.0.mlp.down_proj.weight": ((7168, 33792), torch.bfloat16),
        f"{L}.3.self_attn.q_b_proj.weight": ((18432, 1536), torch.bfloat16),
        f"{L}.3.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), torch.bfloat16),
        f"{L}.3.self_attn.kv_b_proj.weight": ((24576, 512), torch.bfloat16),
        f"{L}.92.self_attn.g_proj.weight": ((12288, 7168), torch.bfloat16),
        f"{L}.1.block_sparse_moe.gate.weight": ((896, 7168), torch.bfloat16),
        f"{L}.1.block_sparse_moe.gate.e_score_correction_bias": ((896,), torch.float32),
        f"{L}.1.block_sparse_moe.routed_expert_down_proj.weight": ((3584, 7168), torch.bfloat16),
        f"{L}.1.block_sparse_moe.routed_expert_norm.weight": ((3584,), torch.bfloat16),
        f"{L}.1.block_sparse_moe.shared_experts.down_proj.weight": ((7168, 6144), torch.bfloat16),
        f"{L}.92.block_sparse_moe.experts.895.w1.weight_packed": ((3072, 1792), torch.uint8),
        f"{L}.92.block_sparse_moe.experts.895.w3.weight_scale": ((3072, 112), torch.uint8),
        f"{L}.5.block_sparse_moe.experts.0.w2.weight_packed": ((3584, 1536), torch.uint8),
        f"{L}.5.block_sparse_moe.experts.0.w2.weight_scale": ((3584, 96), torch.uint8),
        "language_model.lm_head.weight": ((163840, 7168), torch.bfloat16),
        "mm_projector.proj.0.weight": ((4096, 4096), torch.bfloat16),
        "mm_projector.proj.2.weight": ((7168, 4096), torch.bfloat16),
        "vision_tower.patch_embed.proj.weight": ((1024, 3, 14, 14), torch.bfloat16),
        "vision_tower.patch_embed.pos_emb.weight": ((64, 64, 1024), torch.bfloat16),
        "vision_tower.encoder.blocks.26.wqkv.weight": ((4608, 1024), torch.bfloat16),
        "vision_tower.encoder.blocks.0.wo.weight": ((1024, 1536), torch.bfloat16),
    }
    for name, (shape, dtype) in expect.items():
        assert layout[name] == N.TensorSpec(shape, dtype), name
    # one expert in MXFP4: 3 × (5,505,024 packed + 344,064 scale) = 17,547,264 B (§8.2)
    e0 = [n for n in layout if ".layers.1.block_sparse_moe.experts.0." in n]
    assert sum(layout[n].shape[0] * layout[n].shape[1] for n in e0) == 17_547_264
    # parameters: the release listing = k3's count + 69 × 32 zero pads of A_log, + vision 401.2M / 46.1M
    text_release = sum(torch.Size(s.shape).numel() for n, s in layout.items() if not N.is_vision_name(n))
    assert text_release < sum(p.numel() for p in k3_meta.parameters())  # packed experts are smaller
    tower = sum(torch.Size(s.shape).numel() for n, s in vision.items() if n.startswith("vision_tower."))
    projector = sum(torch.Size(s.shape).numel() for n, s in vision.items() if n.startswith("mm_projector."))
    assert (tower, projector) == (401_214_464, 46_144_512)


def test_unpacked_listing_and_a_log_padding(k3_meta):
    layout = N.release_layout(k3_meta, packed=False, vision=False)
    assert len(layout) == 497_052 - 92 * 896 * 3
    assert layout["language_model.model.layers.7.block_sparse_moe.experts.3.w2.weight"] == \
        N.TensorSpec((3584, 3072), torch.bfloat16)
    k3_params = sum(p.numel() for n, p in k3_meta.named_parameters())
    release_params = sum(torch.Size(s.shape).numel() for n, s in layout.items()
                         if not n.endswith("e_score_correction_bias"))
    assert release_params - k3_params == 69 * 32  # A_log: 96 heads padded to head_dim 128


def test_both_directions_on_debug():
    with torch.device("meta"):
        model = K3ForCausalLM(get_preset("debug"))
    E = model.config.num_experts
    seen = set()
    for name in model.state_dict():
        for packed in (False, True):
            release = N.to_release(name, E, packed)
            for r in release:
                where = N.from_release(r)
                assert where.k3_name == name
                if N.is_expert_name(name):
                    assert where.field in (("weight_packed", "weight_scale") if packed else ("weight",))
                    seen.add((name, where.expert))
                else:
                    assert where.expert is None and r == "language_model." + name
    assert len({e for _, e in seen}) == E
    assert N.from_release("vision_tower.encoder.blocks.0.wo.weight") is None
    assert N.from_release("mm_projector.proj.0.weight") is None
    with pytest.raises(ValueError, match="neither under"):
        N.from_release("model.embed_tokens.weight")


def test_release_dtypes_follow_the_model():
    """fp32 in the release = exactly the tensors the model pins to fp32 (§9.4's list)."""
    with torch.device("meta"):
        model = K3ForCausalLM(get_preset("debug"))
    layout = N.release_layout(model, packed=True, vision=False)
    fp32 = {n.removeprefix("language_model.") for n, s in layout.items() if s.dtype == torch.float32}
    suffixes = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias", "A_log", "o_norm.weight",
                "gate.e_score_correction_bias")
    assert fp32 == {n for n in model.state_dict() if n.endswith(suffixes)}
    assert N.MXFP4_QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert N.MXFP4_QUANTIZATION_CONFIG["ignore"][2] == "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"
