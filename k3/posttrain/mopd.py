"""`k3 mopd`: multi-teacher on-policy distillation (K3 report §4.1.3).

K3 merges its per-domain, per-effort experts into one model by on-policy distillation: the student samples its own
answers, and every token it wrote is scored by the teacher of the sample's domain and effort,

    r_t = clip(sg[log π_T(y_t | teacher context) − log π_θ(y_t | student context)], −R_max, R_max),

which enters RL's policy loss as a dense per-token advantage. Everything else is `k3 rl` (`k3.posttrain.rl`): the
rollouts on the engine (partial rollouts included), the loss, the optimizer step, routing replay, resume,
checkpoints, metrics and plots. This module adds the scorer RL calls on every iteration (`TeacherScorer`), the
teachers and the run's settings (`MOPDConfig`); docs/post-training.md has the reference.

- **Routing.** A sample's domain is its task's environment, its effort the group's; its teacher is the one given as
  `DOMAIN:EFFORT=RUN`. New groups are sampled only at efforts that have a teacher for their task's domain.
- **Contexts.** The student's context is RL's: the prompt rendered with the `thinking-effort` option of the sample's
  effort. The teacher's is the same messages rendered at the teacher's own effort (`RUN@EFFORT`; by default its
  routing effort, which makes it the student's context token for token), followed by the student's tokens after
  the prompt, unchanged: the teacher scores exactly the tokens the student wrote.
- **Scoring.** Without gradients, on the trainer's device, packed into rows of `row_tokens` as in the training step:
  one pass of the student (the trainer's current weights) over the complete trajectories, one pass of each teacher
  over its own. Teachers load through `k3.checkpoint.load_trained`, so QAT runs quantize as they trained.
- **Budgets.** Length is the teachers' to teach, not a budget's: every task's b0 is `max_tokens` and τ is 1, so RL's
  over-budget override fires only on truncation; the task reward is measured, never trained on.

Legend: N scored tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3.checkpoint import load_trained, resolve_checkpoint
from k3.model.model import K3ForCausalLM
from k3.posttrain.budget import EFFORTS, TauCurriculum
from k3.posttrain.envs import Task, get_environment, write_tasks
from k3.posttrain.rl import (Document, RLConfig, RLSummary, _check_out, _make_tasks, pack_rows, rl,
                             row_tensors)
from k3.posttrain.rl_loss import token_logprobs
from k3.posttrain.rollout import Group, Trajectory
from k3.runfolder import StopSignals, check_writable_folder
from k3.tokenizer import Tokenizer
from k3.train.loop import autocast_context
from k3.train.metrics import MetricsLog

DEFAULT_R_MAX = 5.0
# `k3 mopd`'s learning rate: every token carries its own advantage, a denser signal than RL's group rewards, whose
# lower default (`RLConfig.lr`) is measured on those (docs/post-training.md)
DEFAULT_LR = 3e-4


@dataclass(frozen=True)
class Teacher:
    """One teacher: the (domain, effort) it answers for, its run, and the effort its context is rendered at."""

    domain: str
    effort: str
    run: str
    context_effort: str | None = None  # None: `effort`

    @property
    def key(self) -> str:
        return f"{self.domain}:{self.effort}"

    @property
    def format_effort(self) -> str:
        return self.context_effort or self.effort

    @classmethod
    def parse(cls, text: str) -> Teacher:
        """`DOMAIN:EFFORT=RUN` or `DOMAIN:EFFORT=RUN@EFFORT` (the teacher's context at another effort)."""
        key, _, run = text.partition("=")
        domain, _, effort = key.partition(":")
        context = None
        head, at, tail = run.rpartition("@")
        if at and tail in EFFORTS:
            run, context = head, tail
        if not (domain.strip() and effort.strip() and run.strip()):
            raise ValueError(f"--teacher {text!r}: expected DOMAIN:EFFORT=RUN, e.g. math:high=runs/math-teacher")
        teacher = cls(domain.strip(), effort.strip(), run.strip(), context)
        teacher.validate()
        return teacher

    def validate(self) -> None:
        for what, effort in (("effort", self.effort), ("context effort", self.format_effort)):
            if effort not in EFFORTS:
                raise ValueError(f"teacher {self.key}: unknown {what} {effort!r}; the levels are {', '.join(EFFORTS)}")
        get_environment(self.domain)

    def __str__(self) -> str:
        return f"{self.key}={self.run}" + (f"@{self.context_effort}" if self.context_effort else "")


@dataclass
class MOPDConfig:
    """The run: RL's settings (the student is `rl.init_from`; environments, efforts and the τ curriculum follow from
    the teachers, `distillation_rl_config`), the teachers, and R_max."""

    rl: RLConfig
    teachers: list[Teacher] = field(default_factory=list)
    r_max: float = DEFAULT_R_MAX

    def validate(self) -> None:
        if not self.teachers:
            raise ValueError("name at least one teacher: --teacher DOMAIN:EFFORT=RUN")
        keys = [t.key for t in self.teachers]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"two teachers for {', '.join(twice)}: each (domain, effort) has one teacher")
        for t in self.teachers:
            t.validate()
        if not (math.isfinite(self.r_max) and self.r_max > 0):
            raise ValueError(f"r_max must be a positive number, got {self.r_max!r}")

    def info(self) -> dict[str, Any]:
        """What run.json keeps (`mopd_config`) beside RL's settings."""
        return {"teachers": [dataclasses.asdict(t) for t in self.teachers], "r_max": self.r_max}


def distillation_rl_config(cfg: MOPDConfig) -> RLConfig:
    """RL's settings for distillation: the teachers' domains as environments, their efforts, no budget (τ = 1)."""
    envs = list(dict.fromkeys(t.domain for t in cfg.teachers))
    efforts = [e for e in EFFORTS if any(t.effort == e for t in cfg.teachers)]
    flat = TauCurriculum(max_first_iterations=0, anneal_iterations=0, tau_cap=1.0, tau_final={e: 1.0 for e in EFFORTS})
    return dataclasses.replace(cfg.rl, envs=envs, efforts=efforts, curriculum=flat)


# ---------------------------------------------------------------------------------------------------------- scoring


def distillation_advantages(teacher_logp: torch.Tensor, student_logp: torch.Tensor, r_max: float) -> torch.Tensor:
    """teacher_logp, student_logp [N] -> r [N] fp64 = clip(sg[log π_T − log π_θ], −R_max, R_max), without gradient."""
    return (teacher_logp.detach().double() - student_logp.detach().double()).clamp(-r_max, r_max)


@torch.no_grad()
def sequence_logprobs(model: K3ForCausalLM, sequences: list[tuple[list[int], list[bool]]], device: torch.device,
                      row_tokens: int, pad_id: int) -> list[torch.Tensor]:
    """For each (tokens, scored) pair: log π(tokens[i] | tokens[:i]) at every i ≥ 1 with scored[i], as [n_i] fp64 on
    the CPU. Sequences are packed into rows of `row_tokens` (`k3.posttrain.rl.pack_rows`), one forward per row."""
    docs = [Document(tokens[:-1], tokens[1:], scored[1:], [0.0] * (len(tokens) - 1), [0.0] * (len(tokens) - 1), 0.0,
                     None) for tokens, scored in sequences]
    out: list[torch.Tensor] = []
    for row in pack_rows(docs, row_tokens):
        t = row_tensors(row, pad_id, None)
        if not len(t["at"]):  # nothing generated in this row (trajectories cut before their first token)
            out += [torch.zeros(0, dtype=torch.float64) for _ in row]
            continue
        with autocast_context(device):
            logits = model(t["ids"].to(device), cu_seqlens=t["cu_seqlens"].to(device),
                           logits_at=t["at"].to(device)).logits
            logp = token_logprobs(logits, t["targets"].to(device))
        out += list(logp.double().cpu().split([sum(d.loss) for d in row]))
    return out


def teacher_sequence(template, envs: dict, traj: Trajectory, effort: str) -> tuple[list[int], list[bool]]:
    """(tokens, scored) of `traj` in a teacher's context: the task's prompt rendered at `effort`, then the trajectory's
    tokens after its own prompt unchanged; scored where the student generated."""
    prompt = envs[traj.task.env]().reset(traj.task)
    ids = template.render(prompt.messages, tools=prompt.tools, reasoning_effort=effort)
    return ids + traj.tokens[traj.prompt_len:], [False] * len(ids) + traj.generated[traj.prompt_len:]


class TeacherScorer:
    """What `k3.posttrain.rl.rl` calls as its `scorer`: the effort of each new group (`effort`), and the per-token
    advantages of every iteration's complete groups (calling it), returning their metrics.

    `models`: the teachers' models by key (`load_teachers`); moved to the trainer's device on first use (bf16 on
    CUDA, as the rollout engine holds the student), and never trained."""

    def __init__(self, teachers: list[Teacher], models: dict[str, K3ForCausalLM], r_max: float, row_tokens: int,
                 info: dict[str, Any] | None = None):
        self.teachers = {t.key: t for t in teachers}
        self.models = models
        self.r_max, self.row_tokens = r_max, row_tokens
        self.info = {"mopd_config": info} if info is not None else {}
        self.efforts_by_domain: dict[str, list[str]] = {}
        for t in teachers:
            self.efforts_by_domain.setdefault(t.domain, []).append(t.effort)
        for efforts in self.efforts_by_domain.values():
            efforts.sort(key=EFFORTS.index)
        self._placed: set[str] = set()

    def route(self, domain: str, effort: str) -> Teacher:
        """The teacher of a sample of `domain` (its task's environment) at `effort`. Raises ValueError."""
        teacher = self.teachers.get(f"{domain}:{effort}")
        if teacher is None:
            raise ValueError(f"no teacher for domain {domain!r} at effort {effort!r}; the teachers are "
                             f"{', '.join(self.teachers)}")
        return teacher

    def effort(self, task: Task, uid: int) -> str:
        """The effort of new group `uid` of `task`: its domain's teacher efforts in turn."""
        efforts = self.efforts_by_domain.get(task.env)
        if not efforts:
            raise ValueError(f"task {task.id}: no teacher for domain {task.env!r}")
        return efforts[uid % len(efforts)]

    def model(self, key: str, device: torch.device) -> K3ForCausalLM:
        model = self.models[key]
        if key not in self._placed:
            model.requires_grad_(False).eval()
            if device.type == "cuda":
                model.cast(torch.bfloat16)
            model.to(device)  # in place: a run teaching several keys is one module, placed once
            self._placed.update(k for k, m in self.models.items() if m is model)
        return model

    def __call__(self, run, groups: list[Group]) -> dict[str, Any]:
        """Set `token_advantages` on every trajectory of `groups` (the run's complete groups) and return the metrics:
        mean advantage, teacher KL estimate and clip rate overall and per teacher, with task accuracy and answer
        length per teacher."""
        start = time.perf_counter()
        trajectories = [t for g in groups for t in g.trajectories]
        if not trajectories:
            return {}
        device, template, pad = run.runtime.device, run.template, run.template.tokenizer.pad_id
        student = sequence_logprobs(run.model, [(t.tokens, t.generated) for t in trajectories], device,
                                    self.row_tokens, pad)
        by_teacher: dict[str, list[int]] = {}
        for i, t in enumerate(trajectories):
            by_teacher.setdefault(self.route(t.task.env, t.effort).key, []).append(i)
        teacher: list[torch.Tensor | None] = [None] * len(trajectories)
        for key, index in by_teacher.items():
            sequences = [teacher_sequence(template, run.envs, trajectories[i], self.teachers[key].format_effort)
                         for i in index]
            for i, logp in zip(index, sequence_logprobs(self.model(key, device), sequences, device, self.row_tokens,
                                                        pad)):
                teacher[i] = logp
        sums: dict[str, list[float]] = {}  # per teacher: trajectories, tokens, Σr, Σ(log π_θ − log π_T), clipped, Σreward
        for traj, s, t in zip(trajectories, student, teacher):
            assert s.shape == t.shape, "the teacher scores exactly the student's tokens"
            r = distillation_advantages(t, s, self.r_max)
            advantages = [0.0] * len(traj.tokens)
            for position, value in zip((i for i in range(1, len(traj.tokens)) if traj.generated[i]), r.tolist()):
                advantages[position] = value
            traj.token_advantages = advantages
            acc = sums.setdefault(self.route(traj.task.env, traj.effort).key, [0.0] * 6)
            acc[0] += 1
            acc[1] += len(r)
            acc[2] += float(r.sum())
            acc[3] += float((s - t).sum())
            acc[4] += float((r.abs() >= self.r_max).sum())
            acc[5] += traj.task_reward
        per_teacher = {key: _teacher_metrics(acc) for key, acc in sorted(sums.items())}
        total = _teacher_metrics([sum(acc[i] for acc in sums.values()) for i in range(6)])
        return {"advantage": total["advantage"], "teacher_kl": total["teacher_kl"],
                "advantage_clip_fraction": total["clip_fraction"], "teachers": per_teacher,
                "score_s": time.perf_counter() - start}


def _teacher_metrics(acc: list[float]) -> dict[str, float]:
    n, tokens, r, kl, clipped, reward = acc
    return {"n": int(n), "accuracy": reward / max(n, 1), "tokens": tokens / max(n, 1),
            "advantage": r / max(tokens, 1), "teacher_kl": kl / max(tokens, 1), "clip_fraction": clipped / max(tokens, 1)}


def load_teachers(teachers: list[Teacher], tokenizer: Tokenizer) -> tuple[list[Teacher], dict[str, K3ForCausalLM]]:
    """(the teachers with their runs resolved to checkpoint folders, their models by key on the CPU). A run named by
    several teachers loads once. Refuses a teacher whose tokenizer differs from the student's (`tokenizer`): it
    must score the student's token ids."""
    resolved, models, by_ckpt = [], {}, {}
    for t in teachers:
        ckpt = resolve_checkpoint(t.run).resolve()
        if ckpt not in by_ckpt:
            model, teacher_tokenizer, _ = load_trained(ckpt)
            if teacher_tokenizer.fingerprint() != tokenizer.fingerprint():
                raise ValueError(f"teacher {t.key} ({t.run}) has another tokenizer than the student: it could not "
                                 f"score the student's token ids")
            by_ckpt[ckpt] = model
        models[t.key] = by_ckpt[ckpt]
        resolved.append(dataclasses.replace(t, run=str(ckpt)))
    return resolved, models


# ---------------------------------------------------------------------------------------------------------- the run


def mopd(cfg: MOPDConfig, resume: bool = False, log=print, progress: bool = True,
         stop: StopSignals | None = None) -> RLSummary:
    """Run (or resume) distillation as configured; returns RL's summary. A new run writes its tasks (b0 =
    `max_tokens`) into the folder, then runs `k3.posttrain.rl.rl` with a `TeacherScorer`; a resume takes the teachers
    and R_max stored in run.json (`mopd_config`), refusing others. Raises ValueError for bad settings before anything
    is written."""
    cfg.validate()
    rl_cfg = distillation_rl_config(cfg)
    rl_cfg.validate()
    check_writable_folder(rl_cfg.out)
    out = Path(rl_cfg.out)
    if resume and (out / "run.json").exists():
        stored = json.loads((out / "run.json").read_text()).get("mopd_config")
        if stored is None:
            raise ValueError(f"{out} holds an RL run, not a distillation run; resume it with k3 rl")
        stored_teachers = sorted(str(Teacher(**t)) for t in stored["teachers"])
        given = sorted(str(dataclasses.replace(t, run=str(resolve_checkpoint(t.run).resolve())))
                       for t in cfg.teachers)
        if stored_teachers != given or stored["r_max"] != cfg.r_max:
            raise ValueError(f"{out} holds a distillation run with other teachers or R_max; resume it with its own "
                             f"(k3 mopd --out {out} --resume) or choose another --out")
    rl_cfg, fresh = _check_out(out, rl_cfg, resume)
    student = resolve_checkpoint(rl_cfg.init_from)
    teachers, models = load_teachers(cfg.teachers, Tokenizer.load(student / "tokenizer"))
    if fresh:
        envs = {name: get_environment(name) for name in rl_cfg.envs}
        train, heldout = _make_tasks(rl_cfg, envs)
        out.mkdir(parents=True, exist_ok=True)
        for name, tasks in (("tasks.jsonl", train), ("heldout.jsonl", heldout)):
            write_tasks(out / name, [dataclasses.replace(t, b0=float(rl_cfg.max_tokens)) for t in tasks])
        rl_cfg = dataclasses.replace(rl_cfg, tasks=str((out / "tasks.jsonl").resolve()),
                                     heldout=str((out / "heldout.jsonl").resolve()))
    info = dataclasses.replace(cfg, teachers=teachers).info()
    scorer = TeacherScorer(teachers, models, cfg.r_max, rl_cfg.row_tokens, info)
    log(f"distilling into {student} from " + ", ".join(f"{t.key} ({t.run})" for t in teachers))
    summary = rl(rl_cfg, resume=not fresh, log=log, progress=progress, stop=stop, scorer=scorer)
    if os.environ.get("RANK", "0") == "0":
        plot_mopd(out / "metrics.jsonl", out / "plots")
    return summary


def plot_mopd(metrics_path: Path, out_dir: Path) -> Path | None:
    """plots/mopd.png: per teacher and iteration, the mean advantage, the teacher KL estimate, the task accuracy and
    the mean answer tokens of the training rollouts. Returns the path (None before the first iteration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = [r for r in MetricsLog(metrics_path).read() if r.get("kind") == "rl" and "teachers" in r]
    if not records:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in records for k in r["teachers"]})
    panels = [("advantage", "mean advantage r_t"), ("teacher_kl", "KL(student ‖ teacher) per token"),
              ("accuracy", "task accuracy (rollouts)"), ("tokens", "mean answer tokens")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, title) in zip(axes, panels):
        for key in keys:
            points = [(r["step"], r["teachers"][key][name]) for r in records if key in r["teachers"]]
            ax.plot(*zip(*points), "o-", ms=3, lw=1.2, label=key)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].legend(title="teacher")
    fig.suptitle("k3 mopd: training rollouts per teacher")
    fig.tight_layout()
    path, tmp = out_dir / "mopd.png", out_dir / "mopd.png.tmp"
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
