"""`k3 eval MODEL --tasks …` and `k3 ablate NAME`: thin front ends over `k3.eval.suite` and `k3.eval.ablate`.
`k3.cli` wires them in with `add_eval_parser(sub)` and `add_ablate_parser(sub)`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
    return parse


def cmd_eval(args: argparse.Namespace) -> int:
    """Exit 0 done, 1 the server failed or could not be reached, 2 bad arguments (k3.cli's ValueError)."""
    from k3.eval.client import ServerError

    try:
        return _eval(args)
    except ServerError as e:
        print(f"k3 eval: error: {e}", file=sys.stderr)
        return 1


def _eval(args: argparse.Namespace) -> int:
    from k3.eval.endpoint import is_url, open_endpoint
    from k3.eval.suite import EvalOptions, print_table, run_suite

    options = EvalOptions(
        limit=args.limit, num_fewshot=args.num_fewshot, include_path=args.include_path,
        num_concurrent=args.num_concurrent, batch_size=args.batch_size, seed=args.seed, samples=args.samples,
        ks=args.k or (1,), temperature=args.temperature, max_tokens=args.max_tokens, executor=args.executor,
        timeout=args.timeout, lengths=args.lengths, max_length=args.max_length, depths=args.depths,
        probes_per_cell=args.probes_per_cell, haystack=args.haystack or [], text=args.text or [], window=args.window,
        ppl_tokens=args.ppl_tokens or None)
    tasks = [t for t in args.tasks.split(",") if t]
    engine = {"max_context": args.max_context} if args.max_context else None
    with open_endpoint(args.model, args.api_key, args.device, engine) as endpoint:
        if args.out:
            out = Path(args.out)
        elif not is_url(args.model) and (Path(args.model) / "run.json").exists():
            out = Path(args.model) / "eval"
        else:
            out = Path("eval") / endpoint.model_name
        results = run_suite(endpoint, tasks, options, out, args.model)
    print_table(results)
    return 0


def add_eval_parser(sub) -> None:
    from k3.eval.suite import DEFAULT_TASKS

    p = sub.add_parser("eval", help="evaluate a run, checkpoint or served URL (lm-eval tasks, HumanEval, "
                                    "long-context retrieval, perplexity)",
                       epilog="Tasks: humaneval, passkey, needle, perplexity, or lm-eval tasks (bundled: "
                              "k3_python_mc, k3_python_cloze, k3_arithmetic; --include-path for your own YAML). "
                              "Results: OUT/results.json, heat maps and plots beside it; see docs/evaluation.md.")
    p.add_argument("model", help="a served URL (http://host:port), a run folder, a checkpoint folder, or preset:NAME")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help=f"comma-separated (default {','.join(DEFAULT_TASKS)})")
    p.add_argument("--out", help="results folder (default RUN/eval for a run folder, else eval/MODEL_NAME)")
    p.add_argument("--api-key", help="for a URL that needs one")
    p.add_argument("--device", default="cpu", help="where a local model runs (default cpu)")
    p.add_argument("--max-context", type=int, help="engine context limit for a local model (default: what fits)")
    p.add_argument("--limit", type=int, help="items per task (lm-eval tasks, HumanEval problems)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--include-path", help="a folder of lm-eval task YAML")
    p.add_argument("--num-concurrent", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per log-likelihood request (default 16)")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("humaneval")
    g.add_argument("--samples", type=int, default=1, help="completions per problem (default 1: greedy)")
    g.add_argument("--k", type=_csv(int), help="pass@k for these k (default 1)")
    g.add_argument("--temperature", type=float, help="default 0 for one sample, 0.8 for more")
    g.add_argument("--max-tokens", type=int, default=512, help="completion budget (default 512)")
    g.add_argument("--executor", choices=["auto", "sandbox", "subprocess"], default="auto",
                   help="where programs run (default auto: the sandbox where it can run)")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds per program (default 10)")
    g = p.add_argument_group("passkey / needle")
    g.add_argument("--lengths", type=_csv(int),
                   help="prompt lengths in tokens (default 1024, 2048, … up to the context)")
    g.add_argument("--max-length", type=int, help="cap of the default lengths")
    g.add_argument("--depths", type=_csv(float), default=(0.0, 0.25, 0.5, 0.75, 1.0))
    g.add_argument("--probes-per-cell", type=int, default=3)
    g.add_argument("--haystack", nargs="+", help="needle haystack files (default: this Python's stdlib sources)")
    g = p.add_argument_group("perplexity")
    g.add_argument("--text", nargs="+", help="held-out text/JSONL/Parquet files (default: a run's held-out split)")
    g.add_argument("--window", type=int, help="tokens per scored window (default min(context, 4096))")
    g.add_argument("--ppl-tokens", type=int, default=100_000, help="tokens scored in all (0: all; default 100000)")
    p.set_defaults(func=cmd_eval)


def cmd_ablate(args: argparse.Namespace) -> int:
    from k3.eval.ablate import ABLATIONS, print_ablation, run_ablation

    if args.name == "list":
        for name, a in ABLATIONS.items():
            print(f"{name:20s} {a.claim}")
        return 0
    result = run_ablation(args.name, preset=args.preset, steps=args.steps, seeds=args.seeds, out=Path(args.out),
                          device=args.device, data=args.data, progress=not args.quiet, eval_tokens=args.eval_tokens)
    print_ablation(result)
    return 0


def add_ablate_parser(sub) -> None:
    from k3.eval.ablate import ABLATIONS

    p = sub.add_parser("ablate", help="reproduce one K3 design claim at small scale (`k3 ablate list`)",
                       epilog="Each ablation trains the K3 choice and its baseline on the same data, tokens and "
                              "hyperparameters for several seeds, then prints a table (mean ± spread) and writes "
                              "OUT/NAME.json and OUT/NAME.png; see docs/ablations.md.")
    p.add_argument("name", choices=[*ABLATIONS, "list"])
    p.add_argument("--preset", default="debug", help="model size (default debug, as the documented runs)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: the ablation's)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm (default 3)")
    p.add_argument("--out", default="ablations", help="results folder (default ./ablations)")
    p.add_argument("--data", help="training text: a file or folder (default: this Python's standard library sources)")
    p.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens scored per run (default 32768)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_ablate)

