"""How many tensor ops one training step launches, and from where: a CPU proxy for GPU kernel launches.

A step of the small preset is bound by the host (docs/fast-paths.md): the GPU waits for launches. This
counts, with a dispatch mode, every aten op of one forward and one backward (the recompute of activation
checkpointing included) of the GPU configuration on CPU, leaving out views and allocations (no kernel)
and anything Triton's interpreter runs inside a kernel (on a GPU the kernel is one launch). It prints the
totals, the commonest ops and the k3 lines that issue the most, so a change that removes launches can be
checked without a GPU. The grouped GEMMs run through torch._grouped_mm on CPU and the SiTU kernels
interpreted, so each counts as on a GPU.

    python benchmarks/op_census.py --preset small --seq-len 128 --activation-checkpointing   # ~5 min, 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the fused kernels run on CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3.config import get_preset, hybrid_layer_schedule  # noqa: E402
from k3.model.checkpointing import apply_activation_checkpointing  # noqa: E402
from k3.model.model import build_model  # noqa: E402

NO_KERNEL = {"aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute",
             "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::reshape",
             "aten::alias", "aten::detach", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk",
             "aten::narrow", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
             "aten::new_empty_strided", "aten::lift_fresh", "aten::is_same_size"}
K3 = str(ROOT / "k3") + os.sep
TRITON = f"{os.sep}triton{os.sep}"
GPU_CONFIG = ["kda_impl=triton", "attention_backend=sdpa", "moe_impl=grouped", "attn_res_impl=triton",
              "situ_impl=triton", "norm_impl=triton", "loss_impl=chunked"]


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.ops: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self.written: collections.Counter = collections.Counter()  # bytes of the outputs, by k3 line and op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name not in NO_KERNEL:
            where, frame = None, sys._getframe(1)
            while frame is not None:
                path = frame.f_code.co_filename
                if TRITON in path:  # inside a kernel that Triton's interpreter runs: one launch on a GPU
                    break
                if where is None and path.startswith(K3):
                    where = f"{os.path.relpath(path, ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
                frame = frame.f_back
            else:
                self.ops[(self.phase, name)] += 1
                self.sites[(self.phase, where or "(autograd engine)")] += 1
                out = func(*args, **(kwargs or {}))
                nbytes = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(out)
                             if isinstance(t, torch.Tensor))
                self.written[(self.phase, f"{where or '(autograd engine)'} {name}")] += nbytes
                return out
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=128, help="tokens, packed as two documents in one row")
    p.add_argument("--set", nargs="*", default=GPU_CONFIG, help="runtime config fields (default: the GPU fast paths)")
    p.add_argument("--layers", type=int, default=0, help="keep this many layers (default: the preset's)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()

    import k3.ops.moe
    import k3.ops.situ

    k3.ops.moe._native_ok = lambda *mats: True  # torch._grouped_mm runs on CPU too: one op, as on a GPU
    # the fused SiTU kernels pick Triton only on CUDA; here they run interpreted, one launch each as on a GPU
    k3.ops.situ._use_triton = lambda t: t.dtype in (torch.float32, torch.bfloat16, torch.float16)
    config = get_preset(args.preset).replace(**dict(item.split("=", 1) for item in args.set))
    if args.layers:  # the first N layers (every layer repeats; fewer make the census faster)
        kda, full = hybrid_layer_schedule(args.layers)
        config = config.replace(num_hidden_layers=args.layers, linear_attn_config=dataclasses.replace(
            config.linear_attn_config, kda_layers=kda, full_attn_layers=full))
    model = build_model(config, seed=0)
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    T = args.seq_len
    ids = torch.randint(0, min(1000, config.vocab_size), (1, T), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    census = Census()
    with torch.autocast("cpu", dtype=torch.bfloat16), census:  # the loss as training computes it
        loss = model(ids, cu_seqlens=cu, labels=ids.roll(-1, 1)).loss / T
    census.phase = "backward"
    with census:
        loss.backward()

    totals = {ph: sum(v for (p_, _), v in census.ops.items() if p_ == ph) for ph in ("forward", "backward")}
    print(f"{args.preset}, 1×{T} tokens, {' '.join(args.set)}, checkpointing {args.activation_checkpointing}: "
          f"{totals['forward']:,} ops forward, {totals['backward']:,} backward"
          f"{' (recompute included)' if args.activation_checkpointing else ''}, {sum(totals.values()):,} in all")
    for title, counter in (("ops", census.ops), ("k3 lines", census.sites)):
        for ph in ("forward", "backward"):
            print(f"\n{ph}: commonest {title}")
            for (p_, key), v in [kv for kv in counter.most_common() if kv[0][0] == ph][: args.top]:
                print(f"  {v:7,d}  {key}")
    # a proxy for memory traffic: on a GPU most of these ops are bandwidth-bound, so bytes written ~ time
    for ph in ("forward", "backward"):
        total = sum(v for (p_, _), v in census.written.items() if p_ == ph)
        print(f"\n{ph}: most bytes written, by k3 line and op ({total / 2**20:,.1f} MiB in all)")
        for (p_, key), v in [kv for kv in census.written.most_common() if kv[0][0] == ph][: args.top]:
            print(f"  {v / 2**20:9,.2f} MiB  {key}")


if __name__ == "__main__":
    main()
