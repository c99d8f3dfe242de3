"""The MoonEP planner: balance expert-parallel ranks exactly with redundant expert copies (pure function).

Follows the Kimi K3 report §5.2.1 and App. E, and docs/distributed.md. A pure function of the counts:
`plan_moonep` (placement as tensor ops) and `plan_moonep_reference`, its loop twin, which it is tested to equal
exactly (timed against each other by `benchmarks/moonep_planner.py`). `k3.parallel.expert_parallel` runs it on
the all-gathered counts and dispatches by its `send`.

Setting. R expert-parallel ranks, E routed experts, E/R of them at home on each rank: expert e lives on
rank e // (E/R). Each rank holds S tokens routed top-K, so it sends T = S·K token copies. The step's
routing is summarised by counts C [R, E]: C[r, e] copies from source rank r for expert e. Without a
plan, rank h would process its home load L_h = Σ_{e ∈ home(h)} Σ_r C[r, e], which can be anything from
0 to R·T. MoonEP gives each rank a few *slots* (redundant copies of other ranks' experts) and reroutes
copies so that every rank processes the same number of copies, with static buffer shapes.

Algorithm (deterministic; every rank runs it on the same all-gathered C and gets the same plan):
1. Targets. N = Σ C. Rank h's target is ⌊N/R⌋, plus one for the first N mod R ranks. When every rank
   routes all its S tokens to K experts, N = R·T and every target is exactly T = S·K.
2. Fill. While some rank is below its target: u = the rank with the largest deficit, o = the rank with
   the largest surplus (lowest index on ties). Move exactly q = target_u − L_u copies from o's home
   experts to u, taking o's experts by descending remaining home copies (lower id on ties) and splitting
   only the last one. Then L_u = target_u for good and L_o −= q (o may fall below its target and be
   filled later).
3. Placement. Each expert's copies are ordered by (source rank, index on that rank). The home keeps the
   leading range; the migrated chunks take the following ranges in fill order. So send[r, e, d], the
   number of copies source r sends to destination d for expert e, is the overlap of r's range with d's.

Guarantees (tested in tests/parallel/test_moonep.py):
- Exact balance: every rank processes exactly its target, i.e. exactly S·K copies whenever N = R·S·K
  (the normal case: nothing dropped). If fewer copies are routed (N < R·S·K, e.g. masked padding
  tokens), loads differ by at most one copy and never exceed S·K, so the S·K-row buffer stays valid.
  A rank that routes more than S·K copies is an input error (ValueError).
- Why it terminates and fits: a donor always has L_o > target_o ≥ q, so it can pay in full. A filled
  rank sits exactly at its target, so it is never a donor and never filled again: at most R − 1 fills,
  and each rank receives from a single home, hence holds at most E/R redundant experts (slots).
- Conservation: for every expert, Σ_{r,d} send[r, e, d] = Σ_r C[r, e], and for every (r, e),
  Σ_d send[r, e, d] = C[r, e].
- Determinism: a pure function of C (ties by lowest index), identical on every rank.

Dimensions: R ranks, E experts, P = E/R home experts (and slots) per rank.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoonEPPlan:
    """One layer's expert-parallel plan; every tensor is int64 with a static shape.

    send: [R, E, R] copies that source rank r routes to expert e which are processed on rank d.
    slot_experts: [R, P] the redundant (non-home) experts rank d hosts, −1 for an empty slot.
    slot_counts: [R, P] copies rank d processes in each slot (0 for an empty slot).
    slot_home: [R] the one rank whose home experts fill rank d's slots, −1 if it has none.
    load: [R] copies each rank processes (home + slots); equals the target (S·K when nothing dropped).
    """

    send: torch.Tensor
    slot_experts: torch.Tensor
    slot_counts: torch.Tensor
    slot_home: torch.Tensor
    load: torch.Tensor

    def send_splits(self, rank: int) -> torch.Tensor:
        """[R] copies `rank` sends to each destination: the all-to-all input splits."""
        return self.send[rank].sum(0)

    def recv_splits(self, rank: int) -> torch.Tensor:
        """[R] copies `rank` receives from each source: the all-to-all output splits."""
        return self.send[:, :, rank].sum(1)


def plan_moonep(counts: torch.Tensor, tokens_per_rank: int, top_k: int) -> MoonEPPlan:
    """Plan redundant experts and token routes so every rank processes the same number of copies.

    counts: [R, E] non-negative integers, C[r, e] copies from rank r routed to expert e; E % R == 0.
    tokens_per_rank: S; top_k: K. Each row must sum to at most S·K. Returns a MoonEPPlan.

    The fill (at most R − 1 moves over R ranks and P experts) runs on small Python lists; the placement —
    O(E·R²) overlaps, the part that grows with the model — is tensor ops, so a K3-sized plan (E = 896,
    R = 64) stays in the low milliseconds. `plan_moonep_reference` places with plain loops instead.
    """
    C = _check_counts(counts, tokens_per_rank, top_k)
    R, E = C.shape
    remaining, chunks, slots, slot_home = _fill(C.sum(0).tolist(), R)
    # Expert e's destination ranges: the home's leading range, then the migrated chunks in fill order.
    width = 1 + max((len(c) for c in chunks), default=0)
    dest = torch.zeros(E, width, dtype=torch.int64)
    length = torch.zeros(E, width, dtype=torch.int64)
    dest[:, 0] = torch.arange(E) // (E // R)
    length[:, 0] = torch.tensor(remaining, dtype=torch.int64)
    for e, migrated in enumerate(chunks):
        for j, (d, c) in enumerate(migrated, start=1):
            dest[e, j], length[e, j] = d, c
    range_end = length.cumsum(1)  # [E, width]
    range_start = range_end - length
    src_end = C.t().cumsum(1)  # [E, R] end of source r's copies along expert e's order
    src_start = src_end - C.t()
    overlap = (torch.minimum(src_end[:, :, None], range_end[:, None, :])
               - torch.maximum(src_start[:, :, None], range_start[:, None, :])).clamp(min=0)  # [E, R, width]
    send = torch.zeros(R, E, R, dtype=torch.int64)
    e_idx = torch.arange(E)[:, None, None].expand_as(overlap)
    r_idx = torch.arange(R)[None, :, None].expand_as(overlap)
    d_idx = dest[:, None, :].expand_as(overlap)
    send.index_put_((r_idx.reshape(-1), e_idx.reshape(-1), d_idx.reshape(-1)), overlap.reshape(-1), accumulate=True)
    return _assemble(send, slots, slot_home)


def plan_moonep_reference(counts: torch.Tensor, tokens_per_rank: int, top_k: int) -> MoonEPPlan:
    """`plan_moonep` with the placement as plain loops over integers: the twin it is tested to equal."""
    C = _check_counts(counts, tokens_per_rank, top_k)
    R, E = C.shape
    P = E // R
    remaining, chunks, slots, slot_home = _fill(C.sum(0).tolist(), R)
    counts_list = C.tolist()
    send = torch.zeros(R, E, R, dtype=torch.int64)
    for e in range(E):
        ranges = [(e // P, remaining[e])] + chunks[e]  # (dest, length) in order along e's copies
        bounds, pos = [], 0
        for d, length in ranges:
            bounds.append((d, pos, pos + length))
            pos += length
        start = 0
        for r in range(R):
            lo, hi = start, start + counts_list[r][e]
            for d, a, b in bounds:
                overlap = min(hi, b) - max(lo, a)
                if overlap > 0:
                    send[r, e, d] += overlap
            start = hi
    return _assemble(send, slots, slot_home)


def _check_counts(counts: torch.Tensor, tokens_per_rank: int, top_k: int) -> torch.Tensor:
    """The counts as a CPU int64 [R, E] tensor, or ValueError for a shape or value the planner cannot take."""
    if counts.dim() != 2 or counts.is_floating_point():
        raise ValueError(f"counts must be an integer [R, E] tensor, got {counts.dtype} {tuple(counts.shape)}")
    R, E = counts.shape
    if R < 1 or E % R != 0:
        raise ValueError(f"the number of experts E={E} must be a positive multiple of the number of ranks R={R}")
    C = counts.to(device="cpu", dtype=torch.int64)
    if bool((C < 0).any()):
        raise ValueError("counts must be non-negative")
    cap = tokens_per_rank * top_k
    routed = C.sum(1)
    if bool((routed > cap).any()):
        r = int(torch.nonzero(routed > cap)[0])
        raise ValueError(f"rank {r} routes {int(routed[r])} copies, more than S·K = {cap}")
    return C


def _fill(n: list[int], R: int):
    """Steps 1–2 on the copies per expert n [E]: returns (remaining[e] copies kept at home, chunks[e] =
    [(dest, count)] migrated in fill order, slots[d] = [(expert, count)], slot_home[d] or −1)."""
    E = len(n)
    P = E // R
    load = [sum(n[h * P:(h + 1) * P]) for h in range(R)]
    N = sum(load)
    target = [N // R + (1 if h < N % R else 0) for h in range(R)]
    remaining = list(n)
    chunks: list[list[tuple[int, int]]] = [[] for _ in range(E)]
    slots: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    slot_home = [-1] * R
    while True:
        deficit = [target[h] - load[h] for h in range(R)]
        u = max(range(R), key=lambda h: (deficit[h], -h))
        if deficit[u] <= 0:
            break
        o = max(range(R), key=lambda h: (-deficit[h], -h))
        q = deficit[u]
        assert load[o] - target[o] > 0 and load[o] >= q and slot_home[u] == -1
        slot_home[u] = o
        for e in sorted(range(o * P, (o + 1) * P), key=lambda e: (-remaining[e], e)):
            if q == 0:
                break
            take = min(q, remaining[e])
            if take == 0:
                continue
            remaining[e] -= take
            q -= take
            chunks[e].append((u, take))
            slots[u].append((e, take))
        assert q == 0
        load[o] -= deficit[u]
        load[u] = target[u]
    return remaining, chunks, slots, slot_home


def _assemble(send: torch.Tensor, slots: list[list[tuple[int, int]]], slot_home: list[int]) -> MoonEPPlan:
    R, E, _ = send.shape
    P = E // R
    slot_experts = torch.full((R, P), -1, dtype=torch.int64)
    slot_counts = torch.zeros(R, P, dtype=torch.int64)
    for d in range(R):
        assert len(slots[d]) <= P
        for i, (e, c) in enumerate(slots[d]):
            slot_experts[d, i] = e
            slot_counts[d, i] = c
    return MoonEPPlan(send=send, slot_experts=slot_experts, slot_counts=slot_counts,
                      slot_home=torch.tensor(slot_home, dtype=torch.int64), load=send.sum((0, 1)))
