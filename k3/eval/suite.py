"""`k3 eval`: run the named tasks against one endpoint, write `results.json` (and the plots) to a folder, print a
table. Task names are k3's own evaluations (`humaneval`, `passkey`, `needle`, `perplexity`) or lm-eval tasks
(k3's bundled ones, any lm-eval knows, or your own YAML through `include_path`); docs/evaluation.md.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3.eval.endpoint import Endpoint

NATIVE_TASKS = ("humaneval", "passkey", "needle", "perplexity")
DEFAULT_TASKS = ("k3_python_mc", "k3_python_cloze", "k3_arithmetic")


@dataclass
class EvalOptions:
    """Every knob of `k3 eval`, with its default."""

    limit: int | None = None  # items per task (lm-eval tasks and HumanEval problems)
    num_fewshot: int | None = None
    include_path: str | None = None  # a folder of your own lm-eval task YAML
    num_concurrent: int = 4  # requests in flight
    batch_size: int = 16  # prompts per log-likelihood request
    seed: int = 0
    # HumanEval
    samples: int = 1  # completions per problem (1: greedy)
    ks: tuple[int, ...] = (1,)
    temperature: float | None = None  # default 0 for one sample, 0.8 for more
    max_tokens: int = 512
    executor: str = "auto"  # auto | sandbox | subprocess
    timeout: float = 10.0  # seconds per program
    # long context
    lengths: tuple[int, ...] | None = None  # default 1K, 2K, … up to the context (or max_length)
    max_length: int | None = None
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    probes_per_cell: int = 3
    haystack: list[str] = field(default_factory=list)  # needle's haystack files (default: the stdlib sources)
    # perplexity
    text: list[str] = field(default_factory=list)  # held-out files (default: a run folder's held-out split)
    window: int | None = None  # tokens per scored window (default min(context, 4096))
    ppl_tokens: int | None = 100_000  # tokens scored in all (None: every token of the text)


def run_suite(endpoint: Endpoint, tasks: list[str], options: EvalOptions, out: Path, model_spec: str = "",
              progress: bool = True) -> dict[str, Any]:
    """Run every task; returns (and writes to out/results.json) {"model", "tasks": {task: {metric: value}},
    "details": {task: ...}, "files": [...]}."""
    out.mkdir(parents=True, exist_ok=True)
    client = endpoint.client()
    results: dict[str, Any] = {"model": model_spec or endpoint.model_name, "served_as": endpoint.model_name,
                               "url": endpoint.url, "max_context": endpoint.max_context,
                               "options": {k: v for k, v in asdict(options).items()}, "tasks": {}, "details": {},
                               "n": {}, "files": [], "seconds": {}, "host": platform.node()}
    harness_tasks = [t for t in tasks if t not in NATIVE_TASKS]
    if harness_tasks:
        from k3.eval.harness import run_lm_eval

        start = time.monotonic()
        r = run_lm_eval(endpoint, harness_tasks, limit=options.limit, num_fewshot=options.num_fewshot,
                        include_path=options.include_path, num_concurrent=options.num_concurrent,
                        batch_size=options.batch_size, seed=options.seed or 1234)
        results["tasks"].update(r["results"])
        results["n"].update(r["n"])
        results["details"]["lm_eval_model_types"] = r["model_types"]
        results["seconds"]["lm-eval"] = time.monotonic() - start
    for task in [t for t in tasks if t in NATIVE_TASKS]:
        start = time.monotonic()
        if task == "humaneval":
            from k3.eval.execute import default_executor
            from k3.eval.humaneval import run_humaneval

            executor = default_executor(options.executor)
            try:
                r = run_humaneval(client, executor, samples=options.samples, ks=options.ks,
                                  temperature=options.temperature, max_tokens=options.max_tokens, limit=options.limit,
                                  num_concurrent=options.num_concurrent, timeout=options.timeout, seed=options.seed,
                                  progress=progress)
            finally:
                executor.close()
            results["tasks"][task] = r["metrics"]
            results["n"][task] = r["problems"]
            results["details"][task] = r
        elif task in ("passkey", "needle"):
            from k3.eval.longctx import default_lengths, plot_heatmap, run_retrieval

            lengths = list(options.lengths or default_lengths(endpoint.max_context, options.max_length))
            r = run_retrieval(client, task, lengths, tuple(options.depths), options.probes_per_cell,
                              options.haystack or None, options.seed, options.num_concurrent, progress)
            png = out / f"{task}.png"
            plot_heatmap(r, png, f"{task}: {results['model']}")
            results["tasks"][task] = {"accuracy": r["mean_accuracy"]} | {
                f"accuracy@{n}": sum(row[j] for row in r["accuracy"]) / len(r["depths"]) for j, n in enumerate(lengths)}
            results["n"][task] = len(r["cells"])
            results["details"][task] = r
            results["files"].append(str(png))
        else:
            from k3.eval.perplexity import documents, plot_by_position, run_perplexity

            tokenizer = endpoint.tokenizer
            run = model_spec if model_spec and Path(model_spec).is_dir() else None
            docs = documents(options.text or None, run, tokenizer)
            bos = tokenizer.bos_id if tokenizer is not None else client.tokenize("", add_special_tokens=True)[0]
            window = options.window or min(endpoint.max_context, 4096)
            r = run_perplexity(client, docs, bos, window, options.ppl_tokens, progress)
            png = out / "perplexity_by_position.png"
            plot_by_position(r, png, f"held-out loss by position: {results['model']}")
            results["tasks"][task] = {k: r[k] for k in ("nats_per_token", "bits_per_byte", "perplexity")}
            results["n"][task] = r["tokens"]
            results["details"][task] = r
            results["files"].append(str(png))
        results["seconds"][task] = time.monotonic() - start
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    results["files"].append(str(path))
    return results


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"k3 eval: {results['model']}")
    for col, justify in (("task", "left"), ("metric", "left"), ("value", "right"), ("± stderr", "right"),
                         ("n", "right")):
        table.add_column(col, justify=justify)
    for task, metrics in results["tasks"].items():
        first = True
        for name, value in metrics.items():
            if name.endswith("_stderr") or name == "sample_len":
                continue
            err = metrics.get(f"{name}_stderr")
            n = str(results["n"].get(task, "")) if first else ""
            err_text = f"{err:.4f}" if isinstance(err, float) else ""
            table.add_row(task if first else "", name, f"{value:.4f}", err_text, n)
            first = False
    Console().print(table)
    for f in results["files"]:
        print(f"wrote {f}")
