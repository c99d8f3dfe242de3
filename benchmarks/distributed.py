"""Distributed training measured: step time, tokens/s per rank, bytes per collective against prediction.

Runs each (world size, parallel config) as its own `torchrun --standalone` job of this file in worker
mode, on gloo (CPU) or NCCL (GPU), and prints one table. Every job trains the same global batches —
packed documents of a learnable synthetic language over the first V = --language-vocab token ids
(next = (31·prev + 7 + r) mod V, r uniform in 0…3, so the floor is ln 4 = 1.386 nats; V well below the
model's vocabulary makes the first hundred steps visibly learn) — from the same seed, so loss curves are
comparable across world sizes. Each run is compared with the 1-rank run of its batch shape (rows × length);
the CP config may use its own, longer shape (--cp-rows, --cp-seq-len). --report merges the JSON files of
several device calls into one table.

Configs: `fsdp` (FSDP2 over all ranks), `fsdp+ep` (plus expert parallelism with MoonEP), `fsdp+ep-noplan`
(plain EP, for the imbalance MoonEP removes), `fsdp+cp` (plus context parallelism over all ranks).

Bytes are what one rank receives from other ranks per step, per collective kind, counted by wrapping
the torch.distributed calls (FSDP2's all-gathers and reduce-scatters, P2P Muon's all-to-alls, the QB
and metric all-reduces) and the autograd collectives of EP/CP (each call, recomputed forwards included,
and its backward when the gradient arrives). Predictions: FSDP2 gathers every layer twice (forward, and
again in backward after resharding) and the root once, and reduce-scatters the gradients once, each
moving (W−1)/W of the bytes; P2P Muon moves exactly its static plan; QB all-reduces E·1000 int64 per MoE
layer; EP moves 2·S·k·L values each way with (W−1)/W leaving the rank when routing is uniform; CP gathers
the KDA maps [B_l, H, K, K+V] and conv halos per KDA layer and the MLA latents per MLA layer; with
activation checkpointing the EP/CP forwards run twice.

    python benchmarks/distributed.py --device cpu --preset debug --worlds 1 2 4            # CPU (gloo)
    python benchmarks/distributed.py --device cuda --preset small --worlds 1 2 --configs fsdp fsdp+ep fsdp+cp \\
        --steps 200 --rows 2 --seq-len 4096 --cp-rows 1 --cp-seq-len 16384 --activation-checkpointing \\
        --set attention_backend=sdpa kda_impl=triton --concurrent-references --repeat-reference 60 \\
        --dcp-check --dcp-steps 10 --json dist.json --plot dist.png                       # 2 × H200
    python benchmarks/distributed.py --report a.json b.json --write-results   # merge runs into the results file

`--write-results` writes the tables to benchmarks/results/distributed-<device>.json (`cpu`, `2xh200`, ...): with a run,
or with --report over the --json files of runs split into several calls (each record carries its commit and
device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import device_name, git_sha, save_result, table  # noqa: E402


def synthetic_batch(step: int, rows: int, seq_len: int, vocab: int):
    """Global batch `step`: packed documents (lengths 64…seq_len) of the synthetic language."""
    from k3.train.data import Batch

    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.empty(rows, seq_len, dtype=torch.int64)
    cu = [0]
    for r in range(rows):
        t = 0
        while t < seq_len:
            n = min(int(torch.randint(64, seq_len + 1, (1,), generator=g)), seq_len - t)
            tok = int(torch.randint(0, vocab, (1,), generator=g))
            noise = torch.randint(0, 4, (n,), generator=g)
            for i in range(n):
                ids[r, t + i] = tok
                tok = (31 * tok + 7 + int(noise[i])) % vocab
            t += n
            cu.append(r * seq_len + t)
    labels = torch.full_like(ids, -100)
    flat_ids, flat_labels = ids.view(-1), labels.view(-1)
    for a, b in zip(cu[:-1], cu[1:]):
        flat_labels[a:b - 1] = flat_ids[a + 1:b]
    return Batch(ids, labels, torch.tensor(cu), int((labels != -100).sum()))


class CollectiveCounter:
    """Wraps torch.distributed calls to add up received bytes and wall time per kind."""

    def __init__(self, world: int):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self.world = world
        self.bytes = defaultdict(float)
        self.seconds = defaultdict(float)
        self.enabled = False
        frac = (world - 1) / world

        def nbytes(t):
            return t.numel() * t.element_size()

        self._depth = 0

        def wrap(module, name, kind, size_of):
            original = getattr(module, name, None)
            if original is None:  # not in this torch version
                return

            def wrapper(*args, **kwargs):
                if not self.enabled or self._depth:  # count once when one wrapped call makes another
                    return original(*args, **kwargs)
                self._depth += 1
                try:
                    start = time.perf_counter()
                    out = original(*args, **kwargs)
                    self.seconds[kind] += time.perf_counter() - start
                finally:
                    self._depth -= 1
                self.bytes[kind] += size_of(args, kwargs, out)
                return out

            setattr(module, name, wrapper)

        # FSDP2 calls the *_single names in recent torch and the *_tensor names in older ones
        def arg(a, k, i, name):
            return a[i] if len(a) > i else k[name]

        for name in ("all_gather_into_tensor", "all_gather_single"):
            wrap(dist, name, "fsdp_all_gather", lambda a, k, o: nbytes(arg(a, k, 0, "output_tensor")) * frac)
        for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            wrap(dist, name, "fsdp_reduce_scatter", lambda a, k, o: nbytes(arg(a, k, 1, "input")) * frac
                 if (len(a) > 1 or "input" in k) else nbytes(arg(a, k, 1, "input_tensor")) * frac)
        wrap(dist, "all_reduce", "all_reduce", lambda a, k, o: nbytes(a[0]) * 2 * frac)
        wrap(dist, "all_gather", "ep_counts_all_gather", lambda a, k, o: nbytes(a[1]) * (world - 1))

        def a2a_bytes(a, k, o):
            out_splits = a[2] if len(a) > 2 else k.get("output_split_sizes")
            rank = dist.get_rank()
            row = a[0].numel() // max(a[0].shape[0], 1) * a[0].element_size() if a[0].dim() else a[0].element_size()
            if out_splits is None:
                return nbytes(a[0]) * frac
            return sum(n for r, n in enumerate(out_splits) if r != rank) * row

        wrap(dist, "all_to_all_single", "muon_all_to_all", a2a_bytes)

        def when_backward(out, kind: str, size: float) -> None:
            """Count the backward collective when the gradient reaches `out`. A forward recomputed by
            activation checkpointing is counted again, but its output gets no gradient (the backward runs
            through the original graph), so its backward is not counted twice."""
            if out.requires_grad:
                def hook(grad):
                    if self.enabled:
                        self.bytes[kind] += size
                    return grad

                out.register_hook(hook)

        def funcol_a2a(a, k, o):  # (input, output_split_sizes, input_split_sizes, group)
            row = a[0].numel() // max(a[0].shape[0], 1) * a[0].element_size()
            rank = dist.get_rank()
            # the backward returns the gradients of what this rank sent: it receives its input splits
            when_backward(o, "ep_all_to_all", row * sum(n for r, n in enumerate(a[2]) if r != rank))
            return row * sum(n for r, n in enumerate(a[1]) if r != rank)

        def funcol_gather(a, k, o):  # backward: a reduce-scatter receiving W − 1 pieces of the input's size
            when_backward(o, "cp_all_gather", nbytes(a[0]) * (world - 1))
            return nbytes(a[0]) * (world - 1)

        wrap(funcol, "all_to_all_single_autograd", "ep_all_to_all", funcol_a2a)
        for name in ("all_gather_tensor_autograd", "all_gather_single_autograd"):  # old and new torch names
            wrap(funcol, name, "cp_all_gather", funcol_gather)


def worker(args) -> None:
    from k3.config import get_preset
    from k3.parallel.muon import DistributedMuonAdamW
    from k3.parallel.parallelize import parallelize
    from k3.parallel.runtime import ParallelRuntime
    from k3.model.model import build_model
    from k3.optim import cosine_schedule
    from k3.train.config import TrainConfig
    from k3.train.loop import train_step

    world = int(os.environ["WORLD_SIZE"])
    counter = CollectiveCounter(world)
    cp = world if "cp" in args.config else 1
    ep = 0 if "ep" in args.config else 1
    runtime = ParallelRuntime.from_env(cp=cp, expert_parallel=ep == 0, device=args.device)
    if args.fsdp_bf16 and runtime.device.type == "cpu":  # emulate the GPU's bf16 compute on CPU
        import k3.train.loop

        k3.train.loop.autocast_context = lambda device: torch.autocast("cpu", dtype=torch.bfloat16)
    device = runtime.device
    if device.type == "cpu":
        torch.set_num_threads(max(1, args.threads))
    config = get_preset(args.preset)
    if args.set:
        config = config.replace(**{k: v for k, v in (item.split("=", 1) for item in args.set)})
    model = build_model(config, seed=0, device=device)
    params = sum(p.numel() for p in model.parameters())
    root_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
    parallel = parallelize(model, runtime, moonep="noplan" not in args.config,
                           activation_checkpointing=args.activation_checkpointing,
                           param_dtype=torch.bfloat16 if args.fsdp_bf16 else None)
    optimizer = DistributedMuonAdamW(model.named_parameters(), config, lr=args.lr, ns_dtype=torch.float32
                                     if device.type == "cpu" else torch.bfloat16)
    scheduler = cosine_schedule(optimizer, args.total_steps or args.start_step + args.steps)
    for _ in range(args.start_step):
        scheduler.step()  # a resumed run continues the same schedule
    cfg = TrainConfig(preset=args.preset, qk_clip_tau=100.0)
    if args.load:
        parallel.load(Path(args.load), optimizer)
    losses, times, ep_load, ep_home = [], [], [], []
    nccl_ms = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        batch = synthetic_batch(args.start_step + step, args.rows, args.seq_len,
                                min(config.vocab_size, args.language_vocab))
        counter.enabled = step == args.steps - 1  # count (and on GPU profile) the last step only
        if device.type == "cuda":
            torch.cuda.synchronize()
        runtime_barrier()
        profile = counter.enabled and device.type == "cuda"
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profile else None
        start = time.perf_counter()
        if prof is not None:
            prof.__enter__()
        metrics = train_step(model, optimizer, scheduler, [batch], cfg, device, parallel)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if prof is not None:
            prof.__exit__(None, None, None)
            nccl_ms = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
                          for e in prof.key_averages() if "nccl" in e.key.lower()) / 1e3
        times.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
        if "ep_load_max_over_mean" in metrics:
            ep_load.append(max(metrics["ep_load_max_over_mean"]))
            ep_home.append(max(metrics["ep_home_load_max_over_mean"]))
    counter.enabled = False
    if args.save:
        parallel.save(Path(args.save), optimizer)
    # the last step is instrumented (collectives wrapped, CUDA profiler on): it is never timed
    plain = times[:-1] if len(times) > 1 else times
    timed = plain[min(2, len(plain) - 1):]
    result = {
        "world": world, "config": args.config, "params": params, "losses": losses,
        "language_vocab": min(config.vocab_size, args.language_vocab),
        "step_s": statistics.median(timed), "tokens_per_step": args.rows * args.seq_len,
        "bytes": dict(counter.bytes), "collective_s": dict(counter.seconds),
        "muon_plan_bytes": muon_plan_bytes(optimizer),
        "ep_load": max(ep_load) if ep_load else None, "ep_home_load": max(ep_home) if ep_home else None,
        "peak_gib": (max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, device)
                     if device.type == "cuda" else None),
        "nccl_ms": nccl_ms,
        "prediction": predict(config, world, cp, ep, args, params, root_params),
    }
    if runtime.is_main:
        result |= {"commit": git_sha(), "device_name": device_name()}
        Path(args.result).write_text(json.dumps(result))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def max_over_ranks(value: float, device) -> float:
    import torch.distributed as dist

    t = torch.tensor(value, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def runtime_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def muon_plan_bytes(optimizer) -> float:
    """Bytes this rank receives per step under the static P2P Muon plan (both directions)."""
    rank = optimizer.rank
    return 4.0 * (sum(optimizer._recv_splits) - optimizer._recv_splits[rank]
                  + sum(optimizer._send_splits) - optimizer._send_splits[rank])


def predict(config, world: int, cp: int, ep: int, args, params: int, root_params: int) -> dict[str, float]:
    """Bytes per rank per step the algorithms predict (see the module docstring)."""
    frac = (world - 1) / world
    act = 2 if args.device == "cuda" or args.fsdp_bf16 else 4  # EP/CP activations travel in autocast's bf16
    param = 2 if args.fsdp_bf16 else 4  # FSDP2 gathers bf16 parameters with param_dtype=bf16
    forwards = 2 if args.activation_checkpointing else 1  # a checkpointed layer runs its forward again
    expert_params = sum(config.num_experts * 3 * config.moe_intermediate_size * config.routed_expert_hidden_size
                        for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    sharded = params - (expert_params if ep == 0 and world > 1 else 0)
    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    # FSDP2 regathers every layer for backward but keeps the root (embeddings, head) gathered after forward;
    # all-reduce: QB histograms dominate (plus expert loads, MLA max logits, loss, grad norm: small)
    out = {"fsdp_all_gather": param * (2 * sharded - root_params) * frac, "fsdp_reduce_scatter": 4 * sharded * frac,
           "all_reduce": 2 * frac * n_moe * config.num_experts * 1000 * 8}
    tokens_local = args.rows * args.seq_len // world
    if ep == 0 and world > 1:
        k, L = config.num_experts_per_token, config.routed_expert_hidden_size
        # per MoE layer: dispatch + combine, each forward (once more when recomputed) + backward (slot weights
        # come on top when the plan uses them)
        out["ep_all_to_all"] = n_moe * 2 * (forwards + 1) * tokens_local * k * L * act * frac
        out["ep_counts_all_gather"] = forwards * n_moe * (world - 1) * config.num_experts * 8
    if cp > 1:
        lin = config.linear_attn_config
        H, K = lin.num_heads, lin.head_dim
        rows_local = args.rows // (world // cp)
        n_kda = config.num_hidden_layers - len(config.mla_layer_ids)
        kda = rows_local * H * K * 2 * K * 4 + 3 * rows_local * (lin.short_conv_kernel_size - 1) * H * K * act
        mla = rows_local * (args.seq_len // cp) * (config.kv_lora_rank + config.qk_rope_head_dim) * act
        out["cp_all_gather"] = (forwards + 1) * (cp - 1) * (n_kda * kda + len(config.mla_layer_ids) * mla)
    return out


class Job:
    """One torchrun job of this file in worker mode, started now; `result()` waits for it.

    Output goes to files (a pipe nobody reads while other jobs are awaited would stall the job), and a job
    past --job-timeout gets SIGTERM first: torchrun then stops its workers, which live in their own
    sessions and would outlive a SIGKILL of torchrun alone.
    """

    def __init__(self, world: int, config: str, args, extra: list[str] | None = None, gpu: int | None = None,
                 threads: int | None = None):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = Path(self.tmp.name) / "result.json"
        self.world, self.config, self.timeout = world, config, args.job_timeout
        threads = max(1, (threads or args.threads) // world)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, "--worker", "--config", config, "--result", str(self.path), "--device", args.device,
               "--preset", args.preset, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
               "--rows", str(args.rows), "--lr", str(args.lr), "--language-vocab", str(args.language_vocab),
               "--threads", str(threads)] + (extra or [])
        if args.set:
            cmd += ["--set", *args.set]
        if args.activation_checkpointing:
            cmd.append("--activation-checkpointing")
        if args.fsdp_bf16:
            cmd.append("--fsdp-bf16")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if gpu is not None:  # the gpu-th device this process sees, through any mask it already has
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        self.settings = settings_of(args)
        self.log = open(Path(self.tmp.name) / "log.txt", "w+")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def done(self) -> bool:
        """Whether the job has ended or run past --job-timeout (result() then stops it)."""
        over = self.timeout is not None and time.perf_counter() - self.started > self.timeout
        return self.proc.poll() is not None or over

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def result(self) -> dict | None:
        """The job's result, or None (reported on stderr) when it failed or ran past --job-timeout."""
        try:
            remaining = None if self.timeout is None else max(1.0, self.timeout - (time.perf_counter() - self.started))
            try:
                self.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                self.stop()
                sys.stderr.write(self.tail())
                print(f"{self.config} on {self.world} ranks timed out after {self.timeout} s; continuing",
                      file=sys.stderr, flush=True)
                return None
            if self.proc.returncode != 0:
                sys.stderr.write(self.tail())
                print(f"{self.config} on {self.world} ranks FAILED (exit {self.proc.returncode}); continuing",
                      file=sys.stderr, flush=True)
                return None
            result = json.loads(self.path.read_text())
            result["settings"] = self.settings
            return result
        finally:
            self.log.close()
            self.tmp.cleanup()

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-9000:]


def settings_of(args) -> dict:
    """What must match for two runs' losses to be comparable (besides the batch shape)."""
    return {"preset": args.preset, "device": args.device, "steps": args.steps, "lr": args.lr, "set": args.set,
            "activation_checkpointing": args.activation_checkpointing, "language_vocab": args.language_vocab,
            "fsdp_bf16": args.fsdp_bf16}


def launch(world: int, config: str, args, extra: list[str] | None = None) -> dict | None:
    return Job(world, config, args, extra).result()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="debug")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--configs", nargs="+", default=["fsdp", "fsdp+ep", "fsdp+ep-noplan", "fsdp+cp"])
    p.add_argument("--steps", type=int, default=6, help="steps per job: warm-up 2, timed, 1 instrumented")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dcp-check", action="store_true", help="save on the largest world, resume on 1 rank")
    p.add_argument("--language-vocab", type=int, default=1024, help="token ids the synthetic language uses")
    p.add_argument("--concurrent-references", action="store_true",
                   help="run the 1-rank reference jobs side by side before the rest: one per GPU (on a shared "
                        "CPU their times are not comparable)")
    p.add_argument("--repeat-reference", type=int, metavar="STEPS",
                   help="run the 1-rank reference of the --rows × --seq-len shape again for the first STEPS steps "
                        "of its schedule: the run-to-run spread that the loss tolerance is measured against")
    p.add_argument("--job-timeout", type=float, help="seconds before a job counts as hung and is skipped")
    p.add_argument("--dcp-steps", type=int, help="steps covered by the DCP check (default --steps)")
    p.add_argument("--set", nargs="*", default=[], help="runtime config fields, e.g. attention_backend=sdpa")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--fsdp-bf16", action="store_true", help="bf16 FSDP2 parameters on CPU too (GPU default)")
    p.add_argument("--cp-rows", type=int, help="rows for the fsdp+cp config (default --rows)")
    p.add_argument("--cp-seq-len", type=int, help="sequence length for the fsdp+cp config (long context)")
    p.add_argument("--json", help="also write all results here")
    p.add_argument("--plot", help="loss curves (PNG), rewritten after every job")
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="only print the tables (and --plot) of earlier --json files, merged (e.g. one per device call)")
    p.add_argument("--write-results", action="store_true",
                   help="also write the tables to benchmarks/results/distributed-<device>.json")
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="fsdp", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--load", help=argparse.SUPPRESS)
    p.add_argument("--start-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--total-steps", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dcp_steps is not None and not 2 <= args.dcp_steps <= args.steps:
        p.error(f"--dcp-steps must be in [2, --steps = {args.steps}], got {args.dcp_steps}")
    if args.repeat_reference is not None and not 1 <= args.repeat_reference <= args.steps:
        p.error(f"--repeat-reference must be in [1, --steps = {args.steps}], got {args.repeat_reference}")
    if args.worker:
        worker(args)
        return
    if args.report:
        merged = [r for f in args.report for r in json.loads(Path(f).read_text())]
        for r in merged:
            if "dcp_check" in r:
                print(describe_dcp(r["dcp_check"]))
        tables = report([r for r in merged if "world" in r])
        if args.write_results:
            save_tables(tables, [r for r in merged if "world" in r])
        if args.plot:
            plot_losses([r for r in merged if "world" in r], Path(args.plot))
        return

    results = []
    jobs = job_list(args)
    # single-rank references may run side by side, one process per GPU (nothing shared): a queue over the
    # GPUs, each taking the next one when its job ends; they are awaited before any multi-rank job starts
    side_by_side = [job for job in jobs if job[0] == 1] if args.concurrent_references else []
    if args.repeat_reference:
        side_by_side.append(REPEAT)
    slots = (max(1, min(len(side_by_side), torch.cuda.device_count())) if args.device == "cuda"
             else max(1, len(side_by_side)))
    queue = list(side_by_side)
    running: dict[int, tuple] = {}  # slot -> (job key, Job)

    def start_next(slot: int) -> None:
        key = queue.pop(0)
        world, config, shape = key if key != REPEAT else (1, "fsdp", (args.rows, args.seq_len))
        extra = None
        job_args = with_args(args, rows=shape[0], seq_len=shape[1])
        if key == REPEAT:  # the first --repeat-reference steps of the same schedule
            job_args = with_args(job_args, steps=args.repeat_reference)
            extra = ["--total-steps", str(args.steps)]
        gpu = slot if args.device == "cuda" else None
        print(f"starting {'a repeat of ' if key == REPEAT else ''}{config} on 1 rank at {shape[0]}×{shape[1]} "
              f"tokens" + (f" on GPU {gpu}" if gpu is not None else "") + "...", file=sys.stderr, flush=True)
        job = Job(world, config, job_args, extra, gpu=gpu, threads=args.threads // slots)
        if key == REPEAT:
            job.settings = settings_of(args)  # comparable with the reference, whose schedule it follows
        running[slot] = (key, job)

    def finished(key, job: Job) -> None:
        r = job.result()
        if r is None:
            return
        world, config, shape = key if key != REPEAT else (1, "fsdp", (args.rows, args.seq_len))
        r["rows"], r["seq_len"] = shape
        if key == REPEAT:
            r["repeat"] = True
        results.append(r)
        print(f"  {config} on {world} rank(s){' (repeat)' if key == REPEAT else ''}, "
              f"{time.perf_counter() - job.started:.0f} s: step "
              f"{r['step_s'] * 1e3:,.0f} ms, losses "
              f"{' '.join(f'{x:.3f}' for x in r['losses'][::max(1, len(r['losses']) // 10)])}, "
              f"peak {r['peak_gib']} GiB, EP {r['ep_load']} (plain {r['ep_home_load']}), "
              f"nccl {r.get('nccl_ms')} ms",
              file=sys.stderr, flush=True)
        if args.json:  # after every job: a cut-off run keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
        if args.plot:
            plot_losses(results, Path(args.plot))

    try:
        for slot in range(min(slots, len(queue))):
            start_next(slot)
        while running:
            for slot, (key, job) in list(running.items()):
                if job.done():
                    del running[slot]
                    finished(key, job)
                    if queue:
                        start_next(slot)
            time.sleep(0.5)
        for key in [job for job in jobs if job not in side_by_side]:
            world, config, shape = key
            print(f"running {config} on {world} rank(s) at {shape[0]}×{shape[1]} tokens...", file=sys.stderr,
                  flush=True)
            finished(key, Job(world, config, with_args(args, rows=shape[0], seq_len=shape[1])))
    finally:  # an interrupted run leaves no side-by-side job behind
        for _, job in running.values():
            job.stop()
    results.sort(key=lambda r: len(jobs) if r.get("repeat") else
                 jobs.index((r["world"], r["config"], (r["rows"], r["seq_len"]))))
    if not results:
        raise SystemExit("every job failed")
    tables = report(results)
    if args.write_results:
        save_tables(tables, results)
    if args.dcp_check:
        world = max(args.worlds)
        same = [r for r in results if r["world"] == world and r["config"] == "fsdp"]
        dcp = dcp_check(args, world, same[0] if same else None)
        if dcp is not None:
            results.append({"dcp_check": dcp})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


REPEAT = "repeat"  # the job key of --repeat-reference


def reference_of(r: dict, results: list[dict]) -> dict | None:
    """The 1-rank run with r's batch shape and settings (r itself when r is one; never a repeat)."""
    return next((b for b in results if b["world"] == 1 and not b.get("repeat") and (b["rows"], b["seq_len"]) == (r["rows"], r["seq_len"])
                 and b.get("settings") == r.get("settings")), None)


def save_tables(tables: dict, results: list[dict]) -> None:
    """The report's tables into benchmarks/results/distributed-<device>.json, with the runs' commit and device."""
    world = max(r["world"] for r in results)
    names = sorted({r.get("device_name", "unknown") for r in results})
    commits = sorted({r.get("commit", "unknown") for r in results})
    cpu = all((r.get("settings") or {}).get("device", "cpu") == "cpu" for r in results)
    gpu = next((n for n in names if "cpu" not in n.lower() and n != "unknown"), None)
    slug = "cpu" if cpu else f"{world}x{gpu.split()[1].lower() if gpu and len(gpu.split()) > 1 else 'gpu'}"
    save_result("distributed", "Distributed training: step time and tokens/s per rank, loss agreement with one "
                "rank, bytes per collective against the algorithms' prediction", tables,
                raw={"results": results}, slug=slug, commit=", ".join(commits),
                device=", ".join(names) + ("" if cpu else f" × {world}"))


def report(results: list[dict]) -> dict[str, dict]:
    """The tables of `results`, each run compared with the 1-rank run of its batch shape and settings; printed and
    returned in the results-file form (`training`, `bytes`)."""
    rows = []
    for r in results:
        base = reference_of(r, results)
        tps = r["tokens_per_step"] / r["step_s"]
        if base is None:
            scaling, diff = "-", "no 1-rank run"
        elif r is base:
            scaling, diff = "1.00", "-"
        else:
            # the same run again (a repeat): only its losses mean something
            scaling = "-" if r.get("repeat") else f"{tps / r['world'] / (base['tokens_per_step'] / base['step_s']):.2f}"
            deltas = [abs(a - b) for a, b in zip(r["losses"], base["losses"])]
            late = deltas[int(0.3 * len(deltas)):]  # after the plateau exit, where curves a step apart differ by nats
            tail = deltas[-max(1, len(deltas) // 10):]
            diff = f"{max(deltas):.1e} / {max(late):.1e} / {statistics.mean(tail):.1e}"
        # GPU: time inside NCCL kernels (profiled step; they may overlap compute); CPU: wall time in gloo calls
        comm = r["nccl_ms"] / 1e3 if r.get("nccl_ms") is not None else sum(r["collective_s"].values())
        escape = plateau_exit(r)
        rows.append([f"{r['world']}", label_of(r), f"{r['rows']}×{r['seq_len']}", f"{r['step_s'] * 1e3:,.0f}",
                     f"{tps / r['world']:,.0f}",
                     scaling, f"{r['losses'][0]:.3f}→{r['losses'][-1]:.3f}",
                     diff, "-" if escape is None else f"{escape}",
                     "-" if r["world"] == 1 else f"{100 * comm / r['step_s']:.0f}%",
                     "-" if r["ep_load"] is None else f"{r['ep_load']:.2f} ({r['ep_home_load']:.2f})",
                     "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"])
    header = ["ranks", "config", "batch", "step ms", "tok/s/rank", "scaling eff.", "loss first→last",
              "|Δloss| max / from 30% of the steps / last 10% mean", "leaves plateau at step",
              "comm share", "EP load max/mean (no plan)", "peak GiB"]
    steps = sorted({len(r["losses"]) for r in results})
    print_table(f"steps per job: {', '.join(map(str, steps))}; each run against the 1-rank run of its batch shape",
                header, rows)

    byte_rows = []
    for r in results:
        if r["world"] == 1:
            continue
        measured = {k: v for k, v in r["bytes"].items()}
        predicted = dict(r["prediction"])
        predicted["muon_all_to_all"] = r["muon_plan_bytes"]
        for kind in sorted(set(measured) | set(predicted)):
            m = measured.get(kind)
            pr = predicted.get(kind)
            byte_rows.append([f"{r['world']}", r["config"], kind, "-" if m is None else f"{m / 1e6:,.3f}",
                              "-" if pr is None else f"{pr / 1e6:,.3f}"])
    print_table("bytes received per rank per step (MB)", ["ranks", "config", "collective", "measured", "predicted"],
                byte_rows)
    # the results file's bytes table: one row per run, one "measured / predicted" cell per collective
    kinds = sorted({row[2] for row in byte_rows})
    pivot: dict[tuple, dict] = {}
    for world, config, kind, m, pr in byte_rows:
        pivot.setdefault((world, config), {})[kind] = f"{m} / {pr}"
    return {"training": table(header, [[cell(v) for v in row] for row in rows]),
            "bytes": table(["ranks", "config"] + kinds,
                           [[cell(w), c] + [cells.get(k) for k in kinds] for (w, c), cells in pivot.items()],
                           note="MB received per rank per step: measured / predicted.")}


def cell(text: str):
    """A printed cell as a results-file value: "1,200" -> 1200, "-" -> None, anything else as printed."""
    if text == "-":
        return None
    try:
        return int(text.replace(",", "")) if text.replace(",", "").isdigit() else text
    except ValueError:
        return text


def label_of(r: dict) -> str:
    return r["config"] + (" (repeat)" if r.get("repeat") else "")


def plateau_exit(r: dict) -> int | None:
    """First step whose loss is below the midpoint of the unigram plateau (ln V) and the floor (ln 4): when
    the run started to use the context. Curves that leave the plateau a step apart differ by nats there."""
    import math

    vocab = r.get("language_vocab") or (r.get("settings") or {}).get("language_vocab")
    if not vocab:
        return None
    threshold = (math.log(vocab) + math.log(4)) / 2
    return next((i for i, x in enumerate(r["losses"]) if x < threshold), None)


def with_args(args, **changes):
    """A copy of the parsed `args` with some fields changed."""
    return argparse.Namespace(**{**vars(args), **changes})


def job_list(args) -> list[tuple[int, str, tuple[int, int]]]:
    """(world, config, (rows, seq_len)) per job. One rank runs once per batch shape: every config is the same
    single-rank run there, and it is the reference the multi-rank runs of that shape are compared with."""
    base_shape = (args.rows, args.seq_len)
    cp_shape = (args.cp_rows or args.rows, args.cp_seq_len or args.seq_len)
    jobs = []
    for world in args.worlds:
        for config in args.configs:
            shape = cp_shape if "cp" in config else base_shape
            if world == 1:
                config = "fsdp"
            if (world, config, shape) not in jobs:
                jobs.append((world, config, shape))
    return jobs


def plot_losses(results: list[dict], path: Path) -> None:
    """Loss curves of every job, one panel per batch shape, and the difference to that shape's 1-rank run."""
    try:
        import matplotlib
    except ImportError:  # e.g. a GPU machine without it: plot later from --json
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["rows"], r["seq_len"]) for r in results})
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 7), squeeze=False, sharex="col")
    for col, shape in enumerate(shapes):
        group = [r for r in results if (r["rows"], r["seq_len"]) == shape]
        base = reference_of(group[0], results) or min(group, key=lambda r: r["world"])
        for r in group:
            label = f"{r['world']} rank{'s' if r['world'] > 1 else ''} {label_of(r)}"
            axes[0][col].plot(r["losses"], label=label)
            if r is not base:
                axes[1][col].plot([a - b for a, b in zip(r["losses"], base["losses"])], label=label)
        axes[0][col].set_title(f"{shape[0]}×{shape[1]} tokens per step")
        axes[0][col].set_ylabel("training loss (nats)")
        axes[0][col].legend()
        axes[1][col].axhline(0, color="grey", lw=0.5)
        axes[1][col].set_ylabel(f"loss − {base['world']}-rank loss")
        axes[1][col].set_xlabel("step")
        if len(group) > 1:
            axes[1][col].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def dcp_check(args, world: int, straight: dict | None) -> dict | None:
    """Train on `world` ranks, save DCP, resume on 1 rank; compare with the uninterrupted `world`-rank run.

    The two halves cover the first --dcp-steps steps of the same --steps schedule, so the straight run's
    first --dcp-steps losses are the reference.
    """
    total = args.dcp_steps or args.steps
    half = total // 2
    schedule = ["--total-steps", str(args.steps)]  # every part follows the same --steps schedule
    with tempfile.TemporaryDirectory() as tmp:
        # (the first `total` steps of the uninterrupted run are the reference)
        straight = straight or launch(world, "fsdp", with_args(args, steps=total), schedule)
        first = launch(world, "fsdp", with_args(args, steps=half), ["--save", f"{tmp}/ckpt"] + schedule)
        second = first and launch(1, "fsdp", with_args(args, steps=total - half),
                                  ["--load", f"{tmp}/ckpt", "--start-step", str(half)] + schedule)
    if not (straight and first and second):
        print("DCP check did not complete", file=sys.stderr)
        return None
    resumed = first["losses"] + second["losses"]
    result = {"world": world, "saved_after": half, "steps": total, "resumed_losses": resumed,
              "max_abs_diff": max(abs(a - b) for a, b in zip(resumed, straight["losses"]))}
    print(describe_dcp(result))
    return result


def describe_dcp(d: dict) -> str:
    return (f"DCP: saved on {d['world']} ranks after {d['saved_after']} steps, resumed on 1 rank: max |Δloss| "
            f"{d['max_abs_diff']:.2e} against the uninterrupted {d['world']}-rank run over {d['steps']} steps")


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=200).print(table)
    except ImportError:
        print(title)
        print(" | ".join(header))
        for row in rows:
            print(" | ".join(row))


if __name__ == "__main__":
    main()
