"""P2P Muon on gloo: three steps equal single-process MuonAdamW (float32 Newton–Schulz), uneven shards too."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from k3.config import get_preset
from k3.parallel.muon import DistributedMuonAdamW, _row_ranges
from k3.model.model import build_model
from k3.optim.muon import MuonAdamW
from tests.parallel.spawn import run_workers

STEPS = 3


def _grads(model, step):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _worker(rank, world, ns_dtype=torch.float32):
    model = build_model(get_preset("debug"), seed=0)
    mesh = init_device_mesh("cpu", (world,))
    params = {n: torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for n, p in model.named_parameters()}
    opt = DistributedMuonAdamW(params.items(), model.config, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
    for step in range(STEPS):
        for n, g in _grads(model, step).items():
            params[n].grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    return {"params": {n: p.full_tensor() for n, p in params.items()}, "bytes": opt.bytes_sent,
            "load": opt.ns_load}


def _single_process(ns_dtype):
    """The model after STEPS steps of single-process MuonAdamW on the same gradients."""
    model = build_model(get_preset("debug"), seed=0)
    opt = MuonAdamW(model.named_parameters(), model.config, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
    for step in range(STEPS):
        for n, g in _grads(model, step).items():
            dict(model.named_parameters())[n].grad = g
        opt.step()
    return model


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_muon_matches_single_process(world):
    results = run_workers(_worker, world)
    model = _single_process(torch.float32)
    for name, p in model.named_parameters():
        for r in results:
            torch.testing.assert_close(r["params"][name], p.detach(), rtol=2e-5, atol=2e-6, msg=name)
    assert sum(r["bytes"] for r in results) > 0  # whole matrices split across ranks had to move


def _bf16_worker(rank, world):
    return _worker(rank, world, ns_dtype=torch.bfloat16)


def test_bf16_newton_schulz_sends_bf16_rows():
    """With bf16 Newton–Schulz the rows travel as bf16: half the bytes of the fp32 run, and the same update as
    one process (the owner would have cast them on stacking anyway)."""
    fp32 = run_workers(_worker, 2)
    bf16 = run_workers(_bf16_worker, 2)
    assert [r["bytes"] for r in bf16] == [b // 2 for b in (r["bytes"] for r in fp32)]
    model = _single_process(torch.bfloat16)
    for name, p in model.named_parameters():
        for r in bf16:
            torch.testing.assert_close(r["params"][name], p.detach(), rtol=0, atol=0, msg=name)


def test_row_ranges_follow_torch_chunk():
    for dim0, world in [(10, 3), (2, 4), (7, 7), (128, 3)]:
        sizes = [c.shape[0] for c in torch.arange(dim0).chunk(world)] + [0] * world
        ranges = _row_ranges(dim0, 1, world)
        assert [b - a for a, b in ranges] == sizes[:world]


def _aligned_worker(rank, world):
    model = build_model(get_preset("debug"), seed=0)
    mesh = init_device_mesh("cpu", (world,))
    # per-expert and per-head units that shard boundaries do not cut: every unit is owned where it lives
    names = [n for n, _ in model.named_parameters() if ".experts.w" in n or "self_attn.q_proj" in n]
    params = {n: torch.nn.Parameter(distribute_tensor(dict(model.named_parameters())[n].detach(), mesh, [Shard(0)]))
              for n in names}
    opt = DistributedMuonAdamW(params.items(), model.config, lr=0.02, ns_dtype=torch.float32)
    for n, p in params.items():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)), mesh, [Shard(0)])
    opt.step()
    return opt.bytes_sent


def test_aligned_units_move_no_bytes():
    assert run_workers(_aligned_worker, 2) == [0, 0]
