"""The tower, merge and projector against explicit formulas (docs/architecture.md §7.3–7.4)."""

import math

import pytest
import torch
import torch.nn.functional as F

from k3.config import VisionConfig, get_preset
from k3.vision.attention import naive_varlen_attention, varlen_attention
from k3.vision.projector import PatchMergerV2, sd2_tpool
from k3.vision.tower import MoonViT, apply_rope_2d, check_vision_config, rope_2d_angles, sincos_time_table


def small_config(**changes) -> VisionConfig:
    vc = get_preset("debug").vision_config  # D 64, 2 blocks, 2 heads × 48, 8 × 8 grid
    for k, v in changes.items():
        setattr(vc, k, v)
    return vc


def tower(seed=0, dtype=torch.float64, **changes) -> MoonViT:
    torch.manual_seed(seed)
    model = MoonViT(small_config(**changes), attention_backend="reference")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for blk in model.encoder.blocks:
            blk.norm0.weight.uniform_(0.5, 1.5)
    return model.to(dtype)


def test_position_grid_bilinear_by_hand():
    model = tower()
    pos = model.patch_embed.pos_emb
    with torch.no_grad():
        pos.weight.zero_()
        pos.weight[:2, :2, 0] = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=pos.weight.dtype)
    # the 8 × 8 grid at its own size is used as stored, row-major
    assert torch.equal(pos.grid(8, 8), pos.weight.flatten(0, 1))
    # 8 → 4 per side with align_corners False samples at 2i + 0.5: the mean of each 2 × 2 block
    g = pos.grid(4, 4)[:, 0].view(4, 4)
    assert torch.allclose(g[0, 0], torch.tensor(11.0 / 4, dtype=g.dtype))
    assert torch.allclose(g[1:, 1:], torch.zeros(3, 3, dtype=g.dtype))
    # an upsampled side: 8 → 16 samples at (i + 0.5)/2 − 0.5, i.e. −0.25 (clamped to 0), 0.25, 0.75, 1.25, …
    row = pos.grid(1, 16)[:, 0]  # h 8 → 1 samples row 3.5: the mean of rows 3 and 4 (zero here)
    assert torch.allclose(row, torch.zeros(16, dtype=row.dtype))
    col = pos.grid(16, 8)[:, 0].view(16, 8)[:, 0]  # column 0 of the table: 1, 3, 0, … upsampled
    # 1, .75·1 + .25·3, .25·1 + .75·3, .75·3, .25·3, 0
    want = torch.tensor([1.0, 1.5, 2.5, 2.25, 0.75, 0.0], dtype=col.dtype)
    assert torch.allclose(col[:6], want)


def test_time_table_by_hand():
    table = sincos_time_table(3, 8)
    omega = [10000 ** (-2 * i / 8) for i in range(4)]
    for t in range(3):
        want = [math.sin(t * w) for w in omega] + [math.cos(t * w) for w in omega]
        assert torch.allclose(table[t], torch.tensor(want, dtype=torch.float64))


def test_rope_2d_is_the_explicit_complex_rotation():
    torch.manual_seed(0)
    grid = [(1, 3, 5), (2, 2, 4)]
    K = 48
    angles = rope_2d_angles(grid, K)
    x = torch.randn(angles.shape[0], 3, K, dtype=torch.float64)
    # explicit: pair j as a complex number, pair 2i turned by column·θ^(−4i/K), pair 2i+1 by row·θ^(−4i/K)
    want = []
    for t, h, w in grid:
        for _ in range(t):
            for r in range(h):
                for c in range(w):
                    theta = torch.tensor([(c if j % 2 == 0 else r) * 10000 ** (-4 * (j // 2) / K)
                                          for j in range(K // 2)], dtype=torch.float64)
                    want.append(torch.polar(torch.ones_like(theta), theta))
    rot = torch.stack(want)[:, None]  # [N, 1, K/2]
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)
    got = apply_rope_2d(x, angles.cos(), angles.sin())
    assert torch.allclose(got, expected, atol=1e-12)
    # a rotation: norms are kept, and q·k depends on the offset between patches only
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1))


def reference_tower(model: MoonViT, pixel_values, t, h, w):
    """One item through the tower written out from the documented math: all t·h·w patches attend to each other."""
    vc = model.config
    D, H = vc.vt_hidden_size, vc.vt_num_attention_heads
    K = vc.qkv_hidden_size // H
    x = F.conv2d(pixel_values, model.patch_embed.proj.weight, stride=vc.patch_size).flatten(1)  # [N, D]
    table = model.patch_embed.pos_emb.weight.permute(2, 0, 1)[None]
    grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False)[0].permute(1, 2, 0).reshape(h * w, D)
    time = torch.tensor([[math.sin(f * 10000 ** (-2 * i / D)) for i in range(D // 2)] +
                         [math.cos(f * 10000 ** (-2 * i / D)) for i in range(D // 2)] for f in range(t)],
                        dtype=x.dtype)
    x = x + (grid[None] + (time[:, None] if t > 1 else 0)).reshape(t * h * w, D)
    rows = torch.arange(h).repeat_interleave(w).repeat(t)
    cols = torch.arange(w).repeat(h).repeat(t)
    freqs = torch.tensor([10000 ** (-4 * i / K) for i in range(K // 4)], dtype=torch.float64)
    theta = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], -1).flatten(1)  # [N, K/2]
    rot = torch.polar(torch.ones_like(theta), theta)[:, None]

    def rope(z):
        return torch.view_as_real(torch.view_as_complex(z.unflatten(-1, (-1, 2)).contiguous()) * rot).flatten(-2)

    def rms(z, wt):
        return wt * z / torch.sqrt((z * z).mean(-1, keepdim=True) + torch.finfo(z.dtype).eps)

    for blk in model.encoder.blocks:
        q, k, v = (blk.wqkv.weight @ rms(x, blk.norm0.weight).T).T.view(-1, 3, H, K).unbind(1)
        q, k = rope(q), rope(k)
        p = torch.softmax(torch.einsum("thd,shd->hts", q, k) / math.sqrt(K), dim=-1)
        x = x + torch.einsum("hts,shd->thd", p, v).reshape(-1, H * K) @ blk.wo.weight.T
        y = rms(x, blk.norm1.weight) @ blk.mlp.fc0.weight.T
        x = x + F.gelu(y, approximate="tanh") @ blk.mlp.fc1.weight.T
    return rms(x, model.encoder.final_layernorm.weight)


def test_video_t2_equals_the_documented_joint_attention():
    model = tower()
    t, h, w = 2, 4, 6
    pixels = torch.randn(t * h * w, 3, 14, 14, dtype=torch.float64)
    out = model(pixels, torch.tensor([[t, h, w]]))
    want = reference_tower(model, pixels, t, h, w)
    assert torch.allclose(out, want, atol=1e-10)
    # the merge averages the two frames' tokens: equal to pooling the reference by hand
    merged = sd2_tpool(out, [(t, h, w)])
    by_hand = want.view(t, h // 2, 2, w // 2, 2, -1).mean(0).permute(0, 2, 1, 3, 4).reshape(h * w // 4, -1)
    assert torch.allclose(merged, by_hand, atol=1e-12)
    # frames attend to each other: changing frame 1 changes frame 0's output
    other = pixels.clone()
    other[h * w:] += 1
    assert not torch.allclose(model(other, [(t, h, w)])[: h * w], out[: h * w])
    # an image (t = 1) gets no time term: it equals the reference without one
    assert torch.allclose(model(pixels[: h * w], [(1, h, w)]), reference_tower(model, pixels[: h * w], 1, h, w),
                          atol=1e-10)
    # the grid at its stored size (8 × 8) is used without interpolation
    full = torch.randn(64, 3, 14, 14, dtype=torch.float64)
    assert torch.allclose(model(full, [(1, 8, 8)]), reference_tower(model, full, 1, 8, 8), atol=1e-10)


def test_packed_batch_equals_items_alone():
    model = tower()
    grid = [(1, 4, 6), (1, 2, 2), (2, 2, 4), (1, 6, 2), (1, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), 3, 14, 14, dtype=torch.float64)
    packed = model(pixels, torch.tensor(grid))
    start, alone = 0, []
    for t, h, w in grid:
        alone.append(model(pixels[start:start + t * h * w], [(t, h, w)]))
        start += t * h * w
    assert torch.allclose(packed, torch.cat(alone), atol=1e-12)
    model.attention_backend = "sdpa"  # the GPU path (one SDPA call per item length) computes the same
    assert torch.allclose(model(pixels, grid), packed, atol=1e-12)


def test_sdpa_matches_the_reference_with_gradients():
    torch.manual_seed(1)
    cu = [0, 24, 28, 44, 68]
    q, k, v = (torch.randn(68, 3, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = naive_varlen_attention(q, k, v, cu, 0.25)
    grads_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    fast = varlen_attention(q, k, v, cu, 0.25, "sdpa")
    grads = torch.autograd.grad(fast.square().sum(), (q, k, v))
    assert torch.allclose(fast, ref, atol=1e-12)
    for a, b in zip(grads, grads_ref):
        assert torch.allclose(a, b, atol=1e-10)
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        varlen_attention(q, k, v, [0, 30, 20, 68], 0.25)


def test_patch_embed_is_the_convolution():
    model = tower()
    pixels = torch.randn(5, 3, 14, 14, dtype=torch.float64)
    embed = model.patch_embed
    got = embed(pixels, [(1, 1, 5)]) - embed.pos_emb([(1, 1, 5)])
    assert torch.allclose(got, embed.proj(pixels).flatten(1), atol=1e-12)


def test_sd2_tpool_order():
    D = 3
    t, h, w = 1, 4, 6
    # token (r, c) carries value 100·r + c in every channel; channel c' adds c'/10
    x = torch.tensor([[100 * r + c + ch / 10 for ch in range(D)] for r in range(h) for c in range(w)])
    merged = sd2_tpool(x, [(t, h, w)])
    assert merged.shape == ((h // 2) * (w // 2), 4 * D)
    for i in range(h // 2):
        for j in range(w // 2):
            row = merged[i * (w // 2) + j]  # merged tokens row-major
            for dy in range(2):
                for dx in range(2):
                    for ch in range(D):
                        assert row[(2 * dy + dx) * D + ch] == 100 * (2 * i + dy) + (2 * j + dx) + ch / 10
    two = sd2_tpool(torch.cat([x, x + 1000]), [(2, h, w)])  # the frames' mean
    assert torch.allclose(two, merged + 500)
    with pytest.raises(ValueError, match="odd side"):
        sd2_tpool(x[:15], [(1, 3, 5)])


def test_projector_by_hand():
    vc = small_config()
    proj = PatchMergerV2(vc).double()
    torch.manual_seed(0)
    for p in proj.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    merged = torch.randn(7, 4 * vc.vt_hidden_size, dtype=torch.float64)
    h = F.gelu(merged @ proj.proj[0].weight.T) @ proj.proj[2].weight.T  # exact GELU, no pre-norm
    want = proj.post_norm.weight * h / torch.sqrt(h.square().mean(-1, keepdim=True) + vc.projector_ln_eps)
    assert torch.allclose(proj(merged), want, atol=1e-12)


def test_norm_eps_is_the_dtype_epsilon():
    model = tower(dtype=torch.float32)
    norm = model.encoder.final_layernorm
    x = torch.full((1, 64), 1e-4)
    want = x / torch.sqrt(x.square().mean() + torch.finfo(torch.float32).eps) * norm.weight
    assert torch.allclose(norm(x), want)
    xb = x.bfloat16()
    wantb = (x / torch.sqrt(x.square().mean() + 2 ** -7) * norm.weight).bfloat16()
    assert torch.allclose(norm.bfloat16()(xb).float(), wantb.float(), rtol=1e-2)


def test_config_checks_and_input_errors():
    with pytest.raises(ValueError, match="width divisible by 4"):
        check_vision_config(small_config(qkv_hidden_size=90))
    with pytest.raises(ValueError, match="merge_type 'other'"):
        check_vision_config(small_config(merge_type="other"))
    with pytest.raises(ValueError, match="biases are not supported"):
        check_vision_config(small_config(attn_bias=True))
    model = tower()
    with pytest.raises(ValueError, match="does not describe the 8 patches"):
        model(torch.randn(8, 3, 14, 14, dtype=torch.float64), [(1, 2, 2)])
    with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3, 14, 14\]"):
        model(torch.randn(4, 3, 16, 16, dtype=torch.float64), [(1, 2, 2)])
    with pytest.raises(ValueError, match="time table holds 4"):
        model(torch.randn(20, 3, 14, 14, dtype=torch.float64), [(5, 2, 2)])


def test_norm_eps_field_round_trips_only_when_set(tmp_path):
    from k3.config import ModelConfig

    cfg = get_preset("debug")
    assert "norm_eps" not in cfg.to_config_json()["vision_config"]  # the release's config.json has no such key
    cfg.vision_config.norm_eps = 1e-6
    cfg.save(tmp_path)
    assert ModelConfig.load(tmp_path).vision_config.norm_eps == 1e-6
    assert MoonViT(cfg.vision_config).encoder.final_layernorm.eps == 1e-6
