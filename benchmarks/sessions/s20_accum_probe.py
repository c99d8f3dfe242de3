"""Session 20: what gradient accumulation over micro-batches costs the small preset per micro-batch after the
first: for every parameter the engine's fp32 gradient (a bf16 product cast up) added into .grad, as
AccumulateGrad does, against the bare cast and an add of a bf16 gradient straight into fp32."""
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from k3.config import get_preset  # noqa: E402
from k3.model.model import build_model  # noqa: E402

model = build_model(get_preset("small"), seed=0, device=torch.device("cuda"))
params = [p for p in model.parameters() if p.requires_grad]
grads32 = [torch.zeros_like(p) for p in params]
g16 = [torch.randn_like(p, dtype=torch.bfloat16) for p in params]
n = sum(p.numel() for p in params)


def cast_then_add():
    for acc, g in zip(grads32, g16):
        acc += g.float()


def cast_only():
    for g in g16:
        g.float()


def add_mixed():
    for acc, g in zip(grads32, g16):
        acc.add_(g)


def foreach_mixed():
    torch._foreach_add_(grads32, g16)


print(f"{len(params)} parameters, {n / 1e6:.1f}M elements")
for name, fn in [("cast + add (AccumulateGrad)", cast_then_add), ("cast only", cast_only),
                 ("bf16 added into fp32", add_mixed), ("foreach bf16 into fp32", foreach_mixed)]:
    ms = triton.testing.do_bench(fn, warmup=5, rep=50)
    print(f"{name:32s} {ms:7.3f} ms per micro-batch")
