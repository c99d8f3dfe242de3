"""The KDA layer's output stage against its formula (docs/architecture.md §2): y = o_proj(σ(g) ⊙ RMSNorm_head(o)),
the per-head RMSNorm with one gain shared by all heads, g the output-gate projection of x. The recurrence
itself is tested in tests/ops (against the fp64 naive recurrence); here it is replaced by a fixed o."""

import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model
from k3.model.sequence import SequenceLayout


@pytest.mark.parametrize("norm_impl", ["reference", "auto"])
def test_output_gate_and_per_head_norm_fp64(monkeypatch, norm_impl):
    config = get_preset("debug").replace(vision_config=None, norm_impl=norm_impl)
    model = build_model(config, seed=0, dtype=torch.float64)
    layer = next(layer.self_attn for layer in model.model.layers if layer.is_kda)
    H, K = layer.num_heads, layer.head_dim
    B, T = 2, 5
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, config.hidden_size, generator=g, dtype=torch.float64)
    o = torch.randn(B, T, H, K, generator=g, dtype=torch.float64) * 3
    with torch.no_grad():
        layer.o_norm.weight.copy_(1 + 0.3 * torch.randn(K, generator=g, dtype=torch.float64))
    monkeypatch.setattr(layer, "recurrence", lambda *args: (o, None))
    y, _ = layer(x, SequenceLayout(B, T))
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * layer.o_norm.weight
    gate = torch.sigmoid(x @ layer.g_proj.weight.t()).view(B, T, H, K)
    expected = (gate * normed).reshape(B, T, H * K) @ layer.o_proj.weight.t()
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_save_intermediates_is_a_validated_runtime_switch():
    config = get_preset("debug").replace(kda_save_intermediates=False)
    model = build_model(config.replace(vision_config=None), seed=0)
    assert all(layer.self_attn.save_intermediates is False for layer in model.model.layers if layer.is_kda)
    with pytest.raises(ValueError, match="kda_save_intermediates"):
        get_preset("debug").replace(kda_save_intermediates="yes")
