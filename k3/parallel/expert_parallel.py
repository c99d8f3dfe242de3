"""Expert parallelism with the MoonEP planner: routed experts sharded over ranks (docs/distributed.md).

Legend: R EP ranks, E experts, P = E/R home experts per rank, N local tokens, k experts per token,
L latent width, I expert hidden width; a *copy* is one (token, expert) pair.

`ExpertParallelExperts` replaces a layer's `LatentExperts` after the model is built (never inside model
code): same call `(z, topk_idx, weights) -> Σ_j w_j E_j(z)`, same parameter names, but w1/w3/w2 are
DTensors sharded by expert over the EP mesh (rank h holds experts h·P … h·P + P − 1). One forward:

1. Counts: local bincount [E] → all-gather → C [R, E]; every rank runs the same `plan_moonep(C)`.
2. Dispatch: each rank orders its copies by (destination, expert, index) — for each expert its copies
   go to the destinations in ascending order with the planned counts send[r, e, :] — and one
   `all_to_all_single` moves the latent rows (autograd: the backward is the reverse all-to-all).
3. Slots: a rank with redundant experts receives their w1/w3/w2 from the one home rank the planner
   gave it, through a second (autograd) all-to-all; the backward of that exchange returns the slot
   gradients to the home expert's gradient within the same backward.
4. Compute: received rows are grouped by expert (home experts, then slots) and run as one grouped
   SiTU-GLU; the rows go back by the inverse all-to-all and are summed per token with the router
   weights in fp32, exactly like the single-device reference.

With the planner every rank computes exactly S·k copies per layer; `last_stats` keeps the step's per-rank
load max/mean with and without it. The splits need the counts on the host (one small sync per layer);
the device-side planner and symmetric-memory dispatch of docs/ are not built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from k3.parallel.moonep import MoonEPPlan, plan_moonep
from k3.model.moe import LatentExperts
from k3.ops.moe import grouped_situ_glu


def home_only_plan(counts: torch.Tensor) -> MoonEPPlan:
    """The plain EP assignment (every copy to its expert's home), for comparison with MoonEP."""
    R, E = counts.shape
    P = E // R
    send = torch.zeros(R, E, R, dtype=torch.int64)
    send[:, torch.arange(E), torch.arange(E) // P] = counts.to(torch.int64)
    return MoonEPPlan(send, torch.full((R, P), -1, dtype=torch.int64), torch.zeros(R, P, dtype=torch.int64),
                      torch.full((R,), -1, dtype=torch.int64), send.sum((0, 1)))


def _max_over_mean(load: torch.Tensor) -> float:
    load = load.double()
    return float(load.max() / load.mean()) if float(load.mean()) > 0 else 1.0


class ExpertParallelExperts(nn.Module):
    """`LatentExperts` with experts sharded over an EP mesh and tokens moved by all-to-all (see module doc)."""

    def __init__(self, experts: LatentExperts, mesh: DeviceMesh, use_planner: bool = True):
        super().__init__()
        if mesh.ndim != 1:
            raise ValueError("the EP mesh must be one-dimensional")
        E = experts.w1.shape[0]
        self.num_ranks = mesh.size()
        if E % self.num_ranks:
            raise ValueError(f"{E} experts cannot be sharded over {self.num_ranks} expert-parallel ranks")
        self.mesh, self.group, self.rank = mesh, mesh.get_group(), mesh.get_local_rank()
        self.num_experts, self.experts_per_rank = E, E // self.num_ranks
        self.beta1, self.beta2 = experts.beta1, experts.beta2
        self.use_planner = use_planner
        # Every rank built the same seeded full model, so slicing it reproduces the single-device weights.
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name).detach()
            setattr(self, name, nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
        self.last_stats: dict[str, float] = {}

    def _plan(self, topk_idx: torch.Tensor) -> tuple[MoonEPPlan, torch.Tensor]:
        """The step's plan, and this rank's copies per expert [E] it was made from."""
        counts = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)  # [E]
        gathered = [torch.empty_like(counts) for _ in range(self.num_ranks)]
        dist.all_gather(gathered, counts, group=self.group)
        C = torch.stack(gathered).cpu()  # [R, E]
        home = home_only_plan(C)
        plan = plan_moonep(C, tokens_per_rank=topk_idx.shape[0], top_k=topk_idx.shape[1]) if self.use_planner else home
        self.last_stats = {"load_max_over_mean": _max_over_mean(plan.load),
                           "home_load_max_over_mean": _max_over_mean(home.load),
                           "slots": int((plan.slot_experts[self.rank] >= 0).sum())}
        return plan, counts

    def forward(self, z: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """z [N, L]; topk_idx [N, k]; weights [N, k] fp32 -> Σ_j weights_j · E_j(z) [N, L] in fp32."""
        N, k = topk_idx.shape
        R, E, P, r = self.num_ranks, self.num_experts, self.experts_per_rank, self.rank
        device = z.device
        plan, counts = self._plan(topk_idx)
        send = plan.send  # [R, E, R] host int64

        # 2. order local copies by (destination, expert, index)
        flat_e = topk_idx.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        e_sorted = flat_e[order]
        rank_in_expert = torch.arange(N * k, device=device) - (counts.cumsum(0) - counts)[e_sorted]
        cum = send[r].cumsum(-1).to(device)  # [E, R] copies of e sent to destinations ≤ d
        dest = (rank_in_expert[:, None] >= cum[e_sorted]).sum(1)  # [N·k]
        pairs = order[torch.argsort(dest * E + e_sorted, stable=True)]  # pair ids in send order
        in_splits, out_splits = plan.send_splits(r).tolist(), plan.recv_splits(r).tolist()
        x_send = z[pairs // k]
        x_recv = funcol.all_to_all_single_autograd(x_send, out_splits, in_splits, self.group)

        # 3. slot weights from their home (autograd: slot gradients flow back home)
        # [P, ...] each, in the activations' dtype (bf16 under autocast: half the bytes for slot copies)
        w_home = [getattr(self, n).to_local().to(z.dtype) for n in ("w1", "w3", "w2")]
        slot_experts = plan.slot_experts[r][plan.slot_experts[r] >= 0].tolist()
        w_all = self._with_slots(w_home, plan, slot_experts)

        # 4. group received rows by expert (home experts, then slots), compute, undo
        recv_expert = torch.repeat_interleave(torch.arange(E).repeat(R), send[:, :, r].reshape(-1)).to(device)
        group_of_expert = torch.full((E,), -1, dtype=torch.int64, device=device)
        group_of_expert[r * P:(r + 1) * P] = torch.arange(P, device=device)
        if slot_experts:
            group_of_expert[torch.tensor(slot_experts, device=device)] = torch.arange(
                P, P + len(slot_experts), device=device)
        group = group_of_expert[recv_expert]
        if bool((group < 0).any()):
            raise AssertionError("a received copy has no expert on this rank: inconsistent plan")
        perm = torch.argsort(group, stable=True)
        sizes = torch.bincount(group, minlength=P + len(slot_experts))
        y_grouped = grouped_situ_glu(x_recv[perm], sizes, *w_all, self.beta1, self.beta2)
        y_recv = torch.empty_like(y_grouped).index_copy(0, perm, y_grouped)
        y_back = funcol.all_to_all_single_autograd(y_recv, in_splits, out_splits, self.group)

        accum = torch.float64 if z.dtype == torch.float64 else torch.float32
        weighted = y_back.to(accum) * weights.reshape(-1)[pairs].unsqueeze(-1).to(accum)
        return torch.zeros(N, z.shape[1], dtype=accum, device=device).index_add_(0, pairs // k, weighted)

    def _with_slots(self, w_home: list[torch.Tensor], plan: MoonEPPlan, slot_experts: list[int]):
        """Home weights plus the slot experts' weights fetched from `plan.slot_home` (one all-to-all)."""
        R, P, r = self.num_ranks, self.experts_per_rank, self.rank
        n_slots = [(plan.slot_experts[d] >= 0).sum().item() for d in range(R)]
        if sum(n_slots) == 0:
            return w_home
        shapes = [w.shape[1:] for w in w_home]
        flat = torch.cat([w.flatten(1) for w in w_home], dim=1)  # [P, F]
        F_ = flat.shape[1]
        # indexing `flat` even when nothing is sent keeps the exchange in every rank's autograd graph, so
        # every rank runs the backward all-to-all (a rank that skipped it would hang the others)
        ids = [e - r * P for d in range(R) if int(plan.slot_home[d]) == r
               for e in plan.slot_experts[d][: n_slots[d]].tolist()]
        send_buf = flat[torch.tensor(ids, dtype=torch.int64, device=flat.device)]
        in_splits = [n_slots[d] * F_ if int(plan.slot_home[d]) == r else 0 for d in range(R)]
        home = int(plan.slot_home[r])
        out_splits = [n_slots[r] * F_ if h == home else 0 for h in range(R)]
        received = funcol.all_to_all_single_autograd(send_buf.reshape(-1), out_splits, in_splits,
                                                     self.group).view(-1, F_)  # [slots, F]
        assert received.shape[0] == len(slot_experts)
        pieces = received.split([s.numel() for s in shapes], dim=1)
        return [torch.cat([w, p.reshape(-1, *s)]) for w, p, s in zip(w_home, pieces, shapes)]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, use_planner: bool = True) -> list[ExpertParallelExperts]:
    """Swap every MoE layer's routed experts for the expert-parallel version; returns the new modules."""
    swapped = []
    for layer in model.model.layers:
        if getattr(layer, "is_moe", False):
            moe = layer.block_sparse_moe
            moe.experts = ExpertParallelExperts(moe.experts, mesh, use_planner)
            swapped.append(moe.experts)
    return swapped
