"""Serving beyond one engine: the fleet router over `k3 serve` replicas (docs/serving.md "The fleet router").

One function per section, chosen with `--sections`; all write one result file, benchmarks/results/fleet-<device>.json
(not with --quick).

router: 3 replicas (`k3 serve --preset debug`, random weights, the byte tokenizer, one torch thread each) behind
`k3 route`, once with `--balance least-loaded` (a plain load balancer) and once with `--balance affinity`, each
with fresh replicas (empty prefix caches). The workload: `--conversations` multi-turn chats of `--turns` turns,
`--concurrency` at a time; a conversation opens with a shared system prompt and a document of its own, later
turns are short questions after a user's pause (`--think-ms`), and each turn sends the whole history back (as
chat clients do). Without pauses a closed-loop client flatters least-loaded balancing: the replica a
conversation just left is the one with a free slot, so its next turn lands there again. Measured per
balance: the replicas' prefix-cache hit rate (cached prompt tokens over prompt tokens, from each reply's
`usage.prompt_tokens_details.cached_tokens`), the time to first token per turn (streamed, from sending to the
first content chunk), the router's affinity hit rate and the failed requests. Gate first: a greedy reply through
the router equals the same request sent to the replica directly.

    python benchmarks/fleet.py --sections router
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from benchmarks.provenance import save_result  # noqa: E402
from benchmarks.provenance import table as result_table  # noqa: E402

CLAIM = "Serving over several engines: {sections}"
SECTION_CLAIMS = {"router": "the fleet router's conversation affinity against a plain least-loaded balancer "
                            "({replicas} replicas of the {preset} preset, CPU, one torch thread each)"}
WORDS = ("weather forecast rain wind sun cloud north south river city bridge market train station museum garden "
         "morning evening road coast harbour valley").split()
SYSTEM = ("You are a careful assistant for a travel desk. Answer briefly, cite the document when you can, and say "
          "when you do not know. ")
QUESTIONS = ["Summarise the document in one line.", "What should a visitor do first?",
             "Is the weather a concern?", "Anything else worth knowing?", "Which day is best?", "Thank you."]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Processes:
    """Child processes (replicas, the router) started with one torch thread each, stopped together."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.children = log_dir, []

    def start(self, name: str, args: list[str]) -> str:
        port = free_port()
        env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "k3.cli", *args, "--port", str(port), "--log-level", "warning"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.children.append((proc, log))
        return f"http://127.0.0.1:{port}"

    def wait_healthy(self, urls: list[str], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for url in urls:
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or any(p.poll() is not None for p, _ in self.children):
                    raise SystemExit(f"{url} did not come up; logs in {self.log_dir}")
                time.sleep(0.25)

    def stop(self) -> None:
        for proc, log in self.children:
            proc.terminate()
        for proc, log in self.children:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        self.children = []


def conversations(n: int, doc_words: int, seed: int) -> list[tuple[str, str]]:
    """(system prompt, opening message with its own document) per conversation."""
    rng = random.Random(seed)
    return [(SYSTEM, f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(doc_words)) + "\nPlease help.")
            for i in range(n)]


async def run_workload(url: str, convs: list[tuple[str, str]], turns: int, concurrency: int, max_tokens: int,
                       model: str, think_s: float) -> list[dict]:
    """Every conversation turn by turn (`concurrency` conversations at a time, a user's pause of 0.5-1.5 ×
    `think_s` between turns); one record per turn."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    records: list[dict] = []

    async def conversation(i: int, system: str, opening: str) -> None:
        async with gate:
            messages = [{"role": "system", "content": system}]
            pause = random.Random(i)
            for turn in range(turns):
                if turn:
                    await asyncio.sleep(think_s * pause.uniform(0.5, 1.5))
                messages.append({"role": "user", "content": opening if turn == 0 else QUESTIONS[turn % len(QUESTIONS)]})
                record = {"conversation": i, "turn": turn + 1, "error": None}
                start = time.perf_counter()
                try:
                    stream = await client.chat.completions.create(
                        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True})
                    text = []
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content is not None and "ttft" not in record:
                            record["ttft"] = time.perf_counter() - start
                        if chunk.choices:
                            text.append(chunk.choices[0].delta.content or "")
                        if chunk.usage:
                            record["prompt"] = chunk.usage.prompt_tokens
                            record["cached"] = chunk.usage.prompt_tokens_details.cached_tokens
                    record.setdefault("ttft", time.perf_counter() - start)
                    messages.append({"role": "assistant", "content": "".join(text)})
                except openai.APIError as e:
                    record["error"] = f"{type(e).__name__}: {e}"
                    messages.append({"role": "assistant", "content": ""})
                records.append(record)

    try:
        await asyncio.gather(*(conversation(i, s, o) for i, (s, o) in enumerate(convs)))
    finally:
        await client.close()
    return records


def router_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def router_gate(router_url: str, model: str) -> None:
    """A greedy reply through the router equals the same request sent to the replica that answered it."""
    body = {"model": model, "messages": [{"role": "user", "content": "gate: say something"}], "max_tokens": 8,
            "temperature": 0}
    via = httpx.post(router_url + "/v1/chat/completions", json=body, timeout=120)
    direct = httpx.post(via.headers["x-k3-replica"] + "/v1/chat/completions", json=body, timeout=120)
    assert via.status_code == direct.status_code == 200, (via.text, direct.text)
    assert via.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"], (via.text, direct.text)


def router_section(args, console: Console) -> tuple[dict, dict, str]:
    convs = conversations(args.conversations, args.doc_words, seed=0)
    model = f"k3-{args.preset}"
    rows, raw = [], {}
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    for balance in ("least-loaded", "affinity"):
        procs = Processes(log_dir)
        try:
            replicas = [procs.start(f"replica{i}-{balance}", ["serve", "--preset", args.preset, "--max-context",
                                                              str(args.max_context)])
                        for i in range(args.replicas)]
            procs.wait_healthy(replicas)
            router = procs.start(f"router-{balance}", ["route", *[a for u in replicas for a in ("--replica", u)],
                                                       "--balance", balance])
            procs.wait_healthy([router])
            router_gate(router, model)
            console.print(f"[bold]{balance}[/]: {args.conversations} conversations × {args.turns} turns over "
                          f"{args.replicas} replicas")
            start = time.perf_counter()
            records = asyncio.run(run_workload(router, convs, args.turns, args.concurrency, args.max_tokens, model,
                                                 args.think_ms / 1000))
            wall = time.perf_counter() - start
            metrics = router_metrics(router)
        finally:
            procs.stop()
        ok = [r for r in records if r["error"] is None]
        errors = len(records) - len(ok)
        later = [r for r in ok if r["turn"] > 1]
        hit = sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok))
        hit_later = sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))
        ttft = [1000 * statistics.median(r["ttft"] for r in ok if r["turn"] == t) for t in range(1, args.turns + 1)]
        rows.append([balance, f"{hit:.1%}", f"{hit_later:.1%}", *[round(x) for x in ttft],
                     f"{metrics['k3_route_affinity_hit_rate']:.0%}" if balance == "affinity" else "–", errors,
                     round(wall, 1)])
        raw[balance] = {"records": records, "wall_s": wall, "router_metrics": metrics}
    load_after = os.getloadavg()
    columns = (["balance", "prefix-cache hit rate", "hit rate, turns 2+"]
               + [f"TTFT turn {t} ms (median)" for t in range(1, args.turns + 1)]
               + ["router affinity hits", "failed requests", "wall s"])
    note = (f"{args.conversations} conversations × {args.turns} turns, {args.concurrency} at a time, "
            f"{args.think_ms / 1000:g} s mean pause between turns, {args.max_tokens} tokens per reply, a {args.doc_words}-word document per conversation (the byte "
            f"tokenizer: one token per byte); load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
            f"(a shared 2-core machine)")
    table = Table(title="fleet router: affinity against a least-loaded balancer")
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*map(str, row))
    console.print(table)
    console.print(note)
    claim = SECTION_CLAIMS["router"].format(replicas=args.replicas, preset=args.preset)
    return {"router": result_table(columns, rows, note=note)}, raw, claim


SECTIONS = {"router": router_section}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="a smoke run with small sizes; nothing is saved")
    router = parser.add_argument_group("router section")
    router.add_argument("--preset", default="debug")
    router.add_argument("--replicas", type=int, default=3)
    router.add_argument("--conversations", type=int, default=24)
    router.add_argument("--turns", type=int, default=4)
    router.add_argument("--concurrency", type=int, default=6)
    router.add_argument("--max-tokens", type=int, default=16)
    router.add_argument("--think-ms", type=float, default=1000.0, help="a user's mean pause between turns")
    router.add_argument("--doc-words", type=int, default=120)
    router.add_argument("--max-context", type=int, default=4096)
    router.add_argument("--log-dir", default="/tmp/k3-fleet-bench", help="the child processes' logs")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.doc_words = 4, 2, 30
    console = Console()
    tables, raw, claims = {}, {}, []
    for name in args.sections:
        section_tables, section_raw, claim = SECTIONS[name](args, console)
        tables |= section_tables
        raw[name] = section_raw
        claims.append(claim)
    if not args.quick:
        save_result("fleet", CLAIM.format(sections="; ".join(claims)), tables, raw=raw)


if __name__ == "__main__":
    main()
