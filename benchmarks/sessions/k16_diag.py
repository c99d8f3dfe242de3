"""Session 7, run 8: which inputs make `_bwd_vu` fault on the H200 (run 7: K = 16, V = 32, tiny documents)?
Each case runs in its own process (a fault poisons the CUDA context) with CUDA_LAUNCH_BLOCKING=1, and prints
ok/fault and the worst relative error against the fp64 recurrence.
    python benchmarks/sessions/k16_diag.py"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "K16 V32 dense T=130": (16, 32, None, 130),
    "K16 V64 dense T=130": (16, 64, None, 130),
    "K32 V32 tiny docs": (32, 32, [1, 0, 2, 64, 3, 1, 70, 16], None),
    "K16 V32 tiny docs": (16, 32, [1, 0, 2, 64, 3, 1, 70, 16], None),
    "K16 V32 docs 64,70": (16, 32, [64, 70], None),
    "K64 V64 tiny docs": (64, 64, [1, 0, 2, 64, 3, 1, 70, 16], None),
}
# run 9: is it `_bwd_vu`'s software pipeline (one loop trip at V = BV = 32)?
TUNINGS = {"K16 V32 dense T=130, bwd_v_stages 1": ("K16 V32 dense T=130", {"bwd_v_stages": 1}),
           "K16 V32 dense T=130, bwd_v_bv 16": ("K16 V32 dense T=130", {"bwd_v_bv": 16})}


def one(name):
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.ops.test_kda_triton import NAMES, make_raw, rel_err, run_both

    from k3.ops.kda import triton_chunk as tc

    base, overrides = TUNINGS.get(name, (name, {}))
    tc.TUNING.update(overrides)
    K, V, lengths, T = CASES[base]
    cu = None
    if lengths is not None:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        inputs = make_raw(1, cu[-1], 2, K, V, seed=5, N=len(lengths))
    else:
        inputs = make_raw(1, T, 2, K, V, seed=5)
    (o, S, g), (ro, rS, rg) = run_both(inputs, "cuda", cu_seqlens=cu)
    torch.cuda.synchronize()
    errs = {"o": rel_err(o.cpu(), ro), "S": rel_err(S.cpu(), rS)}
    errs.update({n: rel_err(a.cpu(), r) for n, a, r in zip(NAMES, g, rg)})
    print(f"{name}: ok, worst {max(errs, key=errs.get)} {max(errs.values()):.1e}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        one(sys.argv[2])
    else:
        for name in sys.argv[1:] or list(CASES) + list(TUNINGS):
            r = subprocess.run([sys.executable, __file__, "--one", name], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}, timeout=120)
            if r.returncode:
                kernel = [ln for ln in r.stderr.splitlines() + r.stdout.splitlines() if "triton_chunk.py" in ln]
                print(f"{name}: FAULT (rc {r.returncode}); last k3 frame: {kernel[-1].strip() if kernel else '?'}")
                print("   ", (r.stdout + r.stderr).strip().splitlines()[-1][:200])
            else:
                print(r.stdout.strip())
