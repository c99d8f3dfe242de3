"""KDA kernels: ours (`k3.ops.kda.chunk_kda`, `fused_recurrent_kda`) against fla-core's on one GPU.

The baseline (fla-core 0.6.0 with the K3 settings: in-kernel gate with lower bound −5 and safe gate, in-kernel L2
norm and β sigmoid, FLA_FLASH_KDA=0) runs in the same process on the same inputs, alternating with ours; a
correctness gate runs first (small shape against the fp64 recurrence with the test tolerances, and every timed
shape against fla); times are medians of `triton.testing.do_bench` samples (L2 flushed) over 5 alternating
repeats. Reports ms, IQR, ratio (fla ÷ ours), achieved TB/s of unavoidable bytes, fraction of the memory floor at
4.25 TB/s, TFLOP/s, peak memory.

    python -m benchmarks.kda            # all cases on the GPU (fla optional: ours alone without it)
    python -m benchmarks.kda --fla-configs 1 --accuracy \\
        --fla-cases 'fwd B=1 T=8192 H=96,fwd+bwd B=1 T=8192 H=96,decode B=64 T=1 H=96'   # the headline run
    python -m benchmarks.kda --cases none --compare '[{}, {"bwd_k_maxnreg": 168}]'   # TUNING alternatives
    python -m benchmarks.kda --quick    # tiny shapes; on CPU through the Triton interpreter

Results: benchmarks/results/kda-<device>.json (`provenance.save_result`; --quick writes only with --out), whose
tables a run replaces where it measures them: "cases" and "targets" (the timed cases), "accuracy" (--accuracy),
"compare", "compare-accuracy" and "kernels" (--compare; the kernel split of its first config). The file's
"variants" and "pipeline" tables are kept from the runs that measured them.

Legend: B batch, T tokens, H heads, K = V = 128 head dims.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
import torch  # noqa: E402

if not torch.cuda.is_available():
    # must precede the first import of triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402

from k3.ops.kda import chunk_kda, fused_recurrent_kda, naive_kda_gate, naive_recurrent_kda  # noqa: E402
from k3.ops.kda import chunk as kda_chunk  # noqa: E402

from benchmarks.provenance import RESULTS, device_slug, save_result  # noqa: E402
from benchmarks.provenance import table as result_table  # noqa: E402

BANDWIDTH = 4.25e12  # measured device copy bandwidth of an H200
PEAK_FLOPS = 807e12
VARLEN_MIX = [1300, 547, 2048, 963, 271, 3063]
# the faster, less accurate storage variants (docs/kda-kernels.md), timed with --variants
VARIANTS = {"k3 state-bf16": {"state_bf16": True}, "k3 all-bf16": {"all_bf16": True, "state_bf16": True},
            "k3 recompute": {"save_intermediates": False}}  # the backward recomputes the prepare and _state
TOL = {"o": 5e-3, "S": 5e-3, "q": 8e-3, "k": 8e-3, "v": 8e-3, "h0": 8e-3, "dt_bias": 8e-3,
       "z": 2e-2, "A_log": 2e-2, "b": 2e-2}
CLAIM = ("KDA Triton kernels (chunk_kda forward, forward + backward, fused_recurrent_kda decode) against fla-core at "
         "the K3 layer shape on one GPU: times, errors against the fp64 recurrence, the per-kernel split, and the "
         "kernel variants tried")
# the targets at the K3 shape: 2x and 1.5x the fully autotuned fla times, as limits on our ms; decode as a ratio
TARGETS = [("forward ≥ 2× fla", "fwd B=1 T=8192 H=96", "ms", 1.3),
           ("forward + backward ≥ 1.5× fla", "fwd+bwd B=1 T=8192 H=96", "ms", 8.8),
           ("decode ≥ 1.2× fla", "decode B=64 T=1 H=96", "ratio", 1.2)]
# the rows of the "accuracy" tables, by `accuracy_table`'s names
ERROR_NAMES = {"o": "o", "S": "final state S", "q": "dq", "k": "dk", "v": "dv", "z": "dz (gate logits)",
               "b": "dβ (logits)", "A_log": "dA_log", "dt_bias": "ddt_bias", "h0": "dh0",
               "o_inf": "o, inference forward", "S_inf": "S, inference forward"}
# the KDA kernels of the "kernels" table, in launch order, with the stage each belongs to
KERNEL_STAGES = {"_prep_gate": "prepare", "_prep_intra": "prepare", "_prep_solve": "prepare", "_prep_wu": "prepare",
                 "_state": "training forward: state pass", "_fwd_o": "training forward: output",
                 "_state_bwd": "backward: state pass", "_bwd_vk": "backward: key slices",
                 "_bwd_vv": "backward: value side", "_bwd_k_block": "backward: scores", "_bwd_gate": "backward: gate",
                 "_bwd_norms": "backward: norms and β",
                 "_prefill_prepare": "inference forward: prepare (all segments)",
                 "_prefill_state": "inference forward: state pass (all segments)"}


def load_fla(max_configs: int = 0):
    """fla's chunk_kda and in-place decode kernel, or None. max_configs > 0 keeps that many (evenly spaced)
    of each fla autotuner's configs: a full autotune compiles ~180 configs per shape key, more device time
    than a run can spend, so runs that set it say so."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_recurrent
    except Exception:
        return None
    if max_configs > 0:
        from triton.runtime.autotuner import Autotuner

        for name, mod in list(sys.modules.items()):
            if not name.startswith("fla.") or mod is None:
                continue
            for x in list(vars(mod).values()):
                for _ in range(4):  # heuristics wrap the autotuner
                    if isinstance(x, Autotuner):
                        n = len(x.configs)
                        if n > max_configs:
                            x.configs = [x.configs[(2 * i + 1) * n // (2 * max_configs)] for i in range(max_configs)]
                        break
                    x = getattr(x, "fn", None)
    return fla_chunk, fla_recurrent


def raw_inputs(B, T, H, K=128, V=128, N=None, seed=0, device="cuda", h0=False):
    """Raw layer inputs in bf16 (q, k as after conv + SiLU), fp32 gate parameters, optional fp32 state."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k = F.silu(randn(B, T, H, K)), F.silu(randn(B, T, H, K))
    v, z, b = randn(B, T, H, V), randn(B, T, H, K), randn(B, T, H)
    A_log = torch.rand(H, generator=gen, device=device)
    dt = torch.exp(torch.rand(H * K, generator=gen, device=device) * (2.303 * 2) - 6.908)  # logU(1e-3, 1e-1)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    state = randn(B if N is None else N, H, K, V) if h0 else None
    return [x.bfloat16() for x in (q, k, v, z, b)] + [A_log, dt_bias, state]


def ours_fn(ins, cu, **kw):
    return chunk_kda(*ins[:7], initial_state=ins[7], output_final_state=True, cu_seqlens=cu, **kw)


def fla_fn(fla, ins, cu):
    q, k, v, z, b, A_log, dt_bias, h0 = ins
    return fla[0](q, k, v, z, b, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                  A_log=A_log, dt_bias=dt_bias, cu_seqlens=None if cu is None else cu.long())


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def grads_of(fn, ins, do, dS):
    ins = [x.detach().requires_grad_() if x is not None else None for x in ins]
    o, S = fn(ins)
    live = [x for x in ins if x is not None]
    g = torch.autograd.grad((o, S), live, (do.to(o.dtype), dS))
    return o.detach(), S.detach(), list(g)


def reference_fn(ins, cu):
    q, k, v, z, b, A_log, dt_bias, h0 = (None if x is None else x.double() for x in ins)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = naive_kda_gate(z, A_log, dt_bias, -5.0)
    return naive_recurrent_kda(qn, kn, v, g, torch.sigmoid(b), initial_state=h0, output_final_state=True,
                               cu_seqlens=None if cu is None else cu.cpu())


@contextlib.contextmanager
def prefill_at_every_size():
    """chunk_kda's inference forward in its own kernels whatever the shape (`prefill_applies`), if TUNING["prefill"]
    is on: the accuracy checks run at small head counts, where chunk_kda would take the 64-token ones."""
    saved = kda_chunk.TUNING["prefill_min_programs"]
    kda_chunk.TUNING["prefill_min_programs"] = 0
    try:
        yield
    finally:
        kda_chunk.TUNING["prefill_min_programs"] = saved


def small_gate(device, **kw):
    """Small shape against the fp64 recurrence with the test tolerances (forward and every gradient)."""
    ins = raw_inputs(1, 300, 2, seed=7, device=device, h0=True)
    gen = torch.Generator(device=device).manual_seed(8)
    do = torch.randn(1, 300, 2, 128, generator=gen, device=device)
    dS = torch.randn(1, 2, 128, 128, generator=gen, device=device)
    tri = grads_of(lambda x: ours_fn(x, None, **kw), ins, do, dS)
    ref = grads_of(lambda x: reference_fn(x, None), [x.double() for x in ins], do.double(), dS.double())
    errs = {"o": rel(tri[0], ref[0]), "S": rel(tri[1], ref[1])}
    errs.update({n: rel(a, r) for n, a, r in zip(("q", "k", "v", "z", "b", "A_log", "dt_bias", "h0"), tri[2], ref[2])})
    # the inference forward (no backward can follow) is its own kernels (`chunk_prefill.py`, TUNING["prefill"]), which
    # chunk_kda picks only with enough programs to fill the GPU: here at this small shape too
    with torch.no_grad(), prefill_at_every_size():
        o, S = ours_fn(ins, None, **kw)
    errs.update({"o_inference": rel(o, ref[0]), "S_inference": rel(S, ref[1])})
    return errs, all(e <= TOL[n.removesuffix("_inference")] for n, e in errs.items())


def accuracy_table(configs, fla, device, quick):
    """Relative RMSE against the fp64 recurrence, forward and every gradient, at T = 8192, H = 4 (dense, and the
    varlen mix of long, short and one-token documents; the fp64 autograd reference must fit), for each TUNING override set and for fla on the same
    inputs: the target "never worse than 1.5× fla" beside the absolute limits. Prints one table, returns the rows."""
    names = ("o", "S", "q", "k", "v", "z", "b", "A_log", "dt_bias", "h0", "o_inf", "S_inf")
    T, H = (300, 2) if quick else (8192, 4)
    base = dict(kda_chunk.TUNING)
    rows = []
    for lengths in (None, VARLEN_MIX if not quick else [100, 1, 199]):
        cu = None if lengths is None else cu_tensor(lengths, device)
        ins = raw_inputs(1, T, H, N=None if lengths is None else len(lengths), seed=11, device=device, h0=True)
        gen = torch.Generator(device=device).manual_seed(12)
        do = torch.randn(1, T, H, 128, generator=gen, device=device)
        dS = torch.randn(ins[7].shape, generator=gen, device=device)
        ref = grads_of(lambda x: reference_fn(x, cu), [x.double() for x in ins], do.double(), dS.double())
        impls = [(json.dumps(cfg), cfg) for cfg in configs] + ([("fla", None)] if fla is not None else [])
        for label, cfg in impls:
            kda_chunk.TUNING.clear()
            kda_chunk.TUNING.update(base, **(cfg or {}))
            fn = (lambda x: fla_fn(fla, x, cu)) if cfg is None else (lambda x: ours_fn(x, cu))
            out = grads_of(fn, ins, do, dS)
            errs = [rel(out[0], ref[0]), rel(out[1], ref[1])] + [rel(a, r) for a, r in zip(out[2], ref[2])]
            with torch.no_grad(), prefill_at_every_size():  # ours: the inference forward's kernels (fla: the same)
                o, S = fn(ins)
            errs += [rel(o, ref[0]), rel(S, ref[1])]
            rows.append({"case": "dense" if lengths is None else "varlen", "impl": label, **dict(zip(names, errs))})
            print(f"[accuracy] {rows[-1]['case']} {label}: " + ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs)),
                  flush=True)
    kda_chunk.TUNING.clear()
    kda_chunk.TUNING.update(base)
    print(f"relative RMSE vs fp64 at T={T} H={H} (limits: o, S 5e-3; q, k, v, h0, dt_bias 8e-3; z, b, A_log 2e-2)")
    width = max(len(r["impl"]) for r in rows) + 8
    print("case/impl".ljust(width) + "".join(n.rjust(9) for n in names))
    for r in rows:
        print(f"{r['case']} {r['impl']}".ljust(width) + "".join(f"{r[n]:9.1e}" for n in names))
    return rows


def cu_tensor(lengths, device):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return torch.tensor(offs, dtype=torch.int32, device=device)


def fwd_bytes(T, H):
    return 4 * T * H * 256 + T * H * 2 + T * H * 256


def fwd_flops(T, H, d=128, C=64):
    return H * (6 * T * d * d + 3 * T * C * d + T * C * C)


def bench(fns, quick):
    """Median/IQR (ms) per implementation, alternating ABAB over 5 repeats of do_bench samples."""
    import time

    import triton

    samples = {name: [] for name in fns}
    for _ in range(1 if quick else 5):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                samples[name] += triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=5 if quick else 100,
                                                         return_mode="all")
            else:  # the interpreter: wall clock, a smoke number only
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, s in samples.items():
        t = torch.tensor(s)
        out[name] = {"ms_median": t.median().item(), "ms_iqr": (t.quantile(0.75) - t.quantile(0.25)).item(),
                     "samples_ms": s}
    return out


def graph_time(fn, iters=50):
    """Replay time (ms) of fn captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of the script and its gates")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names to run")
    ap.add_argument("--out", default="", help="results folder (default benchmarks/results; --quick: none)")
    ap.add_argument("--sweep", action="store_true", help="per-stage times under alternative launch configs")
    ap.add_argument("--variants", action="store_true",
                    help="also time chunk_kda's state_bf16 and all_bf16 variants (main shape)")
    ap.add_argument("--accuracy", action="store_true",
                    help="errors vs fp64 at T=8192 H=4 for each --compare config (or TUNING as it is) and fla")
    ap.add_argument("--profile", action="store_true", help="per-kernel CUDA times of fwd+bwd at B=1 T=8192 H=96")
    ap.add_argument("--fla-configs", type=int, default=0, help="keep this many configs per fla autotuner (0: all)")
    ap.add_argument("--fla-cases", default="", help="comma-separated case names: run fla only on these cases")
    ap.add_argument("--tuning", default="", metavar="JSON",
                    help='launch-config overrides for every k3 case, e.g. \'{"prep_intra_maxnreg": 168}\' (keys of '
                         'k3.ops.kda.tuning.TUNING)')
    ap.add_argument("--compare", default="", metavar="JSON",
                    help='a JSON list of TUNING overrides, e.g. \'[{}, {"bwd_k_maxnreg": 168}]\': each one is gated '
                         'and timed at B=1 T=8192 H=96 (fwd, fwd+bwd, per kernel) in this process; one table')
    ap.add_argument("--compare-shapes", default="1,8192,96", metavar="B,T,H[;B,T,H…]",
                    help="the shapes --compare times, e.g. '1,8192,96;2,8192,8;4,4096,8' (the last two: the small "
                         "preset's KDA layer at 16K tokens per step, where the state passes have few programs)")
    args = ap.parse_args()
    compare = json.loads(args.compare) if args.compare else []
    if not isinstance(compare, list) or not all(isinstance(c, dict) for c in compare):
        ap.error("--compare takes a JSON list of objects")
    for overrides in [json.loads(args.tuning) if args.tuning else {}] + compare:
        unknown = set(overrides) - set(kda_chunk.TUNING)
        if unknown:
            ap.error(f"unknown TUNING keys {sorted(unknown)}; known: {', '.join(kda_chunk.TUNING)}")
    if args.tuning:
        kda_chunk.TUNING.update(json.loads(args.tuning))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fla_all = load_fla(args.fla_configs) if device == "cuda" else None
    if fla_all is not None and not args.fla_configs:
        print("fla autotunes every config (~180 per shape key): minutes per case; --fla-configs 1 keeps one",
              flush=True)
    torch.manual_seed(0)

    errs, ok = small_gate(device)
    print("correctness gate (T=300, H=2, vs fp64 recurrence):", {k: f"{v:.1e}" for k, v in errs.items()})
    variants_ok = {}
    if args.variants:
        for name, variant in VARIANTS.items():
            v_errs, variants_ok[name] = small_gate(device, **variant)
            print(f"  variant {name}:", {k: f"{v:.1e}" for k, v in v_errs.items()},
                  "ok" if variants_ok[name] else "over tolerance: not timed")
    if not ok:
        print("correctness gate FAILED: no timings")
        return 1

    if args.quick:
        cases = [("fwd", 1, 128, 2, None), ("fwd+bwd", 1, 128, 2, None), ("fwd", 1, 100, 2, [30, 1, 69]),
                 ("decode", 4, 1, 2, None)]
    else:
        cases = [("fwd", 1, 8192, 96, None), ("fwd", 1, 8192, 64, None), ("fwd", 1, 8192, 96, VARLEN_MIX),
                 ("fwd", 1, 8192, 96, [1024] * 8), ("fwd", 1, 32768, 32, None),
                 ("fwd+bwd", 1, 8192, 96, None), ("fwd+bwd", 2, 16384, 16, None), ("fwd+bwd", 1, 32768, 32, None),
                 ("decode", 64, 1, 96, None)]
    rows = []
    for mode, B, T, H, lengths in cases:
        name = f"{mode} B={B} T={T} H={H}" + ("" if lengths is None else f" varlen{len(lengths)}")
        if args.cases and not any(c in name for c in args.cases.split(",")):
            continue
        torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
        fla = fla_all if not args.fla_cases or name in args.fla_cases.split(",") else None
        if mode == "decode":
            new = run_decode(name, B, H, fla, device, args.quick)
        else:
            extra = {v: kw for v, kw in VARIANTS.items() if variants_ok.get(v)}
            new = run_chunk(name, mode, B, T, H, lengths, fla, device, args.quick, extra)
        rows += new
        for r in new:  # as each case finishes, so a run cut short by a time limit keeps what it measured
            ratio = "" if r["ratio_vs_baseline"] is None else f", {r['ratio_vs_baseline']:.2f}x fla"
            print(f"[{name}] {r['impl']}: {r['ms_median']:.3f} ms{ratio}, diff {r['correctness']['value']:.1e}",
                  flush=True)
        torch.cuda.empty_cache() if device == "cuda" else None
    print_table(rows)
    if args.profile and device == "cuda":
        # fla only where it was asked for: `--fla-cases none` times and profiles k3 alone
        profile_fla = not args.fla_cases or "fwd+bwd B=1 T=8192 H=96" in args.fla_cases.split(",")
        profile_breakdown(fla_all if profile_fla else None)
    if args.sweep and device == "cuda":
        tuning_sweep()
    shapes = [tuple(int(x) for x in shape.split(",")) for shape in args.compare_shapes.split(";")]
    compared = [row for shape in shapes for row in compare_tunings(compare, device, args.quick, shape)] \
        if compare else None
    accuracy = accuracy_table(compare or [{}], fla_all, device, args.quick) if args.accuracy else None
    ok = all(r["correctness"]["ok"] for r in rows)
    tables = result_tables(rows, accuracy, compared, fla_configs=args.fla_configs, fla_version=_fla_version(),
                           quick=args.quick)
    if not ok:
        print("a timed case differs from its baseline beyond the tolerance: no results written")
    elif tables and (args.out or not args.quick):
        config = {"bandwidth": BANDWIDTH, "peak_flops": PEAK_FLOPS, "fla": _fla_version(),
                  "fla_configs_per_autotuner": args.fla_configs or "all",
                  "FLA_FLASH_KDA": os.environ.get("FLA_FLASH_KDA"), "tuning": dict(kda_chunk.TUNING)}
        # the full records (without the timing samples), each with the settings and gate of this run; the file's
        # records of what this run did not measure stay
        records = {"cases": [{k: v for k, v in r.items() if k != "samples_ms"} for r in rows] or None,
                   "compare-accuracy" if compared else "accuracy": accuracy, "compare": compared}
        raw = kept_raw(args.out) | {k: {"config": config, "gate": errs, "records": v}
                                    for k, v in records.items() if v is not None}
        save_result("kda", CLAIM, tables, raw=raw, out=args.out or None)
    elif args.quick:
        print("--quick: no results written (--out DIR writes them there)")
    return 0 if ok else 1


def _fla_version():
    try:
        from importlib.metadata import version

        return version("fla-core")
    except Exception:
        return None


def run_chunk(name, mode, B, T, H, lengths, fla, device, quick, extra):
    cu = None if lengths is None else cu_tensor(lengths, device)
    N = B if lengths is None else len(lengths)
    ins = raw_inputs(B, T, H, N=N, seed=1, device=device, h0=True)
    gen = torch.Generator(device=device).manual_seed(2)
    do = torch.randn(B, T, H, 128, generator=gen, device=device).bfloat16()
    dS = torch.randn(N, H, 128, 128, generator=gen, device=device)
    variants = {"k3": {}}
    if B == 1 and T == 8192 and H == 96 and lengths is None:
        variants.update(extra)
    impls = {v: (lambda x, kw=kw: ours_fn(x, cu, **kw)) for v, kw in variants.items()}
    if fla is not None:
        impls["fla"] = lambda x: fla_fn(fla, x, cu)

    # correctness against fla on the timed shape (and each variant against the default)
    outs = {}
    for v, fn in impls.items():
        if mode == "fwd":
            with torch.no_grad():
                o, S = fn(ins)
            outs[v] = (o, S, None)
        else:
            outs[v] = grads_of(fn, ins, do, dS)
    base = outs.get("fla", outs["k3"])
    rows = []
    if mode == "fwd":
        timed = {}
        for v, fn in impls.items():
            timed[v] = (lambda fn=fn: fn(ins))
        with torch.no_grad():
            times = bench(timed, quick)
        nbytes, flops = fwd_bytes(T * B, H), fwd_flops(T * B, H)
    else:
        live = [x.detach().requires_grad_() for x in ins]
        timed = {}
        for v, fn in impls.items():
            def step(fn=fn):
                o, S = fn(live)
                return torch.autograd.grad((o, S), live, (do, dS))
            timed[v] = step
        times = bench(timed, quick)
        nbytes = fwd_bytes(T * B, H) + T * B * H * (9 * 256 + 4)
        flops = 3 * fwd_flops(T * B, H)
    floor_ms = nbytes / BANDWIDTH * 1e3
    for v in impls:
        diff = {"o": rel(outs[v][0], base[0]), "S": rel(outs[v][1], base[1])}
        if outs[v][2] is not None:
            diff.update({n: rel(a, r) for n, a, r in zip(("q", "k", "v", "z", "b", "A_log", "dt_bias", "h0"),
                                                         outs[v][2], base[2])})
        # two independent errors each within the tolerance: their difference within twice it
        ok = all(e <= 2 * TOL[n] for n, e in diff.items()) if v != "fla" else True
        t = times[v]
        ms = t["ms_median"]
        rows.append({
            "case": name, "shape": {"B": B, "T": T, "H": H, "K": 128, "V": 128, "lengths": lengths},
            "dtype": "bf16", "impl": v, "baseline": "fla" if fla is not None else None,
            "ms_median": ms, "ms_iqr": t["ms_iqr"], "samples_ms": t["samples_ms"],
            "ratio_vs_baseline": (times["fla"]["ms_median"] / ms) if "fla" in times else None,
            "floor_ms": floor_ms, "floor_fraction": floor_ms / ms, "tb_s": nbytes / ms / 1e9,
            "tflop_s": flops / ms / 1e9,
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "correctness": {"metric": "rel. diff vs fla" if fla is not None else "rel. diff vs k3",
                            "value": max(diff.values()), "detail": diff, "ok": ok},
        })
    return rows


def run_decode(name, B, H, fla, device, quick):
    K = V = 128
    q, k, v, z, b, A_log, dt_bias, _ = raw_inputs(B, 1, H, seed=3, device=device)
    pool = torch.randn(B, H, K, V, device=device)
    idx = torch.arange(B, device=device, dtype=torch.int32)
    ours_pool, fla_pool = pool.clone(), pool.clone()
    impls = {"k3": lambda: fused_recurrent_kda(q, k, v, z, b, A_log, dt_bias, ours_pool, idx)[0]}
    if fla is not None:
        impls["fla"] = lambda: fla[1](q, k, v, z, b, A_log=A_log, dt_bias=dt_bias, initial_state=fla_pool,
                                      inplace_final_state=True, output_final_state=True,
                                      ssm_state_indices=idx.long(), use_qk_l2norm_in_kernel=True,
                                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                      lower_bound=-5.0)[0]
    outs = {n: fn() for n, fn in impls.items()}
    base = outs.get("fla", outs["k3"])
    state_diff = rel(ours_pool, fla_pool) if fla is not None else 0.0
    times = bench(impls, quick)
    nbytes = B * H * K * V * 4 * 2 + B * H * (4 * 256 + 2 + 256)
    floor_ms = nbytes / BANDWIDTH * 1e3
    rows = []
    for n in impls:
        ms = times[n]["ms_median"]
        graph_ms = graph_time(impls[n]) if device == "cuda" else None
        diff = {"o": rel(outs[n], base), "S": state_diff}
        rows.append({
            "case": name, "shape": {"B": B, "T": 1, "H": H, "K": K, "V": V}, "dtype": "bf16, fp32 state",
            "impl": n, "baseline": "fla" if fla is not None else None, "ms_median": ms, "ms_iqr": times[n]["ms_iqr"],
            "samples_ms": times[n]["samples_ms"], "graph_ms": graph_ms,
            "ratio_vs_baseline": (times["fla"]["ms_median"] / ms) if "fla" in times else None,
            "floor_ms": floor_ms, "floor_fraction": floor_ms / ms, "tb_s": nbytes / ms / 1e9, "tflop_s": None,
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "correctness": {"metric": "rel. diff vs fla", "value": max(diff.values()), "detail": diff,
                            "ok": all(e <= 2 * TOL["o"] for e in diff.values())},
        })
    return rows


def profile_breakdown(fla, iters=5):
    """CUDA time per kernel for forward and forward+backward at B=1, T=8192, H=96 (torch.profiler)."""
    from benchmarks.kernel_profile import print_kernel_times

    ins = raw_inputs(1, 8192, 96, seed=4, h0=True)
    live = [x.detach().requires_grad_() for x in ins]
    do = torch.randn(1, 8192, 96, 128, device="cuda").bfloat16()
    dS = torch.randn(1, 96, 128, 128, device="cuda")
    impls = {"k3": lambda x: ours_fn(x, None)}
    if fla is not None:
        impls["fla"] = lambda x: fla_fn(fla, x, None)
    for name, fn in impls.items():
        for mode in ("fwd", "fwd+bwd"):
            def step():
                if mode == "fwd":
                    with torch.no_grad():
                        fn(live)
                else:
                    o, S = fn(live)
                    torch.autograd.grad((o, S), live, (do, dS))
            print_kernel_times(f"{name} {mode}", step, iters)


def forward_steps(B, T, H, device):
    """(forward, forward + backward) of `chunk_kda` at dense B×T×H (K = V = 128) on fixed random inputs and
    cotangents: zero-argument callables for timing and profiling (`compare_tunings`, `benchmarks/ncu.py kda`)."""
    ins = raw_inputs(B, T, H, seed=4, device=device, h0=True)
    live = [x.detach().requires_grad_() for x in ins]
    gen = torch.Generator(device=device).manual_seed(5)
    do = torch.randn(B, T, H, 128, generator=gen, device=device).bfloat16()
    dS = torch.randn(B, H, 128, 128, generator=gen, device=device)

    def forward():
        with torch.no_grad():
            ours_fn(live, None)

    def forward_backward():
        o, S = ours_fn(live, None)
        torch.autograd.grad((o, S), live, (do, dS))

    return forward, forward_backward


def compare_tunings(configs, device, quick, shape=(1, 8192, 96)):
    """Each TUNING override set (on top of the current TUNING) at shape (B, T, H): the fp64 gate, fwd and
    fwd+bwd times (`bench`) and fwd+bwd kernel times (profiler); prints one table, returns the rows."""
    from triton.runtime.errors import OutOfResources

    from benchmarks.kernel_profile import kernel_times

    B, T, H = (1, 128, 2) if quick else shape
    base = dict(kda_chunk.TUNING)
    fwd, fwd_bwd = forward_steps(B, T, H, device)
    rows = []
    try:
        for cfg in configs:
            kda_chunk.TUNING.clear()
            kda_chunk.TUNING.update(base, **cfg)
            try:
                errs, ok = small_gate(device)
            except (ValueError, OutOfResources) as e:
                # a setting the kernels refuse (e.g. `_state_bwd` products at 8 warps) or the GPU cannot launch
                # (e.g. more shared memory than an SM has): reported, and the next config runs
                errs, ok = {"refused": str(e)}, False
            row = {"shape": {"B": B, "T": T, "H": H}, "tuning": cfg, "gate_ok": ok, "gate": errs}
            if ok:
                try:
                    times = bench({"fwd": fwd, "fwd+bwd": fwd_bwd}, quick)
                    row.update(fwd_ms=times["fwd"]["ms_median"], fwd_bwd_ms=times["fwd+bwd"]["ms_median"])
                    if device == "cuda":
                        row["kernels_ms"] = {k: ms for k, (ms, _) in kernel_times(fwd_bwd).items()}
                        row["fwd_kernels_ms"] = {k: ms for k, (ms, _) in kernel_times(fwd).items()}
                except OutOfResources as e:  # a variant the timed shape compiles and the gate's did not
                    ok = row["gate_ok"] = False
                    errs = row["gate"] = {"refused": str(e)}
            rows.append(row)
            # per config as it finishes, kernels included: a run cut short by its time limit keeps them
            top = ", ".join(f"{k.split('(')[0][:14]} {ms:.2f}" for k, ms in list(row.get("kernels_ms", {}).items())[:8])
            top += "; fwd: " + ", ".join(f"{k.split('(')[0][:18]} {ms:.3f}"
                                         for k, ms in list(row.get("fwd_kernels_ms", {}).items())[:6])
            print(f"[compare] B={B} T={T} H={H} {json.dumps(cfg)}: " + ("gate FAILED " + str(errs) if not ok else
                  f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwd_bwd_ms']:.3f} ms; {top}"), flush=True)
    finally:
        kda_chunk.TUNING.clear()
        kda_chunk.TUNING.update(base)
    kernels = []
    for r in rows:
        kernels += [k for k, ms in r.get("kernels_ms", {}).items() if ms >= 0.05 and k not in kernels]
    cols = ["tuning", "fwd ms", "fwd+bwd ms"] + [k.split("(")[0][:12] for k in kernels]
    table = [[json.dumps(r["tuning"]), *(("gate FAIL", "") if not r["gate_ok"] else
                                         (f"{r['fwd_ms']:.3f}", f"{r['fwd_bwd_ms']:.3f}")),
              *(f"{r['kernels_ms'][k]:.2f}" if k in r.get("kernels_ms", {}) else "" for k in kernels)]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    print(f"KDA launch configs at B={B} T={T} H={H} (kernel columns: fwd+bwd ms per call)")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in table:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)))
    return rows


def tuning_sweep():
    """Per-stage times at B=1, T=8192, H=96 under alternative launch configs (`TUNING` overrides)."""
    import triton

    from k3.ops.kda import chunk as tc

    base = dict(tc.TUNING)
    q, k, v, z, b, A_log, dt_bias, h0 = raw_inputs(1, 8192, 96, seed=5, h0=True)
    flat = [x.reshape(8192, *x.shape[2:]).contiguous() for x in (q, k, v, z, b)]
    plan = tc.make_plan(1, 8192, None, q.device)
    dtypes = tc.inter_dtypes(torch.bfloat16)
    args = (*flat, A_log, dt_bias, -5.0, 128**-0.5)
    do = torch.randn(8192, 96, 128, device="cuda").bfloat16()

    def t(fn):
        try:
            fn()
        except triton.runtime.errors.OutOfResources as e:  # e.g. too much shared memory for this config
            print(f"[sweep] skipped: {e}")
            return float("nan")
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    def report(stage, cfg, ms):
        print(f"[sweep] {stage:10s} {str(cfg):60s} {ms:8.3f} ms")

    for cfg in ({}, {"prep_gate_warps": 1}, {"prep_intra_warps": 8}, {"prep_wu_warps": 8}):
        tc.TUNING.update(base, **cfg)
        report("prepare", cfg, t(lambda: tc._fwd_prepare(*args, plan, dtypes)))
    tc.TUNING.update(base)
    ops = tc._fwd_prepare(*args, plan, dtypes)[:6]
    for cfg in ({}, {"state_stages": 2}, {"state_warps": 8}, {"state_bv": 64, "state_warps": 8},
                {"state_bv": 16}):
        for bf in (False, True):
            tc.TUNING.update(base, **cfg)
            report("state", dict(cfg, bf16=bf),
                   t(lambda: tc._fwd_state(*ops, h0, plan, torch.bfloat16, want_ht=True, state_bf16=bf)))
    for cfg in ({}, {"bwd_vk_warps": 8}, {"bwd_vv_bv": 64}, {"bwd_k_warps": 8}, {"bwd_k_cols": 64},
                {"state_bwd_bv": 64}, {"state_bwd_stages": 2}, {"state_bwd_products": "tf32"}):
        tc.TUNING.update(base, **cfg)
        # the switches the autograd function reads at its forward, read here as it would
        switches = dict(qprime=bool(tc.TUNING["state_bwd_qprime"]),
                        norms_from_scores=bool(tc.TUNING["norms_from_scores"]))
        report("backward", cfg, t(lambda: tc._bwd(*args, h0, plan, do, None, dtypes, False, **switches)))
    dq, dk, dv, dz, db = raw_inputs(64, 1, 96, seed=6)[:5]
    pool = torch.randn(64, 96, 128, 128, device="cuda")
    for cfg in ({}, {"decode_bv": 32}, {"decode_bv": 128, "decode_warps": 8}, {"decode_bv": 32, "decode_warps": 2}):
        tc.TUNING.update(base, **cfg)
        report("decode", cfg, t(lambda: fused_recurrent_kda(dq, dk, dv, dz, db, A_log, dt_bias, pool)))
    tc.TUNING.update(base)


def print_table(rows):
    cols = ["case", "impl", "ms", "iqr", "ratio", "TB/s", "floor", "TFLOP/s", "graph ms", "diff", "mem GB"]
    table = []
    for r in rows:
        table.append([
            r["case"], r["impl"], f"{r['ms_median']:.3f}", f"{r['ms_iqr']:.3f}",
            "" if r["ratio_vs_baseline"] is None else f"{r['ratio_vs_baseline']:.2f}x",
            f"{r['tb_s']:.2f}", f"{100 * r['floor_fraction']:.1f}%",
            "" if r["tflop_s"] is None else f"{r['tflop_s']:.0f}",
            "" if r.get("graph_ms") is None else f"{r['graph_ms']:.3f}",
            f"{r['correctness']['value']:.1e}" + ("" if r["correctness"]["ok"] else " FAIL"),
            "" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**30:.1f}",
        ])
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title="KDA kernels: k3 vs fla (ratio = fla ms / k3 ms)")
        for c in cols:
            t.add_column(c)
        for row in table:
            t.add_row(*row)
        Console(width=200).print(t)
    except ImportError:
        widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for row in table:
            print("  ".join(x.ljust(w) for x, w in zip(row, widths)))


# ---- the results file's tables --------------------------------------------------------------------------------

def sci(x: float, digits: int = 1) -> str:
    """3.8e-3 (not 3.8e-03), as the docs write errors."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{x:.{digits}e}").replace("e+", "e")


def cases_tables(rows: list[dict], fla_configs: int, fla_version: str | None) -> dict[str, dict]:
    """The "cases" table (one row per timed case and k3 variant, fla beside it) and, where its cases ran, the
    "targets" table, from `run_chunk` / `run_decode` records."""
    fla = {r["case"]: r for r in rows if r["impl"] == "fla"}
    out, lengths = [], {}
    for r in rows:
        if r["impl"] == "fla":
            continue
        case = r["case"] + (f" ({r['dtype'].removeprefix('bf16, ')})" if r["dtype"] != "bf16" else "")
        case += f" ({r['impl']})" if r["impl"] != "k3" else ""
        base = fla.get(r["case"])
        out.append([case, round(r["ms_median"], 3), round(base["ms_median"], 3) if base else "",
                    f"{r['ratio_vs_baseline']:.2f}x" if base else "", round(r["tb_s"], 2),
                    f"{100 * r['floor_fraction']:.1f}%"])
        if r["shape"].get("lengths"):
            lengths[f"varlen{len(r['shape']['lengths'])}"] = r["shape"]["lengths"]
    if fla:
        configs = "every config" if not fla_configs else "one config" if fla_configs == 1 else f"{fla_configs} configs"
        note = (f"fla: fla-core {fla_version} with {configs} per autotuner (--fla-configs {fla_configs}), "
                f"FLA_FLASH_KDA={os.environ.get('FLA_FLASH_KDA')}, in the same process")
    else:
        note = "k3 alone (fla-core not installed, or not asked for by --fla-cases)"
    note += (f"; medians of triton.testing.do_bench; memory floor: unavoidable bytes at {BANDWIDTH / 1e12:g} TB/s"
             + "".join(f"; {name}: documents of {', '.join(map(str, docs))} tokens" for name, docs in lengths.items()))
    tables = {"cases": result_table(["case (bf16, K = V = 128)", "k3 ms", "fla ms", "speed-up", "TB/s",
                                     "of the memory floor"], out, note)}
    ours = {r["case"]: r for r in rows if r["impl"] == "k3"}
    targets = []
    for target, case, kind, limit in TARGETS:
        r = ours.get(case)
        if r is None or (kind == "ratio" and r["ratio_vs_baseline"] is None):
            continue
        ratio = r["ratio_vs_baseline"]
        if kind == "ms":
            targets.append([target, f"≤ {limit} ms", f"{r['ms_median']:.3f} ms"
                            + (f" ({ratio:.2f}x fla)" if ratio is not None else ""), r["ms_median"] <= limit])
        else:
            targets.append([target, f"≥ {limit}x", f"{ratio:.2f}x", ratio >= limit])
    if targets:
        tables["targets"] = result_table(
            ["target", "required", "measured", "met"], [[*t[:3], "yes" if t[3] else "no"] for t in targets],
            "B=1 T=8192 H=96 (decode: B=64 H=96); the required times are 2× and 1.5× the fully tuned fla anchors")
    return tables


def errors_table(rows: list[dict], quick: bool) -> dict:
    """`accuracy_table`'s records as one table: a row per output or gradient, a column per implementation and
    case (dense, varlen), the limit last."""
    dense = [r for r in rows if r["case"] == "dense"]
    varlen = [r for r in rows if r["case"] == "varlen"]
    labels = []
    for r in dense:
        label = "fla" if r["impl"] == "fla" else "k3" if r["impl"] == "{}" else f"k3 {r['impl']}"
        while label in labels:  # the same config twice (a check for drift): the second one marked
            label += " (again)"
        labels.append(label)
    columns = ["output"] + [f"{label} {case}" for label in labels for case in ("dense", "varlen")] + ["limit"]
    out = [[shown] + [sci(rs[name]) for d, v in zip(dense, varlen) for rs in (d, v)]
           + [sci(TOL[name.removesuffix("_inf")], 0)] for name, shown in ERROR_NAMES.items()]
    T, H = (300, 2) if quick else (8192, 4)
    return result_table(columns, out, f"relative RMSE against the fp64 token recurrence on the same bf16 inputs, "
                                      f"T={T} H={H} (dense, and the packed-document mix)")


def compare_table(rows: list[dict]) -> dict:
    """`compare_tunings`'s records: per config and shape, its gate and times."""
    out = []
    for r in rows:
        shape = r["shape"]
        gate = "ok" if r["gate_ok"] else "refused" if "refused" in r["gate"] else "over tolerance"
        out.append([f"B={shape['B']} T={shape['T']} H={shape['H']}", json.dumps(r["tuning"]), gate,
                    round(r["fwd_ms"], 3) if "fwd_ms" in r else None,
                    round(r["fwd_bwd_ms"], 3) if "fwd_bwd_ms" in r else None])
    return result_table(["shape", "TUNING overrides", "gate", "fwd ms", "fwd+bwd ms"], out,
                        "each config on top of TUNING, gated against the fp64 recurrence at T=300 H=2 before it is "
                        "timed; medians of triton.testing.do_bench; kernel times per call in the raw records")


def kernels_table(row: dict) -> dict:
    """One `compare_tunings` record's kernel time per call: the KDA kernels of forward + backward in launch order,
    the rest summed, then those of the inference forward."""
    out = []
    for times, prefix in ((row["kernels_ms"], ""), (row["fwd_kernels_ms"], "inference forward: ")):
        named = {k.split("(")[0]: ms for k, ms in times.items()}
        ours = [k for k in KERNEL_STAGES if k in named] + [k for k in named if k.startswith("_")
                                                             and k not in KERNEL_STAGES]
        for k in ours:
            stage = KERNEL_STAGES.get(k, "")
            out.append([f"`{k}`", stage if stage.startswith(prefix) else prefix + stage, round(named[k], 3)])
        rest = sum(ms for k, ms in named.items() if k not in ours)
        if rest >= 5e-4:
            out.append(["other kernels (PyTorch)", prefix + "other", round(rest, 3)])
    shape, tuning = row["shape"], row["tuning"]
    return result_table(["kernel", "stage", "ms per call"], out,
                        f"torch.profiler kernel times at B={shape['B']} T={shape['T']} H={shape['H']}: forward + "
                        f"backward at TUNING{' with ' + json.dumps(tuning) if tuning else ''} (fwd+bwd "
                        f"{row['fwd_bwd_ms']:.3f} ms), then the inference forward (fwd {row['fwd_ms']:.3f} ms)")


def result_tables(rows, accuracy, compared, fla_configs=0, fla_version=None, quick=False) -> dict[str, dict]:
    """The tables of a run's results file: "cases" and "targets" from the timed cases, "accuracy" from --accuracy
    alone, and with --compare "compare", "compare-accuracy" and "kernels" (the first config's split)."""
    tables = cases_tables(rows, fla_configs, fla_version) if rows else {}
    if accuracy:
        tables["compare-accuracy" if compared else "accuracy"] = errors_table(accuracy, quick)
    if compared:
        tables["compare"] = compare_table(compared)
        if "kernels_ms" in compared[0]:
            tables["kernels"] = kernels_table(compared[0])
    return tables


def kept_raw(out: str) -> dict:
    """The raw records of the results file this run updates: those of tables it does not measure stay."""
    path = Path(out or os.environ.get("K3_RESULTS") or RESULTS) / f"kda-{device_slug()}.json"
    return json.loads(path.read_text()).get("raw", {}) if path.exists() else {}


if __name__ == "__main__":
    sys.exit(main())
