"""The fused projections' backward (`k3.model.projections.fused_linears`): one x-gradient GEMM per wide output
slice, accumulated in place (here `SPLIT_BACKWARD_WIDTH` = 256; the default is 1024), against autograd's backward, which
concatenates every slice's gradient first (`SPLIT_BACKWARD_WIDTH` = None), at a 64K-token step of the small
preset: the KDA layer's six projections (q, k, v, gate 1024 each, β 8, decay input 128) and the shared SiTU MLP's
gate and up (320 each). Checked first against fp32 linears on the same bf16 inputs (relative error ≤ 1e-2).

    python -m benchmarks.fused_linears     # one GPU: table "backward" of benchmarks/results/fused-linears-<device>.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import save_result, table  # noqa: E402
from k3.model import projections  # noqa: E402

CASES = [("KDA projections", (1024, 1024, 1024, 1024, 8, 128)), ("shared MLP gate+up", (320, 320))]
TOKENS, D = 65536, 768
ROWS: list[list] = []  # the rows of the results file, as measured


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case(label, widths) -> bool:
    from triton.testing import do_bench

    torch.manual_seed(0)
    linears = tuple(nn.Linear(D, w, bias=False, device="cuda") for w in widths)
    x = torch.randn(TOKENS, D, device="cuda").to(torch.bfloat16)
    douts = [torch.randn(TOKENS, w, device="cuda").to(torch.bfloat16) for w in widths]
    params = [lin.weight for lin in linears]
    xf = x.float().requires_grad_()
    ref = torch.autograd.grad([xf @ p.t() for p in params], [xf] + params, [d.float() for d in douts])
    times, saved = {}, projections.SPLIT_BACKWARD_WIDTH
    try:
        for name, width in (("autograd cat", None), ("split", 256)):
            projections.SPLIT_BACKWARD_WIDTH = width
            xx = x.clone().requires_grad_()

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    outs = projections.fused_linears(xx, linears, row_multiple=16)
                return torch.autograd.grad(outs, [xx] + params, douts)

            errs = [rel(g, r) for g, r in zip(step(), ref)]
            if max(errs) > 1e-2:
                print(f"[fused_linears] {label} {name}: FAILED errors {[f'{e:.1e}' for e in errs]}", flush=True)
                return False
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                fwd = do_bench(lambda: projections.fused_linears(x, linears, row_multiple=16), warmup=10, rep=50)
            both = do_bench(step, warmup=10, rep=50)
            times[name] = (fwd, both - fwd)
            print(f"[fused_linears] {label} {name:12s}: fwd {fwd * 1e3:7.1f} us, bwd {(both - fwd) * 1e3:7.1f} us, "
                  f"errors {[f'{e:.1e}' for e in errs]}", flush=True)
    finally:
        projections.SPLIT_BACKWARD_WIDTH = saved
    print(f"[fused_linears] {label}: backward cat / split = {times['autograd cat'][1] / times['split'][1]:.2f}x",
          flush=True)
    for name, (fwd, bwd) in times.items():
        speedup = times["autograd cat"][1] / bwd
        ROWS.append([label, name, round(fwd * 1e3, 1), round(bwd * 1e3, 1), f"{speedup:.2f}×"])
    return True


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (tests/model/test_fast_model.py checks the function on CPU)")
        return 0
    ok = all([case(*c) for c in CASES])
    save_result("fused-linears", "The fused input projections' backward at 64K tokens: one concatenated gradient GEMM "
                "(autograd's cat) against one x-gradient GEMM per slice accumulated in place",
                {"backward": table(["projections", "backward form", "fwd µs", "bwd µs", "bwd speed-up"], ROWS)})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
