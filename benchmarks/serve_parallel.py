"""Serving across processes on CPU (gloo): tensor/expert-parallel engines, and prefill/decode disaggregation.

Random weights, fp32, one thread per process (`--threads`). The model is the tiny preset with 8 heads instead of 6
(`--heads`), so that 4 ranks can split them. Two tables:
1. `tp-scaling`: 1 process (the plain engine) vs 2 and 4 gloo ranks (tensor parallel; and with `--expert-parallel`
   experts whole per rank): time to first token of one `--ttft-prompt`-token prompt, prefill and decode tokens/s of
   a batch of `--batch` requests (`--prompt-len` prompts, `--decode-tokens` greedy tokens each), decode ms per step,
   and the per-step overhead: collectives per decode step and the time rank 0 spends in them (waiting included).
   On CPU the ranks share the machine's cores, so scaling is not the point: the overhead per step is.
2. `disaggregation`: a stream of `--stream-requests` long-prompt requests (`--stream-prompt` tokens, one every
   `--stream-interval` s, `--stream-tokens` greedy tokens) served co-located (one engine prefills and decodes) vs
   disaggregated (a prefill instance in another process ships each request's cache over TCP to the decode
   instance): time to first token and time between tokens (mean and p90 over all requests).
Correctness gate first: the parallel engines' greedy tokens equal the single process's, and the disaggregated
stream's equal the co-located one's. Run: `python benchmarks/serve_parallel.py [--quick]`; the tables go to
benchmarks/results/serve_parallel-cpu.json (not with --quick).
"""

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.infer.api import RequestOutput, SamplingParams  # noqa: E402
from k3.infer.config import EngineConfig  # noqa: E402
from k3.infer.engine import AsyncEngine, Engine, merge_output  # noqa: E402
from k3.infer.transfer import DisaggregatedEngine, PrefillServer, PrefillWorker  # noqa: E402
from k3.model.model import build_model  # noqa: E402
from k3.parallel.inference import TPGroup, serving_engine, shard_model  # noqa: E402

console = Console()
ENGINE = EngineConfig(max_step_tokens=2048, prefill_chunk_tokens=512, eos_token_ids=())


def model_config(heads: int):
    config = get_preset("tiny")
    lin = dataclasses.replace(config.linear_attn_config, num_heads=heads)
    return config.replace(num_attention_heads=heads, num_key_value_heads=heads, linear_attn_config=lin)


def prompt(n: int, seed: int, V: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class CommTimer:
    """Counts and times this process's collectives (wrapping torch.distributed's functions in place)."""

    NAMES = ("all_reduce", "all_gather", "broadcast_object_list", "gather_object")

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0
        for name in self.NAMES:
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1
        return wrapper

    def snapshot(self) -> tuple[int, float]:
        return self.calls, self.seconds


def drive(front, requests) -> tuple[dict, int]:
    """Run requests to the end (all added at once); -> (id -> tokens, steps)."""
    outs = {}
    for rid, ids, sp in requests:
        front.add_request(rid, ids, sp)
        outs[rid] = RequestOutput(rid, [])
    steps = 0
    while front.has_unfinished():
        for out in front.step():
            merge_output(outs[out.request_id], out)
        steps += 1
    return {rid: o.new_token_ids for rid, o in outs.items()}, steps


def measure(front, args, V, comm: CommTimer | None) -> dict:
    """TTFT of one long prompt; prefill and decode rates of a batch; the collectives per decode step."""
    greedy = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0)
    drive(front, [("warm", prompt(64, 0, V), SamplingParams(max_tokens=4, temperature=0.0))])
    t = time.perf_counter()
    front.add_request("ttft", prompt(args.ttft_prompt, 1, V), SamplingParams(max_tokens=1, temperature=0.0))
    while front.has_unfinished():
        front.step()
    ttft = time.perf_counter() - t
    batch = [(f"b{i}", prompt(args.prompt_len, 10 + i, V), greedy) for i in range(args.batch)]
    for rid, ids, sp in batch:
        front.add_request(rid, ids, sp)
    outs = {rid: [] for rid, _, _ in batch}
    t = time.perf_counter()
    prefill_s = None
    decode_steps = 0
    c0 = comm.snapshot() if comm else (0, 0.0)
    while front.has_unfinished():
        produced = front.step()
        for out in produced:
            outs[out.request_id] += out.new_token_ids
        if prefill_s is None and all(outs.values()):
            prefill_s = time.perf_counter() - t
            t = time.perf_counter()
            c0 = comm.snapshot() if comm else (0, 0.0)
        elif prefill_s is not None:
            decode_steps += 1
    decode_s = time.perf_counter() - t
    c1 = comm.snapshot() if comm else (0, 0.0)
    return {"tokens": outs, "ttft_ms": ttft * 1e3, "prefill_tok_s": args.batch * args.prompt_len / prefill_s,
            "decode_tok_s": args.batch * (args.decode_tokens - 1) / decode_s,
            "decode_ms_step": decode_s / decode_steps * 1e3,
            "collectives_step": (c1[0] - c0[0]) / decode_steps, "comm_ms_step": (c1[1] - c0[1]) / decode_steps * 1e3}


def tp_worker(rank: int, world: int, init_file: str, out_dir: str, args, expert_parallel: bool) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    comm = CommTimer()
    config = model_config(args.heads)
    tp = TPGroup.world()
    local = shard_model(build_model(config, seed=0), tp, expert_parallel)
    engine = Engine(local, ENGINE)
    front = serving_engine(engine, tp)
    if rank != 0:
        front.follow()
    else:
        result = measure(front, args, config.vocab_size, comm)
        front.shutdown()
        torch.save(result, os.path.join(out_dir, "result.pt"))
    dist.barrier()
    os._exit(0)  # gloo's threads sometimes abort at interpreter teardown


def run_tp(args, world: int, expert_parallel: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(tp_worker, args=(world, os.path.join(tmp, "rendezvous"), tmp, args, expert_parallel), nprocs=world,
                 join=True)
        return torch.load(os.path.join(tmp, "result.pt"), weights_only=False)


# -- disaggregation -----------------------------------------------------------------------------------------------

def prefill_process(args, port_queue) -> None:
    torch.set_num_threads(args.threads)
    engine = Engine(build_model(model_config(args.heads), seed=0), ENGINE)
    worker = PrefillWorker(engine)
    server = PrefillServer(worker)
    port_queue.put(server.address[1])
    server._thread.join()


async def stream(aeng, args, V) -> dict:
    """The request stream: id -> (tokens, TTFT s, gaps between tokens s)."""
    sp = SamplingParams(max_tokens=args.stream_tokens, temperature=0.0)

    async def one(i):
        await asyncio.sleep(i * args.stream_interval)
        t0 = time.perf_counter()
        last, tokens, gaps, ttft = t0, [], [], None
        async for out in aeng.stream(f"s{i}", prompt(args.stream_prompt, 500 + i, V), sp):
            now = time.perf_counter()
            if out.new_token_ids:
                if ttft is None:
                    ttft = now - t0
                    n_rest = len(out.new_token_ids) - 1
                else:
                    n_rest = len(out.new_token_ids)
                gaps += [(now - last) / max(1, len(out.new_token_ids))] * n_rest
                tokens += out.new_token_ids
                last = now
        return f"s{i}", (tokens, ttft, gaps)

    return dict(await asyncio.gather(*(one(i) for i in range(args.stream_requests))))


def warmup(args):
    """The stream's settings for one short request (first-call costs out of the measurement)."""
    return argparse.Namespace(**{**vars(args), "stream_requests": 1, "stream_prompt": 64})


def stream_stats(result: dict) -> dict:
    ttfts = sorted(v[1] for v in result.values())
    gaps = sorted(g for v in result.values() for g in v[2])

    def p90(xs):
        return xs[min(len(xs) - 1, int(0.9 * len(xs)))]

    return {"ttft_mean_ms": statistics.mean(ttfts) * 1e3, "ttft_p90_ms": p90(ttfts) * 1e3,
            "tbt_mean_ms": statistics.mean(gaps) * 1e3, "tbt_p90_ms": p90(gaps) * 1e3}


def run_disaggregation(args) -> dict:
    config = model_config(args.heads)
    V = config.vocab_size
    model = build_model(config, seed=0)
    colocated = AsyncEngine(Engine(model, ENGINE))
    try:
        asyncio.run(stream(colocated, warmup(args), V))  # warm
        co = asyncio.run(stream(colocated, args, V))
    finally:
        colocated.shutdown()
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=prefill_process, args=(args, ports), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=600)
        decode = DisaggregatedEngine(Engine(model, ENGINE), ("127.0.0.1", port))
        try:
            asyncio.run(stream(decode, warmup(args), V))
            dis = asyncio.run(stream(decode, args, V))
            transfers, fallbacks = decode.transfers, decode.transfer_fallbacks
        finally:
            decode.shutdown()
    finally:
        proc.terminate()
    if {k: v[0] for k, v in co.items()} != {k: v[0] for k, v in dis.items()}:
        raise SystemExit("gate failed: the disaggregated stream's tokens differ from the co-located ones")
    if fallbacks:
        raise SystemExit(f"gate failed: {fallbacks} transfers fell back to local prefill")
    return {"co-located": stream_stats(co), "disaggregated": stream_stats(dis), "transfers": transfers}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--ttft-prompt", type=int, default=1024)
    parser.add_argument("--stream-requests", type=int, default=8)
    parser.add_argument("--stream-prompt", type=int, default=1024)
    parser.add_argument("--stream-tokens", type=int, default=32)
    parser.add_argument("--stream-interval", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run (nothing saved)")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.batch, args.ttft_prompt, args.decode_tokens = [2], 2, 128, 4
        args.stream_requests, args.stream_prompt, args.stream_tokens, args.stream_interval = 2, 256, 4, 0.2
    torch.set_num_threads(args.threads)
    config = model_config(args.heads)

    base_model = build_model(config, seed=0)
    base = measure(Engine(base_model, ENGINE), args, config.vocab_size, None)
    runs = [("1 process", 1, base)]
    for world in args.ranks:
        for ep in (False, True):
            got = run_tp(args, world, ep)
            if got["tokens"] != base["tokens"]:
                raise SystemExit(f"gate failed: {world} ranks{' (EP)' if ep else ''} gave other greedy tokens")
            runs.append((f"{world} ranks, {'TP attention + EP experts' if ep else 'TP'}", world, got))
    t = Table(title=f"tensor/expert parallel engines on gloo (tiny, {args.heads} heads, fp32, {args.threads} thread "
                    "per process)")
    columns = ["engine", "TTFT ms", "prefill tok/s", "decode tok/s", "decode ms/step", "collectives/step",
               "comm ms/step"]
    for c in columns:
        t.add_column(c, justify="right")
    rows = []
    for name, world, r in runs:
        row = [name, round(r["ttft_ms"], 1), round(r["prefill_tok_s"]), round(r["decode_tok_s"], 1),
               round(r["decode_ms_step"], 1), round(r["collectives_step"], 1), round(r["comm_ms_step"], 1)]
        rows.append(row)
        t.add_row(*[f"{v:,}" if isinstance(v, (int, float)) else v for v in row])
    console.print(t)

    dis = run_disaggregation(args)
    t2 = Table(title=f"{args.stream_requests} requests of {args.stream_prompt} prompt tokens, one every "
                     f"{args.stream_interval} s, {args.stream_tokens} tokens each")
    columns2 = ["serving", "TTFT mean ms", "TTFT p90 ms", "TBT mean ms", "TBT p90 ms"]
    for c in columns2:
        t2.add_column(c, justify="right")
    rows2 = []
    for name in ("co-located", "disaggregated"):
        s = dis[name]
        row = [name, round(s["ttft_mean_ms"], 1), round(s["ttft_p90_ms"], 1), round(s["tbt_mean_ms"], 1),
               round(s["tbt_p90_ms"], 1)]
        rows2.append(row)
        t2.add_row(*[f"{v:,}" if isinstance(v, (int, float)) else v for v in row])
    console.print(t2)
    if args.quick:
        return
    save_result("serve_parallel", "tensor/expert-parallel serving overheads on gloo, and prefill/decode "
                "disaggregation vs co-located serving (CPU)", {
                    "tp-scaling": table(columns, rows, note=f"batch {args.batch} × {args.prompt_len}-token prompts, "
                                        f"{args.decode_tokens} tokens each; TTFT of one {args.ttft_prompt}-token "
                                        "prompt; comm = rank 0's time inside collectives, waiting included"),
                    "disaggregation": table(columns2, rows2, note="disaggregated: prefill in a second process "
                                            "(its own core), each request's cache shipped over loopback TCP"),
                })


if __name__ == "__main__":
    main()
