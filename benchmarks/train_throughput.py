"""Training throughput: tokens/s, model FLOP utilisation, per-fast-path speedups and peak memory.

For each preset and sequence length, one full training step (forward, backward, Per-Head Muon/AdamW,
QK-Clip, Quantile Balancing update) on packed synthetic documents, timed after a warm-up step (whose
time, compilation included, is reported separately). "step s" is the median of steps each synchronised
before and after (MFU is computed from it); "back-to-back s" is the mean of as many steps run back to back
with one synchronisation, where the host may run into the next step while the optimizer's kernels run.
Variants run side by side in one process:
- `reference`: every reference path (padded MoE, explicit fp32 MLA attention, stacked AttnRes reads,
  autograd SiTU-GLU and RMSNorm, full-logit loss);
- `fast`: every fast path ("auto" on CUDA: grouped-GEMM MoE, flash/flex attention, fused Triton AttnRes,
  SiTU-GLU and RMSNorm, chunked loss with the Triton row kernel);
- `fast-no-X`: the fast stack with one path X back on its reference, so step(fast-no-X) / step(fast) is
  X's speedup inside the fast stack (X ∈ moe, attn, attnres, situ, norm, loss);
- `fast-sdpa`: the fast stack with SDPA (explicit document mask) instead of flex;
- `*-ckpt`: with activation checkpointing per decoder layer (k3.model.checkpointing).
KDA runs `kda_impl` (default the torch chunked form) in every variant: its kernels are another issue.
A large GEMM measures the machine's practical peak in the same run, so MFU is reported against it and
(on CUDA) against the H200's 989 TFLOP/s bf16 datasheet number.

FLOPs per token: training = 3 × forward, forward = 2 × active matmul parameters
(lm_head included, embedding excluded, routed experts at top-k/E) + per MLA layer 2·H·(d_qk + d_v)·L_ctx
(L_ctx = mean attended length inside each document) + per KDA layer H·(6d² + 3Cd + C²).

`--micro-batches N` accumulates N forward+backward passes of `--tokens` tokens per optimizer step, as
training at a realistic batch does: the optimizer's fixed cost per step (Newton–Schulz on every block) is
then shared by N× the tokens. Tables report tokens per micro-batch and the micro-batch count.

Correctness gate: the loss at init is within 1 nat of ln V and finite after the timed steps. With
`--loss-steps N`, `reference` and `fast` also train N steps from the same init on the same batches and
the largest loss difference is reported (`docs/fast-paths.md` states the tolerance).

Results: table `--result-table` (default "mfu") of `benchmarks/results/train-throughput-<device>.json`, the loss
curves in `loss-curves-<device>.json` (`benchmarks/provenance.py`).

    python benchmarks/train_throughput.py --presets tiny                                  # CPU
    python benchmarks/train_throughput.py --presets small --kda-impl triton --variants fast --tokens 65536 \\
        --micro-batches 4 --steps 3 --seq-lens 4096 8192                                  # the MFU table, one GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere, as profile_step.py

from benchmarks.provenance import save_result, table as result_table  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.model.accounting import account  # noqa: E402
from k3.model.checkpointing import apply_activation_checkpointing  # noqa: E402
from k3.model.model import build_model  # noqa: E402
from k3.optim import MuonAdamW, cosine_schedule  # noqa: E402
from k3.train.config import TrainConfig  # noqa: E402
from k3.train.loop import train_step  # noqa: E402

H200_BF16_PEAK = 989e12
REFERENCE = dict(moe_impl="reference", attention_backend="reference", attn_res_impl="direct",
                 situ_impl="reference", norm_impl="reference", loss_impl="reference")
FAST = dict(moe_impl="auto", attention_backend="auto", attn_res_impl="auto", situ_impl="auto", norm_impl="auto",
            loss_impl="auto")
PATHS = {"moe": "moe_impl", "attn": "attention_backend", "attnres": "attn_res_impl", "situ": "situ_impl",
         "norm": "norm_impl", "loss": "loss_impl"}


RESULT_COLUMNS = ["preset", "variant", "T", "rows × micro-batches", "tokens per step", "step s", "back to back s",
                  "tokens/s", "TFLOP/s", "MFU", "GEMM peak TFLOP/s", "optimizer share", "peak GiB"]


def result_rows(results: list[dict], peak: float) -> list[list]:
    """One row of the results file per timed case."""
    rows = []
    for r in results:
        if "step_s" not in r:
            continue
        mem = r["peak_mem_gib"]
        rows.append([r["preset"], r["variant"], r["seq_len"], f"{r['rows']} × {r['micro_batches']}",
                     r["rows"] * r["seq_len"] * r["micro_batches"], round(r["step_s"], 3), round(r["back_to_back_s"], 3),
                     round(r["tokens_per_s"]), round(r["tflop_s"], 1), f"{100 * r['mfu_measured']:.1f}%",
                     round(peak / 1e12, 1), f"{100 * r['optimizer_share']:.1f}%",
                     round(mem, 1) if math.isfinite(mem) else None])
    return rows


def loss_curve_row(curves: dict) -> list:
    diffs = [abs(a - b) for a, b in zip(curves["fast"], curves["reference"])]
    return ["fast vs reference", round(max(diffs), 4), round(statistics.mean(diffs), 4),
            round(abs(statistics.mean(curves["fast"]) - statistics.mean(curves["reference"])), 4),
            f"{curves['fast'][-1]:.4f} vs {curves['reference'][-1]:.4f}"]


def variant_overrides(name: str) -> tuple[dict, bool]:
    """Variant name -> (config overrides, activation checkpointing)."""
    ckpt = name.endswith("-ckpt")
    base = name.removesuffix("-ckpt")
    if base == "reference":
        return dict(REFERENCE), ckpt
    if base == "fast":
        return dict(FAST), ckpt
    if base == "fast-sdpa":
        return dict(FAST, attention_backend="sdpa"), ckpt
    if base.startswith("fast-no-") and base[8:] in PATHS:
        field = PATHS[base[8:]]
        return dict(FAST, **{field: REFERENCE[field]}), ckpt
    raise SystemExit(f"unknown variant {name!r}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measured_gemm_peak(device) -> float:
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    iters = 10 if device.type == "cuda" else 3
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start)


class Batch:
    """A packed batch of synthetic documents (lengths drawn from a fixed generator)."""

    def __init__(self, rows, seq_len, vocab, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
        self.labels = torch.roll(self.input_ids, -1, dims=1)
        offsets = [0]
        for r in range(rows):
            pos = 0
            while pos < seq_len:
                n = min(seq_len - pos, int(torch.randint(seq_len // 4, seq_len + 1, (1,), generator=g)))
                pos += n
                offsets.append(r * seq_len + pos)
                self.labels[r, pos - 1] = -100
        self.cu_seqlens = torch.tensor(offsets, dtype=torch.int64)
        self.num_tokens = int((self.labels != -100).sum())
        self.device = device

    def to(self, device, non_blocking=False):
        moved = object.__new__(Batch)
        moved.__dict__.update(self.__dict__)
        moved.input_ids, moved.labels = self.input_ids.to(device), self.labels.to(device)
        moved.cu_seqlens = self.cu_seqlens.to(device)
        return moved

    def mean_context(self) -> float:
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).double()
        return float((lengths * (lengths + 1) / 2).sum() / lengths.sum())


def flops_per_token(model, config, mean_ctx: float, chunk: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) per token for one training step (3 × forward)."""
    k, E = config.num_experts_per_token, config.num_experts
    matmul = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or "conv1d" in name:
            continue
        matmul += p.numel() * (k / E if ".experts." in name else 1)
    H, d = config.num_attention_heads, config.head_dim
    n_mla, n_kda = len(config.mla_layer_ids), len(config.kda_layer_ids)
    attn = n_mla * 2 * H * (config.qk_head_dim + config.v_head_dim) * mean_ctx
    attn += n_kda * H * (6 * d * d + 3 * chunk * d + chunk * chunk)
    return 3 * 2 * matmul, 3 * attn


class TimedMuonAdamW(MuonAdamW):
    """MuonAdamW that records the wall time of each step (synchronised on CUDA)."""

    def __init__(self, *args, record: list[float], device, **kwargs):
        super().__init__(*args, **kwargs)
        self._record, self._device = record, device
        self.timing = True  # off for back-to-back steps: its synchronisation would stop the overlap measured there

    def step(self, closure=None):
        if not self.timing:
            return super().step(closure)
        sync(self._device)
        start = time.perf_counter()
        out = super().step(closure)
        sync(self._device)
        self._record.append(time.perf_counter() - start)
        return out


def build(name, preset, overrides, ckpt, device, record):
    config = get_preset(preset, **overrides)
    model = build_model(config, seed=0, device=device)
    if ckpt:
        apply_activation_checkpointing(model)
    optimizer = TimedMuonAdamW(model.named_parameters(), config, lr=1e-3, record=record, device=device,
                               ns_dtype=torch.bfloat16)  # as `k3 train` runs it
    return config, model, optimizer, cosine_schedule(optimizer, 1000)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


CLAIM = ("Training step time and MFU with every fast path: MFU = model FLOPs (6 × active parameters + attention) per "
         "second over the bf16 GEMM peak measured in the same process")
LOSS_CLAIM = ("Training losses of the fast paths against the reference ops from the same initialisation on the same "
              "batches (uniform random tokens: numerical agreement, not learning)")


def run_variant(name, preset, seq_len, rows, steps, base, device, peak, micro_batches=1):
    """Time one variant: `micro_batches` forward+backward passes of rows × seq_len tokens per optimizer step.
    Returns a result dict (with "error" on failure)."""
    cuda = device.type == "cuda"
    overrides, ckpt = variant_overrides(name)
    overrides.update(base)
    opt_times: list[float] = []
    result = {"preset": preset, "seq_len": seq_len, "rows": rows, "variant": name, "overrides": overrides,
              "checkpointing": ckpt, "micro_batches": micro_batches}
    model = optimizer = None
    try:
        config, model, optimizer, scheduler = build(name, preset, overrides, ckpt, device, opt_times)
        batches = [Batch(rows, seq_len, config.vocab_size, device, seed=i) for i in range(micro_batches)]
        batch = batches[0]
        # with gradients enabled, so compiled kernels (flex) are built once, for training
        with (torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)):
            b = batch.to(device)
            loss0 = (model(b.input_ids, cu_seqlens=b.cu_seqlens, labels=b.labels).loss / b.num_tokens).item()
        if not (math.isfinite(loss0) and abs(loss0 - math.log(config.vocab_size)) < 1.0):
            raise RuntimeError(f"correctness gate: loss at init {loss0:.3f}, ln V = {math.log(config.vocab_size):.3f}")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        cfg = TrainConfig(preset=preset)
        times = []
        for _ in range(steps + 1):
            sync(device)
            t = time.perf_counter()
            metrics = train_step(model, optimizer, scheduler, batches, cfg, device)
            sync(device)
            times.append(time.perf_counter() - t)
        # the same steps back to back, one synchronisation at the end: what a training run sees, where the host
        # may run ahead into the next step while the optimizer's kernels run (train_step reads back only before
        # its update)
        optimizer.timing = False
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            metrics = train_step(model, optimizer, scheduler, batches, cfg, device)
        sync(device)
        back_to_back_s = (time.perf_counter() - t) / steps
        optimizer.timing = True
        if not math.isfinite(metrics["loss"]):
            raise RuntimeError(f"correctness gate: non-finite loss after {2 * steps + 1} steps")
        step_s = statistics.median(times[1:])
        tokens = rows * seq_len * micro_batches
        mean_context = statistics.mean(b.mean_context() for b in batches)
        mm, attn = flops_per_token(model, config, mean_context, config.kda_chunk_size)
        achieved = (mm + attn) * tokens / step_s
        acc = account(config)
        result.update(step_s=step_s, first_step_s=times[0], step_samples_s=times[1:], back_to_back_s=back_to_back_s,
                      tokens_per_s=tokens / step_s,
                      tflop_s=achieved / 1e12, mfu_measured=achieved / peak, mfu_989=achieved / H200_BF16_PEAK,
                      attention_flop_share=attn / (mm + attn), optimizer_share=statistics.median(opt_times[1:]) / step_s,
                      peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
                      params=f"{acc.total_params / 1e6:,.1f}M / {acc.active_params / 1e6:,.1f}M", loss0=loss0)
    except torch.OutOfMemoryError:
        result["error"] = "OOM"
    except Exception as e:  # report and go on with the other variants
        result["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        del model, optimizer
        free(device)
    return result


def loss_curves(preset, seq_len, rows, steps, base, device, ckpt=False):
    """Train `reference` and `fast` for `steps` steps from the same init on the same batches."""
    curves = {}
    for name in ("reference", "fast"):
        overrides, _ = variant_overrides(name)
        overrides.update(base)
        config, model, optimizer, scheduler = build(name, preset, overrides, ckpt, device, [])
        cfg = TrainConfig(preset=preset)
        losses = []
        started = time.perf_counter()
        for step in range(steps):
            batch = Batch(rows, seq_len, config.vocab_size, device, seed=1000 + step)
            losses.append(train_step(model, optimizer, scheduler, [batch], cfg, device)["loss"])
            if step % 10 == 9 or step == steps - 1:
                print(f"  loss curve {name}: step {step + 1}/{steps} loss {losses[-1]:.4f} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
        curves[name] = losses
        del model, optimizer
        free(device)
    diffs = [abs(a - b) for a, b in zip(curves["fast"], curves["reference"])]
    return {"steps": steps, "reference": curves["reference"], "fast": curves["fast"], "max_abs_diff": max(diffs),
            "max_rel_diff": max(d / abs(r) for d, r in zip(diffs, curves["reference"]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=None, help="rows per step (default: --tokens / seq_len)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default 4096 CPU, 32768 GPU)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 256 CPU, 4096 GPU")
    parser.add_argument("--seq-len", type=int, default=None, help="one sequence length (same as --seq-lens N)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override (e.g. 32768 for small with k3's BPE)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up step")
    parser.add_argument("--kda-impl", default="torch")
    parser.add_argument("--variants", nargs="+", default=["reference", "fast"])
    parser.add_argument("--ablate-at", type=int, default=None,
                        help="also run fast-no-X for every fast path at this sequence length")
    parser.add_argument("--extra", nargs="*", default=[], help="more variants at the ablation length")
    parser.add_argument("--late", nargs="*", default=[], help="variants run last, at the first length")
    parser.add_argument("--loss-steps", type=int, default=0, help="loss-curve comparison, reference vs fast")
    parser.add_argument("--loss-tokens", type=int, default=None, help="tokens per loss-curve step (default --tokens)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="runtime config overrides for every variant, e.g. loss_impl=triton")
    parser.add_argument("--ckpt", action="store_true",
                        help="activation checkpointing for every variant (ablations and loss curves included)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="forward+backward passes of --tokens each per optimizer step (gradient accumulation)")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; later cases are skipped")
    parser.add_argument("--json", default=None, help="also write the raw records here")
    parser.add_argument("--result-table", default="mfu",
                        help="the table of benchmarks/results/train-throughput-<device>.json this run writes")
    args = parser.parse_args()
    if args.micro_batches < 1:
        parser.error(f"--micro-batches must be at least 1, got {args.micro_batches}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    seq_lens = args.seq_lens or ([args.seq_len] if args.seq_len else [4096 if cuda else 256])
    tokens = args.tokens or (32768 if cuda else 4096)
    steps = args.steps or (3 if cuda else 2)
    if not cuda:
        torch.set_flush_denormal(True)
    started = time.perf_counter()
    peak = measured_gemm_peak(device)
    base = {"kda_impl": args.kda_impl, **dict(item.split("=", 1) for item in args.set)}
    if args.vocab_size:
        base["vocab_size"] = args.vocab_size

    # the main variants at every length first, then the ablations, then `--late` (e.g. may run out of memory)
    plan = []
    for preset in args.presets:
        for seq_len in seq_lens:
            plan += [(preset, seq_len, args.rows or max(1, tokens // seq_len), v) for v in args.variants]
        if args.ablate_at:
            rows = args.rows or max(1, tokens // args.ablate_at)
            plan += [(preset, args.ablate_at, rows, v) for v in [f"fast-no-{p}" for p in PATHS] + list(args.extra)]
        plan += [(preset, seq_lens[0], args.rows or max(1, tokens // seq_lens[0]), v) for v in args.late]
    if args.ckpt:
        plan = [(p, t, r, v if v.endswith("-ckpt") else v + "-ckpt") for p, t, r, v in plan]
    results = []
    curves = None

    def save():
        # after every case too, so a run stopped by a time limit keeps what it measured
        if any("step_s" in r for r in results):
            save_result("train-throughput", CLAIM, {args.result_table: result_table(RESULT_COLUMNS, result_rows(results, peak))},
                        raw={args.result_table: results})
        if curves is not None and "error" not in curves:
            save_result("loss-curves", LOSS_CLAIM, {"fast-vs-reference": result_table(
                ["pair", "max |Δloss|", "mean |Δloss|", "|Δ mean loss|", "final loss"], [loss_curve_row(curves)])},
                raw={"fast-vs-reference": curves})
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"benchmark": "train_throughput", "peak_tflop_s": peak / 1e12,
                                                   "env": {"torch": torch.__version__,
                                                           "gpu": torch.cuda.get_device_name() if cuda else "cpu"},
                                                   "results": results, "loss_curves": curves}, indent=1))

    print(f"[{time.perf_counter() - started:6.0f}s] measured GEMM peak {peak / 1e12:.1f} TFLOP/s; "
          f"{len(plan)} cases", flush=True)
    for preset, seq_len, rows, variant in plan:
        if args.time_budget and time.perf_counter() - started > args.time_budget:
            results.append({"preset": preset, "seq_len": seq_len, "rows": rows, "variant": variant,
                            "error": "skipped (time budget)"})
            continue
        print(f"[{time.perf_counter() - started:6.0f}s] {preset} T={seq_len} {variant}: {rows} rows × "
              f"{args.micro_batches} micro-batches, 1 + {steps} steps ...", flush=True)
        r = run_variant(variant, preset, seq_len, rows, steps, base, device, peak, args.micro_batches)
        results.append(r)
        status = r.get("error") or ("{:.3f} s/step (samples {}; first step {:.1f} s; back to back {:.3f} s), "
                                    "{:.1f} TFLOP/s, MFU {:.1%}"
                                    .format(r["step_s"], ", ".join(f"{t:.3f}" for t in r["step_samples_s"]),
                                            r["first_step_s"], r["back_to_back_s"], r["tflop_s"],
                                            r["mfu_measured"]))
        print(f"[{time.perf_counter() - started:6.0f}s] {preset} T={seq_len} {variant}: {status}", flush=True)
        save()

    if args.loss_steps:
        if args.time_budget and time.perf_counter() - started > args.time_budget:
            curves = {"error": "skipped (time budget)"}
        else:
            try:
                loss_tokens = args.loss_tokens or tokens
                curves = loss_curves(args.presets[0], seq_lens[0], max(1, loss_tokens // seq_lens[0]),
                                     args.loss_steps, base, device, ckpt=args.ckpt)
            except Exception as e:
                curves = {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    console = Console(width=240)
    table = Table(title=f"k3 training step on {torch.cuda.get_device_name() if cuda else 'CPU'} "
                        f"({'bf16 autocast' if cuda else 'fp32'}, {tokens} packed tokens/micro-batch, "
                        f"{args.micro_batches} micro-batch{'es' if args.micro_batches > 1 else ''}/step, kda_impl "
                        f"{args.kda_impl}{''.join(', ' + item for item in args.set)}, measured GEMM peak "
                        f"{peak / 1e12:.1f} TFLOP/s)")
    for col in ("preset", "T", "rows", "variant", "step s", "back-to-back s", "tokens/s", "TFLOP/s", "MFU (measured)",
                "MFU (989 TF)", "vs reference", "path speedup", "first step s", "optimizer", "peak GiB"):
        table.add_column(col, justify="right")
    by_key = {(r["preset"], r["seq_len"], r["variant"]): r for r in results}
    for r in results:
        if "error" in r:
            table.add_row(r["preset"], str(r["seq_len"]), str(r["rows"]), r["variant"], r["error"][:60],
                          *[""] * 10)
            continue
        ref = by_key.get((r["preset"], r["seq_len"], "reference"))
        if ref is None or "step_s" not in ref:  # e.g. out of memory without checkpointing
            ref = by_key.get((r["preset"], r["seq_len"], "reference-ckpt"))
        fast = by_key.get((r["preset"], r["seq_len"], "fast-ckpt" if r["variant"].endswith("-ckpt") else "fast"))
        vs_ref = f"{ref['step_s'] / r['step_s']:.2f}×" if ref and "step_s" in ref else ""
        path = ""
        if r["variant"].startswith("fast-no-") and fast and "step_s" in fast:
            path = f"{r['step_s'] / fast['step_s']:.2f}×"
        table.add_row(r["preset"], str(r["seq_len"]), str(r["rows"]), r["variant"], f"{r['step_s']:.3f}",
                      f"{r['back_to_back_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflop_s']:.1f}", f"{r['mfu_measured']:.1%}",
                      f"{r['mfu_989']:.1%}", vs_ref, path, f"{r['first_step_s']:.1f}", f"{r['optimizer_share']:.1%}",
                      f"{r['peak_mem_gib']:.1f}")
    console.print(table)
    console.print("path speedup = step(fast-no-X) / step(fast): what path X saves inside the fast stack; "
                  "vs reference: against `reference`, or `reference-ckpt` where `reference` did not run")
    from k3.ops.attention import FLEX_FAILURE, flash_attn_varlen_func
    console.print(f"attention backend of 'auto': {'flash' if flash_attn_varlen_func else 'flex'}"
                  + (f"; FLEX FAILED, SDPA used instead: {FLEX_FAILURE[0]}" if FLEX_FAILURE else ""))
    if curves is not None:
        if "error" in curves:
            console.print(f"loss curves: {curves['error']}")
        else:
            console.print(f"loss curves over {curves['steps']} steps: max |fast − reference| = "
                          f"{curves['max_abs_diff']:.4f} nats ({curves['max_rel_diff']:.2%}); final "
                          f"{curves['fast'][-1]:.4f} vs {curves['reference'][-1]:.4f}")
    save()


if __name__ == "__main__":
    main()
