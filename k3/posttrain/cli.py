"""`k3 sft`, `k3 data make-sft` and `k3 data make-tasks`: thin front ends over `k3.posttrain.sft`,
`k3.posttrain.sft_data` and the RL environments' task generators."""

from __future__ import annotations

import sys
from pathlib import Path

from k3.runfolder import positive


def cmd_sft(args) -> int:
    """Fine-tune a run on conversations; stops, refusals and failures end as `k3 train`'s do (same exit codes)."""
    from k3.train.command import run_training_command

    out = Path(args.out)

    def start(stop):
        import dataclasses

        from k3.posttrain.sft import sft, sft_config, stored_config
        from k3.train.config import ContextStage

        given = {"data": args.data, "init_from": getattr(args, "from"), "max_steps": args.max_steps,
                 "max_epochs": args.epochs, "time_budget_min": args.time_budget, "lr": args.lr,
                 "tokens_per_step": args.tokens_per_step, "micro_batches": args.micro_batches, "seed": args.seed,
                 "eval_every": args.eval_every, "checkpoint_every": args.checkpoint_every, "device": args.device}
        given = {k: v for k, v in given.items() if v is not None}
        stored = stored_config(out) if (args.resume or args.auto_resume) else None
        if stored is not None:  # a resume starts from the run's own settings; what is given must match or may change
            cfg = dataclasses.replace(stored, out=str(out), **given)
            if args.seq_len:
                cfg.stages = [ContextStage(args.seq_len, 1.0)]
        else:
            if "init_from" not in given:
                raise ValueError("--from RUN is needed: the run or checkpoint folder to fine-tune")
            if "data" not in given:
                raise ValueError("--data FILE.jsonl is needed: conversations, one JSON object per line "
                                 "(`k3 data make-sft --out FILE` writes a generated set)")
            cfg = sft_config(given.pop("init_from"), given.pop("data"), str(out), seq_len=args.seq_len, **given)
            if not (cfg.max_steps or cfg.max_epochs or cfg.time_budget_min):
                cfg.max_epochs = 1.0  # the default length of a new run
        return sft(cfg, resume="auto" if args.auto_resume else args.resume, stop=stop)

    return run_training_command("k3 sft", args, out, start)


def add_sft_parser(subparsers) -> None:
    """Add `sft` to `k3`'s subcommands."""
    p = subparsers.add_parser(
        "sft", help="supervised fine-tuning of a trained run on chat conversations (JSONL)",
        epilog="Ctrl-C or SIGTERM: stop after the current step with a checkpoint and plots (exit 130 / 143); a second "
               "one stops at once. Exit codes: 0 done, 1 system failure (e.g. disk full), 2 refused (bad arguments "
               "or data, folder in use), 3 diverged. Format and defaults: docs/post-training.md.")
    p.add_argument("--from", help="the run (its newest checkpoint) or checkpoint folder to start from; a resume "
                                  "takes the run's own")
    p.add_argument("--data", help="conversations, one JSON object per line (a resume takes the run's own)")
    p.add_argument("--out", required=True, help="the SFT run folder")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=positive(int))
    length.add_argument("--epochs", type=positive(float), help="passes over the training conversations (default 1 "
                                                               "for a new run)")
    length.add_argument("--time-budget", type=positive(float), help="minutes; the step count is measured to fit")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    how.add_argument("--auto-resume", action="store_true", help="continue the run in --out if there is one, else "
                                                                "start it")
    p.add_argument("--lr", type=positive(float), help="peak learning rate (default 2e-3)")
    p.add_argument("--tokens-per-step", type=positive(int), help="default 2048 (two rows of 1024)")
    p.add_argument("--micro-batches", type=positive(int), help="gradient accumulation steps (default 1)")
    p.add_argument("--seq-len", type=positive(int), help="the context rows are packed to (default: the base run's "
                                                         "final one, at least 1024)")
    p.add_argument("--eval-every", type=positive(int), help="default 25")
    p.add_argument("--checkpoint-every", type=positive(int), help="default 50")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu | cuda | auto")
    p.set_defaults(func=cmd_sft)


def _listed(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _difficulties(text: str) -> list[int]:
    try:
        return [int(d) for d in _listed(text)]
    except ValueError:
        raise ValueError(f"--difficulties must be integers 1, 2 or 3, got {text!r}") from None


def cmd_make_sft(args) -> int:
    from k3.posttrain.conversations import write_conversations
    from k3.posttrain.sft_data import make_sft_dataset

    from k3.posttrain.sft_data import KINDS

    efforts = _listed(args.efforts)
    kinds = _listed(args.kinds) if args.kinds else list(KINDS)
    difficulties = _difficulties(args.difficulties)
    conversations = make_sft_dataset(args.problems, seed=args.seed, efforts=efforts, kinds=kinds,
                                     difficulties=difficulties)
    write_conversations(conversations, args.out)
    print(f"wrote {len(conversations):,} conversations ({args.problems:,} problems × {len(efforts)} effort "
          f"level{'s' if len(efforts) > 1 else ''}) to {args.out}", file=sys.stderr)
    return 0


def add_make_sft_parser(data_subparsers) -> None:
    """Add `make-sft` to `k3 data`'s subcommands."""
    p = data_subparsers.add_parser("make-sft", help="write the generated SFT set: arithmetic, word problems, string "
                                                    "tasks and tool use, with worked reasoning at each effort level")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--problems", type=positive(int), default=1200, help="problems, each one conversation per effort "
                                                                        "level (default 1200)")
    p.add_argument("--seed", type=int, default=0, help="default 0; the same seed writes the same file")
    p.add_argument("--efforts", default="low,high,max", help="comma-separated effort levels (default low,high,max)")
    p.add_argument("--kinds", help="comma-separated kinds of problems among arithmetic, sums, word, string, tools, "
                                   "in their default shares (default: all)")
    p.add_argument("--difficulties", default="1,2,3", help="comma-separated difficulties drawn uniformly; a repeated "
                                                          "one counts twice (default 1,2,3)")
    p.set_defaults(func=cmd_make_sft)


def cmd_make_tasks(args) -> int:
    from k3.posttrain.envs import get_environment, write_tasks

    difficulties = _difficulties(args.difficulties) if args.difficulties is not None else None
    kinds = _listed(args.kinds) if args.kinds is not None else None
    tasks = get_environment(args.env).make_tasks(args.tasks, args.seed, difficulties=difficulties, kinds=kinds)
    write_tasks(args.out, tasks)
    print(f"wrote {len(tasks):,} {args.env} tasks to {args.out}", file=sys.stderr)
    return 0


def add_make_tasks_parser(data_subparsers) -> None:
    """Add `make-tasks` to `k3 data`'s subcommands."""
    p = data_subparsers.add_parser("make-tasks", help="write an RL task file (k3 rl --tasks / --heldout) from an "
                                                      "environment's generator")
    p.add_argument("--env", required=True, help="an environment: code, math, strings, tools, or package.module:Class")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--tasks", type=positive(int), default=256, help="how many (default 256)")
    p.add_argument("--seed", type=int, default=0, help="default 0; another seed, other tasks (e.g. a held-out file)")
    p.add_argument("--difficulties", help="comma-separated difficulties 1-3, taken in turn (default: the "
                                          "environment's own, 1,2,3)")
    p.add_argument("--kinds", help="math only: comma-separated kinds among arithmetic, sums, word, taken in turn "
                                   "(default arithmetic,word)")
    p.set_defaults(func=cmd_make_tasks)
