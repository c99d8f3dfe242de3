"""The report card of a recipe run: DIR/report.md and a self-contained DIR/report.html (images inline), rebuilt from
the stages' own outputs (`run.json`, `metrics.jsonl`, `plots/`, `results.json`, `serve.json`) and DIR/recipe.json.

Each stage kind has a reader that turns its folder into blocks (headings, text, tables, images); the blocks render to
Markdown and to HTML. Plots the stages write are embedded; the report draws its own (DIR/report/*.png) where a stage
has only numbers: RL by effort, the eval tasks, the model after each stage. The README block (`update_readme`) takes
the headline numbers from the same readers, so nothing in it is typed by hand.
"""

from __future__ import annotations

import base64
import glob
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from k3.recipe.recipe import Recipe, Stage, parse_recipe

STATE_FILE = "recipe.json"
PLOTS = "report"
README_BLOCK = re.compile(r"(<!-- recipe: (?P<name>[a-z0-9-]+) -->\n)(.*?)(<!-- /recipe -->)", re.S)
# the metrics of the comparison table (task, metric): held-out items the model after every stage can be asked
COMPARED = (("perplexity", "nats_per_token"), ("k3_python_mc", "acc"), ("k3_python_cloze", "acc"),
            ("k3_arithmetic", "exact_match"), ("humaneval", "pass@1"))


@dataclass
class Card:
    """What the readers found: blocks in order, and headline numbers for the README."""
    blocks: list = field(default_factory=list)
    headline: list = field(default_factory=list)  # (what, value) rows

    def h(self, level: int, text: str):
        self.blocks.append(("h", level, text))

    def p(self, text: str):
        self.blocks.append(("p", text))

    def table(self, headers: list[str], rows: list[list]):
        if rows:
            self.blocks.append(("table", headers, rows))

    def img(self, path: Path, caption: str):
        if path.is_file():
            self.blocks.append(("img", path, caption))


def _records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    return out


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if abs(x) >= 1e5:
            return f"{x:.3g}"
        if x == int(x) and abs(x) >= 1e3:
            return f"{x:,.0f}"
        text = f"{x:.{digits}f}".rstrip("0").rstrip(".")
        return "0" if text == "-0" else text
    return str(x)


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _minutes(seconds) -> str:
    return "—" if seconds is None else f"{seconds / 60:.1f}"


def _config(folder: Path) -> dict:
    ckpts = sorted(glob.glob(str(folder / "checkpoints/step_*/config.json")))
    data = _json(Path(ckpts[-1])) if ckpts else _json(folder / "config.json")
    return (data or {}).get("text_config", data or {})


# per-kind readers: (card, stage, folder, context) -> None

def read_pretrain(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    records = _records(folder)
    start = next((r for r in records if r.get("event") == "start"), {})
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    last_train = trains[-1] if trains else {}
    heldout = evals[-1]["loss"] if evals else None
    entropy = start.get("unigram_entropy")
    card.table(["parameters", "steps", "tokens", "train loss", "held-out loss (nats/token)",
                "unigram entropy (nats/token)"],
               [[_fmt(start.get("params")), _fmt(last_train.get("step")), _fmt(last_train.get("tokens_seen")),
                 _fmt(last_train.get("loss")), _fmt(heldout), _fmt(entropy)]])
    if heldout is not None and entropy:
        card.p(f"The held-out loss is {heldout / entropy:.0%} of the corpus's unigram entropy (what a model that "
               f"ignores context would reach).")
        card.headline.append(("pre-training: held-out loss vs unigram entropy (nats/token)",
                              f"{heldout:.3f} vs {entropy:.3f}"))
    card.img(folder / "plots" / "loss.png", "loss, held-out loss and the unigram entropy")
    card.img(folder / "plots" / "moe_balance.png", "MoE load balance")


def read_sft_data(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    efforts: dict[str, int] = {}
    files = sorted(folder.glob("*.jsonl"))
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                effort = json.loads(line).get("reasoning_effort") or "none"
                efforts[effort] = efforts.get(effort, 0) + 1
    card.table(["conversations", *[f"effort {e}" for e in efforts]],
               [[_fmt(sum(efforts.values())), *[_fmt(n) for n in efforts.values()]]])


def read_sft(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    records = _records(folder)
    start = next((r for r in records if r.get("event") == "start"), {})
    evals = [r for r in records if r.get("kind") == "eval"]
    trains = [r for r in records if r.get("kind") == "train"]
    first, last = (evals[0]["loss"], evals[-1]["loss"]) if evals else (None, None)
    card.table(["steps", "conversations", "skipped (too long)", "train loss", "held-out loss before → after"],
               [[_fmt(trains[-1]["step"] if trains else None), _fmt(start.get("train_documents")),
                 _fmt(start.get("skipped_documents")), _fmt(trains[-1]["loss"] if trains else None),
                 f"{_fmt(first)} → {_fmt(last)}"]])
    if last is not None:
        card.headline.append(("SFT: held-out loss on conversations (nats/token)", f"{_fmt(first)} → {_fmt(last)}"))
    card.img(folder / "plots" / "loss.png", "SFT loss (held-out at step 0: where SFT began)")


def _rl_evals(folder: Path) -> tuple[dict, dict]:
    """(first, last) held-out evaluation per effort of an RL or MOPD run."""
    evals = [r for r in _records(folder) if r.get("kind") == "rl_eval"]
    return (evals[0]["efforts"], evals[-1]["efforts"]) if evals else ({}, {})


def read_rl(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    records = [r for r in _records(folder) if r.get("kind") == "rl"]
    first, last = _rl_evals(folder)
    rows = []
    for effort in last:
        train = [r["efforts"][effort] for r in records if effort in r.get("efforts", {})]
        begin, end = first.get(effort, {}), last[effort]
        rows.append([effort, f"{_fmt(train[0]['reward'] if train else None)} → "
                             f"{_fmt(train[-1]['reward'] if train else None)}",
                     f"{_pct(begin.get('accuracy'))} → {_pct(end.get('accuracy'))}",
                     f"{_pct(begin.get('over_budget'))} → {_pct(end.get('over_budget'))}",
                     f"{_fmt(begin.get('tokens'), 1)} → {_fmt(end.get('tokens'), 1)}", _fmt(end.get("n"))])
        ctx.setdefault("efforts", {})[(stage.name, effort)] = end
        card.headline.append((f"RL expert at {effort} effort: held-out accuracy, over budget, answer tokens",
                              f"{_pct(end.get('accuracy'))}, {_pct(end.get('over_budget'))}, "
                              f"{_fmt(end.get('tokens'), 1)}"))
    trained = sum(r.get("trained_groups", 0) for r in records)
    groups = sum(r.get("groups", 0) for r in records)
    card.table(["effort", "training reward, first → last iteration", "held-out accuracy", "held-out over budget",
                "held-out answer tokens", "held-out problems"], rows)
    card.p(f"{len(records)} iterations; {trained} of {groups} rollout groups had unequal rewards and trained.")
    card.img(folder / "plots" / "rl_rollouts.png", "training rollouts per effort")
    card.img(folder / "plots" / "rl_heldout.png", "held-out evaluation per effort")


def read_qat(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    config = _config(folder)
    card.p(f"The student starts from `{stage.of}` with `qat: {config.get('qat', 'none')}` "
           f"(scales `{config.get('qat_scale_mode', '—')}`) in its config.json: from here every training step and "
           f"rollout quantizes the routed experts (MXFP4 weights, MXFP8 inputs; docs/qat.md).")


def read_mopd(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    run = _json(folder / "run.json") or {}
    teachers = (run.get("mopd_config") or {}).get("teachers", [])
    first, last = _rl_evals(folder)
    config = _config(folder)
    card.p(f"Student: QAT `{config.get('qat', 'none')}`; {len(teachers)} teachers.")
    folders = {str((ctx["dir"] / s.name).resolve()): s.name for s in ctx["recipe"].stages}
    rows = []
    for t in teachers:
        effort = t.get("effort")
        run_path = str(Path(t.get("run", "")).resolve())
        source = next((name for path, name in folders.items() if run_path.startswith(path)), None)
        teacher = ctx.get("efforts", {}).get((source, effort), {})
        s0, s1 = first.get(effort, {}), last.get(effort, {})
        rows.append([f"{t.get('domain')}:{effort}", source or t.get("run"), _pct(s0.get("accuracy")),
                     _pct(s1.get("accuracy")), _pct(teacher.get("accuracy")), _fmt(s1.get("tokens"), 1),
                     _fmt(teacher.get("tokens"), 1)])
        if s1:
            card.headline.append((f"MOPD student vs its {effort} teacher: held-out accuracy",
                                  f"{_pct(s1.get('accuracy'))} vs {_pct(teacher.get('accuracy'))}"))
    card.table(["teacher", "teacher stage", "student before", "student after", "teacher", "student tokens",
                "teacher tokens"], rows)
    records = [r for r in _records(folder) if r.get("kind") == "rl" and "teachers" in r]
    if records:
        kl = [[key, _fmt(records[0]["teachers"][key].get("teacher_kl"), 4),
               _fmt(records[-1]["teachers"].get(key, {}).get("teacher_kl"), 4)] for key in records[0]["teachers"]]
        card.table(["teacher", "KL(student ‖ teacher) per token, first iteration", "last iteration"], kl)
    card.p("Held-out accuracy is greedy on the same held-out problems in every RL and MOPD stage (same generator, "
           "seed and task counts).")
    card.img(folder / "plots" / "mopd.png", "per teacher: advantage, KL, accuracy, answer tokens")


def read_export(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    trained = _config(ctx["dir"] / stage.of) if stage.of else {}
    qat = trained.get("qat", "none")
    ctx.setdefault("exports", []).append((stage.name, stage.of, qat))
    card.p(f"`{stage.of}` (trained {'with QAT ' + qat if qat != 'none' else 'without QAT'}) written in the release "
           f"layout with MXFP4 routed experts and loaded back: the model a user of the release gets. The gap to "
           f"the model as trained is in “QAT vs bf16 export gap” below.")


def read_draft(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    evals = [r for r in _records(folder) if r.get("kind") == "eval" and "acceptance" in r]
    if not evals:
        return
    before, after = evals[0], evals[-1]
    rows = [[k + 1, _fmt(a, 3), _fmt(b, 3), _fmt(tokens_per_verify(before["acceptance"], k + 1), 2),
             _fmt(tokens_per_verify(after["acceptance"], k + 1), 2)]
            for k, (a, b) in enumerate(zip(before["acceptance"], after["acceptance"]))]
    card.table(["unrolled step k", "acceptance before (step 0)", f"after (step {after['step']})",
                "tokens per verify drafting k, before", "after"], rows)
    card.p("Training-time-test rates on held-out text (teacher-forced), the draft's own evaluation; the served "
           "acceptance and speedup, where the recipe serves with the draft, are under serve.")
    card.headline.append((f"draft: tokens per verify drafting {len(after['acceptance'])} (training-time test)",
                          f"{before['tokens_per_verify']:.2f} → {after['tokens_per_verify']:.2f}"))
    card.img(folder / "plots" / "acceptance.png", "acceptance per unrolled step, before and after")


def tokens_per_verify(acceptance: list[float], k: int) -> float:
    """1 + Σ_{j ≤ k} Π_{i ≤ j} α_i: expected tokens per target verification when drafting k (docs/speculative.md)."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def _eval_results(folder: Path) -> list[dict]:
    return [r for r in (_json(Path(p)) for p in sorted(glob.glob(str(folder / "**" / "results.json"),
                                                                  recursive=True))) if r]


def read_eval(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    results = _eval_results(folder)
    metrics: dict[tuple[str, str], float] = {}
    rows = []
    for res in results:
        for task, values in res.get("tasks", {}).items():
            for metric, value in values.items():
                if metric.endswith("_stderr") or metric == "sample_len" or not isinstance(value, (int, float)):
                    continue
                metrics[(task, metric)] = value
                rows.append([task, metric, _fmt(value), _fmt(values.get(f"{metric}_stderr")),
                             _fmt(res.get("n", {}).get(task))])
    ctx.setdefault("evals", {})[stage.name] = (stage.of, metrics)
    if stage.name != ctx.get("main_eval"):
        card.p(f"The model of `{stage.of}`: {len(metrics)} metrics (the last table compares it).")
        return
    card.table(["task", "metric", "value", "± stderr", "items"], rows)
    for res in results:
        he = res.get("details", {}).get("humaneval")
        if he:
            card.p(f"HumanEval: {he.get('problems')} problems, {he.get('samples_per_problem')} sample(s) each, "
                   f"programs run by the `{he.get('executor')}` executor.")
        for f in res.get("files", []):
            card.img(Path(f) if Path(f).is_absolute() else folder / f, Path(f).stem.replace("_", " "))
    for key, what in ((("humaneval", "pass@1"), "HumanEval pass@1"), (("k3_python_mc", "acc"), "k3_python_mc acc"),
                      (("passkey", "accuracy"), "passkey retrieval accuracy")):
        if key in metrics:
            card.headline.append((f"eval: {what}", _fmt(metrics[key])))


def read_serve(card: Card, stage: Stage, folder: Path, ctx: dict) -> None:
    runs = [(f.stem, _json(f)) for f in sorted(folder.glob("serve*.json"))]
    runs = sorted([(name, s) for name, s in runs if s], key=lambda r: "--draft" in r[1]["command"])
    if not runs:
        return
    rows = []
    for name, s in runs:
        drafted = s.get("accepted_prediction_tokens", 0) + s.get("rejected_prediction_tokens", 0)
        rows.append([f"`{s['command']}`", s["requests"], _fmt(s["completion_tokens"]), _fmt(s["seconds"], 2),
                     _fmt(s["tokens_per_s"], 1), _fmt(s.get("single_request_tokens_per_s"), 1),
                     _pct(s["accepted_prediction_tokens"] / drafted) if drafted else "—"])
    card.table(["served as", "concurrent requests", "generated tokens", "seconds", "tokens/s (batch)",
                "tokens/s (one request)", "drafts accepted"], rows)
    plain = next((s for _, s in runs if "--draft" not in s["command"]), None)
    spec = next((s for _, s in runs if "--draft" in s["command"]), None)
    card.p(f"Greedy chat completions of at most {runs[0][1]['max_tokens']} tokens through `k3 serve` on loopback, "
           f"after one warm-up request. Serve it yourself: `{runs[0][1]['command']}`.")
    if plain:
        card.headline.append((f"k3 serve: generated tokens/s (batch of {plain['requests']}; one request)",
                              f"{_fmt(plain['tokens_per_s'], 1)}; {_fmt(plain.get('single_request_tokens_per_s'), 1)}"))
    if plain and spec and plain.get("single_request_tokens_per_s") and plain.get("tokens_per_s"):
        one = spec["single_request_tokens_per_s"] / plain["single_request_tokens_per_s"]
        batch = spec["tokens_per_s"] / plain["tokens_per_s"]
        card.p(f"Speculative decoding with the draft: {one:.2f}× the tokens/s of one request, {batch:.2f}× over the "
               f"batch.")
        card.headline.append(("speculative decoding with the draft: speedup (one request; batch)",
                              f"{one:.2f}×; {batch:.2f}×"))


READERS = {"pretrain": read_pretrain, "sft-data": read_sft_data, "sft": read_sft, "rl": read_rl, "qat": read_qat,
           "mopd": read_mopd, "export": read_export, "draft": read_draft, "eval": read_eval, "serve": read_serve}


def _plot(path: Path, draw) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    if fig is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _efforts_plot(path: Path, efforts: dict) -> Path | None:
    """Held-out accuracy and answer tokens of each RL stage's final evaluation, by effort."""
    if not efforts:
        return None

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        labels = [f"{stage}\n{effort}" for stage, effort in efforts]
        axes[0].bar(labels, [100 * m.get("accuracy", 0) for m in efforts.values()], color="C0")
        axes[0].set_ylabel("held-out accuracy %")
        axes[1].bar(labels, [m.get("tokens", 0) for m in efforts.values()], color="C1")
        axes[1].set_ylabel("mean answer tokens")
        for ax in axes:
            ax.grid(alpha=0.3, axis="y")
        return fig

    return _plot(path, draw)


def _comparison(card: Card, ctx: dict) -> None:
    """The model after each stage on the same held-out tasks, and the QAT vs bf16 export gap."""
    order = [s.name for s in ctx["recipe"].stages]
    # one row per model, in the order the recipe made them
    evals = dict(sorted(ctx.get("evals", {}).items(), key=lambda item: order.index(item[1][0])
                        if item[1][0] in order else len(order)))
    if not evals:
        return
    columns = [key for key in COMPARED if sum(key in m for _, m in evals.values()) >= 2]
    rows = [[of, stage, *[_fmt(metrics.get(key), 4 if key[1] == "nats_per_token" else 3) for key in columns]]
            for stage, (of, metrics) in evals.items()]
    exports = ctx.get("exports", [])
    by_model = {of: metrics for of, metrics in evals.values()}
    gap_rows = []
    for name, of, qat in exports:
        if name in by_model and of in by_model:
            for key in columns:
                a, b = by_model[of].get(key), by_model[name].get(key)
                if a is not None and b is not None:
                    gap_rows.append([of, f"with QAT ({qat})" if qat != "none" else "without QAT", f"{key[0]} {key[1]}",
                                     _fmt(a, 4), _fmt(b, 4), _fmt(b - a, 4)])
    if gap_rows:
        card.h(2, "QAT vs bf16 export gap")
        card.p("Each model as trained and after `k3 convert to-release --mxfp4` loaded back (other weights as the "
               "release stores them), on the same held-out items. A QAT model's experts decode to exactly the weights "
               "its forward used, so its gap comes only from the bf16 storage of the other weights.")
        card.table(["model", "trained", "metric", "as trained", "MXFP4 export", "change"], gap_rows)
        for row in gap_rows:
            if row[2] == "perplexity nats_per_token":
                card.headline.append((f"MXFP4 export of `{row[0]}` (trained {row[1]}): held-out nats/token",
                                      f"{row[3]} → {row[4]}"))
    if not columns:
        return
    card.h(2, "The model after each stage")
    card.p("Every evaluated model on the same held-out items (`k3 eval`, the same tasks and --limit).")
    card.table(["model after", "eval stage", *[f"{t} {m}" for t, m in columns]], rows)
    accuracy = [key for key in columns if key[1] != "perplexity" and key[1] != "nats_per_token"]

    nats = ("perplexity", "nats_per_token") in columns

    def draw(plt):
        if not accuracy and not nats:
            return None
        fig, axes = plt.subplots(1, 1 + nats, figsize=(max(6, 1.6 * len(evals)) * (1 + 0.6 * nats), 3.5),
                                 squeeze=False)
        models = [of for of, _ in evals.values()]
        ax = axes[0][0]
        width = 0.8 / max(1, len(accuracy))
        for i, key in enumerate(accuracy):
            ax.bar([x + i * width for x in range(len(evals))], [m.get(key, 0) for _, m in evals.values()], width,
                   label=f"{key[0]} {key[1]}")
        ax.set_xticks([x + width * (len(accuracy) - 1) / 2 for x in range(len(evals))], models)
        ax.set_ylabel("score")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3, axis="y")
        if nats:
            values = [m.get(("perplexity", "nats_per_token"), float("nan")) for _, m in evals.values()]
            axes[0][1].bar(models, values, color="C4")
            low = min(v for v in values if v == v)
            axes[0][1].set_ylim(low * 0.95, max(v for v in values if v == v) * 1.02)
            axes[0][1].set_ylabel("held-out nats/token (lower is better)")
            axes[0][1].grid(alpha=0.3, axis="y")
        return fig

    plot = _plot(ctx["dir"] / PLOTS / "comparison.png", draw)
    if plot:
        card.img(plot, "held-out scores of the model after each stage")


def build(out: Path) -> tuple[Card, dict]:
    state = _json(out / STATE_FILE)
    if state is None:
        raise ValueError(f"{out} holds no recipe run ({STATE_FILE})")
    recipe: Recipe = parse_recipe(state["text"], str(out / STATE_FILE))
    card = Card()
    env = state.get("environment", {})
    status = state.get("status", "?")
    seconds = sum(r.get("seconds", 0.0) for r in state.get("stages", {}).values())
    card.h(1, f"k3 recipe `{recipe.name}`: report card")
    about = recipe.about[:1].upper() + recipe.about[1:]
    card.p(f"{about}. Status: **{status}**; {sum(r.get('status') == 'done' for r in state['stages'].values())} "
           f"of {len(recipe.stages)} stages done in {seconds / 60:.1f} minutes. Folder `{out}`.")
    card.table(["k3 revision", "Python", "torch", "CPU", "cores", "platform"],
               [[env.get("k3_revision"), env.get("python"), env.get("torch"), env.get("cpu"), env.get("cpus"),
                 env.get("platform")]])
    card.headline.append(("recipe wall time (all stages, minutes)", f"{seconds / 60:.1f}"))
    card.h(2, "Stages")
    rows = []
    for i, s in enumerate(recipe.stages):
        r = state["stages"].get(s.name, {})
        rows.append([i + 1, s.name, s.kind, r.get("status", "not run"), _minutes(r.get("seconds")), _fmt(s.minutes, 1),
                     r.get("exit_code") if r.get("exit_code") not in (None, 0) else ""])
    card.table(["#", "stage", "kind", "status", "wall minutes", "estimate", "exit code"], rows)
    evals = [s.name for s in recipe.stages if s.kind == "eval"]
    serve = next((s for s in recipe.stages if s.kind == "serve"), None)
    # the eval stage of the served (final) model gets the full table; the others feed the comparison
    main = next((s.name for s in recipe.stages if s.kind == "eval" and serve and s.of == serve.of),
                evals[0] if evals else None)
    ctx = {"dir": out, "recipe": recipe, "state": state, "main_eval": main}
    for s in recipe.stages:
        r = state["stages"].get(s.name, {})
        folder = out / s.name
        if s.kind == "eval" and s.name != main:
            if folder.is_dir():
                READERS["eval"](Card(), s, folder, ctx)
            continue
        card.h(2, f"{s.name}" + (f": {s.about}" if s.about else ""))
        commands = [c if isinstance(c, str) else json.dumps(c) for c in s.run]
        card.blocks.append(("code", "\n".join(commands)))
        card.p(f"{r.get('status', 'not run')}; wall time {_minutes(r.get('seconds'))} min "
               f"(estimate {_fmt(s.minutes, 1)}).")
        if r.get("status") in ("failed", "stopped") and r.get("message"):
            card.blocks.append(("code", r["message"]))
        if folder.is_dir() and s.kind in READERS:
            READERS[s.kind](card, s, folder, ctx)
        if s.kind == "rl" and s is [x for x in recipe.stages if x.kind == "rl"][-1]:
            plot = _efforts_plot(out / PLOTS / "rl_efforts.png", ctx.get("efforts", {}))
            if plot:
                card.h(3, "every RL stage, by effort")
                card.img(plot, "held-out accuracy and answer tokens at the end of each RL stage")
    _comparison(card, ctx)
    return card, ctx


def _md(card: Card, out: Path) -> str:
    lines = []
    for b in card.blocks:
        if b[0] == "h":
            lines += ["#" * b[1] + " " + b[2], ""]
        elif b[0] == "p":
            lines += [b[1], ""]
        elif b[0] == "code":
            lines += ["```", b[1], "```", ""]
        elif b[0] == "table":
            lines.append("| " + " | ".join(map(str, b[1])) + " |")
            lines.append("|" + "---|" * len(b[1]))
            lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in b[2]]
            lines.append("")
        elif b[0] == "img":
            rel = b[1].resolve().relative_to(out.resolve()) if b[1].resolve().is_relative_to(out.resolve()) else b[1]
            lines += [f"![{b[2]}]({rel})", ""]
    return "\n".join(lines)


def _inline(text: str) -> str:
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def _html(card: Card) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>k3 recipe report</title><style>",
             "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}",
             "table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}",
             "pre{background:#f6f6f6;padding:.6em;overflow-x:auto}img{max-width:100%;border:1px solid #eee}",
             "figure{margin:.8em 0}figcaption{color:#666;font-size:90%}</style></head><body>"]
    for b in card.blocks:
        if b[0] == "h":
            parts.append(f"<h{b[1]}>{_inline(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            parts.append(f"<p>{_inline(b[1])}</p>")
        elif b[0] == "code":
            parts.append(f"<pre>{html.escape(b[1])}</pre>")
        elif b[0] == "table":
            head = "".join(f"<th>{_inline(str(h))}</th>" for h in b[1])
            body = "".join("<tr>" + "".join(f"<td>{_inline(str(c))}</td>" for c in row) + "</tr>" for row in b[2])
            parts.append(f"<table><tr>{head}</tr>{body}</table>")
        elif b[0] == "img":
            data = base64.b64encode(b[1].read_bytes()).decode()
            parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(b[2])}'>"
                         f"<figcaption>{html.escape(b[2])}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out: Path) -> tuple[Path, Path]:
    """Write DIR/report.md and DIR/report.html from the stages' outputs; returns their paths."""
    card, _ = build(out)
    md, page = out / "report.md", out / "report.html"
    md.write_text(_md(card, out))
    page.write_text(_html(card))
    return md, page


def serve_commands(out: Path) -> list[str]:
    """The `k3 serve` command lines the recipe's serve stages ran: without a draft first."""
    state = _json(out / STATE_FILE)
    if state is None:
        return []
    recipe = parse_recipe(state["text"])
    commands = []
    for s in recipe.stages:
        if s.kind == "serve":
            commands += [d["command"] for d in map(_json, sorted((out / s.name).glob("serve*.json"))) if d]
    return sorted(commands, key=lambda c: "--draft" in c)


def headline_markdown(out: Path) -> str:
    card, ctx = build(out)
    state = ctx["state"]
    env = state.get("environment", {})
    lines = ["| measure | value |", "|---|---|", *[f"| {what} | {value} |" for what, value in card.headline], ""]
    readme = ctx["recipe"].readme
    lines.append(f"{readme + ' ' if readme else ''}`k3 recipe run {ctx['recipe'].name} --out {out}` on "
                 f"{env.get('cpu')}, {env.get('cpus')} cores, k3 `{env.get('k3_revision')}` (torch "
                 f"{env.get('torch')}); status {state.get('status')}; the full report card: `{out}/report.md`.")
    return "\n".join(lines) + "\n"


def update_readme(out: Path, readme: Path) -> None:
    """Replace the `<!-- recipe: NAME -->…<!-- /recipe -->` block of `readme` with this run's headline numbers."""
    text = readme.read_text()
    state = _json(out / STATE_FILE) or {}
    matches = [m for m in README_BLOCK.finditer(text) if m.group("name") == state.get("recipe")]
    if not matches:
        raise ValueError(f"{readme} has no <!-- recipe: {state.get('recipe')} --> … <!-- /recipe --> block")
    m = matches[0]
    readme.write_text(text[:m.start(3)] + headline_markdown(out) + text[m.end(3):])
