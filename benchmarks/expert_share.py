"""How much of a trained model's prediction its routed experts carry, and what MXFP4 rounding of their weights
costs: held-out loss with the experts as trained, with W1, W2, W3 rounded to MXFP4 (every scale mode, as an export
without QAT would), and with the routed experts' output removed (W2 zeroed). An export gap can only be as large
as what the experts carry; this is the measurement behind docs/qat.md's reading of the QAT benchmark.

    python benchmarks/expert_share.py --run runs/tiny [--run …] [--text FILE] [--tokens N] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.checkpoint import load_trained  # noqa: E402
from k3.model.moe import LatentExperts  # noqa: E402
from k3.ops.qat import fake_quantize_weight  # noqa: E402

MODES = ("floor", "ceil", "even", "rceil")
WEIGHTS = ("w1", "w2", "w3")


def default_text() -> Path:
    # the standard library's json tests: `k3 train` skips test folders, so no run has read them
    return Path(sysconfig.get_paths()["stdlib"]) / "test" / "test_json"


def read_text(path: Path) -> str:
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return "\n".join(f.read_text(errors="replace") for f in files)


@torch.no_grad()
def heldout_loss(model, ids: torch.Tensor, row: int) -> float:
    """Mean next-token loss over rows of `row` tokens."""
    rows = ids[: ids.numel() // row * row].view(-1, row)
    total, count = 0.0, 0
    for r in rows.split(4):
        logits = model(r[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), r[:, 1:].reshape(-1), reduction="sum").item()
        count += r[:, 1:].numel()
    return total / count


def measure(run: Path, text: str, tokens: int, row: int) -> dict:
    model, tokenizer, ckpt = load_trained(run)
    ids = torch.tensor(tokenizer.encode(text)[:tokens])
    if ids.numel() < row:
        raise SystemExit(f"the held-out text gives {ids.numel()} tokens, fewer than one row of {row}")
    experts = [m for m in model.modules() if isinstance(m, LatentExperts)]
    if not experts:
        raise SystemExit(f"{run} has no routed experts")
    trained = {id(e): {n: getattr(e, n).detach().clone() for n in WEIGHTS} for e in experts}

    def set_experts(fn) -> None:
        for e in experts:
            for n in WEIGHTS:
                getattr(e, n).data.copy_(fn(n, trained[id(e)][n]))

    result = {"run": str(run), "checkpoint": ckpt.name, "tokens": int(ids.numel()),
              "trained": heldout_loss(model, ids, row)}
    for mode in MODES:
        set_experts(lambda n, w: fake_quantize_weight(w, mode))
        result[f"mxfp4_{mode}"] = heldout_loss(model, ids, row)
    set_experts(lambda n, w: torch.zeros_like(w) if n == "w2" else w)
    result["no_routed_experts"] = heldout_loss(model, ids, row)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, action="append", required=True, help="a trained run or checkpoint (repeat)")
    p.add_argument("--text", type=Path, default=default_text(), help="held-out text: a file or a folder of .py")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens (at most)")
    p.add_argument("--row", type=int, default=1024, help="tokens per row")
    p.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    text = read_text(args.text)
    results = [measure(run, text, args.tokens, args.row) for run in args.run]
    rows = []
    for r in results:
        t = r["trained"]
        worst = max(r[f"mxfp4_{m}"] for m in MODES) - t
        rows.append([r["run"], r["checkpoint"], round(t, 4), *(round(r[f"mxfp4_{m}"] - t, 4) for m in MODES),
                     round(r["no_routed_experts"] - t, 4),
                     f"{worst / (r['no_routed_experts'] - t):.1%}" if r["no_routed_experts"] > t else "—"])
    columns = ["run", "checkpoint", "held-out loss", *(f"MXFP4 {m} − trained" for m in MODES),
               "no routed experts − trained", "worst MXFP4 cost / routed experts' share"]
    note = (f"nats per token over the first {results[0]['tokens']} tokens of {args.text} (rows of {args.row}); "
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
