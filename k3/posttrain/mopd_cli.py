"""`k3 mopd`: the thin front end over `k3.posttrain.mopd`. Imports nothing heavy at module level (the parser is built
at every `k3` start, and stop signals are installed before torch loads). RL's options keep their `k3 rl` meaning
and defaults (`k3.posttrain.rl_cli.config_from_args` reads them); exit codes are `k3 rl`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3.runfolder import positive
from k3.train.command import run_training_command


def add_mopd_parser(sub) -> None:
    p = sub.add_parser("mopd", help="multi-teacher on-policy distillation: one student from per-domain, per-effort "
                                    "teachers (after k3 rl)",
                       epilog="Defaults and what each knob does: docs/post-training.md (MOPD). Ctrl-C or SIGTERM: stop "
                              "after the current iteration with a checkpoint (exit 130 / 143). Exit codes: 0 done, "
                              "1 system failure, 2 refused, 3 the run cannot continue.")
    p.add_argument("--student", help="the run or checkpoint folder to distil into (an SFT model)")
    p.add_argument("--teacher", action="append", metavar="DOMAIN:EFFORT=RUN",
                   help="the teacher of samples of environment DOMAIN at EFFORT (repeat for each); RUN@EFFORT renders "
                        "the teacher's context at another effort")
    p.add_argument("--out", default="runs/mopd", help="run folder (default runs/mopd)")
    p.add_argument("--r-max", type=positive(float), help="R_max, the clip of the per-token reward (default 5)")
    p.add_argument("--tasks", help="a JSONL of tasks of the teachers' domains (default: each generates its own)")
    p.add_argument("--heldout", help="a JSONL of evaluation tasks (default: some set aside, --heldout-tasks)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--iterations", type=positive(int), help="iterations (default 40)")
    p.add_argument("--prompts", type=positive(int), help="N, prompts per iteration (default 8)")
    p.add_argument("--samples", type=positive(int), help="K, samples per prompt (default 8)")
    p.add_argument("--partial", type=positive(float), help="λ, the fraction of done trajectories that ends an "
                                                           "iteration's rollout (default 1)")
    p.add_argument("--max-tokens", type=positive(int), help="generated tokens per trajectory (default 192)")
    p.add_argument("--num-tasks", type=positive(int), help="generated training tasks per domain (default 256)")
    p.add_argument("--heldout-tasks", type=positive(int), help="held-out tasks per domain (default 32)")
    p.add_argument("--loss", choices=("k3", "grpo", "dapo"), help="policy loss (default k3)")
    p.add_argument("--reg-tau", type=float, help="τ_reg of the k3 loss (default 0.1)")
    p.add_argument("--lr", type=positive(float), help="learning rate (default 3e-4)")
    p.add_argument("--no-routing-replay", action="store_true", help="let the trainer route tokens itself")
    p.add_argument("--eval-every", type=positive(int), help="iterations between held-out evaluations (default 10)")
    p.add_argument("--checkpoint-every", type=positive(int), help="default 10")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu | cuda | auto")
    # RL options that distillation sets itself (environments and efforts from the teachers, no budget curriculum)
    p.set_defaults(func=cmd_mopd, env=None, efforts=None, b0_samples=None, tau_cap=None, tau_final=None,
                   max_first=None, anneal=None)


def config_from_args(args, stored: dict | None = None):
    """A `MOPDConfig` (imports torch): run.json's settings for a resume (`stored`), else the defaults, with the options
    given on top."""
    from k3.posttrain.mopd import DEFAULT_LR, DEFAULT_R_MAX, MOPDConfig, Teacher
    from k3.posttrain.rl_cli import config_from_args as rl_config_from_args

    args.init_from = args.student
    rl_cfg = rl_config_from_args(args, stored.get("rl_config") if stored else None)
    if stored is None and args.lr is None:
        rl_cfg.lr = DEFAULT_LR
    mopd = (stored or {}).get("mopd_config") or {}
    if args.teacher:
        teachers = [Teacher.parse(text) for text in args.teacher]
    else:
        teachers = [Teacher(**t) for t in mopd.get("teachers", [])]
    r_max = args.r_max if args.r_max is not None else mopd.get("r_max", DEFAULT_R_MAX)
    return MOPDConfig(rl_cfg, teachers, r_max)


def cmd_mopd(args) -> int:
    out = Path(args.out)

    def start(stop):
        stored = None
        if args.resume and (out / "run.json").exists():
            stored = json.loads((out / "run.json").read_text())
            if "mopd_config" not in stored:
                raise ValueError(f"{out} holds an RL run, not a distillation run; resume it with k3 rl")
        from k3.posttrain.mopd import mopd

        return mopd(config_from_args(args, stored), resume=args.resume, stop=stop)

    def done(summary) -> str:
        held = "; ".join(f"{effort}: accuracy {m['accuracy']:.2f}, {m['tokens']:.0f} tokens"
                         for effort, m in (summary.last_eval or {}).items())
        resumed = f" (resumed at iteration {summary.start_iteration})" if summary.start_iteration else ""
        return (f"MOPD: {summary.iterations} iterations{resumed} in {summary.seconds / 60:.1f} min; held-out {held}; "
                f"checkpoint {summary.checkpoint}; plots in {out / 'plots'}")

    return run_training_command("k3 mopd", args, out, start, done, unit="iteration", longer="--iterations",
                                drop=("resume", "student", "teacher", "init_from"))
