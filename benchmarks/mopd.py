"""Multi-teacher on-policy distillation on a CPU: two teachers specialised by `k3 rl` on disjoint generated tasks,
one student distilled from both by `k3 mopd`. Writes benchmarks/results/mopd-<device>.json and docs/figures/mopd.png.

    python benchmarks/mopd.py --base /tmp/k3-base/tiny                  # SFT here, then teachers and student
    python benchmarks/mopd.py --sft RUN --work DIR --threads 2          # start from a finished k3 sft run

1. SFT: `--sft`, else `k3 data make-sft` and `k3 sft` from `--base` (the `make demo` model);
2. teachers: `k3 rl` from the SFT model on arithmetic (`math`, difficulty 1) at effort `high` only, and on string
   and list tasks (`strings`, difficulty 1) at effort `low` only; every task carries b0 = max_tokens, so the reward
   is the task's (−1 only when an answer hits max_tokens);
3. student: `k3 mopd --student SFT --teacher math:high=… --teacher strings:low=…` on both tasks;
4. held-out problems of each task (a stream of their own), greedy, at both efforts, for the SFT model, each teacher
   and the student: accuracy and answer tokens. The claims: the student reaches at least 90% of each teacher's
   held-out accuracy on the teacher's task and effort, and its answers are shorter at `low` than at `high`.

Every stage is a real command in its own process; a finished SFT, teacher or student folder in `--work` is reused,
so an interrupted benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import ROOT, save_result, table  # noqa: E402

EFFORTS = ("low", "high")
TEACHERS = {"math": "high", "strings": "low"}  # domain -> the effort its teacher is trained and routed at


def run(cmd: list[str], log: Path, threads: int | None) -> float:
    """Run a k3 command (output appended to `log`) on `threads` intra-op threads; returns its wall seconds."""
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    start = time.perf_counter()
    with open(log, "a") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        raise SystemExit(f"{cmd[1]} failed with exit code {done.returncode}; see {log}")
    return time.perf_counter() - start


def finished(run_dir: Path, iterations: int | None = None) -> bool:
    """A run folder with a committed checkpoint (of iteration `iterations`, when given)."""
    if not (run_dir / "run.json").exists():
        return False
    done = sorted((run_dir / "checkpoints").glob("step_*/COMMITTED"))
    return bool(done) and (iterations is None or int(done[-1].parent.name.split("_")[1]) >= iterations)


def tasks(domain: str, n: int, seed: int, max_tokens: int) -> list:
    """`n` difficulty-1 problems of `domain` (math: arithmetic) from the seed's stream; b0 = max_tokens (no budget
    but the length)."""
    from k3.posttrain.envs import get_environment

    kinds = ("arithmetic",) if domain == "math" else None
    return [dataclasses.replace(t, b0=float(max_tokens))
            for t in get_environment(domain).make_tasks(n, seed, difficulties=(1,), kinds=kinds)]


def evaluate_model(run_dir: Path, heldout: dict, max_tokens: int,
                   efforts: dict[str, tuple[str, ...]]) -> dict[str, dict[str, dict]]:
    """Greedy held-out episodes of a model at `efforts[domain]`: {domain: {effort: accuracy, tokens, truncated, n}}."""
    import torch

    from k3.chat.template import ChatTemplate
    from k3.checkpoint import load_trained
    from k3.infer.config import EngineConfig
    from k3.infer.engine import Engine
    from k3.posttrain.envs import get_environment, load_tasks
    from k3.posttrain.rl import evaluate

    model, tokenizer, _ = load_trained(run_dir)
    engine = Engine(model, EngineConfig(hash_block_size=16, max_running=64, max_step_tokens=8192,
                                        eos_token_ids=tuple(tokenizer.stop_ids)))
    result = {}
    with torch.inference_mode():
        for domain, levels in efforts.items():
            envs = {domain: get_environment(domain)}
            m = evaluate(engine, ChatTemplate(tokenizer), envs, load_tasks(heldout[domain], envs), list(levels),
                         {e: 1.0 for e in levels}, max_tokens)
            result[domain] = {e: {k: m[e][k] for k in ("accuracy", "tokens", "truncated", "n")} for e in levels}
    return result


def plot(path: Path, scores: dict, mopd_dir: Path) -> None:
    """Held-out accuracy of each model on each teacher's task, answer tokens by effort, the distillation curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from k3.train.metrics import MetricsLog

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    names = list(scores)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        acc = [100 * scores[name].get(d, {}).get(e, {}).get("accuracy", 0.0) for d, e in TEACHERS.items()]
        axes[0].bar([x + i * width for x in range(len(TEACHERS))], acc, width, label=name)
    axes[0].set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(TEACHERS))],
                       [f"{d} @ {e}" for d, e in TEACHERS.items()])
    axes[0].set_ylabel("held-out accuracy %")
    axes[0].set_title("each teacher's task, greedy")
    axes[0].legend(fontsize=8)
    both = [name for name in names if all(e in scores[name].get(d, {}) for d in TEACHERS for e in EFFORTS)]
    for i, name in enumerate(both):
        for j, effort in enumerate(EFFORTS):
            tokens = [scores[name][d][effort]["tokens"] for d in TEACHERS]
            axes[1].bar([x * 2.5 + j * 1.1 + i * width for x in range(len(TEACHERS))], tokens, width,
                        color=f"C{names.index(name)}", alpha=1.0 if effort == "high" else 0.45,
                        label=name if j == 0 else None)
    axes[1].set_xticks([x * 2.5 + j * 1.1 + 0.4 for x in range(len(TEACHERS)) for j in range(len(EFFORTS))],
                       [f"{d}\n{e}" for d in TEACHERS for e in EFFORTS], fontsize=8)
    axes[1].set_ylabel("mean answer tokens")
    axes[1].set_title("answer length by effort (held-out; pale: low)")
    axes[1].legend(fontsize=8)
    axes[0].set_ylim(0, max(10.0, axes[0].get_ylim()[1]))
    records = [r for r in MetricsLog(mopd_dir / "metrics.jsonl").read() if r.get("kind") == "rl" and "teachers" in r]
    for key in sorted({k for r in records for k in r["teachers"]}):
        pts = [(r["step"], r["teachers"][key]["teacher_kl"]) for r in records if key in r["teachers"]]
        axes[2].plot(*zip(*pts), "o-", ms=3, label=key)
    axes[2].set_xlabel("k3 mopd iteration")
    axes[2].set_title("KL(student ‖ teacher) per token, training rollouts")
    axes[2].legend(title="teacher", fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, default=Path("runs/tiny"), help="a finished pre-training run to SFT")
    p.add_argument("--sft", type=Path, help="a finished SFT run or checkpoint (default: trained here from --base)")
    p.add_argument("--work", type=Path, default=Path("/tmp/k3-mopd"), help="where the runs go")
    p.add_argument("--sft-problems", type=int, default=600, help="problems of the generated SFT set (3 efforts each)")
    p.add_argument("--sft-steps", type=int, default=60, help="k3 sft optimizer steps")
    p.add_argument("--teacher-iterations", type=int, default=5, help="k3 rl iterations of each teacher")
    p.add_argument("--student-iterations", type=int, default=6, help="k3 mopd iterations")
    p.add_argument("--train-tasks", type=int, default=64, help="training problems per task")
    p.add_argument("--heldout-tasks", type=int, default=12, help="held-out problems per task")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=4, help="N prompts per iteration")
    p.add_argument("--samples", type=int, default=4, help="K samples per prompt (teachers)")
    p.add_argument("--student-samples", type=int, default=2, help="K samples per prompt (student)")
    p.add_argument("--teacher-lr", type=float, default=1e-3)
    p.add_argument("--student-lr", type=float, default=3e-4)
    p.add_argument("--r-max", type=float, default=5.0)
    p.add_argument("--threads", type=int, help="intra-op threads of every stage (default: torch's)")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    k3 = str(Path(sys.executable).parent / "k3")
    minutes = {}

    sft = args.sft or work / "sft"
    if args.sft is None and not finished(sft):
        if not (work / "sft.jsonl").exists():
            run([k3, "data", "make-sft", "--out", str(work / "sft.jsonl"), "--problems", str(args.sft_problems)], log,
                args.threads)
        minutes["sft"] = run([k3, "sft", "--from", str(args.base), "--data", str(work / "sft.jsonl"), "--out",
                              str(sft), "--max-steps", str(args.sft_steps), "--seq-len", "512", "--auto-resume"],
                             log, args.threads) / 60

    from k3.posttrain.envs import write_tasks

    heldout, train, monitor = {}, {}, {}
    for domain in TEACHERS:
        train[domain] = tasks(domain, args.train_tasks, 11, args.max_tokens)
        # the runs' own evaluations (always at the first and last iteration) get two tasks: the measurement is below
        monitor[domain] = tasks(domain, 2, 13, args.max_tokens)
        heldout[domain] = work / f"heldout-{domain}.jsonl"
        write_tasks(heldout[domain], tasks(domain, args.heldout_tasks, 12, args.max_tokens))
        write_tasks(work / f"train-{domain}.jsonl", train[domain])
        write_tasks(work / f"monitor-{domain}.jsonl", monitor[domain])
    write_tasks(work / "train-both.jsonl", [t for d in TEACHERS for t in train[d]])
    write_tasks(work / "monitor-both.jsonl", [t for d in TEACHERS for t in monitor[d]])
    shared = ["--max-tokens", str(args.max_tokens), "--prompts", str(args.prompts), "--eval-every", "1000",
              "--checkpoint-every", "5"]

    teacher_dirs = {}
    for domain, effort in TEACHERS.items():
        out = teacher_dirs[domain] = work / f"teacher-{domain}-{effort}"
        if not finished(out, args.teacher_iterations):
            cmd = [k3, "rl", "--from", str(sft), "--env", domain, "--efforts", effort, "--tasks",
                   str(work / f"train-{domain}.jsonl"), "--heldout", str(work / f"monitor-{domain}.jsonl"),
                   "--out", str(out), "--samples", str(args.samples),
                   "--iterations", str(args.teacher_iterations), "--tau-cap", "1", "--tau-final", f"{effort}=1",
                   "--max-first", "0", "--anneal", "0", "--lr", str(args.teacher_lr), *shared]
            minutes[f"teacher {domain}"] = run(cmd + (["--resume"] if (out / "run.json").exists() else []), log,
                                               args.threads) / 60

    student = work / "student"
    if not finished(student, args.student_iterations):
        cmd = [k3, "mopd", "--student", str(sft), *[f"--teacher={d}:{e}={teacher_dirs[d]}" for d, e in TEACHERS.items()],
               "--tasks", str(work / "train-both.jsonl"), "--heldout", str(work / "monitor-both.jsonl"),
               "--out", str(student), "--iterations", str(args.student_iterations), "--r-max", str(args.r_max),
               "--lr", str(args.student_lr), "--samples", str(args.student_samples), *shared]
        if (student / "run.json").exists():
            cmd = [k3, "mopd", "--out", str(student), "--resume", "--iterations", str(args.student_iterations)]
        minutes["student"] = run(cmd, log, args.threads) / 60

    start = time.perf_counter()
    every = {d: EFFORTS for d in TEACHERS}
    models = {"SFT": (sft, every), "teacher math@high": (teacher_dirs["math"], {"math": ("high",)}),
              "teacher strings@low": (teacher_dirs["strings"], {"strings": ("low",)}), "student (MOPD)": (student, every)}
    scores = {name: evaluate_model(path, heldout, args.max_tokens, efforts) for name, (path, efforts) in models.items()}
    minutes["evaluation"] = (time.perf_counter() - start) / 60

    def pct(x):
        return round(100 * x, 1)

    def cell(s, domain, effort, key):
        m = s.get(domain, {}).get(effort)
        return None if m is None else pct(m[key]) if key == "accuracy" else round(m[key], 1)

    rows = [[name, *(cell(s, d, e, "accuracy") for d, e in (("math", "high"), ("strings", "low"), ("math", "low"),
                                                            ("strings", "high"))),
             *(cell(s, d, e, "tokens") for d in TEACHERS for e in EFFORTS)] for name, s in scores.items()]
    student_scores = scores["student (MOPD)"]
    claims = {}
    for domain, effort in TEACHERS.items():
        teacher = scores[f"teacher {domain}@{effort}"][domain][effort]["accuracy"]
        got = student_scores[domain][effort]["accuracy"]
        claims[f"student ≥ 90% of the {domain}@{effort} teacher's held-out accuracy"] = got >= 0.9 * teacher
    claims["student answers shorter at low than at high (both tasks)"] = all(
        student_scores[d]["low"]["tokens"] < student_scores[d]["high"]["tokens"] for d in TEACHERS)
    for claim, ok in claims.items():
        print(f"{'PASS' if ok else 'FAIL'}  {claim}")
    runs_minutes = [[stage, round(m, 1)] for stage, m in minutes.items()]
    tables = {
        "heldout": table(["model", "math @ high %", "strings @ low %", "math @ low %", "strings @ high %",
                          "math tokens, low", "math tokens, high", "strings tokens, low", "strings tokens, high"],
                         rows, note=f"{args.heldout_tasks} held-out problems per task (difficulty 1), greedy, "
                                    f"max {args.max_tokens} tokens; the teachers' own (task, effort) are the first "
                                    f"two columns; tokens: mean generated per answer"),
        "claims": table(["claim", "holds"], [[c, ok] for c, ok in claims.items()]),
        "cost": table(["stage", "wall minutes"], runs_minutes,
                      note=f"teachers: {args.teacher_iterations} k3 rl iterations of {args.prompts} prompts × "
                           f"{args.samples} samples; student: {args.student_iterations} k3 mopd iterations of "
                           f"{args.prompts} × {args.student_samples}; stages reused from an earlier run are not listed"),
    }
    plot(ROOT / "docs" / "figures" / "mopd.png", scores, student)
    if (student / "plots" / "mopd.png").exists():
        shutil.copyfile(student / "plots" / "mopd.png", ROOT / "docs" / "figures" / "mopd-training.png")
    save_result("mopd", "Multi-teacher on-policy distillation on a CPU: two teachers specialised by k3 rl on disjoint "
                "generated tasks (arithmetic at high effort, strings at low), one student distilled from both by "
                "k3 mopd; held-out accuracy of each model on each task and answer length by effort", tables,
                raw={"minutes": minutes, "scores": scores, "sft": str(sft), "args": {k: str(v) for k, v in
                                                                                     vars(args).items()}})


if __name__ == "__main__":
    main()
