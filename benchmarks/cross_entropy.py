"""The training loss (lm_head + cross-entropy) three ways, side by side on the same inputs, forward+backward:
`reference` (full logits, fp32 `F.cross_entropy`), `chunked` (k3.ops.cross_entropy, torch softmax per chunk),
`triton` (chunked, each chunk's softmax and logit gradient by the Triton row kernel). bf16 autocast, fp32
master weights, the small preset's head (D = 768, V = 163,840) at 8K and 32K tokens, and K3's (D = 7,168)
at 8K. Reports ms (median of `triton.testing.do_bench`), speedup over the baseline (the reference, or the first
that fits), peak memory above the
inputs, and the loss and gradient differences to the reference (a gate: loss ≤ 1e-3 relative, gradients
≤ 2e-2). The reference is skipped where it would not fit.

    python -m benchmarks.cross_entropy            # one GPU
    python -m benchmarks.cross_entropy --quick    # tiny shapes, gate only (CPU: the Triton interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from k3.ops.cross_entropy import chunked_linear_cross_entropy, naive_linear_cross_entropy  # noqa: E402

IMPLS = {
    "reference": naive_linear_cross_entropy,
    "chunked": chunked_linear_cross_entropy,
    "triton": lambda h, w, y: chunked_linear_cross_entropy(h, w, y, rows_kernel=True),
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(fn, h, w, y, device):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = fn(hh, ww, y)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or device != "cuda"
    shapes = [("tiny", 300, 64, 5000)] if quick else [("small", 8192, 768, 163840), ("small", 32768, 768, 163840),
                                                       ("k3", 8192, 7168, 163840)]
    rows, ok = [], True
    for preset, N, D, V in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(N, D, device=device, generator=g)
        w = torch.randn(V, D, device=device, generator=g) * D ** -0.5
        y = torch.randint(0, V, (N,), device=device, generator=g)
        y[::9] = -100
        base = ref_ms = None  # the first implementation that runs is the baseline (the reference if it fits)
        for name, fn in IMPLS.items():
            if name == "reference" and N * V * 16 > 0.6 * (torch.cuda.mem_get_info()[0] if device == "cuda" else 1 << 40):
                rows.append((preset, N, D, name, None, None, None, "skipped (memory)"))
                continue
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start_mem = torch.cuda.memory_allocated() if device == "cuda" else 0
            out = run(fn, h, w, y, device)
            peak = (torch.cuda.max_memory_allocated() - start_mem) / 2**30 if device == "cuda" else float("nan")
            if base is None:
                base = out
                note = "baseline"
            else:
                errs = [abs(out[0].item() - base[0].item()) / abs(base[0].item()), rel(out[1], base[1]),
                        rel(out[2], base[2])]
                good = errs[0] <= 1e-3 and max(errs[1:]) <= 2e-2
                ok &= good
                note = "diff loss {:.1e} dh {:.1e} dw {:.1e}{}".format(*errs, "" if good else " FAIL")
            ms = None
            if not quick:
                from triton.testing import do_bench

                ms = do_bench(lambda fn=fn: run(fn, h, w, y, device), warmup=3, rep=30)
            ref_ms = ref_ms or ms
            rows.append((preset, N, D, name, ms, ref_ms / ms if ms else None, peak, note))
            del out
    for r in rows:
        ms = "" if r[4] is None else f"{r[4]:9.2f} ms"
        speed = "" if r[5] is None else f"{r[5]:5.2f}x"
        mem = "" if r[6] is None or r[6] != r[6] else f"{r[6]:6.1f} GiB"
        print(f"{r[0]:6s} N={r[1]:6d} D={r[2]:5d} {r[3]:10s} {ms:>12s} {speed:>7s} {mem:>10s}  {r[7]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
