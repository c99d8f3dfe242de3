"""`k3 eval` on the `make demo` model after a long-context stage: where passkey and needle retrieval hold, the
held-out loss by position, the bundled lm-eval tasks and HumanEval; written to benchmarks/results/eval-cpu.json
and docs/figures/eval/.

    make demo                                   # runs/tiny: the tiny preset, 8 minutes at 256 then 512 tokens
    python benchmarks/eval.py --train           # runs/eval-long: a 2,048-token stage from runs/tiny's checkpoint
    python benchmarks/eval.py                   # evaluate runs/eval-long (the gate first) and runs/tiny, write
    python benchmarks/eval.py --quick           # a few items per task (smoke)

The long-context stage is `k3 train`'s loop started from the base run's last checkpoint (`TrainConfig.init_from`:
its weights, config and tokenizer; a fresh optimizer) on the same corpus, `--steps` steps (default 60) of 2,048
tokens, one sequence of `--seq-len` (2,048) each, learning rate `--lr` (3e-3: half the tiny preset's peak, warm-up
and cosine decay as in every run). The gate, before anything is reported: lm-eval's log-likelihoods of
k3_python_mc through the server equal k3's in-process scoring of the same requests (`InProcessLM`). The base run
is evaluated too on passkey, needle and the same held-out text, so the tables show what the stage changed.
Sized for a shared 2-core CPU: probes of 1K, 2K and 4K tokens at five depths, 2 keys per cell; 50,000 held-out
tokens in windows of 4,096; HumanEval's 164 problems, greedy, completions of at most 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import ROOT, save_result, table  # noqa: E402

BASE = ROOT / "runs" / "tiny"
RUN = ROOT / "runs" / "eval-long"
FIGURES = ROOT / "docs" / "figures" / "eval"
LONG_TASKS = ("passkey", "needle", "perplexity")


def train(base: Path, run: Path, steps: int, seq_len: int, lr: float) -> None:
    from k3.train.config import ContextStage, TrainConfig
    from k3.train.loop import train as train_loop

    if not (base / "checkpoints").is_dir():
        raise SystemExit(f"{base} has no checkpoints: run `make demo` first (or pass --base RUN)")
    cfg = TrainConfig(preset="tiny", out=str(run), init_from=str(base), max_steps=steps, lr=lr,
                      stages=[ContextStage(seq_len, 1.0)], tokens_per_step=seq_len, eval_every=steps // 2,
                      checkpoint_every=steps // 2)
    summary = train_loop(cfg, resume="auto")
    print(f"trained {summary.steps} steps at {seq_len} tokens, held-out loss {summary.final_eval_loss:.3f}")


def gate(endpoint, limit: int | None) -> dict:
    """lm-eval through the server against in-process scoring, item by item."""
    import lm_eval

    from k3.eval.harness import lm_class, run_lm_eval, task_manager

    served = run_lm_eval(endpoint, ["k3_python_mc"], limit=limit, log_samples=True)
    local = lm_eval.simple_evaluate(model=lm_class()(endpoint.model, endpoint.tokenizer), tasks=["k3_python_mc"],
                                    task_manager=task_manager(defaults=False), limit=limit, log_samples=True,
                                    bootstrap_iters=0)
    a = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in served["samples"]["k3_python_mc"]}
    b = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in local["samples"]["k3_python_mc"]}
    worst = max(abs(x - y) for d in a for x, y in zip(a[d], b[d]))
    acc_served = served["results"]["k3_python_mc"]["acc"]
    acc_local = local["results"]["k3_python_mc"]["acc,none"]
    if worst > 1e-3 or abs(acc_served - acc_local) > 1e-9:
        raise SystemExit(f"gate failed: server acc {acc_served} vs in-process {acc_local}, max |Δ ll| {worst}")
    return {"acc_served": acc_served, "acc_in_process": acc_local, "max_abs_ll_diff": worst, "items": len(a)}


def heldout_jsonl(run: Path, out: Path) -> Path:
    """The run's held-out split as JSONL, so a model without that folder (the base run) scores the same text."""
    from k3.eval.perplexity import documents
    from k3.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(run / "tokenizer")
    path = out / "heldout.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for _, text in documents(None, str(run), tokenizer)))
    return path


def retrieval_table(r: dict) -> dict:
    return table(["depth", *[f"{n:,} tokens" for n in r["lengths"]]],
                 [[f"{d:.0%}", *[round(v, 2) for v in row]] for d, row in zip(r["depths"], r["accuracy"])],
                 note=f"accuracy, {r['samples']} keys per cell, greedy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, default=BASE, help="the finished short-context run (default runs/tiny)")
    p.add_argument("--run", type=Path, default=RUN, help="the long-context run (default runs/eval-long)")
    p.add_argument("--train", action="store_true", help="train the long-context stage (continues it if it exists)")
    p.add_argument("--steps", type=int, default=60, help="long-context steps (default 60)")
    p.add_argument("--seq-len", type=int, default=2048, help="long-context sequence length (default 2048)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the stage (default 3e-3)")
    p.add_argument("--skip-base", action="store_true", help="evaluate the long-context run only")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.train:
        train(args.base, args.run, args.steps, args.seq_len, args.lr)
        return
    from k3.eval.endpoint import open_endpoint
    from k3.eval.suite import EvalOptions, run_suite

    quick = args.quick
    lengths = (1024,) if quick else (1024, 2048, 4096)
    options = EvalOptions(limit=4 if quick else None, lengths=lengths, probes_per_cell=1 if quick else 2,
                          ppl_tokens=5000 if quick else 50_000, window=max(lengths), max_tokens=64 if quick else 128,
                          num_concurrent=4)
    tasks = ["k3_python_mc", "k3_python_cloze", "k3_arithmetic", "humaneval", *LONG_TASKS]
    out = args.run / "eval"
    engine = {"max_context": max(lengths) + 64}
    options.text = [str(heldout_jsonl(args.run, out))]
    with open_endpoint(str(args.run), engine_options=engine) as endpoint:
        checked = gate(endpoint, 8 if quick else None)
        results = run_suite(endpoint, tasks, options, out, str(args.run))
    base = None
    if not args.skip_base:
        with open_endpoint(str(args.base), engine_options=engine) as endpoint:
            base = run_suite(endpoint, list(LONG_TASKS), options, args.run / "eval-base", str(args.base))
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name in ("passkey.png", "needle.png", "perplexity_by_position.png"):
        shutil.copy(out / name, FIGURES / name)

    rows = []
    for task, metrics in results["tasks"].items():
        for name, value in metrics.items():
            if not name.endswith("_stderr") and name != "sample_len" and not name.startswith("accuracy@"):
                err = metrics.get(f"{name}_stderr")
                rows.append([task, name, round(value, 4), round(err, 4) if err is not None else None,
                             results["n"].get(task)])
    run_info = json.loads((args.run / "run.json").read_text())
    stage = run_info["train_config"]
    tables = {"tasks": table(["task", "metric", "value", "± stderr", "n"], rows,
                             note=f"the tiny preset ({args.base.name}, 256 → 512 tokens) after a long-context stage "
                                  f"of {run_info['total_steps']} steps at {stage['stages'][0]['seq_len']} tokens")}
    for kind in ("passkey", "needle"):
        tables[kind] = retrieval_table(results["details"][kind])
        if base is not None:
            tables[f"{kind}-base"] = retrieval_table(base["details"][kind])
    h = results["details"]["humaneval"]
    completions = [s["completion"] for p in h["per_problem"] for s in p["samples"]]
    tables["humaneval"] = table(
        ["problems", "samples per problem", "pass@1", "empty completions", "executor"],
        [[h["problems"], h["samples_per_problem"], round(h["metrics"]["pass@1"], 4),
          sum(not c.strip() for c in completions), h["executor"]]],
        note=f"greedy, at most {options.max_tokens} tokens, cut at the Codex paper's stop sequences")
    ppl = results["details"]["perplexity"]
    columns = ["positions", "tokens", "nats/token after the stage"]
    by_base = {b["from"]: b for b in base["details"]["perplexity"]["by_position"]} if base is not None else {}
    if base is not None:
        columns.append("nats/token before")
    tables["by-position"] = table(
        columns,
        [[f"{b['from']}–{b['to'] - 1}", b["tokens"], round(b["nats_per_token"], 4)]
         + ([round(by_base[b["from"]]["nats_per_token"], 4)] if base is not None else [])
         for b in ppl["by_position"] if b["tokens"]],
        note=f"the long-context run's held-out split, {ppl['tokens']:,} tokens in windows of {ppl['window']}")
    tables["gate"] = table(["items", "acc through the server", "acc in process", "max |Δ log-likelihood|"],
                           [[checked["items"], checked["acc_served"], checked["acc_in_process"],
                             f"{checked['max_abs_ll_diff']:.2e}"]])
    raw = {"results": {k: v for k, v in results.items() if k != "details"}}
    if base is not None:
        raw["base"] = {k: v for k, v in base.items() if k != "details"}
    save_result("eval", "k3 eval on the make-demo-sized (tiny) model after a long-context stage: lm-eval through the "
                "server, HumanEval in the sandbox, passkey and needle retrieval by length and depth, held-out loss "
                "by position", tables, raw=raw, slug="cpu")


if __name__ == "__main__":
    main()
