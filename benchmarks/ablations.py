"""The K3 report's design claims at the debug scale: `k3 ablate NAME` for each of the seven ablations, gathered into
benchmarks/results/ablations-cpu.json (one table per ablation and a summary) and docs/figures/ablations/NAME.png.

    OMP_NUM_THREADS=1 python benchmarks/ablations.py                    # all seven, their default steps, 3 seeds
    python benchmarks/ablations.py --names attn-res,situ --steps 100    # some of them
    python benchmarks/ablations.py --collect                            # tables from the runs already in --out

Each ablation trains every arm for `--seeds` seeds on the standard library corpus (`k3.eval.ablate`); its JSON and
PNG stay in --out (runs/ablations), the tables are rebuilt from every NAME-PRESET.json found there. Nothing is a
benchmark of speed: the numbers are losses, load imbalance and activations, the verdict their direction against
the report's claim (docs/ablations.md). Decode times (hybrid-ratio) are of the reference path on this CPU.
Ablations with no run in --out keep what the results file already holds (their tables, and their summary rows
rebuilt from its raw numbers), so running a few of them updates those and leaves the others.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import RESULTS, ROOT, save_result, table  # noqa: E402

from k3.eval.ablate import ABLATIONS, SUMMARY, run_ablation, verdict  # noqa: E402

FIGURES = ROOT / "docs" / "figures" / "ablations"
SHOWN = ("heldout_loss", "train_loss", "max_vio", "max_vio_step5", "act_max", "spikes", "max_grad_norm")


def fmt(s: dict) -> str:
    return f"{s['mean']:.4g} ± {s['std']:.2g}"


def ablation_table(result: dict) -> dict:
    arms = result["arms"]
    rows = [[key + (" (claim)" if key == result["metric"] else ""), *[fmt(a["summary"][key]) for a in arms]]
            for key in SHOWN if key in SUMMARY]
    if arms[0].get("decode_ms"):
        for n in arms[0]["decode_ms"]:
            rows.append([f"decode ms/token at {n} tokens", *[round(a["decode_ms"][n], 2) for a in arms]])
        rows.append(["MLA cache bytes/token (bf16)", *[a["cache_bytes_per_token"] for a in arms]])
    note = (f"{result['preset']} preset, {result['steps']} steps of {result['tokens_per_step']} tokens "
            f"(sequences of {result['seq_len']}), lr {result['lr']:g}, {result['seeds']} seeds, mean ± std")
    return table(["measure", *[a["label"] for a in arms]], rows, note)


def summary_table(results: list[dict]) -> dict:
    rows = []
    for r in results:
        for line in r["verdict"]["against"]:
            rows.append([r["ablation"], f"{r['arms'][0]['label']} vs {line['baseline']}", r["metric"],
                         round(line["k3"], 4), round(line["baseline_value"], 4), round(line["noise"], 4),
                         line["verdict"]])
    return table(["ablation", "arms", "measure (lower is better)", "K3 choice", "baseline", "seed spread",
                  "direction vs the report"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--names", default=",".join(ABLATIONS), help="comma-separated (default: all)")
    p.add_argument("--preset", default="debug")
    p.add_argument("--steps", type=int, help="steps per run (default: each ablation's own)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "ablations")
    p.add_argument("--collect", action="store_true", help="only rebuild the tables from the runs in --out")
    args = p.parse_args()
    names = [n for n in args.names.split(",") if n]
    if not args.collect:
        for name in names:
            result = run_ablation(name, args.preset, args.steps, args.seeds, args.out)
            print(name, [(line["baseline"], line["verdict"]) for line in result["verdict"]["against"]])
    results = [json.loads((args.out / f"{n}-{args.preset}.json").read_text()) for n in ABLATIONS
               if (args.out / f"{n}-{args.preset}.json").exists()]
    if not results:
        raise SystemExit(f"no ablation results in {args.out}")
    FIGURES.mkdir(parents=True, exist_ok=True)
    for r in results:
        shutil.copy(args.out / f"{r['ablation']}-{args.preset}.png", FIGURES / f"{r['ablation']}.png")
    raw = stored_raw() | {r["ablation"]: raw_entry(r) for r in results}
    raw = {n: raw[n] for n in ABLATIONS if n in raw}
    tables = {r["ablation"]: ablation_table(r) for r in results} | {"summary": summary_table(
        [from_raw(n, entry) for n, entry in raw.items()])}
    # the tables hold every run in --out: the command that reproduces them all
    steps = f" --steps {args.steps}" if args.steps else ""
    save_result("ablations", "The K3 report's design choices against the baselines they replaced, each trained at the "
                "debug preset on the standard library corpus for several seeds (k3 ablate)", tables, raw=raw,
                slug="cpu", command=f"OMP_NUM_THREADS=1 python benchmarks/ablations.py{steps} --seeds {args.seeds}")


def raw_entry(result: dict) -> dict:
    """What the results file keeps of one ablation: enough to rebuild its summary rows."""
    keep = ("claim", "fields", "metric", "preset", "steps", "seeds", "tokens_per_step", "seq_len", "lr")
    arms = [{"label": a["label"], "summary": a["summary"]}
            | {k: a[k] for k in ("decode_ms", "cache_bytes_per_token") if k in a} for a in result["arms"]]
    return {k: result[k] for k in keep if k in result} | {"arms": arms}


def stored_raw() -> dict:
    path = Path(os.environ.get("K3_RESULTS") or RESULTS) / "ablations-cpu.json"
    return json.loads(path.read_text()).get("raw", {}) if path.exists() else {}


def from_raw(name: str, entry: dict) -> dict:
    """A result as `summary_table` reads it, from a raw entry (older entries lack the metric: the ablation's)."""
    result = {"ablation": name, "metric": entry.get("metric", ABLATIONS[name].metric), "arms": entry["arms"]}
    return result | {"verdict": verdict(result)}


if __name__ == "__main__":
    main()
