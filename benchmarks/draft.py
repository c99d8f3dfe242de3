"""The draft claim: what `k3 train-draft` reaches on the `make demo` model within 10 CPU minutes, measured as the
held-out expected acceptance Σ_x min(p, q) of every unrolled step before and after training, and the tokens per
verification those rates imply.

    make demo                                                   # the target: runs/tiny
    python benchmarks/draft.py --target runs/tiny --out runs/draft-tiny --cpu-minutes 10

The budget is this process's CPU time, not the wall clock, so that a shared machine's load does not decide the
result: the step count is what fits `--cpu-minutes` at the CPU seconds of a training step, measured on one warm and
two timed steps of a throwaway draft (15% left to evaluations and checkpoints), and the run is then
`k3.spec.train.train_draft` with that many steps (the command's own code path; an existing run in --out is
resumed). One torch thread by default: on a loaded machine OpenMP's threads wait on each other at every operation
and multiply both clocks. benchmarks/results/draft-<device>.json is written from the run's metrics log: the first
held-out evaluation is of the untrained draft (step 0), the last of the trained one. The rates come from the
training-time test on held-out text (teacher-forced tokens, the draft's own states), not from an engine.

`--text generated` trains on the target's own continuations (at `--generated-temperature`, 0 for greedy), which the
target writes inside this process's CPU time but after the step count is fixed; such runs write
draft_generated-<device>.json (draft_greedy_generated-<device>.json at temperature 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import save_result, table  # noqa: E402

import torch  # noqa: E402

from k3.checkpoint import load_trained  # noqa: E402
from k3.optim import cosine_schedule  # noqa: E402
from k3.spec.draft import build_draft, tokens_per_verify  # noqa: E402
from k3.spec.train import DraftTrainConfig, build_optimizer, train_draft, train_step  # noqa: E402
from k3.train.data import PackedBatches, TokenizedCorpus  # noqa: E402
from k3.train.metrics import MetricsLog  # noqa: E402


def cpu_seconds_per_step(cfg: DraftTrainConfig) -> float:
    """CPU seconds of one training step of a throwaway draft against the target (the faster of two warm steps)."""
    device = torch.device(cfg.device)
    target, _, ckpt = load_trained(cfg.init_from, device)
    target.requires_grad_(False)
    draft = build_draft(target.config, seed=cfg.seed, device=device)
    optimizer = build_optimizer(draft, cfg, device)
    scheduler = cosine_schedule(optimizer, 10)
    corpus = TokenizedCorpus.open(ckpt.parent.parent / "data" / "train")
    batch = next(PackedBatches(corpus, cfg.tokens_per_step // cfg.seq_len, cfg.seq_len, seed=cfg.seed))
    timings = []
    for _ in range(3):
        start = time.process_time()
        train_step(draft, target, optimizer, scheduler, batch, cfg, device)
        timings.append(time.process_time() - start)
    return min(timings[1:])


def tables(out: Path, cpu_minutes: float, wall_minutes: float, threads: int) -> dict:
    records = MetricsLog(out / "metrics.jsonl").read()
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train" and not r.get("skipped")]
    if len(evals) < 2 or not train:
        raise SystemExit(f"{out}: needs the step-0 evaluation, training steps and a later evaluation")
    before, after = evals[0], evals[-1]
    K = len(after["acceptance"])
    per_step = table(["unrolled step", f"before (step {before['step']})", f"after (step {after['step']})"],
                     [[k + 1, round(b, 3), round(a, 3)] for k, (b, a) in
                      enumerate(zip(before["acceptance"], after["acceptance"]))],
                     note="held-out expected acceptance Σ min(p, q) of each step of the training-time test")
    ks = sorted({min(4, K), K})
    summary = table(["steps", "tokens", "CPU minutes (whole run)", "wall minutes", "held-out L_LK before → after"]
                    + [f"tokens per verify, k = {k}: before → after" for k in ks],
                    [[train[-1]["step"], train[-1]["tokens_seen"], round(cpu_minutes, 1), round(wall_minutes, 1),
                      f"{before['loss']:.3f} → {after['loss']:.3f}"]
                     + [f"{tokens_per_verify(before['acceptance'], k):.2f} → "
                        f"{tokens_per_verify(after['acceptance'], k):.2f}" for k in ks]],
                    note=f"{threads} torch thread(s); the evaluations and the step-count probe are in the CPU time")
    return {"acceptance": per_step, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=Path("runs/tiny"), help="the target run (make demo's)")
    p.add_argument("--out", type=Path, default=Path("runs/draft-tiny"), help="the draft's run folder")
    p.add_argument("--cpu-minutes", type=float, default=10.0, help="CPU minutes of draft training")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--text", choices=("corpus", "generated"), default="corpus")
    p.add_argument("--generated-temperature", type=float, default=1.0, help="with --text generated (0: greedy)")
    # a quarter of the command's default batch: four times the steps in a CPU budget
    p.add_argument("--tokens-per-step", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = DraftTrainConfig(init_from=str(args.target), out=str(args.out), text=args.text,
                           generated_temperature=args.generated_temperature,
                           tokens_per_step=args.tokens_per_step, eval_tokens=args.eval_tokens, device=args.device)
    started, cpu_started = time.perf_counter(), time.process_time()
    resume = (args.out / "run.json").exists()
    if not resume:
        seconds = cpu_seconds_per_step(cfg)
        cfg.max_steps = max(1, int(args.cpu_minutes * 60 * 0.85 / seconds))
        print(f"{seconds:.2f} CPU s/step → {cfg.max_steps} steps in {args.cpu_minutes:g} CPU minutes")
    summary = train_draft(cfg, resume=resume)
    cpu_minutes = (time.process_time() - cpu_started) / 60
    wall_minutes = (time.perf_counter() - started) / 60
    print(f"trained {summary.steps} steps: {cpu_minutes:.1f} CPU minutes, {wall_minutes:.1f} wall minutes")
    result = tables(args.out, cpu_minutes, wall_minutes, args.threads)
    claim = "draft" if args.text == "corpus" else ("draft_generated" if args.generated_temperature > 0 else
                                                   "draft_greedy_generated")
    save_result(claim, "`k3 train-draft` on the make-demo model (tiny preset) within 10 CPU minutes: held-out "
                "expected acceptance of each unrolled step before and after, and the tokens per verification they "
                "imply", result)
    for name, t in result.items():
        print(name, t["columns"], *t["rows"], sep="\n  ")


if __name__ == "__main__":
    main()
