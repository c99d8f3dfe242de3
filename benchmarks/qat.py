"""QAT closes the MXFP4 export gap: an SFT run trained in the working precision and then exported with MXFP4 experts,
against the same SFT run with QAT (MXFP4 expert weights, MXFP8 inputs) from its first step and then exported; and
what QAT costs per training step. CPU. Writes benchmarks/results/qat-<device>.json.

    python benchmarks/qat.py                                   # base: runs/tiny if `make demo` finished it
    python benchmarks/qat.py --base RUN --work DIR --sft-steps 150

1. base: `--base`, else runs/tiny when it holds a finished run, else `k3 train --preset tiny --max-steps 171` (the
   `make demo` run's length, fixed so the result does not depend on the machine's speed);
2. `k3 data make-sft`, and a QAT copy of the base checkpoint: the same weights and run settings, its config.json with
   `qat: mxfp4` (the run's scale mode, default rceil);
3. `k3 sft` from each, the same steps, data and seed (their step times: the overhead as trained);
4. held-out loss of each SFT model on the SFT held-out conversations (`k3.train.loop.evaluate`, fp32 compute) as
   trained, and after `k3 convert to-release --mxfp4` loaded back with k3 (MXFP4 experts, the other weights bf16 as
   the release stores them); the working-precision run also after an export in each scale mode;
5. the overhead in isolation: forward + backward of one SFT batch with QAT off and on, interleaved, median of N.
Correctness gate first: the QAT run's export decodes to exactly the expert weights its forward used.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import ROOT, save_result, table  # noqa: E402

MODES = ("floor", "ceil", "even", "rceil")


def run(cmd: list[str], log: Path) -> float:
    """Run a k3 command (its output appended to `log`); returns its wall seconds. Raises on failure."""
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "a") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{cmd[1]} failed with exit code {done.returncode}; see {log}")
    return time.perf_counter() - start


def finished(run_dir: Path) -> bool:
    return (run_dir / "run.json").exists() and any((run_dir / "checkpoints").glob("step_*/COMMITTED"))


def qat_copy(base: Path, out: Path, mode: str) -> Path:
    """`base`'s newest checkpoint with QAT on in its config.json, as a run folder of its own (run.json copied, so
    `k3 sft` takes the same preset and context from it)."""
    from k3.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
    from k3.config import ModelConfig

    ckpt = resolve_checkpoint(base)
    tensors, _ = load_checkpoint(ckpt)
    config = ModelConfig.load(ckpt / "config.json").replace(qat="mxfp4", qat_scale_mode=mode)
    out.mkdir(parents=True, exist_ok=True)
    if (ckpt.parent.parent / "run.json").is_file():
        shutil.copyfile(ckpt.parent.parent / "run.json", out / "run.json")
    return save_checkpoint(out / "checkpoints", 0, tensors, {"step": 0, "tokens": 0, "source": str(ckpt.resolve())},
                           extra_files={"config.json": json.dumps(config.to_config_json(), indent=2)},
                           extra_dirs={"tokenizer": ckpt / "tokenizer"})


def heldout_loss(model, sft_run: Path, max_tokens: int) -> dict:
    """Mean loss per target token on the SFT run's held-out conversations (its prepared corpus), fp32 on the CPU."""
    import torch

    from k3.train.data import TokenizedCorpus
    from k3.train.loop import evaluate

    seq_len = json.loads((sft_run / "run.json").read_text())["train_config"]["stages"][-1]["seq_len"]
    with torch.no_grad():
        return evaluate(model.float().eval(), TokenizedCorpus.open(sft_run / "data" / "heldout"), seq_len, max_tokens,
                        torch.device("cpu"))


def step_seconds(sft_run: Path) -> float:
    """Median wall time of the run's optimizer steps (tokens per step / tokens per second), the first 3 left out."""
    records = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train" and not r.get("skipped")]
    return statistics.median(r["tokens"] / r["tokens_per_s"] for r in train[3:])


def isolated_overhead(config, sft_run: Path, repeats: int) -> tuple[float, float]:
    """Median seconds of forward + backward on one batch of the run's data, QAT off and on, interleaved."""
    from k3.model.model import build_model
    from k3.train.data import PackedBatches, TokenizedCorpus

    seq_len = json.loads((sft_run / "run.json").read_text())["train_config"]["stages"][-1]["seq_len"]
    batch = next(iter(PackedBatches.eval(TokenizedCorpus.open(sft_run / "data" / "heldout"), 2, seq_len)))
    models = {qat: build_model(config.replace(qat=qat), seed=0) for qat in ("none", "mxfp4")}
    times: dict[str, list[float]] = {qat: [] for qat in models}
    for i in range(repeats + 1):
        for qat, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model(batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels).loss.backward()
            if i:  # the first round warms up
                times[qat].append(time.perf_counter() - start)
    return statistics.median(times["none"]), statistics.median(times["mxfp4"])


def check_export_is_exact(run_dir: Path, release: Path) -> None:
    """The gate: every routed-expert weight of the export decodes to the QAT forward's dequantized weight."""
    import torch

    from k3.checkpoint import load_trained
    from k3.convert.release import load_release
    from k3.ops.mx import mx_fake_quantize

    trained, _, _ = load_trained(run_dir)
    loaded = dict(load_release(release).model.named_parameters())
    mode = trained.config.qat_scale_mode
    for name, p in trained.named_parameters():
        if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
            want = mx_fake_quantize(p.detach(), "e2m1", 32, mode).to(torch.bfloat16)
            if not torch.equal(loaded[name], want):
                raise SystemExit(f"correctness gate: {name} of the export differs from the QAT forward's weights")
    print("gate: the QAT export decodes to exactly the weights its forward used")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, help="a finished pre-training run (default runs/tiny, else trained)")
    p.add_argument("--work", type=Path, default=Path("/tmp/k3-qat"), help="where the runs go")
    p.add_argument("--base-steps", type=int, default=171, help="steps of the base run when one is trained here")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--scale-mode", default="rceil", choices=MODES, help="the QAT run's scale mode")
    p.add_argument("--eval-tokens", type=int, default=65536, help="held-out target tokens per evaluation (at most)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of the isolated overhead measurement")
    p.add_argument("--sft-problems", type=int, default=1200, help="problems of the generated SFT set (3 efforts each)")
    args = p.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    k3 = str(Path(sys.executable).parent / "k3")

    base = args.base or ROOT / "runs" / "tiny"
    if not finished(base):
        base = work / "base"
        run([k3, "train", "--preset", "tiny", "--out", str(base), "--max-steps", str(args.base_steps),
             "--auto-resume"], log)
    if not (work / "sft.jsonl").exists():
        run([k3, "data", "make-sft", "--out", str(work / "sft.jsonl"), "--problems", str(args.sft_problems)], log)
    base_qat = work / "base-qat"
    if not finished(base_qat):
        shutil.rmtree(base_qat, ignore_errors=True)
        qat_copy(base, base_qat, args.scale_mode)
    runs = {"bf16": work / "sft-bf16", "qat": work / "sft-qat"}
    for name, source in (("bf16", base), ("qat", base_qat)):
        run([k3, "sft", "--from", str(source), "--data", str(work / "sft.jsonl"), "--out", str(runs[name]),
             "--max-steps", str(args.sft_steps), "--seed", "0", "--eval-every", str(args.sft_steps), "--auto-resume"], log)
        shutil.rmtree(work / f"release-{name}", ignore_errors=True)
        run([k3, "convert", "to-release", str(runs[name]), str(work / f"release-{name}"), "--mxfp4"], log)
    check_export_is_exact(runs["qat"], work / "release-qat")

    from k3.checkpoint import load_trained
    from k3.convert.release import load_release, save_release

    heldout = runs["bf16"]  # both runs split the same conversations with the same seed
    losses: dict[str, dict[str, float]] = {}
    for name, run_dir in runs.items():
        trained, _, _ = load_trained(run_dir)
        losses[name] = {"trained": heldout_loss(trained, heldout, args.eval_tokens)["loss"],
                        "export": heldout_loss(load_release(work / f"release-{name}").model, heldout,
                                               args.eval_tokens)["loss"]}
        print(name, losses[name], flush=True)
    trained_bf16, _, _ = load_trained(runs["bf16"])
    by_mode: dict[str, float] = {}
    for mode in MODES:
        out = work / f"release-bf16-{mode}"
        save_release(trained_bf16, out, mxfp4=True, scale_mode=mode)
        by_mode[mode] = heldout_loss(load_release(out).model, heldout, args.eval_tokens)["loss"]
        shutil.rmtree(out)
    print("bf16 run exported per scale mode:", by_mode, flush=True)

    a, b = losses["bf16"], losses["qat"]
    mode = args.scale_mode
    # the share of the export's loss gap (to the working-precision model as trained) that QAT removes, against the
    # working-precision run exported in the same scale mode, and in the converter's default (floor); None where the
    # export opens no gap (≤ 0.001 nats): then there is nothing to close and the claim is not shown
    def share_closed(export_loss: float) -> float | None:
        gap = export_loss - a["trained"]
        return 1 - (b["export"] - a["trained"]) / gap if gap > 1e-3 else None

    closed, closed_floor = share_closed(by_mode[mode]), share_closed(by_mode["floor"])
    steps = {name: step_seconds(run_dir) for name, run_dir in runs.items()}
    iso_off, iso_on = isolated_overhead(trained_bf16.config.replace(qat_scale_mode=mode), heldout, args.repeats)
    print(f"gap closed {closed} ({closed_floor} vs floor); step s {steps}; isolated fwd+bwd s "
          f"{iso_off:.3f} / {iso_on:.3f}", flush=True)

    def pct(x: float | None) -> str:
        return "no gap to close" if x is None else f"{x:.0%}"

    rows = []
    for m in MODES:  # the step times once, on the default export's row
        times = [round(steps["bf16"], 2), round(iso_off, 3)] if m == "floor" else [None, None]
        rows.append(["working precision", m + (" (default)" if m == "floor" else ""), round(a["trained"], 4),
                     round(by_mode[m], 4), round(by_mode[m] - a["trained"], 4), *times])
    rows.append([f"QAT ({mode})", mode, round(b["trained"], 4), round(b["export"], 4),
                 round(b["export"] - b["trained"], 4), round(steps["qat"], 2), round(iso_on, 3)])
    note = (f"{args.sft_steps} SFT steps each from the base run {base}; share of the export's gap to the "
            f"working-precision model as trained that QAT closes: {pct(closed)} ({mode}), {pct(closed_floor)} (the "
            f"default floor export's); QAT costs "
            f"{steps['qat'] / steps['bf16']:.2f}× per SFT step as trained, {iso_on / iso_off:.2f}× per forward + "
            "backward in isolation; the QAT row's own difference is the bf16 storage of the non-expert weights")
    save_result("qat", "QAT closes most of the held-out loss gap an MXFP4 export opens; its step overhead", {
        "qat": table(["SFT run", "MXFP4 export scales", "held-out loss as trained", "after export",
                      "export − trained", "SFT step s", "fwd + bwd s (isolated)"], rows, note=note),
    }, raw={"losses": losses, "by_mode": by_mode, "gap_closed": closed, "gap_closed_vs_floor": closed_floor,
            "step_s": steps, "isolated_s": [iso_off, iso_on], "base": str(base), "sft_steps": args.sft_steps})
    if closed is None:
        raise SystemExit(f"claim not shown: the {mode} export opens no gap to close ({a}, {by_mode})")
    if not closed > 0.5:
        raise SystemExit(f"claim failed: QAT closed {closed:.0%} of the export gap (needs most of it)")


if __name__ == "__main__":
    main()
