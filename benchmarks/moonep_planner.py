"""MoonEP planner cost: the tensor placement (`plan_moonep`) against its loop twin, same plans.

Routing: every rank sends S·K copies with Zipf-like expert popularity (weights u⁴, u uniform), the shape
of the skew Quantile Balancing removes over training. Prints ms per plan (best of 3) and the ratio.

    python benchmarks/moonep_planner.py     # table "plan" of benchmarks/results/moonep-planner-<device>.json
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.parallel.moonep import plan_moonep, plan_moonep_reference  # noqa: E402


def counts(R: int, E: int, S: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(E, generator=g) ** 4
    return torch.stack([torch.bincount(torch.multinomial(w, S * K, replacement=True, generator=g), minlength=E)
                        for _ in range(R)])


def best_ms(fn, *args) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'R':>4} {'E':>5} {'tensor ms':>10} {'loop ms':>9} {'speedup':>8}")
    rows = []
    for R, E in [(2, 64), (8, 64), (16, 896), (64, 896)]:
        C = counts(R, E, 4096, 16 if E == 896 else 8)
        S, K = 4096, 16 if E == 896 else 8
        a, b = plan_moonep(C, S, K), plan_moonep_reference(C, S, K)
        assert torch.equal(a.send, b.send) and torch.equal(a.slot_experts, b.slot_experts)
        t_tensor, t_loop = best_ms(plan_moonep, C, S, K), best_ms(plan_moonep_reference, C, S, K)
        print(f"{R:>4} {E:>5} {t_tensor:>10.1f} {t_loop:>9.1f} {t_loop / t_tensor:>7.1f}x")
        rows.append([R, E, round(t_tensor, 1), round(t_loop, 1), f"{t_loop / t_tensor:.1f}×"])
    save_result("moonep-planner", "The MoonEP planner's cost per plan (one thread, best of 3): the tensor placement "
                "against its loop twin, which gives the same plans", {"plan": table(
                    ["ranks", "experts", "tensor ms", "loop ms", "speed-up"], rows)})


if __name__ == "__main__":
    main()
