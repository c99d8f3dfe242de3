"""Post-training on a CPU, end to end: the `make demo` model, SFT on the generated set, then RL with effort levels on
arithmetic. Writes benchmarks/results/post_training-<device>.json and the figures in docs/figures/.

    python benchmarks/post_training.py                       # base: runs/tiny if `make demo` finished it
    python benchmarks/post_training.py --base RUN --work DIR --sft-epochs 1 --rl-iterations 30

1. base: `--base`, else runs/tiny when it holds a finished run, else `k3 train --preset tiny --time-budget 8`;
2. SFT: `k3 data make-sft` of the easy tier (`sums`: one- and two-digit additions), then `k3 sft --epochs E`
   (resumed when the folder holds a run);
3. RL: `k3 rl --env math` on sums of difficulty 1 and 2 (the SFT data's generator, a stream of its own), held out:
   sums of difficulty 1 (the easy subset: two one-digit numbers) and 2 (a one-digit and a two-digit number);
4. the SFT and the RL model on the held-out problems, greedy, at every effort: accuracy, mean answer tokens (all
   generated tokens), over-budget rate at the final τ; the claims checked and printed: accuracy rises, answer tokens
   order low < high < max with low ≥ 30% shorter than max, low within 5 points of max on the easy subset, and the
   over-budget rate of the training rollouts falls.

Every stage is a real command in its own process (the timings are theirs); nothing is reused between runs except a
finished base, SFT or RL folder in `--work`, so an interrupted benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import ROOT, save_result, table  # noqa: E402

EFFORTS = ("low", "high", "max")


def run(cmd: list[str], log: Path, threads: int | None) -> float:
    """Run a k3 command (its output appended to `log`) on `threads` intra-op threads (None: torch's default);
    returns its wall seconds. Raises on failure."""
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    start = time.perf_counter()
    with open(log, "a") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        raise SystemExit(f"{cmd[1]} failed with exit code {done.returncode}; see {log}")
    return time.perf_counter() - start


def finished(run_dir: Path) -> bool:
    return (run_dir / "run.json").exists() and any((run_dir / "checkpoints").glob("step_*/COMMITTED"))


def write_sum_tasks(path: Path, n: int, seed: int) -> None:
    """`n` easy-tier math tasks (sums of difficulty 1 and 2 in turn) to `path`, as `k3 data make-tasks --env math
    --kinds sums --difficulties 1,2 --seed SEED` writes them."""
    from k3.posttrain.envs import get_environment, write_tasks

    write_tasks(path, get_environment("math").make_tasks(n, seed, difficulties=(1, 2), kinds=("sums",)))


def evaluate_model(run_dir: Path, tasks, taus: dict[str, float], max_tokens: int) -> dict[str, dict]:
    """Greedy held-out episodes of a model at every effort: per effort, over all tasks and over the easy ones."""
    import torch

    from k3.chat.template import ChatTemplate
    from k3.checkpoint import load_trained
    from k3.infer.config import EngineConfig
    from k3.infer.engine import Engine
    from k3.posttrain.envs import get_environment
    from k3.posttrain.rl import evaluate

    model, tokenizer, _ = load_trained(run_dir)
    engine = Engine(model, EngineConfig(hash_block_size=16, max_running=64, max_step_tokens=8192,
                                        eos_token_ids=tuple(tokenizer.stop_ids)))
    envs = {"math": get_environment("math")}
    with torch.inference_mode():
        every = evaluate(engine, ChatTemplate(tokenizer), envs, tasks, list(EFFORTS), taus, max_tokens)
        easy = evaluate(engine, ChatTemplate(tokenizer), envs, [t for t in tasks if t.data["difficulty"] == 1],
                        list(EFFORTS), taus, max_tokens)
    return {"all": every, "easy": easy}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, help="a finished pre-training run (default runs/tiny, else trained)")
    p.add_argument("--sft", type=Path, help="a finished SFT run to start RL from (default: trained here)")
    p.add_argument("--work", type=Path, default=Path("/tmp/k3-post-training"), help="where the runs go")
    p.add_argument("--sft-problems", type=int, default=500, help="problems of the generated SFT set (3 efforts each)")
    p.add_argument("--sft-kinds", default="sums", help="k3 data make-sft --kinds (default sums)")
    p.add_argument("--sft-difficulties", default="1,1,2", help="k3 data make-sft --difficulties (default 1,1,2)")
    p.add_argument("--sft-epochs", type=float, default=1.0, help="passes of k3 sft over the generated set")
    p.add_argument("--sft-seq-len", type=int, default=512, help="rows k3 sft packs conversations into")
    p.add_argument("--rl-iterations", type=int, default=20)
    p.add_argument("--train-tasks", type=int, default=48, help="RL training problems (sums, difficulty 1 and 2)")
    p.add_argument("--heldout-tasks", type=int, default=36, help="held-out problems (sums, difficulty 1 and 2)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=8, help="N prompts per RL iteration")
    p.add_argument("--samples", type=int, default=8, help="K samples per prompt")
    p.add_argument("--lr", type=float, default=3e-5, help="RL learning rate (default k3 rl's, 3e-5)")
    p.add_argument("--threads", type=int, help="intra-op threads of every stage (default: torch's); 1 on a shared "
                                                "machine, where spinning OpenMP threads slow each other down")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    k3 = str(Path(sys.executable).parent / "k3")
    minutes = {}

    base = args.base or ROOT / "runs" / "tiny"
    if not finished(base):
        base = work / "base"
        minutes["base"] = run([k3, "train", "--preset", "tiny", "--out", str(base), "--time-budget", "8",
                               "--auto-resume"], log) / 60
    sft = args.sft or work / "sft"
    if args.sft is None:
        if not (work / "sft.jsonl").exists():
            run([k3, "data", "make-sft", "--out", str(work / "sft.jsonl"), "--problems", str(args.sft_problems),
                 "--kinds", args.sft_kinds, "--difficulties", args.sft_difficulties], log, args.threads)
        minutes["sft"] = run([k3, "sft", "--from", str(base), "--data", str(work / "sft.jsonl"), "--out", str(sft),
                              "--epochs", str(args.sft_epochs), "--seq-len", str(args.sft_seq_len), "--eval-every", "100",
                              "--auto-resume"], log, args.threads) / 60

    # written once: a rerun keeps the tasks, with the b0 of an earlier run's tasks.jsonl if copied over them
    for name, n, seed in (("rl_tasks.jsonl", args.train_tasks, 1), ("rl_heldout.jsonl", args.heldout_tasks, 2)):
        if not (work / name).exists():
            write_sum_tasks(work / name, n, seed)
    rl_dir = work / "rl"
    iterations = args.rl_iterations
    max_first, anneal = max(1, iterations // 5), max(1, iterations // 2)
    tau_final = {"low": 0.5, "high": 0.8, "max": 1.5}
    rl_cmd = [k3, "rl", "--from", str(sft), "--env", "math", "--tasks", str(work / "rl_tasks.jsonl"),
              "--heldout", str(work / "rl_heldout.jsonl"), "--out", str(rl_dir), "--iterations", str(iterations),
              "--prompts", str(args.prompts), "--samples", str(args.samples), "--partial", "0.9", "--max-tokens", str(args.max_tokens),
              "--max-first", str(max_first), "--anneal", str(anneal), "--tau-cap", "2",
              "--tau-final", ",".join(f"{e}={v}" for e, v in tau_final.items()), "--lr", str(args.lr),
              "--eval-every", str(max(1, iterations // 3)), "--checkpoint-every", "5"]
    if (rl_dir / "run.json").exists():
        rl_cmd.append("--resume")
    minutes["rl"] = run(rl_cmd, log, args.threads) / 60

    from k3.posttrain.envs import load_tasks
    from k3.train.metrics import MetricsLog

    heldout = load_tasks(rl_dir / "heldout.jsonl")
    before = evaluate_model(sft, heldout, tau_final, args.max_tokens)
    after = evaluate_model(rl_dir, heldout, tau_final, args.max_tokens)

    records = [r for r in MetricsLog(rl_dir / "metrics.jsonl").read() if r["kind"] == "rl"]
    window = max(1, len(records) // 5)

    def over_rate(part):
        rows = [r["efforts"][e] for r in part for e in r["efforts"]]
        return sum(m["over_budget"] * m["n"] for m in rows) / max(1, sum(m["n"] for m in rows))

    first_over, last_over = over_rate(records[:window]), over_rate(records[-window:])
    rl_minutes = sum(r["rollout_s"] + r["train_s"] + r["sync_s"] for r in records) / 60

    def pct(x):
        return round(100 * x, 1)

    held_rows = [[e, pct(before["all"][e]["accuracy"]), pct(after["all"][e]["accuracy"]),
                  round(before["all"][e]["tokens"], 1), round(after["all"][e]["tokens"], 1),
                  pct(before["all"][e]["over_budget"]), pct(after["all"][e]["over_budget"]),
                  pct(before["easy"][e]["accuracy"]), pct(after["easy"][e]["accuracy"])] for e in EFFORTS]
    tokens = {e: after["all"][e]["tokens"] for e in EFFORTS}
    claims = {
        "held-out accuracy rises by at least 10 points (mean of the efforts)":
            sum(after["all"][e]["accuracy"] - before["all"][e]["accuracy"] for e in EFFORTS) / len(EFFORTS) >= 0.10,
        "answer tokens low < high < max": tokens["low"] < tokens["high"] < tokens["max"],
        "low at least 30% shorter than max": tokens["low"] <= 0.7 * tokens["max"],
        "easy subset: low within 5 points of max": after["easy"]["low"]["accuracy"]
        >= after["easy"]["max"]["accuracy"] - 0.05,
        "over-budget rate falls during training": last_over < first_over,
    }
    for claim, ok in claims.items():
        print(f"{'PASS' if ok else 'FAIL'}  {claim}")
    tables = {
        "heldout": table(["effort", "SFT accuracy %", "RL accuracy %", "SFT tokens", "RL tokens", "SFT over budget %",
                          "RL over budget %", "SFT easy accuracy %", "RL easy accuracy %"], held_rows,
                         note=f"{len(heldout)} held-out sums ({sum(t.data['difficulty'] == 1 for t in heldout)} "
                              f"easy), greedy; tokens: mean generated per answer; over budget at the final τ "
                              f"(low {tau_final['low']}, high {tau_final['high']}, max {tau_final['max']})"),
        "training": table(["RL iterations", "RL minutes (rollout + train + sync)", "RL wall minutes",
                           "over budget, first fifth %", "over budget, last fifth %"],
                          [[len(records), round(rl_minutes, 1), round(minutes["rl"], 1), pct(first_over),
                            pct(last_over)]]),
        "claims": table(["claim", "holds"], [[c, ok] for c, ok in claims.items()]),
    }
    figures = ROOT / "docs" / "figures"
    for name, target in (("rl_rollouts.png", "post-training-rl-rollouts.png"),
                         ("rl_heldout.png", "post-training-rl-heldout.png")):
        if (rl_dir / "plots" / name).exists():
            shutil.copyfile(rl_dir / "plots" / name, figures / target)
    save_result("post_training", "Post-training on a CPU from the `make demo` model: SFT on the generated set (sums and "
                "string tasks), then RL with effort levels and token budgets on sums; held-out accuracy and answer length per effort "
                "before and after RL", tables,
                raw={"minutes": minutes, "before": before, "after": after, "base": str(base)})


if __name__ == "__main__":
    main()
