"""Peak host memory while loading a release-layout checkpoint, against the bytes of the loaded weights.

Claim: `load_release` streams shard by shard, so its peak RSS stays within 1.2× the loaded
weights once shards are small next to the model (the release: ~15 GB shards, ≥1.45 TB of weights).
Baseline in the same run: the naive loader, `safetensors.torch.load_file` of every shard, then build
and fill the model. Each load runs in a fresh subprocess; "peak" is the child's VmHWM minus its VmRSS
just before loading (imports and torch's one-time
runtime set-up excluded, see `child`). Correctness gate first: both loaders give identical tensors.

Run: `python benchmarks/convert_memory.py [--preset small --vocab-size 32768 --num-experts 32]`
(default ≈ 417M parameters in bf16, MXFP4 experts); the table goes to
benchmarks/results/convert-memory-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


@torch.no_grad()
def naive_load(path: Path):
    """Everything in memory at once: all shards, then the model filled from them."""
    from safetensors.torch import load_file

    from k3.convert import names as N
    from k3.convert.mx import mx_dequantize
    from k3.convert.release import read_release_config, read_weight_map
    from k3.model.model import K3ForCausalLM

    config = read_release_config(path).replace(quantization_config=None)
    state = {}
    for shard in sorted(set(read_weight_map(path).values())):
        state |= load_file(str(path / shard))
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.cast(torch.bfloat16).to_empty(device="cpu")
    targets = model.state_dict(keep_vars=True)
    for name, t in state.items():
        where = N.from_release(name)
        if where is None or where.field == "weight_scale":
            continue
        target = targets[where.k3_name]
        if where.expert is None:
            target.copy_(t[: target.shape[0]] if name.endswith("A_log") else t)
        else:
            scale = state[name.replace("weight_packed", "weight_scale")]
            target[where.expert].copy_(mx_dequantize(t, scale, dtype=target.dtype))
    vision = {n: t for n, t in state.items() if N.is_vision_name(n)}
    return model, vision


def child(path: Path, mode: str) -> None:
    """Load once, print JSON with the memory numbers."""
    from k3.config import get_preset
    from k3.convert.release import load_release
    from k3.model.model import K3ForCausalLM

    torch.set_num_threads(1)
    # warm-up: the first nn.Module construction costs ~70 MB of one-time torch runtime state, whatever the
    # model size (a meta-device debug model shows it); the baseline is taken after it
    with torch.device("meta"):
        K3ForCausalLM(get_preset("debug"))
    before = _status("VmRSS")
    start = time.perf_counter()
    if mode == "naive":
        model, vision = naive_load(path)
        packed = {}
    else:
        ckpt = load_release(path, experts="packed" if mode == "packed" else "dequantize")
        model, vision, packed = ckpt.model, ckpt.vision, ckpt.packed_experts
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")  # before the digest below allocates anything
    weights = _tensor_bytes(model.state_dict().values()) + _tensor_bytes(vision.values()) + \
        _tensor_bytes(packed.values())
    digest = float(sum(t.float().sum() for t in model.state_dict().values() if not t.is_meta))
    print(json.dumps({"before": before, "peak": peak, "weights": weights, "seconds": seconds,
                      "digest": digest}))


def run_child(path: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(path), mode], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--shard-sizes", nargs="+", default=["25MB", "100MB", "5GB"])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return

    from rich.console import Console
    from rich.table import Table

    from k3.config import get_preset
    from k3.convert.release import save_release
    from k3.model.model import build_model

    config = get_preset(args.preset, vocab_size=args.vocab_size, num_experts=args.num_experts)
    model = build_model(config, seed=0, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    table = Table(title=f"load_release peak RSS: {args.preset} preset, vocab {args.vocab_size}, "
                        f"{args.num_experts} experts ({n_params / 1e6:.0f}M parameters), MXFP4 experts")
    columns = ("shard size", "shards", "checkpoint MB", "loader", "weights MB", "peak − baseline MB",
               "peak / weights", "load s")
    for col in columns:
        table.add_column(col, justify="right")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.shard_sizes:
            path = save_release(model, Path(tmp) / size, mxfp4=True, shard_size=size)
            shards = len(list(path.glob("model-*.safetensors")))
            ckpt_mb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6
            results = {mode: run_child(path, mode) for mode in ("dequantize", "packed", "naive")}
            # correctness gate: the streaming loader and the naive one fill identical weights
            assert results["dequantize"]["digest"] == results["naive"]["digest"], results
            for mode, r in results.items():
                extra = r["peak"] - r["before"]
                table.add_row(size, str(shards), f"{ckpt_mb:.0f}", mode if mode != "naive" else "naive (baseline)",
                              f"{r['weights'] / 1e6:.0f}", f"{extra / 1e6:.0f}", f"{extra / r['weights']:.2f}×",
                              f"{r['seconds']:.1f}")
                rows.append([size, shards, round(ckpt_mb), mode if mode != "naive" else "naive (baseline)",
                             round(r["weights"] / 1e6), round(extra / 1e6), f"{extra / r['weights']:.2f}×",
                             round(r["seconds"], 1)])
    Console(width=150).print(table)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.provenance import save_result, table as result_table

    save_result("convert-memory", f"Peak host memory of loading a release-layout checkpoint ({args.preset} preset, "
                f"vocab {args.vocab_size}, {args.num_experts} experts, {n_params / 1e6:.0f}M parameters, MXFP4 "
                "experts) against the bytes of the loaded weights; the naive loader as the baseline",
                {"peak-memory": result_table(list(columns), rows)})


if __name__ == "__main__":
    main()
