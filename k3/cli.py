"""`k3 <command>`: thin command-line front-ends. Each command lives in its own function."""

from __future__ import annotations

import argparse
import json
import sys

from k3.convert.cli import add_convert_parser
from k3.posttrain.cli import add_make_sft_parser, add_make_tasks_parser, add_sft_parser
from k3.posttrain.rl_cli import add_rl_parser
from k3.sandbox.cli import add_sandbox_parser
from k3.serve.cli import add_serve_parser
from k3.vision.cli import add_make_vision_parser


def _human(n: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _bytes(n: float) -> str:
    for suffix, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"


def _load_config(args):
    from k3.config import ModelConfig, get_preset

    if getattr(args, "config", None):
        return ModelConfig.load(args.config), args.config
    return get_preset(args.preset), args.preset


def cmd_info(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from k3.model.accounting import account

    config, name = _load_config(args)
    acc = account(config, name)
    if args.json:
        print(json.dumps(acc.as_dict()))
        return 0
    console = Console()
    table = Table(title=f"k3 {name}: {config.num_hidden_layers} layers "
                        f"({acc.num_kda_layers} KDA + {acc.num_mla_layers} Gated MLA), D={config.hidden_size}, "
                        f"{config.num_experts} experts top-{config.num_experts_per_token}")
    table.add_column("component")
    table.add_column("total", justify="right")
    table.add_column("active / token", justify="right")
    for comp, c in acc.components.items():
        table.add_row(comp, f"{c['total']:,}", f"{c['active']:,}")
    table.add_row("[bold]total[/bold]", f"[bold]{acc.total_params:,}[/bold] ({_human(acc.total_params)})",
                  f"[bold]{acc.active_params:,}[/bold] ({_human(acc.active_params)})")
    console.print(table)
    console.print(f"weights in bf16: {_bytes(acc.weight_bytes_bf16)}")
    console.print(f"MLA latent cache: {acc.mla_cache_bytes_per_token:,} B/token (bf16) "
                  f"= {_bytes(acc.mla_cache_bytes_per_token * 2**20)} at 1M tokens")
    console.print(f"KDA state: {_bytes(acc.kda_state_bytes_per_sequence)} per sequence (fp32) "
                  f"+ conv tails {_bytes(acc.kda_conv_bytes_per_sequence)} (bf16)")
    if config.kda_layer_ids:  # speculative decoding's KDA rollback buffers (docs/speculative.md)
        import torch

        from k3.infer.cache import CacheSpec
        from k3.infer.speculative import rollback_bytes

        spec = CacheSpec.build(config, 64, torch.bfloat16)
        console.print("speculative rollback per sequence, k = 4: " + ", ".join(
            f"{form} {_bytes(rollback_bytes(spec, 4, form))}" for form in ("snapshot", "replay")))
    if acc.vision:
        console.print(f"vision (per image token, not in the totals): MoonViT-V2 tower {acc.vision['vision_tower']:,} "
                      f"({_human(acc.vision['vision_tower'])}) + projector {acc.vision['mm_projector']:,} "
                      f"({_human(acc.vision['mm_projector'])})")
    return 0


def cmd_forward(args) -> int:
    """Build a preset, run one forward pass on random tokens, report the loss against ln(V)."""
    import math
    import time

    import torch

    from k3.model.model import build_model

    config, name = _load_config(args)
    torch.manual_seed(args.seed)
    model = build_model(config, seed=args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len))
    start = time.perf_counter()
    with torch.no_grad():
        out = model(ids)
    elapsed = time.perf_counter() - start
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    tokens = args.batch_size * args.seq_len
    print(f"{name}: logits {tuple(out.logits.shape)}, loss at init {loss.item():.3f} "
          f"(ln V = {math.log(config.vocab_size):.3f}), {tokens / elapsed:,.0f} tokens/s forward")
    return 0


def cmd_train(args) -> int:
    """Train or resume a run. A stop by signal, a refusal or a failure ends in one line and the exit code that
    k3.runfolder documents (0 done, 1 system, 2 refused, 3 diverged, 128+N signal N); a stop says how to resume."""
    import dataclasses
    from pathlib import Path

    from k3.train.command import run_training_command

    out = Path(args.out or f"runs/{args.preset}")

    def start(stop):
        from k3.train.config import ContextStage, TrainConfig
        from k3.train.loop import train

        cfg = TrainConfig(preset=args.preset, data=args.data, out=str(out))
        overrides = {"max_steps": args.max_steps, "max_tokens": args.max_tokens,
                     "time_budget_min": args.time_budget, "lr": args.lr, "tokens_per_step": args.tokens_per_step,
                     "micro_batches": args.micro_batches, "seed": args.seed, "eval_every": args.eval_every,
                     "checkpoint_every": args.checkpoint_every, "device": args.device,
                     "vocab_size": args.vocab_size, "context_parallel": args.context_parallel,
                     "expert_parallel": args.expert_parallel or None, "moonep": False if args.no_moonep else None,
                     "activation_checkpointing": args.activation_checkpointing or None}
        cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
        if args.seq_len:
            cfg.stages = [ContextStage(args.seq_len, 1.0)]
        # the default length is for a new run; a resumed one keeps its own unless a length is given
        if not (cfg.max_steps or cfg.max_tokens or cfg.time_budget_min) and not (out / "run.json").exists():
            cfg.time_budget_min = 8.0
        source = None
        if args.data is not None:
            from k3.vision.data import MultimodalRows

            if MultimodalRows.holds_media(args.data):  # rows with images: the tower trains with the model
                source = MultimodalRows(args.data)
                cfg = dataclasses.replace(cfg, data_format=source.format, vision_lr=args.vision_lr)
        return train(cfg, resume="auto" if args.auto_resume else args.resume, stop=stop, source=source)

    return run_training_command("k3 train", args, out, start)


def cmd_generate(args) -> int:
    """One prompt through the inference engine (the same engine `k3 serve` and `k3 chat` use), streamed."""
    from k3.chat.detokenize import TextStream
    from k3.checkpoint import load_trained
    from k3.infer.api import SamplingParams
    from k3.infer.engine import Engine

    model, tokenizer, ckpt = load_trained(args.run)
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t") if args.escapes else args.prompt
    engine = Engine(model)
    if args.draft:  # speculative decoding (docs/speculative.md)
        from k3.infer.config import EngineConfig
        from k3.spec.drafter import DraftRunner

        engine = Engine(model, EngineConfig(speculative_tokens=args.speculative_tokens,
                                            spec_rollback=args.spec_rollback),
                        drafter=DraftRunner.load(args.draft, model))
    # [BOS], each --image's media prompt (its pads expanded), then the prompt
    ids, media = [tokenizer.bos_id], []
    if args.image:
        from k3.infer.api import MediaInput
        from k3.vision.preprocess import preprocess_image
        from k3.vision.prompt import media_prompt

        if not engine.accepts_media:
            raise ValueError(f"--image: {ckpt} is a text-only model: it takes no images")
        for path in args.image:
            item = preprocess_image(path)
            ids += media_prompt(tokenizer, item.width, item.height, item.num_tokens())
            media.append(MediaInput(item.pixel_values, item.grid_thw, item.num_tokens()))
    ids += tokenizer.encode(prompt)
    text = TextStream(tokenizer)
    sampling = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed, stop_token_ids=tuple(tokenizer.stop_ids))
    sampling.validate(model.config.vocab_size)
    engine.add_request("generate", ids, sampling, media=media)
    print(f"# {ckpt}", file=sys.stderr)
    sys.stdout.write(prompt)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(text.feed(out.new_token_ids, out.finished))
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_tokenizer_train(args) -> int:
    from k3.train.data import read_documents, stdlib_documents
    from k3.tokenizer import train_bpe

    docs = stdlib_documents() if args.data is None else read_documents(args.data)
    tokenizer = train_bpe((text for _, text in docs), args.vocab_size)
    tokenizer.save(args.out)
    print(f"saved a {tokenizer.vocab_size}-token tokenizer to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 architecture: model, training, serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_model_args(p):
        p.add_argument("--preset", default="tiny", help="debug | tiny | small | k3 (default tiny)")
        p.add_argument("--config", help="a config.json (overrides --preset)")

    p = sub.add_parser("info", help="parameter counts (total/active per component) and cache bytes")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("forward", help="one forward pass of a freshly initialised model on random tokens")
    add_model_args(p)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_forward)

    from k3.runfolder import positive

    p = sub.add_parser("train", help="train a preset (default data: this Python's standard library sources)",
                       epilog="Ctrl-C or SIGTERM: stop after the current step with a checkpoint and plots (exit 130 / "
                              "143); a second one stops at once. Exit codes: 0 done, 1 system failure (e.g. disk "
                              "full), 2 refused (bad arguments or data, folder in use), 3 diverged.")
    p.add_argument("--preset", default="tiny", help="debug | tiny | small | k3 (default tiny)")
    p.add_argument("--data", help="a text/JSONL/Parquet file, a folder of them, or a saved HF dataset; JSONL rows "
                                  "with images train the vision tower too (docs/vision.md)")
    p.add_argument("--out", help="run folder (default runs/PRESET)")
    p.add_argument("--max-steps", type=positive(int))
    p.add_argument("--max-tokens", type=positive(int))
    p.add_argument("--time-budget", type=positive(float), help="minutes; the step count is measured to fit "
                                                               "(default 8 for a new run)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint "
                                                           "(an error if there is none); a new length trains on")
    how.add_argument("--auto-resume", action="store_true", help="continue the run in --out if there is one, else "
                                                                "start it (for commands re-run until done)")
    p.add_argument("--lr", type=positive(float))
    p.add_argument("--vision-lr", type=positive(float),
                   help="multimodal data: the vision tower's and projector's learning rate (default: --lr)")
    p.add_argument("--tokens-per-step", type=positive(int))
    p.add_argument("--micro-batches", type=positive(int), help="gradient accumulation steps")
    p.add_argument("--seq-len", type=positive(int), help="one fixed context length instead of the preset's stages")
    p.add_argument("--vocab-size", type=positive(int), help="tokenizer vocabulary (default: the preset's)")
    p.add_argument("--eval-every", type=positive(int))
    p.add_argument("--checkpoint-every", type=positive(int))
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu | cuda | auto")
    p.add_argument("--context-parallel", type=positive(int),
                   help="under torchrun: ranks sharing each sequence (default 1)")
    p.add_argument("--expert-parallel", action="store_true", help="under torchrun: shard routed experts over all ranks")
    p.add_argument("--no-moonep", action="store_true", help="with --expert-parallel: plain EP, without the planner")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute decoder layers in backward")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="complete a prompt with a trained run or checkpoint")
    p.add_argument("run", help="a run folder (uses its newest checkpoint) or a checkpoint folder")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--escapes", action="store_true", help="interpret backslash escapes (\\n) in --prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image", action="append", metavar="PATH",
                   help="an image before the prompt (repeatable; a multimodal run)")
    p.add_argument("--draft", help="a `k3 train-draft` run or checkpoint: speculative decoding with it")
    p.add_argument("--speculative-tokens", type=int, default=4, help="tokens drafted per step with --draft")
    p.add_argument("--spec-rollback", choices=["snapshot", "replay"], default="snapshot",
                   help="how KDA states roll back after a rejected draft")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE with K3's special-token layout")
    t.add_argument("--data", help="text/JSONL/Parquet file or folder (default: the standard library sources)")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--out", required=True)
    t.set_defaults(func=cmd_tokenizer_train)

    add_convert_parser(sub)
    add_serve_parser(sub)
    from k3.route.cli import add_route_parser

    add_route_parser(sub)
    add_sandbox_parser(sub)
    from k3.eval.cli import add_ablate_parser, add_eval_parser

    add_eval_parser(sub)
    add_ablate_parser(sub)
    add_sft_parser(sub)
    add_rl_parser(sub)
    from k3.posttrain.mopd_cli import add_mopd_parser

    add_mopd_parser(sub)
    from k3.spec.cli import add_train_draft_parser

    add_train_draft_parser(sub)
    from k3.recipe.cli import add_recipe_parser

    add_recipe_parser(sub)

    p = sub.add_parser("data", help="write generated data sets (no download)")
    dsub = p.add_subparsers(dest="data_command", required=True)
    add_make_sft_parser(dsub)
    add_make_tasks_parser(dsub)
    add_make_vision_parser(dsub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
