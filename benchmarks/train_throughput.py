"""Training throughput: tokens/s, model FLOP utilisation and the optimizer's share of the step.

For each preset, one full training step (forward, backward, Per-Head Muon/AdamW, Quantile Balancing
update) on packed synthetic documents, timed after warm-up. In the same run, a large GEMM measures the
machine's practical peak, so MFU is reported against both the measured peak and (on CUDA) the H200's
989 TFLOP/s bf16 datasheet number.

FLOPs per token (performance.md §3.5): training = 3 × forward, forward = 2 × active matmul parameters
(lm_head included, embedding excluded, routed experts at top-k/E) + per MLA layer 2·H·(d_qk + d_v)·L_ctx
(L_ctx = mean attended length inside each document) + per KDA layer H·(6d² + 3Cd + C²).

Correctness gate: the loss at init is within 1 nat of ln V and finite after the timed steps.

    python benchmarks/train_throughput.py --presets tiny                 # CPU
    python benchmarks/train_throughput.py --presets small --device cuda  # one GPU
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from k3.config import get_preset
from k3.model.accounting import account
from k3.model.model import build_model
from k3.optim import MuonAdamW, cosine_schedule
from k3.train.loop import TrainConfig, train_step

H200_BF16_PEAK = 989e12


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

    def step(self, closure=None):
        sync(self._device)
        start = time.perf_counter()
        out = super().step(closure)
        sync(self._device)
        self._record.append(time.perf_counter() - start)
        return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=None, help="rows per step (default: 16 CPU, 8 GPU)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 256 CPU, 4096 GPU")
    parser.add_argument("--vocab-size", type=int, default=None, help="override (e.g. 32768 for small with k3's BPE)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--kda-impl", default="torch")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rows = args.rows or (8 if cuda else 16)
    seq_len = args.seq_len or (4096 if cuda else 256)
    steps = args.steps or (5 if cuda else 3)
    if not cuda:
        torch.set_flush_denormal(True)

    peak = measured_gemm_peak(device)
    console = Console(width=220)
    table = Table(title=f"k3 training step on {torch.cuda.get_device_name() if cuda else 'CPU'} "
                        f"({'bf16 autocast' if cuda else 'fp32'}, {rows} × {seq_len} packed tokens/step, "
                        f"measured GEMM peak {peak / 1e12:.1f} TFLOP/s)")
    for col in ("preset", "params total / active", "step s", "tokens/s", "TFLOP/s", "MFU (measured peak)",
                "MFU (989 TF)" if cuda else "attention share of FLOPs", "optimizer share", "peak mem GiB"):
        table.add_column(col, justify="right")
    for name in args.presets:
        overrides = {"kda_impl": args.kda_impl}
        if args.vocab_size:
            overrides["vocab_size"] = args.vocab_size
        config = get_preset(name, **overrides)
        model = build_model(config, seed=0, device=device)
        opt_times: list[float] = []
        optimizer = TimedMuonAdamW(model.named_parameters(), config, lr=1e-3, record=opt_times, device=device,
                                   ns_dtype=torch.bfloat16)  # as `k3 train` runs it
        scheduler = cosine_schedule(optimizer, 1000)
        cfg = TrainConfig(preset=name)
        batch = Batch(rows, seq_len, config.vocab_size, device)
        with torch.no_grad(), (torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)):
            b = batch.to(device)
            logits = model(b.input_ids, cu_seqlens=b.cu_seqlens).logits
            loss0 = F.cross_entropy(logits.flatten(0, 1).float(), b.labels.flatten(), ignore_index=-100).item()
        if not (math.isfinite(loss0) and abs(loss0 - math.log(config.vocab_size)) < 1.0):
            raise SystemExit(f"correctness gate failed for {name}: loss at init {loss0:.3f}, ln V = "
                             f"{math.log(config.vocab_size):.3f}")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(steps + 1):
            sync(device)
            t = time.perf_counter()
            metrics = train_step(model, optimizer, scheduler, [batch], cfg, device)
            sync(device)
            times.append(time.perf_counter() - t)
        if not math.isfinite(metrics["loss"]):
            raise SystemExit(f"correctness gate failed for {name}: non-finite loss after {steps} steps")
        step_s = statistics.median(times[1:])
        opt_s = statistics.median(opt_times[1:])
        tokens = rows * seq_len
        mm, attn = flops_per_token(model, config, batch.mean_context(), config.kda_chunk_size)
        achieved = (mm + attn) * tokens / step_s
        acc = account(config)
        mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        table.add_row(name, f"{acc.total_params / 1e6:,.1f}M / {acc.active_params / 1e6:,.1f}M", f"{step_s:.3f}",
                      f"{tokens / step_s:,.0f}", f"{achieved / 1e12:.2f}", f"{achieved / peak:.1%}",
                      f"{achieved / H200_BF16_PEAK:.1%}" if cuda else f"{attn / (mm + attn):.1%}",
                      f"{opt_s / step_s:.1%}", f"{mem:.1f}")
        del model, optimizer
        if cuda:
            torch.cuda.empty_cache()
    console.print(table)


if __name__ == "__main__":
    main()
