"""The speculative-decoding claim: on the `make demo` model with a draft from `k3 train-draft` (benchmarks/draft.py),
greedy decoding with k = 4 drafted tokens emits the same tokens as plain decoding, faster, on held-out standard
library text; reported side by side in one run: acceptance per draft position, tokens per verify, decode tokens/s
with and without speculation at batch 1 and batch 8, and the two KDA rollback forms' memory and speed.

    python benchmarks/spec_decode.py --target /tmp/k3spec/target-tiny --draft /tmp/k3spec/draft-tiny

Prompts are the first `--prompt-tokens` tokens of the target run's held-out documents (data/heldout, which neither
the target nor the draft trained on). Batch 1 runs each prompt alone through a plain engine, a speculative one with
snapshot rollback and one with replay rollback, in turn (so a shared machine's load falls on all three alike);
batch 8 runs all prompts at once on each engine. Decode tokens/s counts the tokens after the first over the time
from the first to the last (the prefill is the same in all three); end-to-end counts every token over the whole
request; the CPU-time row counts this process's own CPU seconds, which other processes' load barely moves. The
gate: every greedy output of the speculative engines equals the plain engine's, else nothing is written. Sampling at
temperature 1 is measured too (acceptance only: its outputs differ by construction), and `--compare-drafts` adds
other drafts' engine acceptance, greedy and at temperature 1, beside --draft's. One torch thread; the machine's load
average is recorded with the result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from provenance import save_result, table  # noqa: E402

import k3.infer.speculative_step as speculative_step  # noqa: E402
from k3.checkpoint import load_trained  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.infer.api import RequestOutput, SamplingParams  # noqa: E402
from k3.infer.cache import CacheSpec  # noqa: E402
from k3.infer.config import EngineConfig  # noqa: E402
from k3.infer.engine import Engine, merge_output  # noqa: E402
from k3.infer.speculative import rollback_bytes  # noqa: E402
from k3.spec.drafter import DraftRunner  # noqa: E402
from k3.train.data import TokenizedCorpus  # noqa: E402

FORMS = ("snapshot", "replay")


class Timed:
    """Seconds spent in the target's forward and in the drafter while `on` (the profile of a speculative run)."""

    def __init__(self, drafter: DraftRunner):
        self.verify = self.draft = 0.0
        self.on = False
        forward = speculative_step.forward_with_features
        extend, propose = drafter.extend, drafter.propose

        def timed(fn, slot):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if self.on:
                        setattr(self, slot, getattr(self, slot) + time.perf_counter() - start)
            return wrapper

        speculative_step.forward_with_features = timed(forward, "verify")
        drafter.extend, drafter.propose = timed(extend, "draft"), timed(propose, "draft")


def run_batch(engine: Engine, prompts: list[list[int]], sampling: SamplingParams) -> tuple[dict, dict, float]:
    """All prompts at once -> (outputs by index, (first-token time, end time) by index, wall seconds)."""
    outs = {i: RequestOutput(str(i), []) for i in range(len(prompts))}
    times: dict[int, list[float]] = {}
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, sampling)
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id)
            merge_output(outs[i], out)
            now = time.perf_counter()
            times.setdefault(i, [now, now])[1] = now
    return outs, times, time.perf_counter() - start


def engines(target, draft_dir: str, k: int) -> dict[str, Engine]:
    made = {"plain": Engine(target, EngineConfig())}
    for form in FORMS:
        drafter = DraftRunner.load(draft_dir, target)
        made[form] = Engine(target, EngineConfig(speculative_tokens=k, spec_rollback=form), drafter=drafter)
    for engine in made.values():  # warm up
        engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, temperature=0.0))
        engine.spec_position_accepted = [0] * k
        engine.spec_position_drafted = [0] * k
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="runs/tiny", help="the target run (make demo's)")
    p.add_argument("--draft", default="runs/draft-tiny", help="its draft (benchmarks/draft.py, k3 train-draft)")
    p.add_argument("--speculative-tokens", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare-drafts", nargs="*", default=[], metavar="DIR",
                   help="other drafts of the same target: their engine acceptance beside --draft's")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    k = args.speculative_tokens
    target, _, ckpt = load_trained(args.target)
    heldout = TokenizedCorpus.open(Path(ckpt).parent.parent / "data" / "heldout")
    docs = [heldout.document(i) for i in range(len(heldout)) if len(heldout.document(i)) > args.prompt_tokens]
    if len(docs) < args.prompts:
        raise SystemExit(f"only {len(docs)} held-out documents are longer than {args.prompt_tokens} tokens")
    prompts = [[int(t) for t in d[: args.prompt_tokens]] for d in docs[: args.prompts]]
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    made = engines(target, args.draft, k)
    timed = Timed(made["snapshot"].drafter)
    first = {name: engine.metrics_state.counters.copy() for name, engine in made.items()}  # after the warm-up

    # batch 1, in turn; the snapshot engine's counters and profile are the batch-1 ones
    decode = {name: [0, 0.0] for name in made}  # tokens after the first, seconds
    e2e = {name: [0, 0.0] for name in made}
    cpu = {name: [0, 0.0] for name in made}  # tokens, CPU seconds of this process (robust to the machine's load)
    outputs = {name: [] for name in made}
    for n, ids in enumerate(prompts):
        for name, engine in made.items():
            timed.on = name == "snapshot"
            cpu_start = time.process_time()
            outs, times, wall = run_batch(engine, [ids], greedy)
            cpu[name][1] += time.process_time() - cpu_start
            timed.on = False
            tokens = outs[0].new_token_ids
            outputs[name].append(tokens)
            decode[name][0] += len(tokens) - 1
            decode[name][1] += times[0][1] - times[0][0]
            e2e[name][0] += len(tokens)
            e2e[name][1] += wall
            cpu[name][0] += len(tokens)
        print(f"prompt {n + 1}/{len(prompts)}: " + ", ".join(
            f"{name} {decode[name][0] / decode[name][1]:.1f} tok/s" for name in made), flush=True)
    snap = made["snapshot"]
    counted = {name: {c: v - first[name][c] for c, v in made[name].metrics_state.counters.items()} for name in made}
    verifies = counted["snapshot"]["spec_verifies_total"]
    steps = {name: counted[name]["steps_total"] for name in made}
    profile = {"forward": timed.verify, "draft": timed.draft, "total": e2e["snapshot"][1], "steps": steps}
    position = [(a, d) for a, d in zip(snap.spec_position_accepted, snap.spec_position_drafted)]
    metrics = {name: {"spec_tokens_per_verify": counted[name]["spec_emitted_tokens_total"]
                      / max(counted[name]["spec_verifies_total"], 1),
                      "spec_acceptance_rate": counted[name]["spec_accepted_tokens_total"]
                      / max(counted[name]["spec_draft_tokens_total"], 1)} for name in FORMS}

    # batch 8
    batch = {}
    for name, engine in made.items():
        outs, times, wall = run_batch(engine, prompts, greedy)
        outputs[name + "-batch"] = [outs[i].new_token_ids for i in range(len(prompts))]
        batch[name] = (sum(len(o.new_token_ids) for o in outs.values()), wall)
        print(f"batch {len(prompts)} {name}: {batch[name][0] / wall:.1f} tok/s", flush=True)

    # the gate: the same greedy tokens everywhere
    for name in FORMS:
        for suffix in ("", "-batch"):
            if outputs[name + suffix] != outputs["plain" + suffix]:
                raise SystemExit(f"{name}{suffix}: speculative greedy output differs from plain decoding")
    if outputs["plain"] != outputs["plain-batch"]:
        print("note: plain batch-1 and batch-8 outputs differ (MoE rounding by batch composition)")

    # sampling at temperature 1 (acceptance only), and each draft's engine acceptance at batch len(prompts)
    measured = {d: draft_acceptance(target, d, prompts, k, args.new_tokens) for d in [args.draft, *args.compare_drafts]}
    sampled, sampled_position = measured[args.draft]["temperature 1"]
    load_after = os.getloadavg()[0]

    rate = {name: decode[name][0] / decode[name][1] for name in made}
    e2e_rate = {name: e2e[name][0] / e2e[name][1] for name in made}
    cpu_rate = {name: cpu[name][0] / cpu[name][1] for name in made}
    b_rate = {name: batch[name][0] / batch[name][1] for name in made}
    acceptance = table(
        ["draft position", "accepted / drafted (greedy)", "accepted given the previous was (greedy)",
         "accepted / drafted (temperature 1)"],
        [[j + 1, round(a / max(d, 1), 3),
          round(a / max(position[j - 1][0], 1), 3) if j else round(a / max(d, 1), 3), round(sampled_position[j], 3)]
         for j, (a, d) in enumerate(position)],
        note=f"k = {k}; greedy: the batch-1 runs of the snapshot engine ({verifies} verifies); temperature 1: "
             f"{len(prompts)} requests at batch {len(prompts)}")
    summary = table(
        ["k", "tokens per verify (greedy)", "acceptance rate (greedy)", "tokens per verify (temperature 1)",
         "acceptance rate (temperature 1)"],
        [[k, round(metrics["snapshot"]["spec_tokens_per_verify"], 2),
          round(metrics["snapshot"]["spec_acceptance_rate"], 3), round(sampled["spec_tokens_per_verify"], 2),
          round(sampled["spec_acceptance_rate"], 3)]],
        note=f"{len(prompts)} held-out prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens each")
    speed = table(
        ["setting", "plain tokens/s", "speculative (snapshot) tokens/s", "speculative (replay) tokens/s",
         "speedup (snapshot)", "speedup (replay)"],
        [[f"batch 1, decode ({len(prompts)} prompts in turn)"] + _speed_row(rate),
         ["batch 1, end to end (prefill included)"] + _speed_row(e2e_rate),
         ["batch 1, end to end, per CPU second of this process"] + _speed_row(cpu_rate),
         [f"batch {len(prompts)}, end to end"] + _speed_row(b_rate)],
        note=f"greedy; every speculative output equals the plain engine's token for token; {args.threads} torch "
             f"thread(s); load average {load_before:.1f} before, {load_after:.1f} after (2 cores shared)")
    n_steps, total = steps["snapshot"], profile["total"]
    rest = total - profile["forward"] - profile["draft"]
    prof = table(
        ["part of a speculative engine step", "ms per step", "share"],
        [["target forward (prefill pieces and verify passes with features, stepwise KDA)",
          round(1e3 * profile["forward"] / n_steps, 1), f"{profile['forward'] / total:.0%}"],
         ["draft (extend over the verified positions, k − 1 chained steps)",
          round(1e3 * profile["draft"] / n_steps, 1), f"{profile['draft'] / total:.0%}"],
         ["acceptance, rollback, sampling, scheduling", round(1e3 * rest / n_steps, 1), f"{rest / total:.0%}"],
         ["whole step (speculative)", round(1e3 * total / n_steps, 1), "100%"],
         ["whole step (plain engine)", round(1e3 * e2e["plain"][1] / steps["plain"], 1), ""]],
        note=f"batch-1 runs, end to end: {n_steps} speculative steps vs {steps['plain']} plain ones for the same tokens")
    tiny_spec = made["snapshot"].spec
    k3_spec = CacheSpec.build(get_preset("k3"), 512, torch.bfloat16)
    rollback = table(
        ["rollback form", "bytes per sequence (this model, fp32 cache)", "bytes per sequence (K3, bf16 cache)",
         "batch-1 decode tokens/s", f"batch-{len(prompts)} tokens/s"],
        [[form, f"{rollback_bytes(tiny_spec, k, form):,}", f"{rollback_bytes(k3_spec, k, form) / 2**20:,.1f} MiB",
          round(rate[form], 1), round(b_rate[form], 1)] for form in FORMS],
        note=f"what a sequence holds per verify step to roll its KDA layers back, k = {k} (k3 info prints it)")
    drafts = table(
        ["draft", "tokens per verify (greedy)", "first draft accepted (greedy)", "tokens per verify (temperature 1)",
         "first draft accepted (temperature 1)"],
        [[Path(d).name] + [x for mode in ("greedy", "temperature 1")
                           for x in (round(measured[d][mode][0]["spec_tokens_per_verify"], 2),
                                     round(measured[d][mode][1][0], 3))]
         for d in measured],
        note=f"k = {k}, snapshot engine, the {len(prompts)} prompts at batch {len(prompts)}; the first row is --draft")
    result = {"acceptance": acceptance, "summary": summary, "speed": speed, "profile": prof, "rollback": rollback,
              "drafts": drafts}
    save_result("spec_decode", "speculative decoding with a `k3 train-draft` draft on the make-demo model: same "
                "greedy tokens as plain decoding, acceptance per position, tokens per verify, decode speed at batch 1 "
                "and 8, snapshot vs replay rollback", result,
                raw={"rate": rate, "e2e": e2e_rate, "batch": b_rate, "profile": profile, "position": position})
    for name, t in result.items():
        print(name, t["columns"], *t["rows"], sep="\n  ")


def draft_acceptance(target, draft_dir: str, prompts: list[list[int]], k: int, new_tokens: int) -> dict:
    """A draft's engine acceptance, greedy and at temperature 1 (seeded), all prompts at once: by mode, (the engine's
    metrics, accepted / drafted by draft position)."""
    out = {}
    for mode, sampling in (("greedy", SamplingParams(max_tokens=new_tokens, temperature=0.0)),
                           ("temperature 1", SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0))):
        engine = Engine(target, EngineConfig(speculative_tokens=k), drafter=DraftRunner.load(draft_dir, target))
        run_batch(engine, prompts, sampling)
        out[mode] = (engine.metrics(), [a / max(d, 1) for a, d in
                                        zip(engine.spec_position_accepted, engine.spec_position_drafted)])
    return out


def _speed_row(rate: dict) -> list:
    return [round(rate["plain"], 1), round(rate["snapshot"], 1), round(rate["replay"], 1),
            f"{rate['snapshot'] / rate['plain']:.2f}×", f"{rate['replay'] / rate['plain']:.2f}×"]


if __name__ == "__main__":
    main()
