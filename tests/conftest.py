import os
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


def pytest_configure(config):
    # pytest-xdist workers share the machine's cores: each gets its share of intra-op threads, inherited by the
    # commands tests start (two 2-thread workers on 2 cores ran some tests 10-30x slower than one thread each)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restored after: engine and RL steps here are tiny, and on a shared machine
    spinning OpenMP threads make them tens of times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
