"""Where one training step goes: phase times and the top operators of a profiled step, on one device.

Times the whole `train_step` and, separately with a device synchronisation between them, its forward
(with the loss), backward and `optimizer.step()` (Per-Head Muon/AdamW); "other" is the rest of the step
(router statistics, QB bias update, QK-Clip, gradient clipping, metrics). Then profiles one more step with
torch.profiler and prints the operators that take the most device time and the most host time. A step
whose device-busy share is far below 100% is bound by the host (kernel launches, Python), not the GPU.

    python benchmarks/profile_step.py --preset small --rows 2 --seq-len 4096 \\
        --set kda_impl=triton attention_backend=sdpa --activation-checkpointing      # one H200
    python benchmarks/profile_step.py --preset debug --rows 2 --seq-len 256 --device cpu
    ... --by-line    # and the device time of one more step by the k3 function that launched it

The phases (and with --by-line the 15 largest k3 functions) go to benchmarks/results/profile-step-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import save_result, table  # noqa: E402
from benchmarks.train_throughput import Batch  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.model.checkpointing import apply_activation_checkpointing  # noqa: E402
from k3.model.model import build_model  # noqa: E402
from k3.optim import MuonAdamW, cosine_schedule  # noqa: E402
from k3.train.config import TrainConfig  # noqa: E402
from k3.train.loop import autocast_context, train_step  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def phase_times(model, optimizer, batch, device) -> dict[str, float]:
    """Seconds of forward (loss included), backward and the optimizer's step, each synchronised."""
    out = {}
    sync(device)
    t0 = time.perf_counter()
    with autocast_context(device):
        loss = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels).loss / batch.num_tokens
    sync(device)
    out["forward"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss.backward()
    sync(device)
    out["backward"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    out["optimizer"] = time.perf_counter() - t0
    return out


def sync_sites(model, optimizer, scheduler, batch, cfg, device, top: int = 12) -> str:
    """Where one train_step makes the host wait for the GPU: torch's sync debug mode warns at every
    synchronising call; the warnings are grouped by the k3 line that made them. Syncs inside C++ autograd
    nodes are replayed when backward ends, so they show at the `.backward()` line; Python backward code
    and checkpoint recomputation are attributed to their own lines."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        # [:-1]: not this function's own frame (which would otherwise collect every sync)
        frames = [f for f in traceback.extract_stack()[:-1] if "/k3/" in f.filename or "/benchmarks/" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else "?"
        sites[where] = sites.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(model, optimizer, scheduler, [batch], cfg, device)
            sync(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    lines = [f"  host syncs in one train_step: {sum(sites.values())} at {len(sites)} places"]
    for where, n in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {n:5d}  {where}")
    return "\n".join(lines)


def time_by_line(model, optimizer, scheduler, batch, cfg, device, top: int = 25) -> tuple[str, list[list]]:
    """One more profiled train_step, with Python stacks: each op's own device time (CPU time without a GPU)
    summed by the innermost k3 function that issued it (the profiler's Python tracer names a function by
    its file and first line), and by (function, op). Ops without a k3 frame (the C++
    autograd engine's backward kernels, the optimizer's foreach ops) are grouped by op name. Stacks slow
    the host, so this step is not the timed one. Returns the report and its rows [function, ms, share]."""
    import collections

    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    # stacks are recorded only in verbose mode (torch >= 2.4)
    config = torch._C._profiler._ExperimentalConfig(verbose=True)
    sync(device)
    with torch.profiler.profile(activities=activities, with_stack=True, experimental_config=config) as prof:
        train_step(model, optimizer, scheduler, [batch], cfg, device)
        sync(device)
    by_line: collections.Counter = collections.Counter()
    by_line_op: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        if t <= 0:
            continue
        frame = next((f for f in e.stack if "k3/" in f and "benchmarks/" not in f), None)
        where = frame[frame.index("k3/"):] if frame else f"(no k3 frame) {e.name}"
        by_line[where] += t
        by_line_op[(where, e.name)] += t
    total = sum(by_line.values())
    unit = "device" if cuda else "CPU"
    lines = [f"  {unit} time by k3 function ({total / 1e3:,.1f} ms in one profiled step):"]
    for where, t in by_line.most_common(top):
        lines.append(f"    {t / 1e3:9.2f} ms  {100 * t / total:5.1f}%  {where}")
    lines.append(f"  {unit} time by k3 function and op:")
    for (where, name), t in by_line_op.most_common(top):
        lines.append(f"    {t / 1e3:9.2f} ms  {name:32s} {where}")
    rows = [[f"`{where}`", round(t / 1e3, 2), f"{100 * t / total:.1f}%"] for where, t in by_line.most_common(top)]
    return "\n".join(lines), rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after one warm-up)")
    p.add_argument("--set", nargs="*", default=[], help="runtime config fields, e.g. kda_impl=triton")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", help="also write a Chrome trace of the profiled step here")
    p.add_argument("--by-line", action="store_true", help="also attribute device time to k3 functions")
    args = p.parse_args()

    device = torch.device(args.device)
    config = get_preset(args.preset)
    if args.set:
        config = config.replace(**{k: v for k, v in (item.split("=", 1) for item in args.set)})
    model = build_model(config, seed=0, device=device)
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    optimizer = MuonAdamW(model.named_parameters(), config, lr=1e-3)
    scheduler = cosine_schedule(optimizer, 1000)
    cfg = TrainConfig(preset=args.preset)
    batch = Batch(args.rows, args.seq_len, config.vocab_size, device).to(device)

    for _ in range(2):  # warm-up: kernel compilation, autotuning, allocator
        train_step(model, optimizer, scheduler, [batch], cfg, device)
    # the direct forward/backward calls compile once more than train_step did (a 3.3 s first forward once made the
    # two-step median 1.66 s), so they get their own warm-up
    phase_times(model, optimizer, batch, device)
    phases = [phase_times(model, optimizer, batch, device) for _ in range(args.steps)]
    steps = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        train_step(model, optimizer, scheduler, [batch], cfg, device)
        sync(device)
        steps.append(time.perf_counter() - t0)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        train_step(model, optimizer, scheduler, [batch], cfg, device)
        sync(device)
        profiled = time.perf_counter() - t0
    events = prof.key_averages()

    tokens = args.rows * args.seq_len
    step = statistics.median(steps)
    print(f"{args.preset}, {args.rows}×{args.seq_len} tokens, {args.set}, checkpointing "
          f"{args.activation_checkpointing}: train_step {step * 1e3:,.0f} ms ({tokens / step:,.0f} tok/s)")
    medians = {name: statistics.median(ph[name] for ph in phases) for name in ("forward", "backward", "optimizer")}
    medians["other"] = max(0.0, step - sum(medians.values()))
    for name, t in medians.items():
        print(f"  {name:10s} {t * 1e3:9,.1f} ms  ({100 * t / step:4.1f}% of the step)")
    phase_rows = [["whole step", round(step * 1e3), "100%"]]
    phase_rows += [[name, round(t * 1e3, 1), f"{100 * t / step:.1f}%"] for name, t in medians.items()]
    tables = {"phases": table(["part", "ms", "share of the step"], phase_rows)}
    if device.type == "cuda":
        # device time of kernels only (the profiler's top-level CUDA events), against the profiled wall time
        busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        # the profiler slows the host, so the busy share is given against the unprofiled step too
        print(f"  profiled step {profiled * 1e3:,.0f} ms; kernels busy {busy / 1e3:,.0f} ms "
              f"({100 * busy / 1e3 / (profiled * 1e3):.0f}% of the profiled step, "
              f"{100 * busy / 1e3 / (step * 1e3):.0f}% of the unprofiled one)")
        runtime = {e.key: e.count for e in events if e.key.startswith("cuda")}
        syncs = {k: v for k, v in runtime.items() if "Synchronize" in k}
        launches = sum(v for k, v in runtime.items() if 'Launch' in k)
        tables["phases"]["note"] = (f"Kernels busy {busy / 1e3:,.0f} ms of the profiled step "
                                    f"({100 * busy / 1e3 / (profiled * 1e3):.0f}%); {launches:,} kernel launches.")
        print(f"  kernel launches {launches:,}; host waits "
              f"{', '.join(f'{k} {v:,}' for k, v in sorted(syncs.items())) or 'none'}; "
              f"copies {sum(v for k, v in runtime.items() if 'Memcpy' in k):,}")
        print(sync_sites(model, optimizer, scheduler, batch, cfg, device))
        print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    if args.by_line:
        text, rows = time_by_line(model, optimizer, scheduler, batch, cfg, device, args.top)
        print(text)
        tables["by-function"] = table(["k3 function", "ms", "share"], rows[:15])
    save_result("profile-step", f"Where one training step of the {args.preset} preset goes ({args.rows} × "
                f"{args.seq_len} tokens): phases, and device time by the k3 function that launched the kernels", tables)
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
