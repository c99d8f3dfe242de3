"""How much of a trained model's prediction its routed experts carry, and what MXFP4 rounding of their weights
costs: the run's held-out loss (what `k3 train` reports, `k3.train.loop.evaluate` on its held-out corpus) with the
experts as trained, with W1, W2, W3 rounded to MXFP4 (every scale mode, as an export without QAT would), and with
the routed experts' output removed (W2 zeroed). An export gap can only be as large as what the experts carry; this
is the measurement behind docs/qat.md's reading of the QAT benchmark.

    python benchmarks/expert_share.py --run runs/tiny [--run …] [--tokens N] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.checkpoint import load_trained  # noqa: E402
from k3.model.moe import LatentExperts  # noqa: E402
from k3.ops.qat import fake_quantize_weight  # noqa: E402
from k3.train.data import TokenizedCorpus  # noqa: E402
from k3.train.loop import evaluate  # noqa: E402

MODES = ("floor", "ceil", "even", "rceil")
WEIGHTS = ("w1", "w2", "w3")


def measure(run: Path, tokens: int) -> dict:
    heldout = run / "data" / "heldout"
    if not heldout.is_dir():
        raise SystemExit(f"{run} has no held-out corpus ({heldout}): pass a `k3 train` run folder")
    model, _, ckpt = load_trained(run)
    model = model.float()
    corpus = TokenizedCorpus.open(heldout)
    seq_len = json.loads((run / "run.json").read_text())["train_config"]["stages"][-1]["seq_len"]
    experts = [m for m in model.modules() if isinstance(m, LatentExperts)]
    if not experts:
        raise SystemExit(f"{run} has no routed experts")
    trained = {id(e): {n: getattr(e, n).detach().clone() for n in WEIGHTS} for e in experts}

    def loss(fn) -> dict:
        for e in experts:
            for n in WEIGHTS:
                getattr(e, n).data.copy_(fn(n, trained[id(e)][n]))
        return evaluate(model, corpus, seq_len, tokens, torch.device("cpu"))

    as_trained = loss(lambda n, w: w)
    result = {"run": str(run), "checkpoint": ckpt.name, "tokens": as_trained["tokens"], "trained": as_trained["loss"]}
    for mode in MODES:
        result[f"mxfp4_{mode}"] = loss(lambda n, w: fake_quantize_weight(w, mode))["loss"]
    result["no_routed_experts"] = loss(lambda n, w: torch.zeros_like(w) if n == "w2" else w)["loss"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, action="append", required=True, help="a k3 train run folder (repeat)")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens (at most)")
    p.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [measure(run, args.tokens) for run in args.run]
    rows = []
    for r in results:
        t = r["trained"]
        worst = max(r[f"mxfp4_{m}"] for m in MODES) - t
        rows.append([r["run"], r["checkpoint"], round(t, 4), *(round(r[f"mxfp4_{m}"] - t, 4) for m in MODES),
                     round(r["no_routed_experts"] - t, 4),
                     f"{worst / (r['no_routed_experts'] - t):.1%}" if r["no_routed_experts"] > t else "—"])
    columns = ["run", "checkpoint", "held-out loss", *(f"MXFP4 {m} − trained" for m in MODES),
               "no routed experts − trained", "worst MXFP4 cost / routed experts' share"]
    note = (f"held-out loss (nats per token) over the first {results[0]['tokens']} tokens of each run's held-out "
            "corpus, fp32; "
            "MXFP4: W1, W2, W3 rounded along their reduction dimension, as an export without QAT; no routed "
            "experts: W2 zeroed, so the routed path adds nothing")
    save_result("expert_share", "What the routed experts carry of a trained model's prediction, and what MXFP4 "
                "rounding of them costs", {"share": table(columns, rows, note=note)}, raw={"runs": results})
    w = max(len(c) for c in columns)
    for r in rows:
        print()
        for c, v in zip(columns, r):
            print(f"{c:>{w}}  {v}")


if __name__ == "__main__":
    main()
