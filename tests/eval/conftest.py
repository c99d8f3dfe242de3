"""Fixtures for the evaluation tests: the debug preset with random weights and the tests' 512-token BPE
(`tokenizer`, tests/conftest.py), served by `k3.eval.endpoint.serve_local` as `k3 eval` serves a local model."""

from __future__ import annotations

import pytest

from k3.config import get_preset
from k3.model.model import build_model


@pytest.fixture(scope="session")
def model():
    return build_model(get_preset("debug"), seed=0).eval()


@pytest.fixture(scope="module")
def endpoint(model, tokenizer):
    from k3.eval.endpoint import serve_local

    with serve_local(model, tokenizer, "k3-debug", {"max_context": 2048}) as ep:
        yield ep


@pytest.fixture(autouse=True)
def _one_thread_here(one_thread):
    """Every test in this folder runs with one intra-op thread (`one_thread`, tests/conftest.py)."""
