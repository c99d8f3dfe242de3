"""flex_attention's launch options at the small preset's MLA shape, side by side in one process (one GPU).

The 32K-token profile of session 9 (docs/fast-paths.md) had flex's backward at 27.8 ms against 5.6 ms forward for
the six MLA layers: about 150 TFLOP/s where its forward reaches about 300. This times forward + backward of
`torch.compile(flex_attention)` with the document mask of packed training rows under each `kernel_options` set
(block sizes, warps, stages of the forward and backward kernels), checks each against the default's output and
gradients, and prints a table; `k3.ops.attention.FLEX_KERNEL_OPTIONS` takes the winner.

    python benchmarks/flex_options.py --options '[{}, {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64}]'
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def packed_documents(B: int, T: int, mean: int, generator: torch.Generator) -> torch.Tensor:
    """[B, T] document ids of rows packed with documents of exponential lengths (mean `mean`)."""
    ids = torch.empty(B, T, dtype=torch.int32)
    for b in range(B):
        t, d = 0, 0
        while t < T:
            n = max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=generator).item()))
            ids[b, t:t + n] = d
            t, d = t + n, d + 1
    return ids


def main() -> int:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default='[{}]', help="JSON list of kernel_options dicts ({} = flex's defaults)")
    ap.add_argument("--shape", default="8,4096,8,192,128", help="B,T,H,Dqk,Dv (the small preset: 8,4096,8,192,128)")
    ap.add_argument("--doc-mean", type=int, default=1500, help="mean document length of the packed rows")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    options = json.loads(args.options)
    B, T, H, Dqk, Dv = (int(x) for x in args.shape.split(","))
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    doc = packed_documents(B, T, args.doc_mean, gen).to(dev)

    def mask_mod(b, h, t, s):
        return (s <= t) & (doc[b, t] == doc[b, s])

    block_mask = create_block_mask(mask_mod, B, None, T, T, device=dev)
    q = torch.randn(B, H, T, Dqk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, H, T, Dqk, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, H, T, Dv, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, T, Dv, device=dev, dtype=torch.bfloat16)
    visible = block_mask.to_dense().sum().item() * 128 * 128 / B  # an upper bound: whole visible blocks
    # FLOPs of the visible (t, s) pairs: 2·(Dqk + Dv) forward, 2.5× that backward
    pairs = sum(((doc[b, :, None] == doc[b, None, :]) & torch.ones(T, T, device=dev, dtype=torch.bool).tril())
                .sum().item() for b in range(B))
    fwd_flops = 2 * (Dqk + Dv) * pairs * H
    compiled = torch.compile(flex_attention, dynamic=False)
    rows, ref = [], None
    for opts in options:
        t0 = time.time()
        try:
            def step():
                o = compiled(q, k, v, block_mask=block_mask, scale=Dqk ** -0.5, kernel_options=opts or None)
                return (o,) + torch.autograd.grad(o, (q, k, v), do)
            outs = step()
            torch.cuda.synchronize()
        except Exception as e:  # a config flex cannot build (shared memory, block sizes): reported, not fatal
            print(f"[flex] {json.dumps(opts)}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append((opts, None, None, None, "failed"))
            continue
        compile_s = time.time() - t0
        if ref is None:
            ref = [x.float() for x in outs]
        diff = max(((a.float() - r).norm() / r.norm()).item() for a, r in zip(outs, ref))
        times = {}
        for name, fn in (("fwd", lambda: compiled(q, k, v, block_mask=block_mask, scale=Dqk ** -0.5,
                                                  kernel_options=opts or None)), ("fwd+bwd", step)):
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[name] = start.elapsed_time(end) / args.iters
        bwd = times["fwd+bwd"] - times["fwd"]
        rows.append((opts, times["fwd"], bwd, diff, f"{compile_s:.0f} s compile"))
        print(f"[flex] {json.dumps(opts)}: fwd {times['fwd']:.3f} ms ({fwd_flops / times['fwd'] / 1e9:.0f} TF/s), "
              f"bwd {bwd:.3f} ms ({2.5 * fwd_flops / bwd / 1e9:.0f} TF/s), diff vs first {diff:.1e}", flush=True)
    print(f"flex_attention B={B} T={T} H={H} Dqk={Dqk} Dv={Dv}, documents of mean {args.doc_mean} "
          f"({pairs / B / T:.0f} visible keys per query; block-mask bound {visible / T:.0f})")
    print(f"{'kernel_options':70s} {'fwd ms':>8s} {'bwd ms':>8s} {'diff':>8s}")
    for opts, f, b, d, note in rows:
        print(f"{json.dumps(opts)[:70]:70s} " + (f"{f:8.3f} {b:8.3f} {d:8.1e}" if f is not None else f"{note:>26s}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
