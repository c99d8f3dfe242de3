"""`k3 eval` on a `make demo`-sized model after a long-context stage: where retrieval holds, the loss by position,
the bundled lm-eval tasks, HumanEval; written to benchmarks/results/eval-cpu.json and docs/figures/eval/.

    python benchmarks/eval.py --train      # train runs/eval-tiny: the tiny preset, stages 256 → 512 → 2048
    python benchmarks/eval.py              # evaluate it (the gate first), write the results
    python benchmarks/eval.py --quick      # a few items per task (smoke)

Training is `k3 train`'s loop on its default corpus and tiny settings (2,048 tokens per step, learning rate 6e-3)
for `--steps` steps (default 240, about the 8-minute `make demo` run's length) in three context stages: 70 % of the
steps at 256 tokens, 15 % at 512, 15 % at 2048. The gate, before anything is reported: lm-eval's log-likelihoods of
k3_python_mc through the server equal k3's in-process scoring of the same requests (`InProcessLM`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import ROOT, save_result, table  # noqa: E402

RUN = ROOT / "runs" / "eval-tiny"
FIGURES = ROOT / "docs" / "figures" / "eval"
STAGES = ((256, 0.7), (512, 0.15), (2048, 0.15))


def train(run: Path, steps: int) -> None:
    from k3.train.config import ContextStage, TrainConfig
    from k3.train.loop import train as train_loop

    cfg = TrainConfig(preset="tiny", out=str(run), max_steps=steps, stages=[ContextStage(n, f) for n, f in STAGES])
    summary = train_loop(cfg, resume="auto")
    print(f"trained {summary.steps} steps, held-out loss {summary.final_eval_loss:.3f}")


def gate(endpoint, limit: int | None) -> dict:
    """lm-eval through the server against in-process scoring, item by item."""
    import lm_eval

    from k3.eval.harness import lm_class, run_lm_eval, task_manager

    served = run_lm_eval(endpoint, ["k3_python_mc"], limit=limit, log_samples=True)
    local = lm_eval.simple_evaluate(model=lm_class()(endpoint.model, endpoint.tokenizer), tasks=["k3_python_mc"],
                                    task_manager=task_manager(), limit=limit, log_samples=True, bootstrap_iters=0)
    a = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in served["samples"]["k3_python_mc"]}
    b = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in local["samples"]["k3_python_mc"]}
    worst = max(abs(x - y) for d in a for x, y in zip(a[d], b[d]))
    acc_served = served["results"]["k3_python_mc"]["acc"]
    acc_local = local["results"]["k3_python_mc"]["acc,none"]
    if worst > 1e-3 or abs(acc_served - acc_local) > 1e-9:
        raise SystemExit(f"gate failed: server acc {acc_served} vs in-process {acc_local}, max |Δ ll| {worst}")
    return {"acc_served": acc_served, "acc_in_process": acc_local, "max_abs_ll_diff": worst, "items": len(a)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=RUN)
    p.add_argument("--train", action="store_true", help="train the run first (continues it if it exists)")
    p.add_argument("--steps", type=int, default=240, help="training steps (default 240)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.train:
        train(args.run, args.steps)
        return
    from k3.eval.endpoint import open_endpoint
    from k3.eval.suite import EvalOptions, run_suite

    quick = args.quick
    options = EvalOptions(limit=4 if quick else None, lengths=(1024,) if quick else (1024, 2048, 4096, 8192),
                          probes_per_cell=1 if quick else 3, ppl_tokens=5000 if quick else 100_000, window=2048,
                          max_tokens=64 if quick else 256, num_concurrent=4)
    tasks = ["k3_python_mc", "k3_python_cloze", "k3_arithmetic", "humaneval", "passkey", "needle", "perplexity"]
    out = args.run / "eval"
    with open_endpoint(str(args.run), engine_options={"max_context": 8192 + 64}) as endpoint:
        checked = gate(endpoint, 8 if quick else None)
        results = run_suite(endpoint, tasks, options, out, str(args.run))
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name in ("passkey.png", "needle.png", "perplexity_by_position.png"):
        shutil.copy(out / name, FIGURES / name)

    rows = []
    for task, metrics in results["tasks"].items():
        for name, value in metrics.items():
            if not name.endswith("_stderr") and name != "sample_len" and "@" not in name:
                err = metrics.get(f"{name}_stderr")
                rows.append([task, name, round(value, 4), round(err, 4) if err is not None else None,
                             results["n"].get(task)])
    tables = {"tasks": table(["task", "metric", "value", "± stderr", "n"], rows,
                             note=f"the tiny preset after stages {', '.join(str(n) for n, _ in STAGES)} (fractions "
                                  f"{', '.join(str(f) for _, f in STAGES)} of the steps)")}
    for kind in ("passkey", "needle"):
        r = results["details"][kind]
        tables[kind] = table(["depth", *[f"{n:,} tokens" for n in r["lengths"]]],
                             [[f"{d:.0%}", *[round(v, 2) for v in row]] for d, row in zip(r["depths"], r["accuracy"])],
                             note=f"accuracy, {r['samples']} keys per cell, greedy")
    ppl = results["details"]["perplexity"]
    tables["by-position"] = table(["positions", "tokens", "nats/token"],
                                  [[f"{b['from']}–{b['to'] - 1}", b["tokens"], round(b["nats_per_token"], 4)]
                                   for b in ppl["by_position"] if b["tokens"]],
                                  note=f"held-out split of the run, windows of {ppl['window']} tokens")
    tables["gate"] = table(["items", "acc through the server", "acc in process", "max |Δ log-likelihood|"],
                           [[checked["items"], checked["acc_served"], checked["acc_in_process"],
                             f"{checked['max_abs_ll_diff']:.2e}"]])
    save_result("eval", "k3 eval on the make-demo-sized (tiny) model after a long-context stage: lm-eval through the "
                "server, HumanEval in the sandbox, passkey and needle retrieval by length and depth, held-out loss "
                "by position", tables, raw={"results": {k: v for k, v in results.items() if k != "details"}},
                slug="cpu")


if __name__ == "__main__":
    main()
