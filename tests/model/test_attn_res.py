"""Block Attention Residuals (docs/architecture.md §4, tests §4.5): the read operator, its two-phase form, and
the model-level wiring (direct vs two-phase, block size 1, K3's 93/12 layout, gradients of all queries).

Legend: n sources, J queries, B batch, T tokens, D model width, L layers, S block size.
"""

import pytest
import torch

import k3.model.attn_res as attn_res_module
import k3.model.model as model_module
from k3.config import LinearAttnConfig, get_preset, hybrid_layer_schedule
from k3.model.attn_res import attn_res_merge, attn_res_phase1, attn_res_read, pseudo_query
from k3.model.model import build_model
from k3.model.sequence import SequenceLayout

EPS = 1e-5
D = 32


def sources_of(n: int, seed: int, dtype=torch.float64, B: int = 2, T: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # different scales per source: values are not normalised, keys are
    return [torch.randn(B, T, D, generator=g, dtype=dtype) * (0.5 + i) for i in range(n)]


def query(seed: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(D, generator=g, dtype=dtype) * scale


def ar_fp64(w: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
    """§4.1 transcribed in fp64, one source at a time: keys RMS-normalised (no gain), values raw."""
    w = w.double()
    logits = []
    for v in sources:
        v = v.double()
        k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
        logits.append((k * w).sum(-1))  # [B, T]
    m = torch.stack(logits).amax(0)
    weights = [torch.exp(s - m) for s in logits]
    total = sum(weights)
    return sum((a / total)[..., None] * v.double() for a, v in zip(weights, sources))


# ---- the read operator -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 5, 9])
def test_read_matches_fp64_transcription(n):
    srcs = sources_of(n, seed=n)
    w = query(seed=100 + n, scale=2.0)
    # fp64: ≤ 1e-12
    torch.testing.assert_close(attn_res_read(w, srcs), ar_fp64(w, srcs), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("n", [2, 5])
def test_read_fp32_and_bf16(n):
    srcs64 = sources_of(n, seed=10 + n)
    w = query(seed=20 + n, scale=2.0)
    srcs32 = [s.float() for s in srcs64]
    out32 = attn_res_read(w.float(), srcs32)
    assert out32.dtype == torch.float32
    # fp32 compute on fp32 inputs: ≤ 1e-5
    torch.testing.assert_close(out32.double(), ar_fp64(w.float(), srcs32), atol=1e-5, rtol=1e-5)
    srcs16 = [s.bfloat16() for s in srcs64]
    out16 = attn_res_read(w.float(), srcs16)
    assert out16.dtype == torch.bfloat16
    # computed in fp32 and cast once: within one bf16 rounding (2^-8 relative) of the fp64 read
    ref16 = ar_fp64(w.float(), srcs16)
    torch.testing.assert_close(out16.double(), ref16, atol=1e-2, rtol=2 ** -8)


def test_pseudo_query_is_gain_times_projection():
    g = torch.Generator().manual_seed(0)
    norm_w = torch.randn(D, generator=g)
    proj_w = torch.randn(1, D, generator=g)
    w = pseudo_query(norm_w, proj_w)
    assert w.shape == (D,) and w.dtype == torch.float32
    assert torch.equal(w, norm_w * proj_w[0])
    assert pseudo_query(norm_w.bfloat16(), proj_w.bfloat16()).dtype == torch.float32
    assert pseudo_query(norm_w.double(), proj_w.double()).dtype == torch.float64


@pytest.mark.parametrize("n", [2, 4])
def test_zero_query_gives_exact_mean_power_of_two(n):
    srcs = sources_of(n, seed=30 + n)
    out = attn_res_read(torch.zeros(D, dtype=torch.float64), srcs)
    # softmax of equal logits is exactly 1/n (a power of two here), so the mean is exact
    assert torch.equal(out, torch.stack(srcs).sum(0) / n)


@pytest.mark.parametrize("n", [3, 5, 7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_query_gives_mean(n, dtype):
    srcs = sources_of(n, seed=40 + n, dtype=dtype)
    out = attn_res_read(torch.zeros(D, dtype=dtype), srcs)
    mean = torch.stack([s.double() for s in srcs]).mean(0)
    # 1/n is rounded once: a few ulps (fp64 ≤ 1e-15, fp32 ≤ 1e-6 relative)
    tol = 1e-15 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(out.double(), mean, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_one_source_returned_unchanged(dtype):
    (src,) = sources_of(1, seed=50, dtype=dtype)
    out = attn_res_read(query(seed=51, scale=100.0, dtype=torch.float32), [src])
    assert torch.equal(out, src) and out.dtype == dtype


# ---- two-phase ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n_sealed", [1, 2, 4])
def test_two_phase_equals_direct(n_sealed):
    sealed = sources_of(n_sealed, seed=60 + n_sealed)
    J = 5
    queries = torch.stack([query(seed=70 + j, scale=3.0) for j in range(J)])  # [J, D]
    o1, m1, l1 = attn_res_phase1(queries, sealed)
    assert o1.shape == (J, 2, 3, D) and m1.shape == (J, 2, 3) and l1.shape == (J, 2, 3)
    for j in range(J):
        # phase 1 alone is the read over the sealed sources
        torch.testing.assert_close(o1[j], ar_fp64(queries[j], sealed), atol=1e-12, rtol=1e-12)
        for seed in range(3):
            # several partials per query, including one that dominates (large scale) and a tiny one
            partial = sources_of(1, seed=80 + 10 * j + seed)[0] * [1.0, 50.0, 1e-3][seed]
            merged = attn_res_merge(o1[j], m1[j], l1[j], queries[j], partial)
            direct = attn_res_read(queries[j], sealed + [partial])
            # fp64: ≤ 1e-12
            torch.testing.assert_close(merged, direct, atol=1e-12, rtol=1e-12)


def test_two_phase_extreme_logits_fp32():
    """Online-softmax merge stays finite and exact where a naive exp would overflow (|s| ~ 1e3)."""
    sealed = [s.float() for s in sources_of(3, seed=90)]
    partial = sources_of(1, seed=91)[0].float()
    w = query(seed=92, scale=300.0).float()
    o1, m1, l1 = attn_res_phase1(w[None], sealed)
    merged = attn_res_merge(o1[0], m1[0], l1[0], w, partial)
    assert torch.isfinite(merged).all()
    # fp32 both ways: ≤ 1e-5
    torch.testing.assert_close(merged, attn_res_read(w, sealed + [partial]), atol=1e-5, rtol=1e-5)


# ---- model-level wiring ------------------------------------------------------------------------

def randomize_res_proj(model, seed: int) -> None:
    """Every *_res_proj.weight ← N(0, 1) so reads are far from uniform (they are 0 at init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def ids_of(B: int, T: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def fp64_model(config, seed=0, res_seed=1):
    model = build_model(config, seed=seed, dtype=torch.float64)
    randomize_res_proj(model, res_seed)
    return model


@pytest.mark.parametrize("block_size", [1, 2, 3, 5])
def test_model_two_phase_equals_direct(block_size):
    config = get_preset("debug").replace(attn_res_block_size=block_size)
    ids = ids_of(2, 7, config.vocab_size, seed=3)
    direct = fp64_model(config.replace(attn_res_impl="direct"))(ids).logits
    two_phase = fp64_model(config.replace(attn_res_impl="two_phase"))(ids).logits
    assert direct.dtype == torch.float64
    # fp64 through 5 layers (KDA gate/conv tensors stay fp32 by design, identically in both): ≤ 1e-10
    torch.testing.assert_close(two_phase, direct, atol=1e-10, rtol=1e-10)


def _sublayers(layer, a, layout):
    """Run one decoder layer's mixer on a read value a; returns (y, ffn) so the caller wires the residual."""
    y, _ = layer.self_attn(layer.input_layernorm(a), layout)

    def ffn(m):
        x = layer.post_attention_layernorm(m)
        return layer.block_sparse_moe(x) if layer.is_moe else layer.mlp(x)

    return y, ffn


def _query(norm, proj):
    return norm.weight.double() * proj.weight[0].double()


@torch.no_grad()
def full_attn_res_logits(model, ids) -> torch.Tensor:
    """Full AttnRes at decoder-layer granularity, transcribed without model.py's wiring code.

    Sources: [embedding, o_0, o_1, …] with o_j = y_j + z_j (mixer + FFN output of layer j).
      mixer input of layer ℓ: AR(w_attn[ℓ]; embedding, o_0 … o_{ℓ-1})      (ℓ = 0: the embedding itself)
      FFN input of layer ℓ:   AR(w_mlp[ℓ];  embedding, o_0 … o_{ℓ-1}, y_ℓ)
      output:                 AR(w_out;     embedding, o_0 … o_{L-1}) → norm → lm_head
    """
    inner = model.model
    B, T = ids.shape
    layout = SequenceLayout(B, T)
    sources = [inner.embed_tokens.weight[ids]]
    for layer in inner.layers:
        a = ar_fp64(_query(layer.self_attention_res_norm, layer.self_attention_res_proj), sources)
        y, ffn = _sublayers(layer, a, layout)
        m = ar_fp64(_query(layer.mlp_res_norm, layer.mlp_res_proj), sources + [y])
        sources.append(y + ffn(m))
    h = ar_fp64(_query(inner.output_attn_res_norm, inner.output_attn_res_proj), sources)
    return model.lm_head(inner.norm(h))


@torch.no_grad()
def per_sublayer_full_attn_res_logits(model, ids) -> torch.Tensor:
    """The AR paper's per-sublayer Full AttnRes: sources [embedding, y_0, z_0, y_1, z_1, …]. Not K3's S = 1."""
    inner = model.model
    B, T = ids.shape
    layout = SequenceLayout(B, T)
    sources = [inner.embed_tokens.weight[ids]]
    for layer in inner.layers:
        a = ar_fp64(_query(layer.self_attention_res_norm, layer.self_attention_res_proj), sources)
        y, ffn = _sublayers(layer, a, layout)
        sources.append(y)
        sources.append(ffn(ar_fp64(_query(layer.mlp_res_norm, layer.mlp_res_proj), sources)))
    h = ar_fp64(_query(inner.output_attn_res_norm, inner.output_attn_res_proj), sources)
    return model.lm_head(inner.norm(h))


@pytest.mark.parametrize("impl", ["direct", "two_phase"])
def test_block_size_one_is_full_attn_res(impl):
    """attn_res_block_size = 1: every layer seals before its mixer, so every block holds exactly one layer's
    y_ℓ + z_ℓ. The wiring then equals Full AttnRes at decoder-layer granularity (`full_attn_res_logits`):
    each layer's summed output is its own source, and the FFN read additionally sees the current y_ℓ.
    It is *not* the AR paper's per-sublayer Full AttnRes (y and z as separate sources); the test checks
    that the two differ, so it would notice a wiring that silently became per-sublayer.
    """
    config = get_preset("debug").replace(attn_res_block_size=1, attn_res_impl=impl)
    model = fp64_model(config, seed=4, res_seed=5)
    ids = ids_of(2, 6, config.vocab_size, seed=6)
    with torch.no_grad():
        logits = model(ids).logits
    # fp64, same sublayers, independent wiring and AR operator: ≤ 1e-10
    torch.testing.assert_close(logits, full_attn_res_logits(model, ids), atol=1e-10, rtol=1e-10)
    assert (logits - per_sublayer_full_attn_res_logits(model, ids)).abs().max() > 1e-6


@torch.no_grad()
def block_attn_res_logits(model, ids, S: int) -> torch.Tensor:
    """Block AttnRes by block membership (§4.2 restated): layer ℓ's y_ℓ, z_ℓ belong to block ⌊ℓ/S⌋, the
    embedding is a source of its own. A read sees the embedding, the sum of every block before the
    current one, and (if non-empty) the current block's running sum. At a block's first layer the mixer
    read therefore sees no running sum."""
    inner = model.model
    B, T = ids.shape
    layout = SequenceLayout(B, T)
    emb = inner.embed_tokens.weight[ids]
    finished: list[torch.Tensor] = []  # block sums
    current: list[torch.Tensor] = []  # sublayer outputs of the current block
    for ell, layer in enumerate(inner.layers):
        if ell % S == 0 and current:
            finished.append(sum(current))
            current = []
        running = [sum(current)] if current else []
        a = ar_fp64(_query(layer.self_attention_res_norm, layer.self_attention_res_proj), [emb] + finished + running)
        y, ffn = _sublayers(layer, a, layout)
        current.append(y)
        m = ar_fp64(_query(layer.mlp_res_norm, layer.mlp_res_proj), [emb] + finished + [sum(current)])
        current.append(ffn(m))
    h = ar_fp64(_query(inner.output_attn_res_norm, inner.output_attn_res_proj), [emb] + finished + [sum(current)])
    return model.lm_head(inner.norm(h))


@pytest.mark.parametrize("S", [2, 3, 5])
def test_block_wiring_matches_membership_transcription(S):
    config = get_preset("debug").replace(attn_res_block_size=S)
    model = fp64_model(config, seed=7, res_seed=8)
    ids = ids_of(1, 5, config.vocab_size, seed=9)
    with torch.no_grad():
        logits = model(ids).logits
    # fp64: ≤ 1e-10
    torch.testing.assert_close(logits, block_attn_res_logits(model, ids, S), atol=1e-10, rtol=1e-10)


def expected_read_counts(L: int, S: int) -> list[int]:
    """Sources per direct read, in call order, from the seal rule alone (seals at ℓ = 0, S, 2S, …)."""
    counts = []
    for ell in range(L):
        seals_before = -(-ell // S)  # seals at indices < ℓ
        seals_through = ell // S + 1  # seals at indices ≤ ℓ
        if ell > 0:
            # mixer read: at a block start the finished block is still the partial (same set as after sealing)
            counts.append(seals_before + 1)
        counts.append(seals_through + 1)  # FFN read: sealed blocks + the running partial
    counts.append(-(-L // S) + 1)  # output read
    return counts


def test_k3_layout_output_read_sees_nine_sources():
    assert expected_read_counts(93, 12)[-1] == 9  # embedding + 7 full blocks + the 9-layer tail


def k3_shaped_tiny(L: int, S: int):
    """K3's layer count and block size at a tiny width (schedule: MLA iff n % 4 == 0 or n == L)."""
    kda, full = hybrid_layer_schedule(L)
    return get_preset("debug").replace(
        hidden_size=32, num_hidden_layers=L, attn_res_block_size=S, vocab_size=64,
        num_attention_heads=1, num_key_value_heads=1, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=88,
        num_experts=4, num_experts_per_token=1, moe_intermediate_size=8, routed_expert_hidden_size=16,
        linear_attn_config=LinearAttnConfig(num_heads=1, head_dim=16, kda_layers=kda, full_attn_layers=full),
        vision_config=None, attn_res_impl="direct")


@pytest.mark.parametrize("L,S", [(93, 12), (5, 2), (7, 3)])
def test_read_source_counts_instrumented(monkeypatch, L, S):
    """Count the sources of every read of a real forward (instrumented attn_res_read / attn_res_phase1)."""
    config = k3_shaped_tiny(L, S)
    model = build_model(config, seed=0)
    ids = ids_of(1, 2, config.vocab_size, seed=0)

    counts = []

    def counting_read(w, sources, *args, **kwargs):
        counts.append(len(sources))
        return attn_res_read(w, sources, *args, **kwargs)

    # the direct wiring reads through `select_read`, which returns attn_res.attn_res_read on CPU
    monkeypatch.setattr(attn_res_module, "attn_res_read", counting_read)
    with torch.no_grad():
        direct = model(ids).logits
    assert counts == expected_read_counts(L, S)
    # 2L reads: layer 0's mixer read is skipped (its input is the embedding)
    assert len(counts) == 2 * L
    if (L, S) == (93, 12):
        assert counts[-1] == 9

    sealed_sizes = []

    def counting_phase1(queries, sealed, *args, **kwargs):
        sealed_sizes.append((queries.shape[0], len(sealed)))
        return attn_res_phase1(queries, sealed, *args, **kwargs)

    monkeypatch.setattr(attn_res_module, "attn_res_phase1", counting_phase1)
    model.config.attn_res_impl = "two_phase"
    try:
        with torch.no_grad():
            two_phase = model(ids).logits
    finally:
        model.config.attn_res_impl = "direct"
    n_blocks = -(-L // S)
    assert [n for _, n in sealed_sizes] == list(range(1, n_blocks + 1))
    # 2 queries per layer of each block, plus the output query in the last block: 2L + 1 in all
    assert sum(j for j, _ in sealed_sizes) == 2 * L + 1
    # the output read merges the last sealed list with the partial: n_blocks + 1 sources
    assert sealed_sizes[-1][1] + 1 == expected_read_counts(L, S)[-1]
    # fp32: ≤ 1e-5
    torch.testing.assert_close(two_phase, direct, atol=1e-5, rtol=1e-5)


def _query_grads(model):
    inner = model.model
    pairs = {"output": (inner.output_attn_res_norm, inner.output_attn_res_proj)}
    for ell, layer in enumerate(inner.layers):
        pairs[f"{ell}.attn"] = (layer.self_attention_res_norm, layer.self_attention_res_proj)
        pairs[f"{ell}.mlp"] = (layer.mlp_res_norm, layer.mlp_res_proj)
    return pairs


def _nonzero(t) -> bool:
    return t is not None and bool(t.abs().sum() > 0)


@pytest.mark.parametrize("impl", ["direct", "two_phase"])
@pytest.mark.parametrize("random_queries", [False, True])
def test_every_query_gets_a_gradient_except_layer0_attn(impl, random_queries):
    """2L + 1 queries; all but layer 0's self_attention_res_* (whose read is the embedding, §4.2) get a
    gradient in one backward. At init (res_proj = 0) w = norm ⊙ proj has d/d(norm) = 0, so there only
    the projections are checked; with random projections both factors are."""
    config = get_preset("debug").replace(attn_res_impl=impl)
    model = build_model(config, seed=10)
    if random_queries:
        randomize_res_proj(model, seed=11)
    ids = ids_of(2, 6, config.vocab_size, seed=12)
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)).backward()
    pairs = _query_grads(model)
    assert len(pairs) == 2 * config.num_hidden_layers + 1
    for name, (norm, proj) in pairs.items():
        if name == "0.attn":
            assert not _nonzero(norm.weight.grad) and not _nonzero(proj.weight.grad), "layer 0 attn query has an effect"
            continue
        assert _nonzero(proj.weight.grad), f"query {name}: res_proj got no gradient"
        if random_queries:
            assert _nonzero(norm.weight.grad), f"query {name}: res_norm got no gradient"
        else:
            assert not _nonzero(norm.weight.grad)


def test_layer0_attn_query_has_no_effect():
    config = get_preset("debug")
    model = fp64_model(config, seed=13, res_seed=14)
    ids = ids_of(1, 5, config.vocab_size, seed=15)
    with torch.no_grad():
        before = model(ids).logits
        model.model.layers[0].self_attention_res_proj.weight.mul_(-7.0)
        model.model.layers[0].self_attention_res_norm.weight.add_(3.0)
        after = model(ids).logits
    assert torch.equal(before, after)


def test_wiring_choice(monkeypatch):
    """Only "two_phase" takes the two-phase wiring (fused where `fused_two_phase_available`); it refuses layers
    checkpointed with `apply_activation_checkpointing` while a backward can follow, and runs them without one."""
    from k3.model.checkpointing import apply_activation_checkpointing

    model = build_model(get_preset("debug"), seed=0)
    inner = model.model
    assert inner._block_queries() == 4  # debug: 5 layers in blocks of 2: 2 · 2 reads (the last: 2 · 1 + 1)
    for impl in ("auto", "direct", "triton"):
        monkeypatch.setattr(inner.config, "attn_res_impl", impl)
        assert not inner._two_phase()
    monkeypatch.setattr(inner.config, "attn_res_impl", "two_phase")
    assert inner._two_phase()
    apply_activation_checkpointing(model)
    with pytest.raises(ValueError, match="checkpoint"):
        inner._two_phase()
    with torch.no_grad():
        assert inner._two_phase()
        seen = []
        monkeypatch.setattr(model_module, "fused_two_phase_available", lambda x, J: seen.append(J) or False)
        model(ids_of(1, 3, get_preset("debug").vocab_size, seed=1))
    assert seen == [4]


def test_sealed_source_is_the_identity_for_any_consumer():
    """`seal_source` (the fused reads' gradient sink) changes nothing for readers that return their gradients
    to autograd (the torch reads, any other op): values, gradients and a second backward are exact; without a
    gradient to follow it hands back the tensor itself. The fused kernels' side runs in the interpreter checks
    (tests/ops/triton_interpreter_checks.py: test_attn_res_sealed, test_model_sealed_reads)."""
    from k3.ops.attn_res import seal_source

    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2, 3, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    w = torch.randn(8, generator=g, dtype=torch.float64)

    def loss(seal):
        sealed = [seal(b) for b in blocks]
        return (attn_res_read(w, sealed) * 2 + sealed[1].sin()).sum() + attn_res_read(w, sealed[:2]).sum()

    ref = torch.autograd.grad(loss(lambda t: t), blocks)
    out = loss(seal_source)
    first = torch.autograd.grad(out, blocks, retain_graph=True)
    second = torch.autograd.grad(out, blocks)
    for r, a, b in zip(ref, first, second):
        assert torch.equal(r, a) and torch.equal(r, b)
    with torch.no_grad():
        assert seal_source(blocks[0]) is blocks[0]
    plain = torch.randn(3)
    assert seal_source(plain) is plain
