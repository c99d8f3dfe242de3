"""`k3 train-draft`: the thin front end over `k3.spec.train`. Imports nothing heavy at module level (the parser is
built at every `k3` start, and stop signals are installed before torch loads).

Exit codes as `k3 train`'s (`k3.runfolder`): 0 done, 1 system failure, 2 refused, 3 the run cannot continue, 128 + N
stopped by signal N (with a checkpoint of the step reached and the command that resumes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from k3.runfolder import positive
from k3.train.command import run_training_command


def add_train_draft_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train a speculative-decoding draft for a trained run (LK loss, unrolled "
                                           "training-time test)",
                       epilog="The draft, the loss and every default: docs/speculative.md. Ctrl-C or SIGTERM: stop "
                              "after the current step with a checkpoint and plots (exit 130 / 143); a second one "
                              "stops at once. Exit codes: 0 done, 1 system failure, 2 refused, 3 the run cannot "
                              "continue.")
    p.add_argument("--from", dest="init_from", help="the target: a run folder (its newest checkpoint) or a "
                                                    "checkpoint folder")
    p.add_argument("--out", default="runs/draft", help="run folder (default runs/draft)")
    p.add_argument("--data", help="documents to train on, tokenized with the target's tokenizer (default: the "
                                  "target run's own corpus)")
    p.add_argument("--text", choices=("corpus", "generated"),
                   help="p on the training text (corpus, default) or on continuations the target samples from it")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--max-steps", type=positive(int), help="optimizer steps (default 200)")
    p.add_argument("--time-budget", type=positive(float), help="minutes of training on this machine (sets the step "
                                                               "count from the first steps' time)")
    p.add_argument("--unroll-steps", type=positive(int), help="steps of the training-time test (default 7)")
    p.add_argument("--seq-len", type=positive(int), help="tokens per row (default 256)")
    p.add_argument("--tokens-per-step", type=positive(int), help="tokens per optimizer step (default 2048)")
    p.add_argument("--generated-documents", type=positive(int), help="sequences the target writes with --text "
                                                                      "generated (default 256)")
    p.add_argument("--generated-temperature", type=float, help="the target's temperature with --text generated "
                                                                "(default 1; 0: greedy)")
    p.add_argument("--lr", type=positive(float), help="peak learning rate (default 3e-3)")
    p.add_argument("--eval-every", type=positive(int), help="steps between held-out evaluations (default 25)")
    p.add_argument("--checkpoint-every", type=positive(int), help="default 50")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu | cuda | auto")
    p.set_defaults(func=cmd_train_draft)


def config_from_args(args, stored: dict | None = None):
    """A `DraftTrainConfig` from the parsed arguments (imports torch): the defaults, or for a resume the run's own
    settings (`stored`, run.json's draft_config), with the options given on the command line on top."""
    from k3.spec.train import DraftTrainConfig

    try:
        cfg = DraftTrainConfig.from_dict(stored) if stored is not None else DraftTrainConfig()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{args.out}/run.json does not hold a draft run's settings ({e}); choose another "
                         f"--out") from e
    overrides = {"init_from": args.init_from, "data": args.data, "text": args.text, "unroll_steps": args.unroll_steps,
                 "seq_len": args.seq_len, "tokens_per_step": args.tokens_per_step,
                 "generated_documents": args.generated_documents,
                 "generated_temperature": args.generated_temperature, "lr": args.lr, "eval_every": args.eval_every,
                 "checkpoint_every": args.checkpoint_every, "seed": args.seed, "device": args.device}
    cfg = dataclasses.replace(cfg, out=args.out, **{k: v for k, v in overrides.items() if v is not None})
    if args.time_budget is not None:
        return dataclasses.replace(cfg, time_budget_min=args.time_budget, max_steps=None)
    # a resume without --max-steps keeps the run's own length (run.json)
    return dataclasses.replace(cfg, max_steps=args.max_steps if args.max_steps is not None or stored is None
                               else None)


def _acceptance(record: dict | None) -> str:
    return " ".join(f"{a:.2f}" for a in record["acceptance"]) if record else "–"


def cmd_train_draft(args) -> int:
    out = Path(args.out)

    def start(stop):
        stored = None
        if args.resume and (out / "run.json").exists():
            stored = json.loads((out / "run.json").read_text()).get("draft_config")
        from k3.spec.train import train_draft

        return train_draft(config_from_args(args, stored), resume=args.resume, stop=stop)

    def done(summary) -> str:
        resumed = f" (resumed at step {summary.start_step})" if summary.start_step else ""
        before, after = summary.before, summary.after
        tpv = (f"; tokens per verify at k = {len(after['acceptance'])}: {before['tokens_per_verify']:.2f} → "
               f"{after['tokens_per_verify']:.2f}" if before and after else "")
        return (f"trained {summary.steps} steps{resumed} in {summary.seconds / 60:.1f} min: held-out expected "
                f"acceptance per unrolled step {_acceptance(before)} (step {before['step'] if before else '–'}) → "
                f"{_acceptance(after)} (step {after['step'] if after else '–'}){tpv}; checkpoint "
                f"{summary.checkpoint}; plots in {out / 'plots'}")

    return run_training_command("k3 train-draft", args, out, start, done, longer="--max-steps", drop=("resume",))
