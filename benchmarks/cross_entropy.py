"""The training loss (lm_head + cross-entropy) three ways, side by side on the same inputs, forward+backward:
`reference` (full logits, fp32 `F.cross_entropy`), `chunked` (k3.ops.cross_entropy, torch softmax per chunk),
`triton` (chunked, each chunk's softmax and logit gradient by the Triton row kernel). bf16 autocast, fp32
master weights, the small preset's head (D = 768, V = 163,840) at 8K and 32K tokens, and K3's (D = 7,168)
at 8K. Reports ms (median of `triton.testing.do_bench`), speedup over the baseline (the reference, or the first
that fits), peak memory above the
inputs, and the loss and gradient differences to the reference (a gate: loss ≤ 1e-3 relative, gradients
≤ 2e-2). The reference is skipped where it would not fit.

`--rows-settings` times the row kernel's launches (`k3.ops.cross_entropy.LOSS_ROWS`): (a) the
kernel alone on a bf16 [rows, 163840] chunk at 1,638 and 6,553 rows for each setting, checked against the
per-row kernel (the default, first), with GB/s counted as the kernel's 2 reads + 1 write of the chunk and as the
1 read + 1 write minimum; (b) the whole loss, forward+backward, at 65,536 tokens of the small head for chunks of
2^28, 2^29, 2^30 logits × {the per-row kernel, the fastest other setting of (a) at 6,553 rows}, against today's
default (2^28 elements, 1,638 rows, per-row), with peak memory. About a minute on an H200.

On a GPU the default run writes table "vs-reference", --rows-settings tables "row-kernel" and "chunks" of
benchmarks/results/cross-entropy-<device>.json.

    python -m benchmarks.cross_entropy                   # one GPU
    python -m benchmarks.cross_entropy --rows-settings   # one GPU: the row kernel's launches and chunk sizes
    python -m benchmarks.cross_entropy --quick           # tiny shapes, gates only (CPU: the Triton interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from k3.ops import cross_entropy as ce  # noqa: E402
from k3.ops.cross_entropy import chunked_linear_cross_entropy, naive_linear_cross_entropy  # noqa: E402

from benchmarks.provenance import save_result, table  # noqa: E402

CLAIM = ("The lm_head + cross-entropy of training: the full-logit reference, the chunked torch form and the chunked "
         "form with the Triton row kernel (`loss_impl`), and the chunk size and launch of the row kernel")
# the rows of --rows-settings' two tables, as measured
ROWS_KERNEL: list[list] = []
CHUNKS: list[list] = []

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


# the row kernel's launch before --rows-settings timed others: the first setting, against which the rest are checked
PER_ROW = dict(form="per_row", programs_per_sm=1, BV=4096, warps=8, stages=None, reverse=False)


def rows_settings() -> list[dict]:
    """The row kernel's launches to compare: PER_ROW first, then persistent forms (and LOSS_ROWS if it is
    neither)."""
    p = dict(form="persistent", programs_per_sm=1, BV=4096, warps=8, stages=3, reverse=True)
    settings = [PER_ROW,
                dict(p, programs_per_sm=64, stages=None),  # ≥ rows programs: one per row, the second sweep reversed
                dict(p, reverse=False), p, dict(p, stages=4), dict(p, stages=None),
                dict(p, programs_per_sm=2), dict(p, programs_per_sm=2, stages=None),
                dict(p, programs_per_sm=4, stages=None), dict(p, BV=2048, stages=4), dict(p, BV=2048, stages=6),
                dict(p, BV=2048, warps=4, programs_per_sm=2, stages=4)]
    return settings + ([dict(ce.LOSS_ROWS)] if ce.LOSS_ROWS not in settings else [])


def label(s: dict) -> str:
    if s["form"] == "per_row":
        return f"per_row BV={s['BV']} w{s['warps']}"
    return (f"persistent {s['programs_per_sm']}/SM BV={s['BV']} w{s['warps']} stages={s['stages']}"
            + (" rev" if s["reverse"] else ""))


def time_rows_kernel(device: str, quick: bool) -> tuple[dict | None, bool]:
    """(a): each setting on a bf16 chunk, checked against the first; returns the fastest non-default setting at
    the larger chunk (the first persistent one when not timed) and whether every check passed."""
    V = 5000 if quick else 163840
    settings, ok, best = rows_settings(), True, {}
    print(f"(a) the row kernel alone, bf16 [rows, {V}], loss and gradient; GB/s as 3 passes | as 2 (the minimum)")
    for rows in (2, 7) if quick else (1638, 6553):
        g = torch.Generator(device=device).manual_seed(rows)
        logits = (torch.randn(rows, V, device=device, generator=g) * 2).to(torch.bfloat16)
        labels = torch.randint(0, V, (rows,), device=device, generator=g)
        labels[::9] = -100
        scratch = logits.clone()  # timed runs overwrite it with the gradient; the values stay finite
        ref = ce._loss_and_logit_grad_triton(logits.clone(), labels, -100, True, settings[0])
        for s in settings:
            loss, grad = ce._loss_and_logit_grad_triton(logits.clone(), labels, -100, True, s)
            d_loss = abs(loss.item() - ref[0].item()) / abs(ref[0].item())
            d_grad = (grad.float() - ref[1].float()).abs().max().item()
            good = d_loss <= 1e-5 and d_grad <= 1e-2
            ok &= good
            timing = ""
            if not quick:
                from triton.testing import do_bench

                ms = do_bench(lambda s=s: ce._loss_and_logit_grad_triton(scratch, labels, -100, True, s), warmup=5,
                              rep=100)
                chunk = rows * V * 2
                timing = f"{ms:7.3f} ms {3 * chunk / ms / 1e6:6.0f} | {2 * chunk / ms / 1e6:6.0f} GB/s"
                ROWS_KERNEL.append([rows, label(s), round(ms, 3), round(3 * chunk / ms / 1e6), round(2 * chunk / ms / 1e6)])
                if s is not settings[0] and good and (rows not in best or ms < best[rows][0]):
                    best[rows] = (ms, s)
            elif s is settings[3]:  # untimed: the persistent form at one program per SM
                best[rows] = (0.0, s)
            print(f"  rows={rows:5d} {label(s):48s} {timing:>34s}  diff loss {d_loss:.1e} grad {d_grad:.1e}"
                  + ("" if good else " FAIL"), flush=True)
        del logits, scratch, ref
    return (best[max(best)][1] if best else None), ok


def time_whole_loss(device: str, quick: bool, other: dict | None) -> bool:
    """(b): forward+backward at the small head for each chunk size × {per-row, `other`}, against today's
    default; returns whether every configuration matched it."""
    N, D, V = (150, 32, 3000) if quick else (65536, 768, 163840)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, D, device=device, generator=g)
    w = torch.randn(V, D, device=device, generator=g) * D ** -0.5
    y = torch.randint(0, V, (N,), device=device, generator=g)
    y[::9] = -100
    per_row = PER_ROW
    # the chunk limits in rows: 2^28, 2^29, 2^30 logits (at the quick shape, 32, 64, 128 rows)
    limits = {k: (1 << (k - 23)) if quick else (1 << k) // V for k in (28, 29, 30)}
    configs = [("2^28 today", limits[28], per_row)]  # today's rule: full chunks and a short last one
    for k, limit in limits.items():
        for s in (per_row, other) if other else (per_row,):
            configs.append((f"2^{k}", ce.balanced_chunk_rows(N, limit), s))
    print(f"(b) the whole loss, forward+backward, bf16 autocast, N={N} D={D} V={V}; x: today's time / this one's")
    saved, ok, base, base_ms = ce.LOSS_ROWS, True, None, None
    try:
        for name, chunk_rows, s in configs:
            ce.LOSS_ROWS = s
            fn = partial(chunked_linear_cross_entropy, chunk_rows=chunk_rows, rows_kernel=True)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start_mem = torch.cuda.memory_allocated() if device == "cuda" else 0
            out = run(fn, h, w, y, device)
            peak = (torch.cuda.max_memory_allocated() - start_mem) / 2**30 if device == "cuda" else float("nan")
            if base is None:
                base, note = out, "baseline"
            else:
                errs = [abs(out[0].item() - base[0].item()) / abs(base[0].item()), rel(out[1], base[1]),
                        rel(out[2], base[2])]
                good = errs[0] <= 1e-4 and max(errs[1:]) <= 1e-2
                ok &= good
                note = "diff loss {:.1e} dh {:.1e} dw {:.1e}{}".format(*errs, "" if good else " FAIL")
            del out
            timing = ""
            if not quick:
                from triton.testing import do_bench

                ms = do_bench(lambda fn=fn: run(fn, h, w, y, device), warmup=200, rep=500)
                base_ms = base_ms or ms
                timing = f"{ms:8.2f} ms {base_ms / ms:5.2f}x {peak:5.1f} GiB"
            chunks = -(-N // chunk_rows)
            if not quick:
                CHUNKS.append([name.split()[0], chunk_rows, chunks, label(s), round(ms, 2), f"{base_ms / ms:.2f}×",
                               round(peak, 1)])
            print(f"  {name:10s} {chunk_rows:5d} rows x {chunks:3d} {label(s):48s} {timing:>28s}  {note}", flush=True)
    finally:
        ce.LOSS_ROWS = saved
    return ok


def rows_settings_mode(device: str, quick: bool) -> int:
    if device == "cuda":
        print(torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    other, ok_a = time_rows_kernel(device, quick)
    if other is not None:
        print(f"(b) compares the per-row kernel with: {other}")
    ok_b = time_whole_loss(device, quick, other)
    if ROWS_KERNEL and CHUNKS:
        save_result("cross-entropy", CLAIM, {
            "row-kernel": table(["rows", "launch", "ms", "GB/s (3 passes)", "GB/s (2 passes)"], ROWS_KERNEL,
                                note="The row kernel alone over bf16 [rows, 163840] logits, loss and gradient."),
            "chunks": table(["logits per chunk", "rows per chunk", "chunks", "row kernel", "ms", "vs first row",
                             "peak GiB"], CHUNKS, note="The whole 65,536-token loss, forward + backward, D = 768, "
                                                       "V = 163,840, bf16 autocast.")})
    return 0 if ok_a and ok_b else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows-settings", action="store_true", help="the row kernel's launches and the chunk sizes")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or device != "cuda"
    if args.rows_settings:
        return rows_settings_mode(device, quick)
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
    if not quick:
        save_result("cross-entropy", CLAIM, {"vs-reference": table(
            ["head", "tokens", "D", "impl", "ms (fwd+bwd)", "vs first row", "peak GiB"],
            [[r[0], r[1], r[2], r[3], "out of memory" if r[4] is None else round(r[4], 2),
              None if r[5] is None else f"{r[5]:.2f}×", None if r[6] is None else round(r[6], 1)] for r in rows],
            note="V = 163,840; bf16 autocast. The row kernel is `loss_impl=\"triton\"` (\"auto\" on CUDA).")})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
