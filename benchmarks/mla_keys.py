"""MLA's per-head keys and values: the Triton pair (`k3.ops.mla_keys.expand_keys`) against the torch cats it
replaces (`naive_expand_keys` under autograd), forward and forward + backward, at a 64K-token step of the small
preset (H = 8, N = 64, P = 64, Vd = 128) and of K3's width (H = 96 heads at 8K tokens). Checked first: k, v and
d(kv) bit for bit, dk_pe within 1e-2 relative of the fp64 sum.

    python -m benchmarks.mla_keys          # one GPU: table "keys" of benchmarks/results/mla-keys-<device>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.ops.mla_keys import expand_keys, naive_expand_keys  # noqa: E402

ROWS: list[list] = []  # the rows of the results file, as measured

SHAPES = [("small 64K", 65536, 8), ("K3 8K", 8192, 96)]
N, P, VD, C = 64, 64, 128, 512


def case(label: str, R: int, H: int) -> bool:
    from triton.testing import do_bench

    g = torch.Generator(device="cuda").manual_seed(H)
    kv = torch.randn(R, H * (N + VD), device="cuda", generator=g).to(torch.bfloat16).view(R, H, N + VD)
    k_pe = torch.randn(R, C + P, device="cuda", generator=g).to(torch.bfloat16)[:, C:]
    dk = torch.randn(R, H, N + P, device="cuda", generator=g).to(torch.bfloat16)
    dv = torch.randn(R, H, VD, device="cuda", generator=g).to(torch.bfloat16)
    leaves = [kv.clone().requires_grad_(), k_pe.clone().requires_grad_()]
    grads = {}
    for name, fn in (("torch", naive_expand_keys), ("triton", expand_keys)):
        k, v = fn(*leaves, N)
        grads[name] = (k.detach(), v.detach()) + torch.autograd.grad((k, v), leaves, (dk, dv))
    ref, tri = grads["torch"], grads["triton"]
    dpe64 = dk[..., N:].double().sum(1)
    ok = all(torch.equal(a, b) for a, b in zip(ref[:3], tri[:3])) and \
        ((tri[3].double() - dpe64).norm() / dpe64.norm()).item() < 1e-2
    if not ok:
        print(f"[mla_keys] {label}: FAILED the correctness gate", flush=True)
        return False
    times = {}
    for name, fn in (("torch", naive_expand_keys), ("triton", expand_keys)):
        with torch.no_grad():
            fwd = do_bench(lambda: fn(kv, k_pe, N), warmup=10, rep=100)

        def both():
            k, v = fn(*leaves, N)
            torch.autograd.grad((k, v), leaves, (dk, dv))

        times[name] = (fwd, do_bench(both, warmup=10, rep=100) - fwd)
    gb = R * H * (N + VD + N + P + VD) * 2 / 1e9  # forward: read kv, write k and v (k_pe's read is small)
    for name, (fwd, bwd) in times.items():
        print(f"[mla_keys] {label} R={R} H={H} {name:6s}: fwd {fwd * 1e3:7.1f} us ({gb / fwd * 1e3:,.0f} GB/s), "
              f"bwd {bwd * 1e3:7.1f} us", flush=True)
    (tf, tb), (rf, rb) = times["triton"], times["torch"]
    print(f"[mla_keys] {label}: torch / triton = fwd {rf / tf:.2f}x, bwd {rb / tb:.2f}x", flush=True)
    ROWS.append([label, R, H, round(rf * 1e3, 1), round(tf * 1e3, 1), round(gb / tf * 1e3), f"{rf / tf:.2f}×",
                 round(rb * 1e3, 1), round(tb * 1e3, 1), f"{rb / tb:.2f}×"])
    return True


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (tests/ops/test_mla_keys.py checks the kernels in the interpreter)")
        return 0
    ok = all([case(*s) for s in SHAPES])
    save_result("mla-keys", "MLA's keys and values from the latent (`k3.ops.mla_keys.expand_keys`): one Triton pass "
                "each way against torch's concatenations", {"keys": table(
                    ["case", "rows", "heads", "torch fwd µs", "Triton fwd µs", "Triton fwd GB/s", "fwd speed-up",
                     "torch bwd µs", "Triton bwd µs", "bwd speed-up"], ROWS)})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
