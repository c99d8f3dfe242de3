"""Kernels and their references. Shared here: where Triton kernels can run."""

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(t) -> bool:
    """A Triton kernel can take this tensor: it is on CUDA, or the interpreter runs kernels on CPU."""
    return t.is_cuda or interpreting()
