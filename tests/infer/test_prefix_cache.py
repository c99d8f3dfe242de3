"""State-aware prefix caching and the CPU pool (docs/inference.md) on the debug preset in fp32.

"Bitwise" below means the warm run does exactly the cold run's arithmetic after the hit: the hit lands on a
boundary where the cold run also split its prefill (pieces end on absolute positions), the copied KDA
state and MLA pages are the cold run's bytes, and the batch is the same. Where the split differs (a
follow-up turn hitting a decode-time checkpoint) tokens must match and logprobs agree to LOGPROB_TOL
(reference MoE rounding depends on row counts, see test_engine.py).
"""

import torch

from k3.infer.api import SamplingParams
from k3.infer.config import EngineConfig
from k3.infer.engine import Engine
from k3.infer.prefix_cache import ROOT_HASH, block_hash, extend_hashes

LOGPROB_TOL = 1e-4
# hash block 8, pages of 16 tokens, checkpoints every 2 hash blocks (16) and at each prompt's last boundary
CFG = EngineConfig(hash_block_size=8, page_tokens=16, prefill_chunk_tokens=16, checkpoint_every_blocks=2,
                   num_pages=160, max_step_tokens=64, max_running=8, eos_token_ids=())


def prompt(n, seed, V=512):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, logprobs=0)


def lps(out):
    return [lp.logprob for lp in out.logprobs]


def hashes_of(engine, ids):
    h = []
    extend_hashes(h, ids, engine.spec.hash_block, engine.prefix.extra)
    return h


def assert_all_free(engine):
    while engine.prefix.evict_one():
        pass
    assert engine.pool.num_free == engine.pool.num_pages and all(rc == 0 for rc in engine.pool.refcount)


def test_chained_hashes():
    a = block_hash(ROOT_HASH, [1, 2, 3], b"k3")
    assert a == block_hash(ROOT_HASH, [1, 2, 3], b"k3") and len(a) == 16
    assert a != block_hash(ROOT_HASH, [1, 2, 3], b"other-model")
    assert block_hash(a, [4], b"k3") != block_hash(block_hash(ROOT_HASH, [9, 2, 3], b"k3"), [4], b"k3")
    h = []
    extend_hashes(h, list(range(20)), 8)
    assert len(h) == 2 and h[1] == block_hash(h[0], list(range(8, 16)))


def test_hit_then_continue_equals_cold_run(model):
    P = prompt(37, 1)
    Q = P[:35] + prompt(20, 2)  # shares 35 tokens with P: 4 whole hash blocks (32)
    cold = Engine(model, CFG).generate(Q, greedy(12))
    warm_engine = Engine(model, CFG)
    first = warm_engine.generate(P, greedy(12))
    warm = warm_engine.generate(Q, greedy(12))
    assert warm.cached_tokens == 32 and cold.cached_tokens == 0
    assert warm.new_token_ids == cold.new_token_ids and lps(warm) == lps(cold)  # bitwise
    again = warm_engine.generate(P, greedy(12))  # the same prompt again: hit at its last boundary (32)
    assert again.cached_tokens == 32 and lps(again) == lps(first)
    # a follow-up turn (prompt + answer + more) hits the decode-time checkpoint at the end of the answer
    follow = P + first.new_token_ids + prompt(10, 3)
    cold_follow = Engine(model, CFG).generate(follow, greedy(8))
    warm_follow = warm_engine.generate(follow, greedy(8))
    assert warm_follow.cached_tokens == (37 + 12 - 1) // 8 * 8
    assert warm_follow.new_token_ids == cold_follow.new_token_ids
    assert max(abs(a - b) for a, b in zip(lps(warm_follow), lps(cold_follow))) < LOGPROB_TOL
    m = warm_engine.metrics()
    assert m["prefix_hit_requests_total"] == 3 and m["prefix_hits_total"] == 32 + 32 + 48
    assert_all_free(warm_engine)


def test_no_hit_without_a_kda_checkpoint(model):
    """Checkpoints every 4 hash blocks (32) plus the prompt's last boundary (40): MLA pages alone never make a
    hit (docs/: the hit is the longest MLA match that also has KDA state)."""
    engine = Engine(model, CFG.replace(checkpoint_every_blocks=4))
    P = prompt(45, 4)
    engine.generate(P, greedy(1))
    look = lambda ids: engine.prefix.lookup(hashes_of(engine, ids), len(ids) - 1)  # noqa: E731
    assert look(P[:30] + prompt(10, 5)) is None  # MLA matches 24 tokens, no checkpoint at or below 24
    assert look(P[:39] + prompt(10, 5)).num_tokens == 32  # MLA matches 32: checkpoint at 32
    assert look(P[:44] + prompt(10, 5)).num_tokens == 40  # MLA matches 40: checkpoint at 40
    # a boundary missing from one KDA group is not a hit, even though every other group has it
    h40 = hashes_of(engine, P)[4]
    page = engine.prefix.kda_index[1].pop(h40)
    assert look(P[:44] + prompt(10, 5)).num_tokens == 32
    engine.prefix.kda_index[1][h40] = page


def test_eviction_in_one_group_invalidates_everywhere(model):
    engine = Engine(model, CFG.replace(checkpoint_every_blocks=4))
    P = prompt(45, 4)
    engine.generate(P, greedy(1))
    hs = hashes_of(engine, P)
    ck = engine.prefix.gpu_checkpoint(hs[4])
    free_before = engine.pool.num_free
    engine.prefix.evict_page(ck.pages[1])  # evict the checkpoint's page of one KDA layer
    assert all(hs[4] not in idx for idx in engine.prefix.kda_index)
    assert engine.pool.num_free == free_before + len(ck.pages)
    assert engine.prefix.lookup(hashes_of(engine, P[:44] + [1] * 10), 53).num_tokens == 32
    block0 = engine.prefix.gpu_block(hs[0])
    engine.prefix.evict_page(block0.pages[0])  # one MLA layer's page of the first block
    assert all(hs[0] not in idx and hs[1] not in idx for idx in engine.prefix.mla_index)
    assert engine.prefix.lookup(hs, 44) is None  # the chain is broken at its first page
    assert_all_free(engine)


def test_copy_on_write_leaves_the_shared_page_intact(model):
    engine = Engine(model, CFG)
    P = prompt(29, 6)  # its last boundary, 24, lies inside page 1 (tokens 16..31)
    engine.generate(P, greedy(2))
    hs = hashes_of(engine, P)
    shared = engine.prefix.gpu_block(hs[2])
    before = engine.pool.arena[list(shared.pages)].clone()
    Q = P[:26] + prompt(5, 7)  # 31 tokens: hit at 24, and it writes 24..30 into page 1
    warm = engine.generate(Q, greedy(10))
    assert warm.cached_tokens == 24
    assert torch.equal(engine.pool.arena[list(shared.pages)], before)
    cold = Engine(model, CFG).generate(Q, greedy(10))
    assert warm.new_token_ids == cold.new_token_ids and lps(warm) == lps(cold)
    assert_all_free(engine)


def test_same_step_requests_do_not_match_each_other(model):
    """Pages written in a step are registered only after it: two identical prompts admitted together both
    run cold (and give the same output)."""
    engine = Engine(model, CFG)
    P = prompt(40, 8)
    engine.add_request("a", P, greedy(5))
    engine.add_request("b", P, greedy(5))
    outs = {"a": [], "b": []}
    cached = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.cached_tokens
    assert cached == {"a": 0, "b": 0} and outs["a"] == outs["b"]
    assert engine.generate(P, greedy(5)).cached_tokens == 32
    assert_all_free(engine)


def test_cpu_pool_evict_and_reload_give_identical_logits(model):
    cfg = CFG.replace(num_pages=30, cpu_pool_bytes=200 * 40_000)
    engine = Engine(model, cfg)
    P = prompt(37, 9)
    first = engine.generate(P, greedy(8))
    for i in range(3):  # other traffic pushes P's pages out of the device pool
        engine.generate(prompt(60, 20 + i), greedy(4))
    host = engine.host_pool
    assert host.stores > 0 and host.bytes_out > 0
    assert engine.prefix.gpu_block(hashes_of(engine, P)[0]) is None  # not on the device any more
    again = engine.generate(P, greedy(8))
    assert again.cached_tokens == 32 and host.loads > 0 and host.bytes_in > 0
    assert again.new_token_ids == first.new_token_ids and lps(again) == lps(first)  # bitwise
    m = engine.metrics()
    assert m["cpu_pool_hits_total"] == host.loads and m["cpu_pool_hit_tokens_total"] == 32
    assert_all_free(engine)


def test_cpu_bundles_move_and_drop_atomically(model):
    page_bytes = Engine(model, CFG).spec.page_bytes
    # room for one bundle of 2 MLA pages + one checkpoint (3 KDA pages), not two
    engine = Engine(model, CFG.replace(cpu_pool_bytes=7 * page_bytes))
    P, Q = prompt(17, 10), prompt(17, 11)  # each: one full page with a checkpoint at 16
    for ids in (P, Q):
        engine.generate(ids, greedy(1))
    host = engine.host_pool
    hp, hq = hashes_of(engine, P), hashes_of(engine, Q)
    engine.prefix.evict(engine.prefix.gpu_block(hp[1]))
    bundle = host.find_block(hp[1])
    assert bundle is not None and host.find_checkpoint(hp[1]) is bundle and host.find_block(hp[0]) is bundle
    engine.prefix.evict(engine.prefix.gpu_block(hq[1]))  # LRU drops P's bundle: pages and checkpoint together
    assert host.find_block(hp[1]) is None and host.find_checkpoint(hp[1]) is None
    assert host.find_block(hq[1]) is not None and host.find_checkpoint(hq[1]) is not None
    assert host.used_slots == 5


def check_refcounts(engine):
    """Every page's refcount is exactly its holders: running requests, the cache's blocks and checkpoints."""
    expect = [0] * engine.pool.num_pages
    for seq in engine.scheduler.running:
        for block in seq.blocks:
            for p in block.pages:
                expect[p] += 1
        for p in seq.kda_pages:
            expect[p] += 1
    for block in engine.prefix.lru:
        for p in block.pages:
            expect[p] += 1
        for ck in block.checkpoints.values():
            for p in ck.pages:
                expect[p] += 1
    assert expect == engine.pool.refcount
    assert sorted(engine.pool.free) == [p for p, n in enumerate(expect) if n == 0]
    for seq in engine.scheduler.waiting:
        assert not seq.blocks and seq.kda_pages is None


def test_random_traffic_keeps_refcounts_exact_and_outputs_unchanged(model):
    """Shared prefixes, a tight pool (eviction to a small CPU pool, preemption) and aborts, with the
    refcount invariant checked after every step; greedy tokens equal those of a roomy engine."""
    g = torch.Generator().manual_seed(12)
    base = prompt(40, 13)
    reqs = []
    for i in range(16):
        cut = int(torch.randint(12, 41, (1,), generator=g))
        ids = base[:cut] + prompt(int(torch.randint(1, 30, (1,), generator=g)), 100 + i)
        arrival, n_out = int(torch.randint(0, 60, (1,), generator=g)), int(torch.randint(1, 25, (1,), generator=g))
        reqs.append((arrival, f"r{i}", ids, greedy(n_out)))
    aborted = {"r3", "r8"}
    tight = Engine(model, CFG.replace(num_pages=37, max_running=4, cpu_pool_bytes=40 * 40_000))
    roomy = Engine(model, CFG)
    results = {}
    for engine in (tight, roomy):
        pending = sorted(reqs, key=lambda r: r[0])
        toks = {}
        step = 0
        while pending or engine.has_unfinished():
            while pending and pending[0][0] <= step:
                _, rid, ids, sp = pending.pop(0)
                engine.add_request(rid, ids, sp)
                toks[rid] = []
            for o in engine.step():
                toks[o.request_id] += o.new_token_ids
            if step == 30:
                for rid in aborted:
                    engine.abort(rid)
            check_refcounts(engine)
            step += 1
        results[engine is tight] = toks
    m = tight.metrics()
    assert m["preemptions_total"] > 0 and m["prefix_hit_requests_total"] > 5 and m["cpu_pool_hits_total"] > 0
    for rid in results[True]:
        if rid not in aborted:
            assert results[True][rid] == results[False][rid], rid
    assert_all_free(tight)
