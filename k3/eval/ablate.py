"""`k3 ablate NAME`: the K3 report's design claims, each reproduced at a CPU-affordable scale (docs/ablations.md).

An ablation pairs the K3 choice with the baseline it replaced (some with two). Every arm trains the same preset on
the same data in the same order, from the same initial weights (k3 initialises each tensor from its name and the
seed, so the arms share every tensor they have in common), with the same tokens and hyperparameters; only the
named component differs: one `ModelConfig` or `TrainConfig` field (`arm_configs`; a test checks the diff). Each
arm runs for several seeds, through the training loop's own step (`k3.train.loop.train_step`) and held-out
evaluation (`k3.train.loop.evaluate`), on the corpus `k3 train` prepares (`k3.train.loop.prepare_data`, built once
per preset and reused). The result is a table (mean ± standard deviation over seeds), a PNG, a JSON file, and a
verdict: does the direction match the report's claim, beyond seed noise or within it?

Legend of the measures: held-out loss (nats/token at the end); MaxVio = (max − mean)/mean expert load per step;
act max = the largest |SiTU/SwiGLU output| entering a dense or shared-expert down projection; spikes = steps whose
loss exceeds the previous step's by more than 0.5 nats; decode = ms per token at a long context (plain cache loop,
random weights: cost does not depend on training).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPIKE_NATS = 0.5


@dataclass(frozen=True)
class Arm:
    label: str
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields


@dataclass(frozen=True)
class Ablation:
    name: str
    fields: tuple[str, ...]  # the ModelConfig / TrainConfig fields the arms differ in, and nothing else
    claim: str  # what the K3 report says, and where
    arms: tuple[Arm, ...]  # the K3 choice first
    metric: str  # the measure the claim is about (lower is better for every one of them)
    steps: int = 100  # optimizer steps per run at the default scale (the documented runs)
    common_model: dict[str, Any] = field(default_factory=dict)  # for every arm (e.g. an implementation)
    common_train: dict[str, Any] = field(default_factory=dict)


def _one_kind(num_layers: int, kind: str) -> dict[str, Any]:
    """`linear_attn_config` layer lists with one mixer throughout: every layer Gated MLA ("mla") or KDA ("kda")."""
    layers = list(range(1, num_layers + 1))
    kda, full = ([], layers) if kind == "mla" else (layers, [])
    return {"kda_layers": kda, "full_attn_layers": full}


ABLATIONS: dict[str, Ablation] = {a.name: a for a in [
    Ablation("attn-res", ("residual",),
             "Block AttnRes reaches a lower loss than plain residuals at equal compute (K3 report §2.2)",
             (Arm("Block AttnRes"), Arm("plain residuals", model={"residual": "plain"})), "heldout_loss"),
    Ablation("quantile-balancing", ("router_balancing", "sign_update_rate"),
             "Quantile Balancing reaches balanced expert loads within a few steps, where the sign-based bias update "
             "oscillates (K3 report §2.3.3, App. C)",
             (Arm("Quantile Balancing"),
              Arm("sign, u=1e-3", train={"router_balancing": "sign", "sign_update_rate": 1e-3}),
              Arm("sign, u=1e-2", train={"router_balancing": "sign", "sign_update_rate": 1e-2})),
             "max_vio"),
    Ablation("situ", ("hidden_act",),
             "SiTU-GLU keeps activations bounded and avoids loss spikes that SwiGLU shows at a high learning rate "
             "(K3 report §2.3.2, App. B)",
             (Arm("SiTU-GLU"), Arm("SwiGLU", model={"hidden_act": "silu"})), "act_max",
             common_train={"lr": 3e-2}),
    Ablation("latent-moe-norm", ("latent_moe_use_norm",),
             "Stable LatentMoE's latent RMSNorm (removing the scale of the routed sum) trains more stably and to a "
             "lower loss than the LatentMoE without it (K3 report §2.3)",
             (Arm("with latent norm"), Arm("without", model={"latent_moe_use_norm": False})), "heldout_loss"),
    Ablation("per-head-muon", ("optimizer",),
             "Per-head Muon (each head's rows orthogonalised on their own) trains at least as well as whole-matrix "
             "Muon; AdamW as a reference (K3 report §2.5)",
             (Arm("per-head Muon"), Arm("whole-matrix Muon", train={"optimizer": "whole_matrix_muon"}),
              Arm("AdamW", train={"optimizer": "adamw"})), "heldout_loss"),
    Ablation("hybrid-ratio", ("linear_attn_config",),
             "KDA:MLA 3:1 matches all-MLA quality at a fraction of the decode cost at long context, and beats "
             "all-KDA (K3 report §2.1, §5.4)",
             (Arm("3:1 KDA:MLA"), Arm("all MLA", model={"linear_attn_config": "mla"}),
              Arm("all KDA", model={"linear_attn_config": "kda"})), "heldout_loss"),
    Ablation("kda-gate-bound", ("kda_gate",),
             "The lower-bounded KDA gate (g > −5) keeps training stable at no cost in loss, against the unbounded "
             "gate −exp(A)·softplus(·) (K3 report §2.1.1)",
             (Arm("lower-bounded gate"), Arm("unbounded gate", model={"kda_gate": "unbounded"})), "heldout_loss",
             common_model={"kda_impl": "naive"}),
]}


def arm_configs(ablation: Ablation, preset: str = "debug", **train: Any):
    """[(label, ModelConfig, TrainConfig)] of every arm: the preset (and the common overrides) with the arm's own."""
    from k3.config import get_preset
    from k3.train.config import ContextStage, TrainConfig

    base = get_preset(preset).replace(**ablation.common_model)
    out = []
    for arm in ablation.arms:
        overrides = dict(arm.model)
        if isinstance(overrides.get("linear_attn_config"), str):
            lin = dataclasses.replace(base.linear_attn_config,
                                      **_one_kind(base.num_hidden_layers, overrides["linear_attn_config"]))
            overrides["linear_attn_config"] = lin
        model = base.replace(**overrides)
        settings = {"preset": preset, "tokens_per_step": 2048, "stages": [ContextStage(256, 1.0)], "max_steps": 1,
                    **ablation.common_train, **train, **arm.train}
        out.append((arm.label, model, TrainConfig(**settings)))
    return out


def config_diff(a: Any, b: Any) -> set[str]:
    """Names of the dataclass fields that differ between a and b."""
    return {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


class ActivationMax:
    """The largest |input| of every dense / shared-expert `down_proj` (the GLU's output) since the last read."""

    def __init__(self, model):
        from k3.model.moe import SiTUMLP

        self.value = 0.0
        self.handles = [m.down_proj.register_forward_pre_hook(self._hook) for m in model.modules()
                        if isinstance(m, SiTUMLP)]

    def _hook(self, module, args) -> None:
        self.value = max(self.value, float(args[0].detach().abs().max()))

    def read(self) -> float:
        value, self.value = self.value, 0.0
        return value


def decode_ms_per_token(model_config, context: int, tokens: int = 16, seed: int = 0) -> float:
    """Decode cost at `context` tokens: prefill random tokens, then time `tokens` single-token steps (fp32)."""
    import torch

    from k3.model.model import build_model

    model = build_model(model_config.replace(max_position_embeddings=max(context + tokens, 1024)), seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        cache = model.new_cache(1)
        ids = torch.randint(0, model_config.vocab_size - 256, (1, context), generator=g)
        logits = model(ids, cache=cache).logits[:, -1]
        start = time.perf_counter()
        for _ in range(tokens):
            logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
        return (time.perf_counter() - start) / tokens * 1000


def shared_data(preset: str, out: Path, data: str | None, log: Callable[[str], None]):
    """The tokenizer and train / held-out corpora of `k3 train --preset PRESET` (its tokenizer size), prepared once
    under out/data-PRESET[-NAME] and reused by every ablation."""
    from k3.config import get_preset
    from k3.train.config import TrainConfig
    from k3.train.loop import prepare_data

    folder = out / (f"data-{preset}" + (f"-{Path(data).name}" if data else ""))
    folder.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(preset=preset, data=data, out=str(folder))
    return prepare_data(cfg, get_preset(preset).vocab_size, folder, log)


def train_arm(model_config, cfg, train_corpus, heldout_corpus, steps: int, device: str, bar=None) -> dict[str, Any]:
    """One run: `steps` optimizer steps of the training loop's `train_step`, then the held-out loss."""
    import torch

    from k3.model.model import build_model
    from k3.optim import MuonAdamW, cosine_schedule
    from k3.train.data import PackedBatches
    from k3.train.loop import MUON_BLOCKS, evaluate, ns_dtype_for, train_step

    torch.manual_seed(cfg.seed)
    dev = torch.device(device)
    model = build_model(model_config, seed=cfg.seed, device=dev)
    optimizer = MuonAdamW(model.named_parameters(), model_config, lr=cfg.lr, weight_decay=cfg.weight_decay,
                          ns_dtype=ns_dtype_for(cfg.muon_ns_dtype, dev), impl=cfg.optimizer_impl,
                          muon_blocks=MUON_BLOCKS[cfg.optimizer])
    scheduler = cosine_schedule(optimizer, steps, cfg.warmup_frac, cfg.min_lr_ratio)
    seq_len = cfg.stages[0].seq_len
    batches = PackedBatches(train_corpus, cfg.tokens_per_step // seq_len, seq_len, seed=cfg.seed,
                            streams=cfg.data_streams)
    acts = ActivationMax(model)
    curve: dict[str, list[float]] = {"loss": [], "grad_norm": [], "max_vio": [], "max_over_mean": [], "act_max": []}
    skipped = 0
    start = time.perf_counter()
    for _ in range(steps):
        m = train_step(model, optimizer, scheduler, [next(batches)], cfg, dev)
        skipped += bool(m.get("skipped"))
        curve["loss"].append(m["loss"])
        curve["grad_norm"].append(m["grad_norm"])
        curve["max_vio"].append(max(m.get("moe_max_vio") or [0.0]))
        curve["max_over_mean"].append(max(m.get("moe_max_over_mean") or [1.0]))
        curve["act_max"].append(acts.read())
        if bar is not None:
            bar.update(1)
    seconds = time.perf_counter() - start
    heldout = evaluate(model, heldout_corpus, seq_len, cfg.eval_tokens, dev)["loss"]
    losses = curve["loss"]
    finite = [x for x in losses if math.isfinite(x)]
    tail = max(1, steps // 10)
    return {
        "heldout_loss": heldout,
        "train_loss": statistics.fmean(finite[-tail:]) if finite else float("nan"),
        "max_vio": statistics.fmean(curve["max_vio"][steps // 2:]) if steps > 1 else curve["max_vio"][-1],
        "max_vio_step5": curve["max_vio"][min(5, steps - 1)],
        "act_max": max(curve["act_max"]),
        "spikes": sum(1 for a, b in itertools.pairwise(losses) if b - a > SPIKE_NATS or not math.isfinite(b)),
        "max_grad_norm": max(x for x in curve["grad_norm"] if math.isfinite(x)) if finite else float("nan"),
        "skipped_steps": skipped,
        "seconds": seconds,
        "curve": curve,
    }


def run_ablation(name: str, preset: str = "debug", steps: int | None = None, seeds: int = 3,
                 out: Path = Path("ablations"), device: str = "cpu", data: str | None = None, progress: bool = True,
                 eval_tokens: int = 32768, decode_contexts: tuple[int, ...] = (1024, 4096),
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train every arm for `seeds` seeds; write out/NAME-PRESET.json and .png; return the result. `data`: the
    training text (default: the standard library sources, as `k3 train`); `eval_tokens`: held-out tokens scored
    at the end; `decode_contexts`: where hybrid-ratio times decoding."""
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; choose one of {sorted(ABLATIONS)}")
    if seeds < 1 or (steps is not None and steps < 2):
        raise ValueError("need at least one seed and two steps")
    ablation = ABLATIONS[name]
    steps = steps or ablation.steps
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, train_corpus, heldout_corpus = shared_data(preset, out, data, log)
    from tqdm import tqdm

    arms = arm_configs(ablation, preset, max_steps=steps, eval_tokens=eval_tokens)
    bar = tqdm(total=len(arms) * seeds * steps, desc=f"ablate {name}", unit="step", disable=not progress)
    results = []
    for label, model_config, cfg in arms:
        model_config = model_config.replace(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                                            eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        runs = [train_arm(model_config, dataclasses.replace(cfg, seed=seed), train_corpus, heldout_corpus, steps,
                          device, bar) for seed in range(seeds)]
        arm = {"label": label, "runs": runs, "summary": summarize(runs)}
        if name == "hybrid-ratio":
            arm["decode_ms"] = {str(n): decode_ms_per_token(model_config, n) for n in decode_contexts}
            from k3.model.accounting import account

            arm["cache_bytes_per_token"] = account(model_config, label).mla_cache_bytes_per_token
        results.append(arm)
    bar.close()
    result = {"ablation": name, "fields": list(ablation.fields), "claim": ablation.claim, "metric": ablation.metric,
              "preset": preset, "steps": steps, "seeds": seeds, "tokens_per_step": arms[0][2].tokens_per_step,
              "seq_len": arms[0][2].stages[0].seq_len, "lr": arms[0][2].lr, "arms": results}
    result["verdict"] = verdict(result)
    path = out / f"{name}-{preset}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot_ablation(result, out / f"{name}-{preset}.png")
    result["files"] = [str(path), str(out / f"{name}-{preset}.png")]
    return result


SUMMARY = ("heldout_loss", "train_loss", "max_vio", "max_vio_step5", "act_max", "spikes", "max_grad_norm",
           "skipped_steps", "seconds")


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """mean and std (0 for one seed) over seeds of every scalar measure."""
    out = {}
    for key in SUMMARY:
        values = [float(r[key]) for r in runs]
        out[key] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Whether the K3 arm is better (lower) on the claim's metric than each baseline, and whether the gap exceeds
    the seeds' spread (the sum of the two standard deviations)."""
    metric = result["metric"]
    k3 = result["arms"][0]["summary"][metric]
    lines = []
    for arm in result["arms"][1:]:
        base = arm["summary"][metric]
        gap = base["mean"] - k3["mean"]
        noise = k3["std"] + base["std"]
        if not math.isfinite(gap):
            word = "K3 arm finite, baseline diverged" if math.isfinite(k3["mean"]) else "both diverged"
        elif gap > noise:
            word = "matches"
        elif gap > 0:
            word = "matches, within seed noise"
        elif -gap <= noise:
            word = "does not match (within seed noise)"
        else:
            word = "does not match"
        lines.append({"baseline": arm["label"], "k3": k3["mean"], "baseline_value": base["mean"], "gap": gap,
                      "noise": noise, "verdict": word})
    return {"metric": metric, "against": lines}


def print_ablation(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"k3 ablate {result['ablation']} ({result['preset']}, {result['steps']} steps × "
                        f"{result['seeds']} seeds, mean ± std)")
    table.add_column("measure")
    for arm in result["arms"]:
        table.add_column(arm["label"], justify="right")
    for key in SUMMARY:
        table.add_row(key + (" ◀" if key == result["metric"] else ""),
                      *[f"{a['summary'][key]['mean']:.4g} ± {a['summary'][key]['std']:.2g}" for a in result["arms"]])
    if result["arms"][0].get("decode_ms"):
        for n in result["arms"][0]["decode_ms"]:
            table.add_row(f"decode ms/token @ {n}", *[f"{a['decode_ms'][n]:.2f}" for a in result["arms"]])
        table.add_row("MLA cache B/token", *[f"{a['cache_bytes_per_token']:,}" for a in result["arms"]])
    console = Console()
    console.print(table)
    console.print(f"claim: {result['claim']}")
    for line in result["verdict"]["against"]:
        console.print(f"vs {line['baseline']}: {line['verdict']} ({result['metric']} {line['k3']:.4g} against "
                      f"{line['baseline_value']:.4g}, seed spread {line['noise']:.2g})")
    for f in result.get("files", []):
        console.print(f"wrote {f}")


def plot_ablation(result: dict[str, Any], path: Path) -> None:
    """Left: training loss (mean over seeds, min–max band). Right: the claim's own curve (MaxVio, activation
    maxima) or its metric per arm (mean ± std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    series = {"max_vio": ("MaxVio (max layer)", True), "act_max": ("max |GLU output|", True)}
    for arm in result["arms"]:
        curves = np.array([r["curve"]["loss"] for r in arm["runs"]], dtype=float)
        x = np.arange(1, curves.shape[1] + 1)
        left.plot(x, np.nanmean(curves, 0), label=arm["label"])
        left.fill_between(x, np.nanmin(curves, 0), np.nanmax(curves, 0), alpha=0.2)
        if result["metric"] in series:
            key = result["metric"]
            c = np.array([r["curve"][key] for r in arm["runs"]], dtype=float)
            right.plot(x, c.mean(0), label=arm["label"])
    left.set_xlabel("step")
    left.set_ylabel("training loss (nats/token)")
    left.legend()
    left.grid(alpha=0.3)
    if result["metric"] in series:
        right.set_xlabel("step")
        right.set_ylabel(series[result["metric"]][0])
        right.set_yscale("log")
        right.legend()
    else:
        labels = [a["label"] for a in result["arms"]]
        means = [a["summary"][result["metric"]]["mean"] for a in result["arms"]]
        stds = [a["summary"][result["metric"]]["std"] for a in result["arms"]]
        right.bar(labels, means, yerr=stds, capsize=4, color=["C0", "C1", "C2"][: len(labels)])
        lo = min(m - s for m, s in zip(means, stds))
        hi = max(m + s for m, s in zip(means, stds))
        right.set_ylim(lo - 0.2 * (hi - lo + 1e-3), hi + 0.2 * (hi - lo + 1e-3))
        right.set_ylabel(result["metric"].replace("_", " "))
    right.grid(alpha=0.3)
    fig.suptitle(f"{result['ablation']}: {result['preset']}, {result['steps']} steps × {result['seeds']} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
