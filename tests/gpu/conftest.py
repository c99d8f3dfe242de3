"""Shared by the GPU tests: TF32 off (so fp32 comparisons stay fp32), and the config with every GPU fast path."""

import pytest
import torch

from k3.config import get_preset


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def gpu_config(preset: str = "debug", **kw):
    """`preset` with every GPU fast path: Triton KDA, AttnRes, SiTU and norm kernels, SDPA, grouped experts."""
    return get_preset(preset).replace(kda_impl="triton", attention_backend="sdpa", moe_impl="grouped",
                                      attn_res_impl="triton", situ_impl="triton", norm_impl="triton", **kw)
