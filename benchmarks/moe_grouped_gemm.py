"""MoE grouped GEMM throughput: the expert block as grouped GEMMs vs its ceiling and baselines.

Cases: the routed-expert shapes of the `small` preset (64 experts, L=384 → 2×320 → 384, top-8) and of K3
(L=3584 → 2×3072 → 3584, top-16; 32 and 128 local experts, as on an expert-parallel rank), each with
balanced routing and with Zipf-skewed routing (expert popularity ∝ 1/rank^0.7, sampled without
replacement per token; the max/mean expert load is printed). The 128-expert case runs the grouped path and
its ceiling only (the baselines would take most of the run). Implementations, side by side on the same inputs:
- `raw grouped_mm`: the three forward torch._grouped_mm calls alone on pre-sorted rows (the ceiling);
- `dense mm, same shapes`: the same two forward GEMMs as one dense cuBLAS matmul each (every row against expert
  0's weights): what the library reaches on these K and N without any grouping, the ceiling of the ceiling
  (thin experts, K = 320-384, are bound by their tiles' prologues and epilogues, not by the grouping);
- `grouped` : k3.ops.moe.grouped_latent_experts (plan, dispatch, grouped GEMMs + fused SiTU, weighted
  combine; forward, and forward+backward with the MoE gradient transform);
- `padded`  : LatentExperts.forward_reference (the padded-batch dispatch, bf16 autocast);
- `loop`    : one expert at a time (per-expert matmuls, bf16).
FLOPs: forward 6·M·L·I (M = tokens × k routed copies), forward+backward 18·M·L·I.
Correctness gate before timing: grouped vs an fp32 reference of the same routing, relative error
≤ 2e-2 (bf16 operands) for the output and the router-weight gradient.

    python -m benchmarks.moe_grouped_gemm            # one H200
    python -m benchmarks.moe_grouped_gemm --quick    # tiny shapes, correctness gate only (any device)
    python -m benchmarks.moe_grouped_gemm --wgrad torch auto   # the weight-gradient GEMMs on torch vs "auto"

Results: table "experts" of benchmarks/results/moe-grouped-gemm-<device>.json (not written by --quick unless
--out names a folder).
"""

from __future__ import annotations

import argparse
import time

import torch

from k3.model.moe import LatentExperts
from k3.ops import moe
from k3.ops.moe import dispatch_plan, grouped_latent_experts
from k3.ops.situ import naive_situ_glu

from benchmarks.provenance import save_result, table

CLAIM = ("The routed experts' function (plan, dispatch, grouped GEMMs, SiTU-GLU, combine) against the padded "
         "reference and a per-expert loop, with the raw grouped GEMMs and the dense cuBLAS matmul of the same shapes "
         "as ceilings; bf16")
PEAK_DENSE = 989e12
ANCHOR = 775e12  # the grouped-GEMM anchor: torch._grouped_mm, 32 experts × 1024 tokens, 7168→2048


IMPLS = ["raw grouped_mm (fwd GEMMs)", "dense mm, same shapes (fwd GEMMs)", "grouped fwd", "grouped fwd+bwd",
         "padded fwd+bwd", "loop fwd+bwd"]


def experts_table(cases: list[dict]) -> dict:
    """One row per (shape, routing), one "ms (TFLOP/s)" cell per implementation."""
    by_case: dict[tuple, dict] = {}
    for c in cases:
        s = c["shape"]
        key = (s["name"], s["E"], s["L"], s["I"], s["tokens"], s["k"], c["routing"])
        by_case.setdefault(key, {"load": c["max_over_mean"]})[c["impl"]] = c
    impls = IMPLS + sorted({c["impl"] for c in cases} - set(IMPLS))
    rows = []
    for (name, E, L, I, tokens, k, routing), cs in by_case.items():
        rows.append([f"{name}: {E} × ({L} → {2 * I} → {L}), {tokens // 1024}K tokens × {k}",
                     f"{routing} ({cs['load']:.2f})"]
                    + [f"{cs[i]['ms_median']:.3f} ({cs[i]['tflop_s']:.0f})" if i in cs else None for i in impls])
    columns = ["experts (L → 2I → L), tokens × top-k", "routing (max/mean load)", "raw `_grouped_mm` fwd",
               "dense mm, same shapes", "grouped fwd", "grouped fwd+bwd", "padded fwd+bwd", "loop fwd+bwd"]
    return table(columns + impls[len(IMPLS):], rows)


def zipf_routes(N, k, E, s, generator, device):
    """top-k experts per token, sampled without replacement with popularity ∝ 1/(rank+1)^s (s=0: uniform)."""
    logits = -s * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    gumbel = -torch.log(-torch.log(torch.rand(N, E, generator=generator).clamp_min(1e-20)))
    return torch.topk(logits + gumbel, k, dim=-1).indices.to(device)


def bench(fn, device):
    if device.type == "cuda":
        import triton

        q = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.25, 0.5, 0.75])
        return q[1], q[2] - q[0]
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[1], times[2] - times[0]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def loop_experts(z, idx, w, experts):
    """One expert at a time (the per-expert Python loop the grouped path replaces)."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    out = torch.zeros(N, z.shape[1], dtype=torch.float32, device=z.device)
    for e in range(experts.w1.shape[0]):
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        rows = z[pairs // k]
        act = naive_situ_glu(rows @ experts.w1[e].t(), rows @ experts.w3[e].t())
        y = act @ experts.w2[e].t()
        out.index_add_(0, pairs // k, y.float() * w.reshape(-1)[pairs, None])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: correctness gate and a smoke timing")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results; --quick: none)")
    parser.add_argument("--wgrad", nargs="+", choices=("auto", "torch", "triton"), default=["auto"],
                        help="k3.ops.moe.GROUPED_WGRAD settings to time the grouped path under (one row each)")
    parser.add_argument("--shapes", nargs="+", choices=("small", "k3"), default=["small", "k3"])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if args.quick:
        shapes = [("quick", 8, 64, 32, 256, 2)]
    else:  # name, E, L, I, tokens, k
        shapes = [("small", 64, 384, 320, 16384, 8), ("k3 (32 local)", 32, 3584, 3072, 2048, 16),
                  ("k3 (128 local)", 128, 3584, 3072, 8192, 16)]
        shapes = [shape for shape in shapes if shape[0].split()[0] in args.shapes]
    skews = [("balanced", 0.0), ("zipf s=0.7", 0.7)]
    dtype = torch.bfloat16 if cuda else torch.float32
    cases, rows = [], []
    g = torch.Generator().manual_seed(0)
    for name, E, L, I, N, k in shapes:
        experts = LatentExperts(E, L, I, 4.0, 25.0).to(device)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0.0, L ** -0.5)
        for skew_name, s in skews:
            idx = zipf_routes(N, k, E, s, g, device)
            loads = torch.bincount(idx.reshape(-1), minlength=E).float()
            imbalance = (loads.max() / loads.mean()).item()
            z = (torch.randn(N, L, generator=g) * 1.0).to(device, dtype).requires_grad_()
            w = torch.rand(N, k, generator=g).to(device).requires_grad_()
            M = N * k
            flops_fwd = 6 * M * L * I
            # correctness gate: grouped (bf16) vs fp32 reference of the same routing (on ≤ 2048 tokens)
            n = min(N, 2048)
            ref = experts.forward_reference(z[:n].float(), idx[:n], w[:n])
            out = grouped_latent_experts(z[:n], idx[:n], w[:n], experts.w1, experts.w3, experts.w2, 4.0, 25.0)
            dw_ref = torch.autograd.grad(ref.pow(2).sum(), w)[0][:n]
            dw_out = torch.autograd.grad(out.pow(2).sum(), w)[0][:n]
            gate = max(rel(out, ref), rel(dw_out, dw_ref))
            del ref, out
            if not gate <= 2e-2:
                raise SystemExit(f"correctness gate failed for {name}/{skew_name}: rel error {gate:.3e}")
            dy = torch.randn(N, L, device=device)
            w13 = torch.cat([experts.w1, experts.w3], 1).to(dtype)
            w2 = experts.w2.to(dtype)
            dest, offs, n_rows = dispatch_plan(idx, E, 8 if cuda else 1)
            xs = torch.randn(n_rows, L, device=device, dtype=dtype)
            act = torch.randn(n_rows, I, device=device, dtype=dtype)

            def raw():
                torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
                torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)

            def grouped_fwd():
                with torch.no_grad():
                    grouped_latent_experts(z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0)

            def grouped_fwd_bwd():
                o = grouped_latent_experts(z, idx, w, experts.w1, experts.w3, experts.w2, 4.0, 25.0)
                torch.autograd.backward(o, dy)

            def ctx():
                return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

            def padded_fwd_bwd():
                with ctx():
                    o = experts.forward_reference(z, idx, w)
                torch.autograd.backward(o, dy)

            def loop_fwd_bwd():
                with ctx():
                    o = loop_experts(z, idx, w, experts)
                torch.autograd.backward(o, dy)

            def with_wgrad(setting, fn):
                def run():
                    moe.GROUPED_WGRAD = setting
                    try:
                        return fn()
                    finally:
                        moe.GROUPED_WGRAD = "auto"
                return run

            def dense():  # M rows, as many as the routed copies
                xs[:M] @ w13[0].t()
                act[:M] @ w2[0].t()

            impls = [("raw grouped_mm (fwd GEMMs)", raw, flops_fwd)]
            if cuda:
                impls.append(("dense mm, same shapes (fwd GEMMs)", dense, flops_fwd))
            impls.append(("grouped fwd", grouped_fwd, flops_fwd))
            impls += [(f"grouped fwd+bwd (dW {setting})" if len(args.wgrad) > 1 else "grouped fwd+bwd",
                       with_wgrad(setting, grouped_fwd_bwd), 3 * flops_fwd) for setting in args.wgrad]
            impls += [("padded fwd+bwd", padded_fwd_bwd, 3 * flops_fwd), ("loop fwd+bwd", loop_fwd_bwd, 3 * flops_fwd)]
            if E > 64:
                impls = impls[:-2]
            base = None
            for impl, fn, flops in impls:
                try:
                    ms, iqr = bench(fn, device)
                except torch.OutOfMemoryError:
                    rows.append((name, skew_name, f"{imbalance:.2f}", impl, "OOM", "", "", ""))
                    continue
                if impl == "loop fwd+bwd":
                    base = ms
                tflops = flops / ms / 1e9
                cases.append({"shape": dict(name=name, E=E, L=L, I=I, tokens=N, k=k), "routing": skew_name,
                              "max_over_mean": imbalance, "impl": impl, "dtype": str(dtype), "ms_median": ms,
                              "ms_iqr": iqr, "tflop_s": tflops, "floor_ms": flops / ANCHOR * 1e3,
                              "floor_fraction": flops / ANCHOR * 1e3 / ms,
                              "correctness": {"metric": "rel err vs fp32 reference", "value": gate,
                                              "threshold": 2e-2}})
                rows.append((name, skew_name, f"{imbalance:.2f}", impl, f"{ms:.3f}", f"{iqr:.3f}", f"{tflops:.0f}",
                             f"{flops / ANCHOR * 1e3 / ms:.0%}"))
            if base is not None:
                for c in cases[-len(impls):]:
                    c["ratio_vs_loop"] = base / c["ms_median"]
            del z, w, xs, act
            if cuda:
                torch.cuda.empty_cache()
    header = ("shape", "routing", "max/mean", "impl", "ms", "IQR", "TFLOP/s", "of 775 anchor")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(v).rjust(wd) for v, wd in zip(r, widths)))
    if args.quick and not args.out:
        return
    experts_tab = experts_table(cases)
    experts_tab["note"] = ("ms (TFLOP/s), median of `triton.testing.do_bench`; every case passed the gate against the "
                           "fp32 reference (relative error ≤ 2e-2).")
    save_result("moe-grouped-gemm", CLAIM, {"experts": experts_tab}, raw={"cases": cases}, out=args.out)


if __name__ == "__main__":
    main()
