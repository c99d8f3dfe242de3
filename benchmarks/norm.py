"""The fused (gated) RMSNorm's launch settings (`k3.ops.norm.NORM_TILES`), side by side on one GPU.

Times the forward and the backward kernels (`rms_norm_forward_triton`, `rms_norm_backward_triton`; median of
`triton.testing.do_bench`, without autograd's host work, which would hide the kernels) at a 64K-token
step's norms: the residual stream's 768-wide rows (ungated) and KDA's gated output norm over 128-wide heads, bf16.
Each setting is checked against the fp64 torch norm first (bf16 outputs: ≤ 1e-2 relative; gradients ≤ 2e-2).
GB/s counts the unavoidable bytes (forward: read x (and the gate), write y; backward: read x, dy (and the gate),
write dx (and dgate)).

    python -m benchmarks.norm                 # one GPU
    python -m benchmarks.norm --quick         # tiny shapes, the gate only (CPU: the Triton interpreter)

On a GPU: table "settings" of benchmarks/results/norm-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.ops import norm  # noqa: E402

# (rows per program, warps, backward programs per SM, one-warp width): None the rule's choice; the first is the
# default (one row on one warp at 256 < D <= 1024 forward; the backward's measured rule,
# `NORM_TILES["measured_bwd"]`), the second the tile form before it
TABLE: list[list] = []  # the rows of the results file, as measured
SETTINGS = [(None, None, None, 1024), (None, None, None, 0), (1, 1, 32, 0), (2, 2, 8, 0), (2, 2, 16, 0),
            (4, 4, 8, 0), (8, 4, 8, 0), (16, 4, 8, 0)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(x, w, eps, gate):
    x64, w64 = x.double(), w.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    return y * torch.sigmoid(gate.double()) if gate is not None else y


def case(N, D, gated, device, settings):
    g = torch.Generator(device=device).manual_seed(D)
    x = torch.randn(N, D, device=device, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(D, device=device, generator=g))
    gate = torch.randn(N, D, device=device, generator=g).to(torch.bfloat16) if gated else None
    dy = torch.randn(N, D, device=device, generator=g).to(torch.bfloat16)
    leaves = [t.double().requires_grad_() for t in (x, w) + ((gate,) if gated else ())]
    ref = reference(leaves[0], leaves[1], 1e-6, leaves[2] if gated else None)
    ref_grads = torch.autograd.grad(ref, leaves, dy.double())
    rows, default = [], dict(norm.NORM_TILES)
    try:
        for block_m, warps, per_sm, width in settings:
            norm.NORM_TILES.update(block_m=block_m, num_warps=warps, bwd_per_sm=per_sm, one_warp_width=width,
                                   measured_bwd=(block_m, warps, per_sm, width) == SETTINGS[0])
            xs = [t.clone().requires_grad_() for t in (x, w) + ((gate,) if gated else ())]
            out = norm.rms_norm_triton(xs[0], xs[1], 1e-6, xs[2] if gated else None)
            grads = torch.autograd.grad(out, xs, dy)
            errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, ref_grads)]
            ok = errs[0] <= 1e-2 and all(e <= 2e-2 for e in errs[1:])
            label = f"{(block_m, warps, per_sm, width)}"
            if not ok or device != "cuda":
                print(f"[norm] N={N} D={D} gated={gated} {label}: errors {[f'{e:.1e}' for e in errs]} "
                      f"{'ok' if ok else 'FAILED'}", flush=True)
                rows.append((label, None, None, ok))
                continue
            from triton.testing import do_bench

            # the kernels alone (autograd's host work would hide them)
            fwd = do_bench(lambda: norm.rms_norm_forward_triton(x, w, 1e-6, gate), warmup=10, rep=100)
            _, rstd = norm.rms_norm_forward_triton(x, w, 1e-6, gate)
            bwd = do_bench(lambda: norm.rms_norm_backward_triton(x, w, rstd, dy, gate), warmup=10, rep=100)
            both = fwd + bwd
            t = 2 if gated else 1
            f_gbs = (t + 1) * N * D * 2 / fwd / 1e6
            b_gbs = (2 * t + 2) * N * D * 2 / (both - fwd) / 1e6
            rows.append((label, fwd, both - fwd, ok))
            TABLE.append([N, D, gated, label, round(fwd * 1e3), round(f_gbs), round((both - fwd) * 1e3), round(b_gbs)])
            print(f"[norm] N={N} D={D} gated={gated} {label}: fwd {fwd * 1e3:.0f} us ({f_gbs:,.0f} GB/s), "
                  f"bwd {(both - fwd) * 1e3:.0f} us ({b_gbs:,.0f} GB/s), errors {[f'{e:.1e}' for e in errs]}",
                  flush=True)
    finally:
        norm.NORM_TILES.update(default)
    return all(ok for *_, ok in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(70, 768, False), (40, 128, True)] if args.quick or device != "cuda" else \
        [(65536, 768, False), (65536 * 8, 128, True)]
    ok = all([case(N, D, gated, device, SETTINGS) for N, D, gated in shapes])
    if TABLE:
        save_result("norm", "The fused RMSNorm kernels' launch settings, forward and backward timed as kernels alone "
                    "(bf16): the small preset's 768-wide rows at 64K tokens and KDA's 128-wide gated heads",
                    {"settings": table(["rows", "D", "gated", "setting (rows, warps, bwd per SM, one-warp width)",
                                        "fwd µs", "fwd GB/s", "bwd µs", "bwd GB/s"], TABLE)})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
