"""QK-Clip (docs/optimizer.md): a toy debug model with one MLA head forced large; after the clip its
recomputed max logit is τ, only that head's q_b_proj rows and kv_b_proj K rows changed, V rows and the
shared k_pe rows are bitwise unchanged; a huge masked logit never counts as a head's max.

Legend: B batch, T tokens, H heads, N nope dim, R rope dim, Vd value dim, C kv_lora_rank.
"""

import copy

import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model
from k3.model.sequence import SequenceLayout
from k3.optim import qk_clip_, qk_clip_stats

CONFIG = get_preset("debug")
H, N, R, VD, C = (CONFIG.num_attention_heads, CONFIG.qk_nope_head_dim, CONFIG.qk_rope_head_dim,
                  CONFIG.v_head_dim, CONFIG.kv_lora_rank)
LAYER, HEAD = CONFIG.mla_layer_ids[0], 1  # the head we force large: MLA slot 0, head 1


def max_logits(model, ids):
    return model(ids, return_mla_max_logits=True).mla_max_logits  # [n_mla, H] fp32


def toy():
    """Debug model whose MLA head (LAYER, HEAD) has logits ~1e2: its q and K rows are scaled by 60."""
    model = build_model(CONFIG)
    attn = model.model.layers[LAYER].self_attn
    with torch.no_grad():
        attn.q_b_proj.weight.view(H, N + R, -1)[HEAD].mul_(60.0)
        attn.kv_b_proj.weight.view(H, N + VD, -1)[HEAD, :N].mul_(60.0)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, ids


def test_clip_brings_the_offending_head_to_tau_and_touches_nothing_else():
    model, ids = toy()
    S = max_logits(model, ids)
    assert S.shape == (len(CONFIG.mla_layer_ids), H)
    tau = 0.5 * S[0, HEAD].item()
    others = S.clone()
    others[0, HEAD] = float("-inf")
    assert others.max() < tau  # exactly one offending head
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    twin = copy.deepcopy(model)  # the same clip from stats read back beforehand (as train_step does)
    out = qk_clip_(model, S, tau)
    assert out == {"clipped_heads": 1, "max_logit": pytest.approx(S.max().item())}
    assert qk_clip_(twin, S, tau, stats=qk_clip_stats(S, tau).tolist()) == out
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    after = max_logits(model, ids)
    assert after[0, HEAD] <= tau * (1 + 1e-6)
    assert after[0, HEAD] >= tau * (1 - 1e-5)  # scaled to τ, not below: every logit of the head × γ
    # heads of the same layer read the same (unchanged) input: their logits are unchanged
    torch.testing.assert_close(after[0, :HEAD], S[0, :HEAD], rtol=1e-6, atol=0)

    gamma = tau / S[0, HEAD].double()
    prefix = f"model.layers.{LAYER}.self_attn."
    for name, p in model.named_parameters():
        if name not in (prefix + "q_b_proj.weight", prefix + "kv_b_proj.weight"):
            assert torch.equal(p, before[name]), name  # k_pe rows of kv_a_proj_with_mqa included
    wq, wq0 = (w.view(H, N + R, -1) for w in (model.get_parameter(prefix + "q_b_proj.weight"),
                                              before[prefix + "q_b_proj.weight"]))
    wkv, wkv0 = (w.view(H, N + VD, -1) for w in (model.get_parameter(prefix + "kv_b_proj.weight"),
                                                 before[prefix + "kv_b_proj.weight"]))
    for h in range(H):
        if h != HEAD:
            assert torch.equal(wq[h], wq0[h]) and torch.equal(wkv[h], wkv0[h])
    assert torch.equal(wkv[HEAD, N:], wkv0[HEAD, N:])  # V rows
    torch.testing.assert_close(wq[HEAD, :N], (wq0[HEAD, :N] * gamma.sqrt()).float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(wq[HEAD, N:], (wq0[HEAD, N:] * gamma).float(), rtol=1e-6, atol=0)  # "rope"
    torch.testing.assert_close(wkv[HEAD, :N], (wkv0[HEAD, :N] * gamma.sqrt()).float(), rtol=1e-6, atol=0)


def test_no_head_above_tau_changes_nothing():
    model, ids = toy()
    S = max_logits(model, ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = qk_clip_(model, S, tau=2 * S.max().item())
    assert out["clipped_heads"] == 0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


@torch.no_grad()
def test_a_huge_masked_logit_never_counts():
    """The model's per-head max runs over unmasked pairs only. The last token gets a huge k_pe (k_pe is
    linear in x, q is not: RMSNorm); its future-masked logits with earlier queries reach a few hundred, its one
    unmasked logit (with itself) is negative by construction, so the true max stays ordinary."""
    model = build_model(CONFIG, dtype=torch.float64)
    attn = model.model.layers[LAYER].self_attn
    g = torch.Generator().manual_seed(0)
    T, scale = 16, 1e4

    def q_pe_and_k_pe(x):  # [.., D] -> q_pe [.., H, R], k_pe [.., R]
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(*x.shape[:-1], H, N + R)
        return q[..., N:], attn.kv_a_proj_with_mqa(x)[..., C:]

    for _ in range(100):  # a direction whose rope self-logit is negative in every head
        u = torch.randn(CONFIG.hidden_size, generator=g, dtype=torch.float64)
        q_pe, k_pe = q_pe_and_k_pe(u)
        if (q_pe @ k_pe < 0).all():
            break
    else:
        raise AssertionError("no direction found")
    x = torch.randn(1, T, CONFIG.hidden_size, generator=g, dtype=torch.float64)
    x[0, -1] = scale * u
    logged = []
    attn(x, SequenceLayout(1, T), max_logits=logged)

    # all pairs, masked or not, from the weights
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, T, H, N + R)
    latent = attn.latent(x)  # [1, T, C + R]: normed c, raw k_pe
    kv = attn.kv_b_proj(latent[..., :C]).view(1, T, H, N + VD)
    k = torch.cat([kv[..., :N], latent[..., None, C:].expand(1, T, H, R)], dim=-1)
    scores = torch.einsum("bthd,bshd->hts", q, k) * (N + R) ** -0.5  # [H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    masked_max = scores.masked_fill(~causal, float("-inf")).amax(dim=(1, 2))
    future_max = scores.masked_fill(causal, float("-inf")).amax(dim=(1, 2))
    torch.testing.assert_close(logged[0].double(), masked_max, rtol=1e-6, atol=1e-6)
    assert (future_max > 1e2).any() and (masked_max < 1).all(), (future_max, masked_max)


def test_bad_input_raises():
    model, ids = toy()
    S = max_logits(model, ids)
    with pytest.raises(ValueError, match="MLA layers"):
        qk_clip_(model, S[:, :1], 1.0)
    with pytest.raises(ValueError, match="NaN"):
        qk_clip_(model, torch.full_like(S, float("nan")), 1.0)
    with pytest.raises(ValueError, match="tau"):
        qk_clip_(model, S, 0.0)
