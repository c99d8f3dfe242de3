"""Session 20: the routed experts' weight gradients at the small preset's shape (64 experts, L = 384, I = 320, 64K
tokens x top-8, Zipf-skewed routes), three ways: the kernel writing bf16 [G, 2I, L] (then the engine's cast and
add into fp32 .grad), the kernel adding into two fp32 outputs (w1's and w3's .grad: `grouped_mm_wgrad_into`),
and the whole expert function forward+backward with .grad present, in place on and off."""
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from k3.ops import grouped_gemm, moe  # noqa: E402
from k3.ops.weight_grads import OPTIONS, accumulating_weight_grads  # noqa: E402

E, L, I, N, k = 64, 384, 320, 65536, 8
g = torch.Generator().manual_seed(0)
logits = -0.7 * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
gumbel = -torch.log(-torch.log(torch.rand(N, E, generator=g).clamp_min(1e-20)))
idx = torch.topk(logits + gumbel, k, dim=-1).indices.cuda()
dest, offs, rows = moe.dispatch_plan(idx, E, moe.CUDA_ALIGN)
dh = torch.randn(rows, 2 * I, device="cuda", dtype=torch.bfloat16)
x = torch.randn(rows, L, device="cuda", dtype=torch.bfloat16)
g1 = torch.zeros(E, I, L, device="cuda")
g3 = torch.zeros(E, I, L, device="cuda")
flops = 2 * rows * 2 * I * L


def bf16_then_engine():
    dw = grouped_gemm.grouped_mm_wgrad(dh.t(), x, offs)
    g1.add_(dw[:, :I])
    g3.add_(dw[:, I:])


g13 = torch.zeros(E, 2 * I, L, device="cuda")
cases = [("kernel, bf16 out", lambda: grouped_gemm.grouped_mm_wgrad(dh.t(), x, offs)),
         ("kernel bf16 + cast/add into fp32 .grad", bf16_then_engine),
         ("kernel adding into two fp32 .grad", lambda: grouped_gemm.grouped_mm_wgrad_into(dh.t(), x, offs, [g1, g3],
                                                                                         True)),
         ("kernel adding into one fp32 [G, 2I, L]", lambda: grouped_gemm.grouped_mm_wgrad_into(dh.t(), x, offs, [g13],
                                                                                              True))]
for name, fn in cases:
    ms = triton.testing.do_bench(fn, warmup=10, rep=100)
    print(f"dW13 {name:42s} {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)

# the whole function, .grad present (a later micro-batch)
w1 = torch.nn.Parameter(torch.randn(E, I, L, device="cuda") * 0.05)
w3 = torch.nn.Parameter(torch.randn(E, I, L, device="cuda") * 0.05)
w2 = torch.nn.Parameter(torch.randn(E, L, I, device="cuda") * 0.05)
for p in (w1, w3, w2):
    p.grad = torch.zeros_like(p)
z = torch.randn(N, L, device="cuda", requires_grad=True)
wts = torch.rand(N, k, device="cuda")
dy = torch.randn(N, L, device="cuda")


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = moe.grouped_latent_experts(z, idx, wts, w1, w3, w2, 4.0, 25.0)
    with accumulating_weight_grads():
        y.backward(dy)


for on in (True, False, True, False):
    OPTIONS["in_place"] = on
    ms = triton.testing.do_bench(step, warmup=5, rep=100)
    print(f"experts fwd+bwd, .grad present, in place {on!s:5s} {ms:7.3f} ms", flush=True)
OPTIONS["in_place"] = True
