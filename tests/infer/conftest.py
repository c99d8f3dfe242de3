import pytest
import torch

from k3.config import get_preset
from k3.model.model import build_model


def every_path_matters(m):
    """Random AttnRes queries and router biases (zero at init), so every path of `m` matters; -> m in eval mode."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return m.eval()


@pytest.fixture(scope="session")
def model():
    """The debug preset in float32 with random AttnRes queries and router biases, so every path matters."""
    return every_path_matters(build_model(get_preset("debug"), seed=0))


@pytest.fixture(autouse=True)
def _one_thread_here(one_thread):
    """Every test in this folder runs with one intra-op thread (`one_thread`, tests/conftest.py)."""
