"""`k3 rl`: the thin front end over `k3.posttrain.rl`. Imports nothing heavy at module level (the parser is built at
every `k3` start, and stop signals are installed before torch loads).

Exit codes as `k3 train`'s (`k3.runfolder`): 0 done, 1 system failure, 2 refused, 3 the run cannot continue, 128 + N
stopped by signal N (with a checkpoint of the iteration reached and the command that resumes).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from k3.posttrain.budget import EFFORTS
from k3.posttrain.envs import ENVIRONMENTS
from k3.runfolder import positive
from k3.train.command import run_training_command


def add_rl_parser(sub) -> None:
    p = sub.add_parser("rl", help="reinforcement learning with effort levels and token budgets (after k3 sft)",
                       epilog="Defaults and what each knob does: docs/post-training.md. Ctrl-C or SIGTERM: stop after "
                              "the current iteration with a checkpoint and plots (exit 130 / 143); a second one stops "
                              "at once. Exit codes: 0 done, 1 system failure, 2 refused, 3 the run cannot continue.")
    p.add_argument("--from", dest="init_from", help="the run or checkpoint folder to start from (an SFT model)")
    p.add_argument("--env", help=f"environments, comma-separated: {', '.join(sorted(ENVIRONMENTS))}, or "
                                 f"package.module:Class (default math)")
    p.add_argument("--efforts", help=f"effort levels to train (default {','.join(EFFORTS)})")
    p.add_argument("--out", default="runs/rl", help="run folder (default runs/rl)")
    p.add_argument("--tasks", help="a JSONL of tasks (default: each environment generates its own)")
    p.add_argument("--heldout", help="a JSONL of evaluation tasks (default: some set aside, --heldout-tasks)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--iterations", type=positive(int), help="RL iterations (default 40)")
    p.add_argument("--prompts", type=positive(int), help="N, prompts per iteration (default 8)")
    p.add_argument("--samples", type=positive(int), help="K, samples per prompt (default 8)")
    p.add_argument("--partial", type=positive(float), help="λ, the fraction of done trajectories that ends an "
                                                           "iteration's rollout (default 1)")
    p.add_argument("--max-tokens", type=positive(int), help="generated tokens per trajectory (default 192)")
    p.add_argument("--num-tasks", type=positive(int), help="generated training tasks per environment (default 256)")
    p.add_argument("--heldout-tasks", type=positive(int), help="held-out tasks per environment (default 32)")
    p.add_argument("--b0-samples", type=positive(int), help="cold-start samples per task for b0 (default 8)")
    p.add_argument("--loss", choices=("k3", "grpo", "dapo"), help="policy loss (default k3)")
    p.add_argument("--reg-tau", type=float, help="τ_reg of the k3 loss (default 0.1)")
    p.add_argument("--lr", type=positive(float), help="learning rate (default 3e-5)")
    p.add_argument("--tau-cap", type=positive(float), help="τ of the max-first phase (default 2)")
    p.add_argument("--tau-final", help="final τ per effort (default low=0.5,high=1,max=2)")
    p.add_argument("--max-first", type=int, help="iterations sampling only max effort (default 10)")
    p.add_argument("--anneal", type=int, help="iterations of the τ anneal after them (default 30)")
    p.add_argument("--no-routing-replay", action="store_true", help="let the trainer route tokens itself")
    p.add_argument("--eval-every", type=positive(int), help="iterations between held-out evaluations (default 10)")
    p.add_argument("--checkpoint-every", type=positive(int), help="default 10")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu | cuda | auto")
    p.set_defaults(func=cmd_rl)


def config_from_args(args, stored: dict | None = None):
    """An `RLConfig` from the parsed arguments (imports torch): the defaults, or for a resume the run's own settings
    (`stored`, run.json's rl_config), with the options given on the command line on top."""
    from k3.posttrain.rl import RLConfig

    try:
        cfg = RLConfig.from_dict(stored) if stored is not None else RLConfig()
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{args.out}/run.json does not hold an RL run's settings ({e}); choose another --out") from e
    cfg = dataclasses.replace(cfg, out=args.out, init_from=args.init_from or cfg.init_from)
    if args.env:
        cfg.envs = [e.strip() for e in args.env.split(",") if e.strip()]
    if args.efforts:
        cfg.efforts = [e.strip() for e in args.efforts.split(",") if e.strip()]
    overrides = {"tasks": args.tasks, "heldout": args.heldout, "iterations": args.iterations, "prompts_per_iteration": args.prompts,
                 "samples_per_prompt": args.samples, "partial_fraction": args.partial, "max_tokens": args.max_tokens,
                 "num_tasks": args.num_tasks, "heldout_tasks": args.heldout_tasks, "lr": args.lr,
                 "b0_samples": args.b0_samples,
                 "eval_every": args.eval_every, "checkpoint_every": args.checkpoint_every, "seed": args.seed,
                 "device": args.device, "routing_replay": False if args.no_routing_replay else None}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.loss is not None:
        cfg.loss.kind = args.loss
    if args.reg_tau is not None:
        cfg.loss.reg_tau = args.reg_tau
    cur = cfg.curriculum
    if args.tau_cap is not None:
        cur.tau_cap = args.tau_cap
    if args.max_first is not None:
        cur.max_first_iterations = args.max_first
    if args.anneal is not None:
        cur.anneal_iterations = args.anneal
    if args.tau_final:
        for part in args.tau_final.split(","):
            effort, _, value = part.partition("=")
            try:
                cur.tau_final[effort.strip()] = float(value)
            except ValueError:
                raise ValueError(f"--tau-final {args.tau_final!r}: expected effort=value pairs, e.g. "
                                 f"low=0.5,high=1,max=2") from None
    return cfg


def cmd_rl(args) -> int:
    out = Path(args.out)

    def start(stop):
        stored = None
        if args.resume and (out / "run.json").exists():
            stored = json.loads((out / "run.json").read_text()).get("rl_config")
        from k3.posttrain.rl import rl

        return rl(config_from_args(args, stored), resume=args.resume, stop=stop)

    def done(summary) -> str:
        held = "; ".join(f"{effort}: accuracy {m['accuracy']:.2f}, {m['tokens']:.0f} tokens, over budget "
                         f"{m['over_budget']:.2f}" for effort, m in (summary.last_eval or {}).items())
        resumed = f" (resumed at iteration {summary.start_iteration})" if summary.start_iteration else ""
        return (f"RL: {summary.iterations} iterations{resumed} in {summary.seconds / 60:.1f} min; held-out {held}; "
                f"checkpoint {summary.checkpoint}; plots in {out / 'plots'}")

    return run_training_command("k3 rl", args, out, start, done, unit="iteration", longer="--iterations",
                                drop=("resume",))
