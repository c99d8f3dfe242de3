"""`k3 convert`: release layout <-> k3 training checkpoints. Thin front-ends over `k3.convert.release`.

    k3 convert to-release RUN_OR_CKPT OUT [--mxfp4 [--scale-mode floor|ceil|even|rceil]] [--shard-size 5GB]
    k3 convert from-release RELEASE_DIR OUT [--dtype bfloat16|float32]

`to-release` reads a run folder (its newest committed checkpoint) or one checkpoint folder
(`model.safetensors`, `config.json`, `tokenizer/`) and writes the release layout with the run's tokenizer
files. `from-release` writes `OUT/checkpoints/step_00000000/` (model.safetensors with dequantised experts,
config.json, tokenizer/, a minimal train_state), so `k3 generate OUT` runs it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

# torch and the converters are imported inside the commands, so `k3 --help` stays fast
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                   "tokenization_kimi.py", "encoding_k3.py", "chat_template.jinja")


def cmd_to_release(args) -> int:
    from k3.checkpoint import load_trained
    from k3.convert.release import save_release

    model, _, ckpt = load_trained(args.source)
    tokenizer = ckpt / "tokenizer"
    if args.scale_mode is not None and not args.mxfp4:
        raise ValueError("--scale-mode applies to --mxfp4 exports only")
    out = save_release(model, args.out, mxfp4=args.mxfp4, shard_size=args.shard_size,
                       copy_files_from=tokenizer if tokenizer.is_dir() else None, scale_mode=args.scale_mode)
    shards = len(list(out.glob("model-*.safetensors")))
    config = model.config
    mode = args.scale_mode or (config.qat_scale_mode if config.qat == "mxfp4" else "floor")
    experts = f"MXFP4 (scales {mode})" if args.mxfp4 else "bf16"
    qat = f", trained with QAT ({config.qat}, {config.qat_scale_mode})" if config.qat != "none" else ""
    print(f"wrote {out}: {shards} shard(s), experts {experts}, from {ckpt}{qat}")
    return 0


def cmd_from_release(args) -> int:
    import json

    import torch

    from k3.convert.release import load_release
    from k3.checkpoint import save_checkpoint

    src = Path(args.release_dir)
    ckpt = load_release(src, dtype=getattr(torch, args.dtype))
    model = ckpt.model
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokenizer"
        tok.mkdir()
        copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        for f in copied:
            (tok / f).write_bytes((src / f).read_bytes())
        if not copied:
            raise ValueError(f"{src} has no tokenizer files (tiktoken.model or tokenizer.json)")
        train_state = {"step": 0, "tokens": 0, "source": str(src.resolve())}
        config_json = json.dumps(model.config.to_config_json(), indent=2)
        path = save_checkpoint(Path(args.out) / "checkpoints", 0, model.state_dict(), train_state,
                               extra_files={"config.json": config_json}, extra_dirs={"tokenizer": tok})
    note = f"; {len(ckpt.vision)} vision tensors not carried (a k3 checkpoint holds the text model)" \
        if ckpt.vision else ""
    print(f"wrote {path} (k3 generate {args.out}){note}")
    return 0


def add_convert_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `convert` with its two subcommands to the `k3` parser's subparsers."""
    p = subparsers.add_parser("convert", help="released checkpoint layout <-> k3 training checkpoints")
    sub = p.add_subparsers(dest="convert_command", required=True)
    t = sub.add_parser("to-release", help="a k3 run or checkpoint -> the released K3 layout")
    t.add_argument("source", help="a run folder (its newest checkpoint) or a checkpoint folder")
    t.add_argument("out", help="output directory")
    t.add_argument("--mxfp4", action="store_true", help="routed experts as packed MXFP4 (default bf16)")
    t.add_argument("--scale-mode", choices=("floor", "ceil", "even", "rceil"), default=None,
                   help="E8M0 scale rounding of --mxfp4 (default: a QAT run's qat_scale_mode, else floor)")
    t.add_argument("--shard-size", default="5GB", help="max shard size, e.g. 5GB, 500MB (default 5GB)")
    t.set_defaults(func=cmd_to_release)
    f = sub.add_parser("from-release", help="a released-layout directory -> a k3 checkpoint (for k3 generate)")
    f.add_argument("release_dir")
    f.add_argument("out", help="run folder; the checkpoint goes to OUT/checkpoints/step_00000000")
    f.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="weights dtype")
    f.set_defaults(func=cmd_from_release)
    return p


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m k3.convert.cli ...`), same as `k3 convert ...`."""
    parser = argparse.ArgumentParser(prog="k3")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"k3 convert: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
