import random

import pytest
import torch

from k3.tokenizer import train_bpe


def _corpus(n: int = 300) -> list[str]:
    rng = random.Random(0)
    words = ["the", "model", "cat", "sat", "on", "a", "mat", "def", "return", "print", "weather", "Paris",
             "tool", "call", "hello", "world", "42", "3.14", "é", "你好", "(", ")", ":", "{", "}", "\n"]
    return [" ".join(rng.choice(words) for _ in range(60)) for _ in range(n)]


@pytest.fixture(scope="session")
def tokenizer():
    """A 512-token byte-level BPE with K3's special tokens, trained on a small mixed-script corpus."""
    return train_bpe(_corpus(), 512, show_progress=False)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
