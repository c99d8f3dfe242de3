"""Context parallelism on gloo: the whole model's logits and every gradient equal one process (float64).

Documents cross rank edges (one spans three ranks), start exactly at an edge, and are one token long;
the KDA layer runs both the naive chunked and the torch chunked recurrence.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from k3.config import get_preset
from k3.parallel.context_parallel import CPContext, apply_context_parallel
from k3.parallel.runtime import shard_batch
from k3.model.model import build_model
from tests.parallel.spawn import run_workers

T = 48
CU = [0, 5, 30, 31, 48, 60, 72, 96]  # two rows of 48: row ends at 48 and 96


def _inputs(config):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (2, T), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, T), generator=g)
    labels[0, 4] = -100
    return ids, labels, torch.tensor(CU)


def _model(kda_impl):
    config = get_preset("debug").replace(kda_impl=kda_impl)
    model = build_model(config, seed=0, dtype=torch.float64)
    return model, config


def _loss(model, ids, labels, cu, count):
    logits = model(ids, cu_seqlens=cu).logits
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / count


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _context_parallel_step(model, ids, labels, cu, rank, world):
    """This rank's logits after switching `model` to CP over the world and back-propagating its loss piece."""
    count = int((labels != -100).sum())
    ctx = CPContext(dist.group.WORLD, world, rank)
    apply_context_parallel(model, ctx)
    local_ids, local_labels, local_cu, shard = shard_batch(ids, labels, cu, 1, 0, world, rank)
    ctx.set_batch(shard, local_cu, torch.device("cpu"))
    logits, loss = _loss(model, local_ids, local_labels, local_cu, count)
    loss.backward()
    return logits.detach()


def _worker(rank, world, kda_impl, perturb):
    model, config = _model(kda_impl)
    ids, labels, cu = _inputs(config)
    if perturb is not None:
        ids[0, perturb] = (ids[0, perturb] + 1) % config.vocab_size
    logits = _context_parallel_step(model, ids, labels, cu, rank, world)
    return {"logits": logits, "grads": _grads(model)}


@pytest.mark.parametrize("world,kda_impl", [(2, "naive"), (4, "torch")])
def test_context_parallel_matches_single_process(world, kda_impl):
    results = run_workers(_worker, world, kda_impl, None)
    model, config = _model(kda_impl)
    ids, labels, cu = _inputs(config)
    logits, loss = _loss(model, ids, labels, cu, int((labels != -100).sum()))
    loss.backward()
    got = torch.cat([r["logits"] for r in results], dim=1)
    torch.testing.assert_close(got, logits.detach(), rtol=1e-9, atol=1e-9)
    for name, p in model.named_parameters():
        if p.grad is None:
            assert all(name not in r["grads"] for r in results), name
            continue
        total = sum(r["grads"][name] for r in results)
        # the release keeps conv/gate parameters in fp32 even in an fp64 model: fp32 rounding for those
        rtol, atol = (1e-8, 1e-10) if p.dtype == torch.float64 else (1e-4, 1e-7)
        torch.testing.assert_close(total, p.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_halo_carries_the_previous_ranks_tokens():
    """Changing the last token of rank 0 changes rank 1's first outputs (same document), bit for bit
    as in one process; without the halo and the state fold they would not move."""
    t_local = T // 2
    base = run_workers(_worker, 2, "torch", None)
    moved = run_workers(_worker, 2, "torch", t_local - 1)
    assert not torch.equal(base[1]["logits"][0, 0], moved[1]["logits"][0, 0])


def _triton_worker(rank, world):
    """CP with the Triton KDA kernels (interpreter), and the single-process run, both in this worker."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1"  # else the torch fallback would run on both sides
    model, config = _model("triton")
    model.float()
    ids, labels, cu = _inputs(config)
    reference = _model("triton")[0].float()
    logits, loss = _loss(reference, ids, labels, cu, int((labels != -100).sum()))
    loss.backward()
    local_logits = _context_parallel_step(model, ids, labels, cu, rank, world)
    return {"logits": local_logits, "reference_logits": logits.detach(), "grads": _grads(model),
            "reference_grads": _grads(reference)}


def test_context_parallel_with_triton_kda(monkeypatch):
    """KCP's augmented-state run (V + K values, a final-state gradient) through the fused kernels: the CP
    model equals one process running the same kernels, in float32 (the kernels' accumulation precision)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned workers before they import Triton
    results = run_workers(_triton_worker, 2)
    got = torch.cat([r["logits"] for r in results], dim=1)
    torch.testing.assert_close(got, results[0]["reference_logits"], rtol=2e-4, atol=2e-4)
    for name, ref in results[0]["reference_grads"].items():
        total = sum(r["grads"][name] for r in results)
        err = (total - ref).norm() / ref.norm().clamp_min(1e-30)
        assert err < 2e-4, f"{name}: relative error {err:.2e}"
