"""The routed experts' two weight-gradient grouped GEMMs: `torch._grouped_mm` against the Triton kernel of
`k3.ops.grouped_gemm` at several tile configs, on the same operands.

For an expert L → 2I → L with M routed rows (tokens × k, padded per expert as the MoE pads them):
  dw2    dyᵀ @ act  -> [G, L, I]
  dw13   dhᵀ @ x    -> [G, 2I, L]
TFLOP/s count 2·M·K·N per GEMM with M the routed rows (not the padding). Correctness gate: every Triton
result against `torch._grouped_mm` on the same bf16 operands, relative error ≤ 1e-2 (both accumulate in fp32;
the difference is the summation order and one bf16 rounding of the output). The best config per GEMM goes to
table "weight-gradients" of benchmarks/results/grouped-gemm-triton-<device>.json (not with --quick).

    python -m benchmarks.grouped_gemm_triton                 # one H200: the small preset's experts at 16K and
                                                             # 32K tokens, K3's 32 local experts; skewed routing
    python -m benchmarks.grouped_gemm_triton --quick         # tiny shapes through the interpreter (CPU)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if "--quick" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from k3.ops import grouped_gemm  # noqa: E402
from k3.ops.moe import dispatch_plan  # noqa: E402

from benchmarks.moe_grouped_gemm import zipf_routes  # noqa: E402
from benchmarks.provenance import save_result, table  # noqa: E402

WGRAD_CONFIGS = [dict(BM=128, BN=128, BK=64, warps=8, stages=3), dict(BM=128, BN=128, BK=64, warps=4, stages=4),
                 dict(BM=128, BN=128, BK=128, warps=8, stages=3), dict(BM=64, BN=128, BK=64, warps=4, stages=4),
                 dict(BM=128, BN=64, BK=64, warps=4, stages=3), dict(BM=128, BN=256, BK=64, warps=8, stages=3)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def cfg_name(c):
    return f"{c['BM']}x{c['BN']}x{c['BK']} w{c['warps']} s{c['stages']}"


def gemms(E, L, I, M_pad, offs, device, dtype, g):
    """The two weight-gradient GEMMs as (name, torch fn, triton fn(cfg), K, N)."""
    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.5).to(device, dtype)

    x, act, dy, dh = rnd(M_pad, L), rnd(M_pad, I), rnd(M_pad, L), rnd(M_pad, 2 * I)

    def torch_wgrad(a, b):
        if device.type == "cuda":
            return torch._grouped_mm(a, b, offs=offs)
        return grouped_gemm.grouped_mm_wgrad_reference(a, b, offs)

    wg = grouped_gemm.grouped_mm_wgrad
    return [("dw2", lambda: torch_wgrad(dy.t(), act), lambda c: wg(dy.t(), act, offs, c), L, I),
            ("dw13", lambda: torch_wgrad(dh.t(), x), lambda c: wg(dh.t(), x, offs, c), 2 * I, L)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=None, help="only these shape names (e.g. 'small 32K')")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if args.quick:
        shapes = [("quick", 4, 32, 24, 64, 2, 0.7)]
        wg_cfgs = [dict(BM=16, BN=16, BK=16, warps=4, stages=2)]
        dtype = torch.bfloat16 if cuda else torch.float32
    else:  # name, E, L, I, tokens, k, Zipf exponent
        shapes = [("small 16K", 64, 384, 320, 16384, 8, 0.7), ("small 32K", 64, 384, 320, 32768, 8, 0.7),
                  ("small 32K balanced", 64, 384, 320, 32768, 8, 0.0),
                  ("k3 32 local", 32, 3584, 3072, 2048, 16, 0.7)]
        wg_cfgs, dtype = WGRAD_CONFIGS, torch.bfloat16
        shapes = [shape for shape in shapes if args.shapes is None or shape[0] in args.shapes]
    if cuda:
        from triton.testing import do_bench
    g = torch.Generator().manual_seed(0)
    results, lines, rows = [], [], []
    for name, E, L, I, N, k, s in shapes:
        idx = zipf_routes(N, k, E, s, g, device)
        _, offs, M_pad = dispatch_plan(idx, E, 8 if cuda else 1)
        M = N * k
        totals = {"torch": 0.0, "best": 0.0}
        for gname, torch_fn, triton_fn, K, Nc in gemms(E, L, I, M_pad, offs, device, dtype, g):
            flops = 2 * M * K * Nc
            ref = torch_fn()
            t_ms = do_bench(torch_fn, warmup=10, rep=100) if cuda else float("nan")
            best = None
            for c in wg_cfgs:
                try:
                    out = triton_fn(c)
                    err = rel(out, ref)
                    if not err <= 1e-2:
                        raise SystemExit(f"correctness gate failed: {name} {gname} {cfg_name(c)} rel {err:.2e}")
                    ms = do_bench(lambda: triton_fn(c), warmup=10, rep=100) if cuda else float("nan")
                except SystemExit:
                    raise
                except Exception as exc:  # a config that does not compile (shared memory): recorded, skipped
                    print(f"  {name} {gname} {cfg_name(c)}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                results.append(dict(shape=name, gemm=gname, config=c, ms=ms, torch_ms=t_ms, rel_err=err,
                                    tflops=flops / ms / 1e9, torch_tflops=flops / t_ms / 1e9))
                if best is None or ms < best[0]:
                    best = (ms, c, err)
            totals["torch"] += t_ms
            totals["best"] += best[0]
            lines.append((name, gname, f"{K}x{Nc}", f"{t_ms:.3f}", f"{flops / t_ms / 1e9:.0f}", f"{best[0]:.3f}",
                          f"{flops / best[0] / 1e9:.0f}", f"{t_ms / best[0]:.2f}", cfg_name(best[1]), f"{best[2]:.1e}"))
            c = best[1]
            rows.append([name, {"dw2": "dW2", "dw13": "dW13"}[gname], f"{t_ms:.3f} ({flops / t_ms / 1e9:.0f})",
                         f"{best[0]:.3f} ({flops / best[0] / 1e9:.0f})", f"{t_ms / best[0]:.2f}×",
                         f"{c['BM']}×{c['BN']}×{c['BK']}, {c['warps']} warps, {c['stages']} stages"])
        fl = 6 * M * L * I
        lines.append((name, "both", "", f"{totals['torch']:.3f}", f"{fl / totals['torch'] / 1e9:.0f}",
                      f"{totals['best']:.3f}", f"{fl / totals['best'] / 1e9:.0f}",
                      f"{totals['torch'] / totals['best']:.2f}", "best per GEMM", ""))
    header = ("shape", "gemm", "K x N", "torch ms", "TF/s", "triton ms", "TF/s", "ratio", "best config", "rel err")
    widths = [max(len(str(r[i])) for r in lines + [header]) for i in range(len(header))]
    for r in [header] + lines:
        print("  ".join(str(v).rjust(wd) for v, wd in zip(r, widths)), flush=True)
    if not args.quick:
        save_result("grouped-gemm-triton",
                    "The routed experts' weight-gradient GEMMs: `torch._grouped_mm` against the Triton kernel "
                    "(`k3.ops.grouped_gemm.grouped_mm_wgrad`) at its best tile config per shape; bf16",
                    {"weight-gradients": table(["shape (Zipf 0.7 unless said)", "GEMM", "torch ms (TFLOP/s)",
                                                "Triton ms (TFLOP/s)", "speed-up", "best tile"], rows,
                                               note="TFLOP/s on the routed rows; every Triton result within 1e-2 "
                                                    "of torch's.")},
                    raw={"results": results})


if __name__ == "__main__":
    main()
