"""RL rollouts on k3's own inference engine: groups of K samples per prompt, multi-turn episodes, partial rollouts.

One generation loop: `k3.infer.engine.Engine` (continuous batching, the paged hybrid cache, prefix caching). The
trainer's weights reach it in process through `Engine.load_weights` after every update (`sync_engine`), which
also drops the prefix cache. Above the engine everything is token ids: prompts are rendered by the chat template
the server uses (`k3.chat.template`), replies are kept exactly as sampled, with the engine's log-probability of
each sampled token (the behaviour policy, temperature 1) and, with routing replay, the experts each position was
routed to (`k3.posttrain.replay`).

    Rollouts.add_group(task, effort)   N prompts × K samples in flight
    Rollouts.run()                     step the engine until λ·N·K trajectories are done and at least one group is
                                       complete; pause the rest; return the complete groups

- **Shared prompts.** A group's first sample is submitted alone; its siblings follow one engine step later, once
  the prompt's prefill has been indexed, so they start from the prefix cache instead of recomputing it.
- **Episodes.** A reply ends at `<|end_of_msg|>`; the environment's `step` answers with tool results (rendered as
  tool messages, then the generation prompt, both input tokens) or ends the episode; `verify` gives the task
  reward. `max_tokens` bounds the tokens generated over all turns; an episode that reaches it is `truncated`.
- **Partial rollouts.** When `run` stops, the unfinished trajectories are aborted in the engine but keep their
  tokens, log-probabilities, routes and their sampler's random state. The next `run` submits them first, as new
  requests whose prompt is everything so far (recomputed under the new weights); the restored random state makes
  a paused-and-resumed trajectory draw exactly what an uninterrupted one would have under the same weights.
  A group trains only once all its K samples are done.
- **Several processes.** Rank r drives the groups whose id ≡ r (mod world size) on its own engine (each rank holds
  full weights for rollouts); after every engine step the ranks add up their finished counts, so all of them
  stop at the same step, and at the end every rank receives every group (`gather`), so all hold the same state.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from k3.chat.template import ChatTemplate, OutputParser, Reply, ReplyAccumulator
from k3.infer.api import AdmissionError, ContextLengthError, SamplingParams
from k3.infer.engine import Engine
from k3.posttrain.budget import thinking_tokens
from k3.posttrain.envs import Environment, Task
from k3.posttrain.replay import RouteRecorder


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes and Python versions)."""
    h = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass
class Trajectory:
    """One sample: the prompt and everything after it, as token ids."""

    group: int
    sample: int
    task: Task
    effort: str
    env: Environment
    tokens: list[int]
    generated: list[bool]  # per token: the policy wrote it (the loss is on these)
    logprobs: list[float]  # per token: the behaviour policy's log-probability (0 where not generated)
    prompt_len: int
    turn_start: int  # where the current reply starts
    routes: torch.Tensor | None = None  # [P, L, k] int16: the experts of positions [0, P) (routing replay)
    turns: int = 0
    num_generated: int = 0
    truncated: bool = False
    done: bool = False
    task_reward: float = 0.0
    budget_tokens: int = 0  # T: thinking tokens (single-turn) or every generated token (agentic)
    rng_state: torch.Tensor | None = None  # the paused request's sampler state
    submitted: bool = False  # it has been in the engine (new trajectories wait for their group's first sample)
    pauses: int = 0
    started: int = 0  # the policy version (iteration) that sampled its first token
    # per-token advantages a caller sets, one per entry of `tokens` (read where `generated`); None: the group's A_i
    token_advantages: list[float] | None = None

    def to_state(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in ("group", "sample", "effort", "tokens", "generated", "logprobs",
                                               "prompt_len", "turn_start", "routes", "turns", "num_generated",
                                               "truncated", "done", "task_reward", "budget_tokens", "rng_state",
                                               "submitted", "pauses", "started", "token_advantages")}
        state["task"] = json.dumps(self.task.to_json())
        state["env"] = json.dumps(self.env.state_dict())
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any], envs: dict[str, type[Environment]]) -> Trajectory:
        state = dict(state)
        task = Task.from_json(json.loads(state.pop("task")))
        env = envs[task.env]()
        env.load_state_dict(json.loads(state.pop("env")))
        return cls(task=task, env=env, **state)


@dataclass
class Group:
    uid: int
    task: Task
    effort: str
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(t.done for t in self.trajectories)


@dataclass
class RolloutStats:
    engine_steps: int = 0
    submitted: int = 0
    paused: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Rollouts:
    """Groups of trajectories in flight on one engine per process (see the module docstring).

    `sum_`: adds a small tensor over the processes (`parallel.sum_` of the training runtime; identity in one
    process); `rank`, `world_size`: this process among them. `temperature` 1 samples the policy itself (training,
    b0 estimation); 0 is greedy (evaluation). `tag` prefixes request ids: rollout sets sharing an engine (training,
    evaluation) need different tags. Give every set on an engine with a `RouteRecorder` the recorder."""

    def __init__(self, engine: Engine, template: ChatTemplate, envs: dict[str, type[Environment]], *,
                 samples_per_prompt: int, max_tokens: int, partial_fraction: float = 1.0, temperature: float = 1.0,
                 seed: int = 0, recorder: RouteRecorder | None = None, rank: int = 0, world_size: int = 1,
                 sum_=None, tag: str = "rl"):
        if not 0 < partial_fraction <= 1:
            raise ValueError(f"partial_fraction must be in (0, 1], got {partial_fraction}")
        self.engine, self.template, self.envs = engine, template, envs
        self.k, self.max_tokens, self.fraction = samples_per_prompt, max_tokens, partial_fraction
        self.temperature, self.seed, self.recorder = temperature, seed, recorder
        self.rank, self.world_size, self.tag = rank, world_size, tag
        self.sum_ = sum_ if sum_ is not None else (lambda t: t)
        self.stop_ids = tuple(template.tokenizer.stop_ids)
        self.groups: list[Group] = []
        self.next_uid = 0
        self.version = 0  # the policy version new tokens come from (the RL iteration)
        self.capacity = engine.config.max_running

    # building groups

    def add_group(self, task: Task, effort: str) -> Group:
        """K new trajectories of `task` at `effort` (every process adds the same groups in the same order)."""
        env_cls = self.envs[task.env]
        group = Group(self.next_uid, task, effort)
        self.next_uid += 1
        for s in range(self.k):
            env = env_cls()
            prompt = env.reset(task)
            ids = self.template.render(prompt.messages, tools=prompt.tools, reasoning_effort=effort)
            n = len(ids)
            group.trajectories.append(Trajectory(group.uid, s, task, effort, env, ids, [False] * n, [0.0] * n, n, n,
                                                 started=self.version))
        self.groups.append(group)
        return group

    def mine(self, group: Group) -> bool:
        return group.uid % self.world_size == self.rank

    # the loop

    def run(self) -> tuple[list[Group], RolloutStats]:
        """Step the engine until ⌈λ·(trajectories in flight)⌉ are done and a group is complete (on every process
        together), pause the rest, and return the complete groups (removed from flight), the same on every process."""
        stats = RolloutStats()
        total = sum(len(g.trajectories) for g in self.groups)
        target = math.ceil(self.fraction * total)
        mine = [g for g in self.groups if self.mine(g)]
        resumed = [t for g in mine for t in g.trajectories if t.submitted and not t.done]
        queue: list[Trajectory] = resumed + [t for g in mine for t in g.trajectories if not t.submitted]
        # a new group's siblings start once its first sample has prefilled the prompt into the prefix cache
        leading = {g.uid: g.trajectories[0] for g in mine if not g.trajectories[0].submitted}
        active: dict[str, Trajectory] = {}
        while True:
            leading = {uid: t for uid, t in leading.items() if not (t.num_generated or t.done)}
            queue = self._submit(queue, active, leading, stats)
            outputs = self.engine.step() if self.engine.has_unfinished() else []
            stats.engine_steps += 1
            for out in outputs:
                traj = active[out.request_id]
                self._append(traj, out.new_token_ids, out.logprobs)
                if out.finished:
                    del active[out.request_id]
                    stats.prompt_tokens += out.prompt_tokens
                    stats.cached_tokens += out.cached_tokens
                    self._take_routes(traj, out.request_id)
                    self._end_turn(traj, out.finish_reason, queue)
            done = sum(t.done for g in self.groups if self.mine(g) for t in g.trajectories)
            complete = sum(g.complete for g in self.groups if self.mine(g))
            work = len(active) + len(queue)
            done, complete, work = self.sum_(torch.tensor([done, complete, work], dtype=torch.float64)).tolist()
            if work == 0 or (done >= target and complete >= 1):
                break
        for rid, traj in list(active.items()):
            traj.rng_state = self.engine.requests[rid].generator.get_state()
            self.engine.abort(rid)
            self._take_routes(traj, rid)
            traj.pauses += 1
            stats.paused += 1
        counts = torch.tensor([stats.submitted, stats.paused, stats.prompt_tokens, stats.cached_tokens],
                              dtype=torch.float64)
        stats.submitted, stats.paused, stats.prompt_tokens, stats.cached_tokens = map(int, self.sum_(counts).tolist())
        self.gather()
        complete = [g for g in self.groups if g.complete]
        self.groups = [g for g in self.groups if not g.complete]
        return complete, stats

    def _submit(self, queue: list[Trajectory], active: dict[str, Trajectory], leading: dict[int, Trajectory],
                stats: RolloutStats) -> list[Trajectory]:
        """Start queued trajectories while the engine has slots; the siblings of a group in `leading` wait for its
        first sample. Returns what is still queued."""
        waiting = []
        for traj in queue:
            leader = leading.get(traj.group)
            if len(active) >= self.capacity or (leader is not None and leader is not traj):
                waiting.append(traj)
                continue
            room = min(self.max_tokens - traj.num_generated, self.engine.max_context - len(traj.tokens))
            if room < 1:
                self._finish(traj, truncated=True)
                continue
            rid = f"{self.tag}-g{traj.group}-s{traj.sample}-t{traj.turns}-p{traj.pauses}"
            sampling = SamplingParams(max_tokens=room, temperature=self.temperature, logprobs=0,
                                      seed=derive_seed(self.seed, traj.group, traj.sample, traj.turns),
                                      stop_token_ids=self.stop_ids)
            try:
                self.engine.add_request(rid, traj.tokens, sampling)
            except AdmissionError:
                waiting.append(traj)
                continue
            except ContextLengthError:
                self._finish(traj, truncated=True)
                continue
            if traj.rng_state is not None:
                self.engine.requests[rid].generator.set_state(traj.rng_state)
                traj.rng_state = None
            active[rid] = traj
            traj.submitted = True
            stats.submitted += 1
        return waiting

    def _append(self, traj: Trajectory, ids: list[int], logprobs) -> None:
        traj.tokens.extend(ids)
        traj.generated.extend([True] * len(ids))
        traj.logprobs.extend(lp.logprob for lp in logprobs)
        traj.num_generated += len(ids)

    def _take_routes(self, traj: Trajectory, request_id: str) -> None:
        """Keep the routes of positions this trajectory has none for: a token keeps the experts it was first
        computed with."""
        if self.recorder is None:
            return
        rows = self.recorder.take(request_id)
        have = 0 if traj.routes is None else traj.routes.shape[0]
        if rows.shape[0] > have:
            traj.routes = rows if traj.routes is None else torch.cat([traj.routes, rows[have:]])

    def _end_turn(self, traj: Trajectory, reason: str, queue: list[Trajectory]) -> None:
        reply_ids = traj.tokens[traj.turn_start:]
        reply = self._parse(reply_ids)
        traj.turns += 1
        if reason != "stop":
            traj.env.record(reply)
            self._finish(traj, truncated=True, reply_ids=reply_ids)
            return
        observation = traj.env.step(reply)
        if observation is None or traj.turns >= traj.env.max_turns:
            self._finish(traj, truncated=False, reply_ids=reply_ids)
            return
        calls = {call.id: (call.name, i) for i, call in enumerate(reply.tool_calls)}
        ids = []
        for message in observation:
            ids += self.template.render_message(message, thinking=True, calls=calls)
        ids += self.template.generation_prompt(thinking=True)
        traj.tokens.extend(ids)
        traj.generated.extend([False] * len(ids))
        traj.logprobs.extend([0.0] * len(ids))
        traj.turn_start = len(traj.tokens)
        queue.append(traj)

    def _parse(self, ids: list[int]) -> Reply:
        counter = itertools.count()
        parser = OutputParser(self.template.tokenizer, thinking=True, call_id=lambda: f"call_{next(counter)}")
        acc = ReplyAccumulator()
        acc.add(parser.feed(ids))
        acc.add(parser.finish())
        return acc.reply(thinking=True)

    def _finish(self, traj: Trajectory, truncated: bool, reply_ids: list[int] | None = None) -> None:
        traj.truncated = truncated
        traj.done = True
        traj.task_reward = float(traj.env.verify())
        if traj.env.agentic or reply_ids is None:
            traj.budget_tokens = traj.num_generated
        else:
            traj.budget_tokens = thinking_tokens(self.template.tokenizer, reply_ids)

    # processes and checkpoints

    def gather(self) -> None:
        """Every process receives every group's current state (rank r owns the groups with uid ≡ r)."""
        if self.world_size == 1:
            return
        mine = [[t.to_state() for t in g.trajectories] for g in self.groups if self.mine(g)]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        by_group = {states[0]["group"]: states for part in everyone for states in part}
        for g in self.groups:
            g.trajectories = [Trajectory.from_state(s, self.envs) for s in by_group[g.uid]]

    def state_dict(self) -> dict[str, Any]:
        return {"next_uid": self.next_uid, "version": self.version,
                "groups": [{"uid": g.uid, "task": json.dumps(g.task.to_json()), "effort": g.effort,
                            "trajectories": [t.to_state() for t in g.trajectories]} for g in self.groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_uid, self.version = state["next_uid"], state["version"]
        self.groups = [Group(g["uid"], Task.from_json(json.loads(g["task"])), g["effort"],
                             [Trajectory.from_state(t, self.envs) for t in g["trajectories"]])
                       for g in state["groups"]]


def sync_engine(engine: Engine, tensors: dict[str, torch.Tensor], recorder: RouteRecorder | None = None) -> None:
    """The trainer's weights into the rollout engine (in place); cached prefixes and block routes are dropped."""
    engine.load_weights(tensors)
    if recorder is not None:
        recorder.clear()


def clear_engine_cache(engine: Engine, recorder: RouteRecorder | None = None) -> None:
    """An empty prefix cache (and block routes): a rollout that starts from it proceeds the same way whatever ran on
    the engine before (evaluation, an earlier iteration), which a resumed run relies on."""
    engine.clear_prefix_cache()
    if recorder is not None:
        recorder.clear()


def run_episodes(rollouts: Rollouts, tasks: list[Task], efforts: list[str]) -> list[Group]:
    """Every task at every effort, run to the end (λ = 1 on a rollout set of its own); groups in task-then-effort
    order. Used for b0 estimation and evaluation."""
    for task in tasks:
        for effort in efforts:
            rollouts.add_group(task, effort)
    done: list[Group] = []
    while rollouts.groups:
        complete, _ = rollouts.run()
        done += complete
    return sorted(done, key=lambda g: g.uid)


def estimate_b0(rollouts: Rollouts, tasks: list[Task], effort: str = "max") -> list[Task]:
    """Each task with b0 = the mean budget tokens of `rollouts.k` samples at `effort` (tasks that have one keep it)."""
    todo = [t for t in tasks if t.b0 is None]
    groups = run_episodes(rollouts, todo, [effort]) if todo else []
    b0 = {g.task.id: max(1.0, sum(t.budget_tokens for t in g.trajectories) / len(g.trajectories)) for g in groups}
    return [t if t.b0 is not None else Task(t.id, t.env, t.data, b0[t.id]) for t in tasks]
