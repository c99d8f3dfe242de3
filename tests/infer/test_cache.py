"""The hybrid paged pool (docs/inference.md): page rule, typed views over one arena, refcounts, gather/scatter."""

import pytest
import torch

from k3.config import get_preset
from k3.infer.api import SamplingParams
from k3.infer.cache import CacheSpec, PagePool, gather, kda_bytes_per_layer, page_tokens_for, scatter
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.prefix_cache import MLABlock
from k3.model.model import build_model


@pytest.mark.parametrize("preset,hash_block,expected", [("k3", 512, 6144), ("small", 256, 1024), ("tiny", 64, 384)])
def test_page_rule_reproduces_the_spec(preset, hash_block, expected):
    cfg = get_preset(preset)
    assert page_tokens_for(cfg, hash_block, cache_bytes=2) == expected
    if preset == "k3":
        assert kda_bytes_per_layer(cfg, 2) == 6_512_640  # docs/inference.md


def test_views_of_different_groups_never_overlap():
    spec = CacheSpec.build(get_preset("debug"), 8, torch.float32)
    pool = PagePool(spec, 4)
    assert pool.mla.data_ptr() == pool.kda_state.data_ptr() == pool.arena.data_ptr()
    # fill page 1 through the MLA view, page 2 through both KDA views: nothing else may change
    pool.mla[1] = 1.5
    pool.kda_state[2] = 2.5
    pool.kda_conv[2] = -3.5
    a = pool.arena
    assert (a[0] == 0).all() and (a[3] == 0).all()
    assert (a[1, spec.mla_page_bytes:] == 0).all() and (a[1, : spec.mla_page_bytes].view(torch.float32) == 1.5).all()
    s, c = spec.kda_state_bytes, spec.kda_conv_bytes
    assert (a[2, :s].view(torch.float32) == 2.5).all() and (a[2, s : s + c].view(torch.float32) == -3.5).all()
    assert (a[2, s + c :] == 0).all()
    assert spec.page_bytes >= max(spec.mla_page_bytes, s + c) and spec.page_bytes % 64 == 0


def test_refcounts_and_free_list():
    spec = CacheSpec.build(get_preset("debug"), 8, torch.float32)
    pool = PagePool(spec, 3)
    pages = pool.allocate(2)
    assert pool.allocate(2) is None and pool.num_free == 1  # all-or-nothing
    pool.incref(pages[:1])
    pool.decref(pages)
    assert pool.num_free == 2 and pool.refcount[pages[0]] == 1
    pool.decref(pages[:1])
    assert pool.num_free == 3
    with pytest.raises(AssertionError):
        pool.decref(pages[:1])


def test_gather_scatter_round_trip_is_the_models_cache(model):
    """Pages written by scatter and read by gather hold exactly the contiguous cache the model builds."""
    spec = CacheSpec.build(model.config, 8, torch.float32, page_tokens=16)
    pool = PagePool(spec, 64)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (21, 5, 40)]
    blocks = [[MLABlock(tuple(pool.allocate(len(spec.mla_layers))), i) for i in range(3)] for _ in seqs]
    kda = [pool.allocate(len(spec.kda_layers)) for _ in seqs]
    for pages in kda:
        pool.zero(pages)
    ref = model.new_cache(3)
    lengths = [0, 0, 0]
    with torch.no_grad():
        for piece in ((7, 5, 16), (14, 0, 24)):  # two ragged steps
            ids = torch.cat([s[a : a + n] for s, a, n in zip(seqs, lengths, piece)])[None]
            cu = torch.tensor([0, *torch.tensor(piece).cumsum(0).tolist()])
            cache = gather(pool, blocks, kda, lengths)
            model(ids, cu_seqlens=cu, cache=cache)
            scatter(pool, cache, blocks, kda, lengths, list(piece))
            model(ids, cu_seqlens=cu, cache=ref)
            lengths = [a + n for a, n in zip(lengths, piece)]
    got = gather(pool, blocks, kda, lengths)
    for layer, (mine, theirs) in enumerate(zip(got.layers, ref.layers)):
        if model.config.is_kda_layer(layer):
            for name in ("recurrent", "conv_q", "conv_k", "conv_v"):
                assert torch.equal(getattr(mine, name), getattr(theirs, name)), (layer, name)
        else:
            for n, L in enumerate(lengths):
                assert torch.equal(mine.latent[n, :L], theirs.latent[n, :L]), layer


def test_every_layer_gated_mla_is_a_valid_model(model):
    """The benchmark's baseline: the same model with every layer Gated MLA (no KDA state at all)."""
    cfg = model.config
    L = cfg.num_hidden_layers
    lin = cfg.linear_attn_config
    all_mla = cfg.replace(linear_attn_config=lin.__class__(**{**lin.__dict__, "kda_layers": [],
                                                              "full_attn_layers": list(range(1, L + 1))}))
    m = build_model(all_mla, seed=0)
    engine = Engine(m, EngineConfig(hash_block_size=8, num_pages=64, eos_token_ids=()))
    assert engine.spec.page_tokens == 8 and not engine.spec.kda_layers
    a = engine.generate([1, 2, 3] * 7, SamplingParams(max_tokens=3, temperature=0))
    b = engine.generate([1, 2, 3] * 7, SamplingParams(max_tokens=3, temperature=0))
    assert a.new_token_ids == b.new_token_ids and b.cached_tokens == 16  # MLA-only: any boundary is a hit

