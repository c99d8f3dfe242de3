"""Session-6 diagnostic for the GPU whole-model test
(tests/gpu/test_fast_paths.py::test_tiny_model_fast_paths_and_checkpointing_match_reference): for several token draws, each fast variant's worst gradient error against fp32 as a fraction of the test's budget
(1.5 × the bf16 reference stack's error + 1e-2). A fast path that adds error shows up in every draw; noise does not."""
import torch

from k3.config import get_preset
from k3.model.model import build_model
from tests.gpu.test_fast_paths import loss_and_grads, rel

torch.backends.cuda.matmul.allow_tf32 = False
base = get_preset("tiny")
ref_cfg = base.replace(moe_impl="reference", attention_backend="reference", attn_res_impl="direct",
                       situ_impl="reference", norm_impl="reference")
fast = base.replace(attention_backend="sdpa")
variants = {"fast": fast, "fast moe=reference": fast.replace(moe_impl="reference"),
            "fast norm=reference": fast.replace(norm_impl="reference"),
            "fast attnres=direct": fast.replace(attn_res_impl="direct")}
cu = torch.tensor([0, 100, 512, 900, 1024, 1536, 2048], device="cuda")
for seed in (5, 6, 7):
    ids = torch.randint(0, base.vocab_size, (4, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    _, g32 = loss_and_grads(build_model(ref_cfg, seed=0, device="cuda"), ids, cu, False)
    _, gref = loss_and_grads(build_model(ref_cfg, seed=0, device="cuda"), ids, cu, True)
    budget = {n: 1.5 * rel(gref[n], g32[n]) + 1e-2 for n in g32 if g32[n].norm() > 0}
    for name, cfg in variants.items():
        _, g = loss_and_grads(build_model(cfg, seed=0, device="cuda"), ids, cu, True)
        ratios = sorted(((rel(g[n], g32[n]) / b, n) for n, b in budget.items()), reverse=True)
        worst = ", ".join(f"{r:.2f} {n}" for r, n in ratios[:3])
        print(f"seed {seed} {name:22s} worst error/budget: {worst}", flush=True)
