"""Block AttnRes on one GPU: the reads of one block in the fused two-phase form (one phase 1 over the sealed
sources for all J queries, then J merges) against the fused direct read (one read over every source per
query), side by side on the same inputs, forward and forward+backward.

Legend: n sealed sources, J reads per block, N rows (tokens), D model width.

Shapes: the small preset at 32K tokens per step (N = 32768, D = 768, J = 7 reads: its last block's 6 plus the
output read, the most any block makes), n = 1, 4 and 7 sealed sources; fp32 sources and partial sums, as in the
model. Times: median of `triton.testing.do_bench` (ms). Forward+backward includes the
autograd engine's sums of the direct read's per-read source gradients, which the two-phase form does not make.
A gate (both against the torch two-phase form in fp64, ≤ 1e-5) runs first.

    python -m benchmarks.attn_res            # one GPU
    python -m benchmarks.attn_res --quick    # small shapes, gate only (CPU: through the Triton interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from k3.model.attn_res import block_reads  # noqa: E402
from k3.ops.attn_res import attn_res_read_triton  # noqa: E402


def block_inputs(n, J, N, D, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    sealed = [torch.randn(1, N, D, device=device, generator=g) * (1 + i) for i in range(n)]  # [B=1, T=N, D]
    partials = [torch.randn(1, N, D, device=device, generator=g) * 2 for _ in range(J)]
    queries = torch.randn(J, D, device=device, generator=g) * 0.05
    douts = [torch.randn(1, N, D, device=device, generator=g) for _ in range(J)]
    return sealed, partials, queries, douts


def direct_block(sealed, partials, queries):
    """Read j over sealed + [partial j] (the first read of a block has no partial: the sealed sources alone)."""
    return [attn_res_read_triton(queries[j], sealed + ([partials[j]] if j else [])) for j in range(len(partials))]


def two_phase_block(sealed, partials, queries, fused=True):
    """The same reads as the model's two-phase wiring makes them (`block_reads`; fused False: the torch form)."""
    read = block_reads(queries, sealed, fused)
    return [read(j, queries[j], partials[j] if j else None) for j in range(len(partials))]


def reference_block(sealed, partials, queries):
    return two_phase_block(sealed, partials, queries, fused=False)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_with_grads(fn, sealed, partials, queries, douts, dtype):
    leaves = [[t.detach().to(dtype).requires_grad_() for t in ts] for ts in (sealed, partials)]
    q = queries.detach().to(dtype).requires_grad_()
    outs = fn(*leaves, q)
    torch.autograd.backward(outs, [d.to(o.dtype) for o, d in zip(outs, douts)])
    return outs, [t.grad for t in leaves[0] + leaves[1][1:]] + [q.grad]


def gate(device, n=4, J=7, N=300, D=96):
    inputs = block_inputs(n, J, N, D, device, seed=1)
    ref_out, ref_grads = run_with_grads(reference_block, *inputs, torch.float64)
    errs = {}
    for name, fn in (("direct", direct_block), ("two-phase", two_phase_block)):
        out, grads = run_with_grads(fn, *inputs, torch.float32)
        errs[name] = max([rel(a, b) for a, b in zip(out, ref_out)] + [rel(a, b) for a, b in zip(grads, ref_grads)])
    return errs, all(e <= 1e-5 for e in errs.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    errs, ok = gate(device)
    print("correctness gate (fp32 vs the fp64 two-phase form):", {k: f"{v:.1e}" for k, v in errs.items()},
          "ok" if ok else "FAILED")
    if not ok:
        return 1
    if args.quick or device != "cuda":
        return 0
    from triton.testing import do_bench

    N, D, J = 32768, 768, 7
    print(f"AttnRes reads of one block, N={N} D={D} J={J} fp32 (ms; ratio = direct / two-phase)")
    print(f"{'sealed':>6}  {'direct fwd':>10}  {'2-phase fwd':>11}  {'ratio':>5}  {'direct f+b':>10}  "
          f"{'2-phase f+b':>11}  {'ratio':>5}")
    for n in (1, 4, 7):
        sealed, partials, queries, douts = block_inputs(n, J, N, D, device)
        times = {}
        for name, fn in (("direct", direct_block), ("two-phase", two_phase_block)):
            with torch.no_grad():
                fwd = do_bench(lambda: fn(sealed, partials, queries), warmup=5, rep=50)
            leaves = [t.clone().requires_grad_() for t in sealed + partials] + [queries.clone().requires_grad_()]

            def step(fn=fn, leaves=leaves):
                outs = fn(leaves[:n], leaves[n:n + J], leaves[-1])
                torch.autograd.backward(outs, douts)

            both = do_bench(step, warmup=5, rep=50, grad_to_none=leaves)
            times[name] = (fwd, both)
        (df, db), (tf, tb) = times["direct"], times["two-phase"]
        print(f"{n:>6}  {df:>10.3f}  {tf:>11.3f}  {df / tf:>5.2f}  {db:>10.3f}  {tb:>11.3f}  {db / tb:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
