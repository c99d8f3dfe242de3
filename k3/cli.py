"""`k3 <command>`: thin command-line front-ends. Each command lives in its own function."""

from __future__ import annotations

import argparse
import json
import sys


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
