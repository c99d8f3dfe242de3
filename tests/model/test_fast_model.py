"""The whole model with the CPU-runnable fast paths against the reference paths, and activation
checkpointing per decoder layer (k3.model.checkpointing)."""

import pytest
import torch

from k3.config import get_preset
from k3.model.checkpointing import apply_activation_checkpointing
from k3.model.model import build_model

CONFIG = get_preset("debug")
CU = torch.tensor([0, 7, 16, 20, 32])  # 2 rows × 16 tokens, four documents


def fp64_model(config, seed=0):
    model = build_model(config, seed=seed, dtype=torch.float64)
    with torch.no_grad():  # non-trivial AttnRes queries, so every read is a real softmax
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def ids():
    return torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def run(model, checkpointed=False):
    out = model(ids(), cu_seqlens=CU, return_router_infos=True, return_mla_max_logits=True)
    out.logits.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def test_runtime_fields_default_auto_and_validate():
    assert (CONFIG.moe_impl, CONFIG.attention_backend, CONFIG.attn_res_impl, CONFIG.situ_impl,
            CONFIG.norm_impl) == ("auto",) * 5
    for field in ("moe_impl", "attention_backend", "attn_res_impl", "situ_impl", "norm_impl"):
        with pytest.raises(ValueError):
            CONFIG.replace(**{field: "fastest"})
    # runtime switches never reach config.json
    text = CONFIG.replace(moe_impl="grouped").to_config_json()["text_config"]
    assert "moe_impl" not in text and "attention_backend" not in text


def test_fast_paths_equal_reference_fp64():
    """Grouped MoE + SDPA attention (what runs on CPU) vs all references: logits and every gradient ≤ 1e-10."""
    ref = fp64_model(CONFIG.replace(moe_impl="reference", attention_backend="reference", attn_res_impl="direct"))
    fast = fp64_model(CONFIG.replace(moe_impl="grouped", attention_backend="sdpa", attn_res_impl="direct"))
    out_r, g_r = run(ref)
    out_f, g_f = run(fast)
    torch.testing.assert_close(out_f.logits, out_r.logits, atol=1e-10, rtol=0)
    torch.testing.assert_close(out_f.mla_max_logits, out_r.mla_max_logits, atol=1e-6, rtol=1e-6)
    assert g_f.keys() == g_r.keys()
    for name in g_r:
        torch.testing.assert_close(g_f[name], g_r[name], atol=1e-10, rtol=1e-8, msg=name)


def test_activation_checkpointing_changes_nothing():
    """Same logits, gradients, router statistics and max logits; reported once; names unchanged; idempotent."""
    config = CONFIG.replace(moe_impl="grouped")
    plain = fp64_model(config)
    ckpt = apply_activation_checkpointing(fp64_model(config))
    apply_activation_checkpointing(ckpt)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    out_p, g_p = run(plain)
    out_c, g_c = run(ckpt)
    assert torch.equal(out_c.logits, out_p.logits)
    assert len(out_c.router_infos) == len(out_p.router_infos) == config.num_hidden_layers - 1
    for a, b in zip(out_c.router_infos, out_p.router_infos):
        assert torch.equal(a.topk_idx, b.topk_idx) and torch.equal(a.scores, b.scores)
    assert torch.equal(out_c.mla_max_logits, out_p.mla_max_logits)
    assert g_c.keys() == g_p.keys()
    for name in g_p:
        torch.testing.assert_close(g_c[name], g_p[name], atol=1e-13, rtol=0, msg=name)
    # inference with a cache bypasses checkpointing and still decodes
    cache = ckpt.new_cache(1)
    with torch.no_grad():
        ckpt(ids()[:1, :5], cache=cache)
        ckpt(ids()[:1, 5:6], cache=cache)
    assert cache.lengths == [6]


def test_checkpointing_saves_less():
    """With checkpointing only the layer inputs stay saved between forward and backward."""
    def saved_bytes(model):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids(), cu_seqlens=CU)
        return total[0]

    config = CONFIG.replace(moe_impl="grouped")
    plain = build_model(config, seed=0)
    ckpt = apply_activation_checkpointing(build_model(config, seed=0))
    assert saved_bytes(ckpt) < 0.5 * saved_bytes(plain)


def test_kda_input_projections_equal_six_linears():
    """The KDA layer's one concatenated GEMM equals its six nn.Linear calls (fp64, outputs and gradients of
    x and of every weight ≤ 1e-12); the parameters stay separate, under their checkpoint names."""
    config = get_preset("debug")
    model = build_model(config, seed=0, dtype=torch.float64)
    kda = next(layer.self_attn for layer in model.model.layers if layer.is_kda)
    x = torch.randn(2, 5, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    linears = (kda.q_proj, kda.k_proj, kda.v_proj, kda.g_proj, kda.b_proj, kda.f_a_proj)
    leaves = [x] + [lin.weight for lin in linears]
    results = []
    for run in (lambda xx: kda.input_projections(xx), lambda xx: [lin(xx) for lin in linears]):
        xx = x.clone().requires_grad_()
        outs = run(xx)
        probe = torch.Generator().manual_seed(2)
        loss = sum((o * torch.randn(o.shape, generator=probe, dtype=o.dtype)).sum() for o in outs)
        grads = torch.autograd.grad(loss, [xx] + leaves[1:])
        results.append([*outs, *grads])
    for fused, separate in zip(*results):
        torch.testing.assert_close(fused, separate, rtol=0, atol=1e-12)
    widths = sum(lin.out_features for lin in linears)
    stride = results[0][0].stride(-2)
    assert widths % 16 and stride % 16 == 0 and stride - widths < 16, "rows padded to a multiple of 16 elements"
    names = {n for n, _ in kda.named_parameters()}
    assert {"q_proj.weight", "g_proj.weight", "b_proj.weight", "f_a_proj.weight"} <= names


@pytest.mark.parametrize("split_width", [None, 1, 9, 10 ** 6], ids=["autograd-cat", "all-wide", "mixed", "all-narrow"])
@pytest.mark.parametrize("used", [(0, 1, 2, 3, 4), (1, 3), (4,)], ids=["all", "some-wide", "one-narrow"])
def test_fused_linears_backward_forms(monkeypatch, split_width, used):
    """Every backward form of `fused_linears` (per-slice x-gradient GEMMs accumulated in place for slices at least
    SPLIT_BACKWARD_WIDTH wide, narrower ones concatenated; or autograd's concatenation) equals separate linears
    in fp64 (≤ 1e-12), also when only some outputs reach the loss (the others' gradients None: zero weight
    gradients, as autograd gives)."""
    from k3.model import projections

    monkeypatch.setattr(projections, "SPLIT_BACKWARD_WIDTH", split_width)
    g = torch.Generator().manual_seed(5)
    widths = (12, 16, 9, 3, 20)
    linears = tuple(torch.nn.Linear(7, w, bias=False, dtype=torch.float64) for w in widths)
    x = torch.randn(3, 4, 7, dtype=torch.float64, generator=g)
    probes = [torch.randn(3, 4, w, dtype=torch.float64, generator=g) for w in widths]
    results = []
    for run in (lambda xx: projections.fused_linears(xx, linears, row_multiple=16),
                lambda xx: [lin(xx) for lin in linears]):
        xx = x.clone().requires_grad_()
        outs = run(xx)
        assert [o.shape[-1] for o in outs] == list(widths)
        loss = sum((outs[i] * probes[i]).sum() for i in used)
        grads = torch.autograd.grad(loss, [xx] + [lin.weight for lin in linears], allow_unused=True)
        results.append([*outs, *(torch.zeros_like(lin.weight) if gr is None else gr
                                 for gr, lin in zip(grads[1:], linears)), grads[0]])
    for fused, separate in zip(*results):
        torch.testing.assert_close(fused, separate, rtol=0, atol=1e-12)


def test_kda_input_projections_under_autocast():
    """Under bf16 autocast the fused projections are the six autocast linears (weights cast one by one,
    never a full fp32 copy of the concatenation)."""
    config = get_preset("debug")
    model = build_model(config, seed=0)
    kda = next(layer.self_attn for layer in model.model.layers if layer.is_kda)
    x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(1))
    linears = (kda.q_proj, kda.k_proj, kda.v_proj, kda.g_proj, kda.b_proj, kda.f_a_proj)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = kda.input_projections(x)
        separate = [lin(x) for lin in linears]
    for a, b in zip(fused, separate):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def _stream_dtypes(model, **kwargs):
    """The dtypes of every layer's (sealed sources, partial sum) in one forward + backward."""
    seen = []

    def hook(module, args, output):
        sealed, partial = output
        seen.append({t.dtype for t in sealed} | {partial.dtype})

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    try:
        out = model(ids(), cu_seqlens=CU, labels=ids(), **kwargs)
        out.loss.backward()
    finally:
        for h in handles:
            h.remove()
    return seen, out.loss.detach()


@pytest.mark.parametrize("residual", ["activation", "float32"])
def test_residual_stream_dtype_under_autocast(residual):
    """Under bf16 autocast the block representations and partial sums are bf16 ("activation", the released
    code's choice, docs/architecture.md §4.3) or fp32 ("float32"); every parameter gradient stays fp32 and finite, and
    the two losses agree to bf16 precision. Without autocast the stream is the model's dtype, fp64 included."""
    config = CONFIG.replace(residual_dtype=residual)
    model = build_model(config, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen, loss = _stream_dtypes(model)
    want = torch.bfloat16 if residual == "activation" else torch.float32
    assert all(s == {want} for s in seen), seen
    assert all(p.grad is None or (p.grad.dtype == torch.float32 and p.grad.isfinite().all())
               for p in model.parameters())
    reference = build_model(CONFIG.replace(residual_dtype="float32"), seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss_ref = _stream_dtypes(reference)
    assert abs(loss.item() - loss_ref.item()) <= 1e-2 * abs(loss_ref.item())
    for dtype in (torch.float32, torch.float64):
        seen, _ = _stream_dtypes(build_model(config, seed=0, dtype=dtype))
        assert all(s == {dtype} for s in seen), (dtype, seen)


def test_situ_mlp_gate_and_up_as_one_gemm():
    """The SiTU MLP's gate and up projections from one GEMM equal the two linears (fp64, output and the
    gradients of x and every weight ≤ 1e-12), for the reference SiTU-GLU that reads the column slices."""
    from k3.model.moe import SiTUMLP
    from k3.ops.situ import naive_situ_glu

    mlp = SiTUMLP(24, 40, 4.0, 25.0, impl="reference").double()
    x = torch.randn(3, 7, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(3, 7, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    results = []
    for run in (mlp, lambda xx: mlp.down_proj(naive_situ_glu(mlp.gate_proj(xx), mlp.up_proj(xx), 4.0, 25.0))):
        xx = x.clone().requires_grad_()
        out = run(xx)
        results.append([out, *torch.autograd.grad(out, [xx, *params], dy)])
    for fused, separate in zip(*results):
        torch.testing.assert_close(fused, separate, rtol=0, atol=1e-12)
