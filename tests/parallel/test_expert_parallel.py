"""Expert parallelism on gloo: forward and every gradient equal the single-process MoE (float64)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from k3.config import get_preset
from k3.parallel.expert_parallel import ExpertParallelExperts
from k3.model.moe import StableLatentMoE
from tests.parallel.spawn import run_workers

TOKENS_PER_RANK = 24


def _moe(skew: str) -> tuple[StableLatentMoE, torch.Tensor]:
    config = get_preset("debug")
    torch.manual_seed(0)
    moe = StableLatentMoE(config).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if skew == "one_expert":
        # a large bias makes expert 5 win for every token (selection only; weights stay unbiased)
        moe.gate.e_score_correction_bias[5] = 10.0
    elif skew == "zipf":
        moe.gate.e_score_correction_bias.copy_(torch.linspace(1.0, -1.0, config.num_experts))
    return moe, config


def _worker(rank, world, skew, planner):
    moe, config = _moe(skew)
    h = torch.randn(world * TOKENS_PER_RANK, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn_like(h)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    moe.experts = ExpertParallelExperts(moe.experts, mesh, use_planner=planner)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    x = h[rows].clone().requires_grad_(True)
    y = moe(x[None])[0]
    y.backward(grad_out[rows])
    grads = {}
    for name, p in moe.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads[name] = g.clone()
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "stats": moe.experts.last_stats}


@pytest.mark.parametrize("world,skew,planner", [(2, "random", True), (4, "zipf", True), (4, "one_expert", True),
                                                (2, "zipf", False)])
def test_expert_parallel_matches_single_process(world, skew, planner):
    results = run_workers(_worker, world, skew, planner)
    moe, config = _moe(skew)
    h = torch.randn(world * TOKENS_PER_RANK, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn_like(h)
    x = h.clone().requires_grad_(True)
    y = moe(x[None])[0]
    y.backward(grad_out)
    y_dist = torch.cat([r["y"] for r in results])
    torch.testing.assert_close(y_dist, y.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat([r["dx"] for r in results]), x.grad, rtol=1e-10, atol=1e-10)
    for name, p in moe.named_parameters():
        if name.startswith("experts."):
            got = torch.cat([r["grads"][name] for r in results])  # sharded by expert
        else:
            got = sum(r["grads"][name] for r in results)  # replicated: per-rank partial sums
        torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-10, msg=name)
    if planner:
        assert all(r["stats"]["load_max_over_mean"] == 1.0 for r in results)
    if skew == "one_expert":
        assert results[0]["stats"]["home_load_max_over_mean"] > 1.5
        assert max(r["stats"]["slots"] for r in results) >= 1
