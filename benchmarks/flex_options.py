"""flex_attention's launch options at the small preset's MLA shape, side by side in one process (one GPU).

flex's default backward runs at about half its forward's TFLOP/s on these shapes. This times forward + backward of
`torch.compile(flex_attention)` with the document mask of packed training rows under each `kernel_options` set
(block sizes, warps, stages of the forward and backward kernels), checks each against the default's output and
gradients, and prints a table; `k3.ops.attention.FLEX_KERNEL_OPTIONS` takes the winner.

    python benchmarks/flex_options.py --options '[{}, {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64}]'
    python benchmarks/flex_options.py --varlen     # also torch.nn.attention.varlen.varlen_attn (FlashAttention)

`--varlen` times PyTorch's FlashAttention varlen entry point on the same packed documents (cu_seqlens from the
ids, causal), first with the value head as it is and, if the kernel refuses a value head unlike the query's,
zero-padded to it (as the `flash` backend pads for FA2), against the first option's output and gradients.

The table goes to `--result-table` (default "options") of benchmarks/results/flex-options-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import save_result, table  # noqa: E402


def short_label(opts) -> str:
    """kernel_options as one short cell ("flex's defaults" for {})."""
    if isinstance(opts, str):
        return opts
    return ", ".join(f"{k.replace('bwd_num_', 'bwd ').replace('fwd_num_', 'fwd ')}={v}" for k, v in opts.items()) \
        or "flex's defaults"


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


def cuda_ms(fn, iters: int) -> float:
    """Mean ms per call of `fn` over `iters` calls between CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_varlen(q, k, v, do, doc, ref, scale, fwd_flops, iters):
    """varlen_attn on the packed rows of `doc` ([B, H, T, D] inputs as flex takes them): (label, fwd ms, bwd ms,
    max relative difference to `ref`, note)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        print(f"[varlen] not in this torch ({torch.__version__}): {e}", flush=True)
        return ("varlen_attn", None, None, None, "not in this torch")
    B, H, T, Dqk = q.shape
    Dv = v.shape[-1]
    flat = (doc + torch.arange(B, device=doc.device)[:, None] * (int(doc.max()) + 1)).reshape(-1)
    starts = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), B * T)]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    packed = [x.detach().transpose(1, 2).reshape(B * T, H, x.shape[-1]).requires_grad_() for x in (q, k, v)]
    do_p = do.transpose(1, 2).reshape(B * T, H, Dv)
    for pad in (0, Dqk - Dv):
        def fwd(pad=pad):
            vv = torch.nn.functional.pad(packed[2], (0, pad)) if pad else packed[2]
            o = varlen_attn(packed[0], packed[1], vv, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0))
            return o[..., :Dv]

        def step(fwd=fwd):
            o = fwd()
            return (o,) + torch.autograd.grad(o, packed, do_p)
        label = f"varlen_attn (value head {'padded to ' + str(Dqk) if pad else Dv})"
        try:
            outs = step()
            torch.cuda.synchronize()
        except Exception as e:
            print(f"[varlen] {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        as_flex = [x.reshape(B, T, H, -1).transpose(1, 2).float() for x in outs]
        diff = max(((a - r).norm() / r.norm()).item() for a, r in zip(as_flex, ref)) if ref else float("nan")
        times = {"fwd": cuda_ms(fwd, iters), "fwd+bwd": cuda_ms(step, iters)}
        bwd = times["fwd+bwd"] - times["fwd"]
        print(f"[varlen] {label}: fwd {times['fwd']:.3f} ms ({fwd_flops / times['fwd'] / 1e9:.0f} TF/s), "
              f"bwd {bwd:.3f} ms ({2.5 * fwd_flops / bwd / 1e9:.0f} TF/s), diff vs flex {diff:.1e}", flush=True)
        return (label, times["fwd"], bwd, diff, "")
    return ("varlen_attn", None, None, None, "failed")


def main() -> int:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default='[{}]', help="JSON list of kernel_options dicts ({} = flex's defaults)")
    ap.add_argument("--shape", default="8,4096,8,192,128", help="B,T,H,Dqk,Dv (the small preset: 8,4096,8,192,128)")
    ap.add_argument("--doc-mean", type=int, default=1500, help="mean document length of the packed rows")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--varlen", action="store_true", help="also time torch.nn.attention.varlen.varlen_attn")
    ap.add_argument("--result-table", default="options", help="the table of the results file this run writes")
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
        times = {"fwd": cuda_ms(lambda: compiled(q, k, v, block_mask=block_mask, scale=Dqk ** -0.5,
                                                 kernel_options=opts or None), args.iters),
                 "fwd+bwd": cuda_ms(step, args.iters)}
        bwd = times["fwd+bwd"] - times["fwd"]
        rows.append((opts, times["fwd"], bwd, diff, f"{compile_s:.0f} s compile"))
        print(f"[flex] {json.dumps(opts)}: fwd {times['fwd']:.3f} ms ({fwd_flops / times['fwd'] / 1e9:.0f} TF/s), "
              f"bwd {bwd:.3f} ms ({2.5 * fwd_flops / bwd / 1e9:.0f} TF/s), diff vs first {diff:.1e}", flush=True)
    if args.varlen:
        rows.append(time_varlen(q, k, v, do, doc, ref, Dqk ** -0.5, fwd_flops, args.iters))
    print(f"flex_attention B={B} T={T} H={H} Dqk={Dqk} Dv={Dv}, documents of mean {args.doc_mean} "
          f"({pairs / B / T:.0f} visible keys per query; block-mask bound {visible / T:.0f})")
    print(f"{'kernel_options':70s} {'fwd ms':>8s} {'bwd ms':>8s} {'diff':>8s}")
    for opts, f, b, d, note in rows:
        label = opts if isinstance(opts, str) else json.dumps(opts)
        print(f"{label[:70]:70s} " + (f"{f:8.3f} {b:8.3f} {d:8.1e}" if f is not None else f"{note:>26s}"))
    result = [[short_label(opts), round(f, 3), round(fwd_flops / f / 1e9), round(b, 3),
               round(2.5 * fwd_flops / b / 1e9), f"{d:.1e}"] if f is not None else
              [short_label(opts), None, None, None, None, note] for opts, f, b, d, note in rows]
    save_result("flex-options",
                "flex_attention's kernel_options for the MLA layers (`k3.ops.attention.FLEX_KERNEL_OPTIONS`) and "
                "PyTorch's FlashAttention varlen, forward and backward on packed documents",
                {args.result_table: table(["kernel_options", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s",
                                           "diff vs first"], result,
                                          note=f"B={B} T={T} H={H}, qk {Dqk}, v {Dv}, documents of mean "
                                               f"{args.doc_mean:,}.")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
