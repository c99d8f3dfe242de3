"""The model, the KDA fast path and one training step on CUDA, against the CPU float32 results."""

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_preset
from k3.model.model import build_model
from k3.ops.kda import naive_recurrent_kda, torch_chunk_kda
from tests.ops.test_kda_reference import make_inputs, rel_err

pytestmark = pytest.mark.gpu


def test_torch_chunk_kda_on_cuda_matches_fp64_recurrence():
    """fp32 on the GPU (TF32 off) vs the fp64 CPU recurrence: relative error ≤ 1e-5."""
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v, g, beta, S0 = make_inputs(2, 700, 4, 64, 64, seed=1)
    ref, ref_S = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    cu = torch.tensor([0, 300, 301, 700]).cuda()
    tri, tri_S = torch_chunk_kda(*(x.float().cuda() for x in (q, k, v, g, beta)), initial_state=S0.float().cuda(),
                                 output_final_state=True)
    assert rel_err(tri.cpu(), ref) <= 1e-5 and rel_err(tri_S.cpu(), ref_S) <= 1e-5
    packed, _ = torch_chunk_kda(*(x[:1].float().cuda() for x in (q, k, v, g, beta)), cu_seqlens=cu)
    assert torch.isfinite(packed).all()


def test_debug_model_on_cuda_matches_cpu():
    """Same weights, fp32 on both devices (TF32 off): logits agree to 1e-4 relative."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = get_preset("debug")
    cpu = build_model(cfg, seed=0)
    gpu = build_model(cfg, seed=0, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = cpu(ids).logits
        b = gpu(ids.cuda()).logits.cpu()
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-4


def test_bf16_training_step_on_cuda():
    from k3.optim import MuonAdamW

    cfg = get_preset("debug")
    model = build_model(cfg, seed=0, device="cuda")
    opt = MuonAdamW(model.named_parameters(), cfg, lr=1e-2)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, return_router_infos=True).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
