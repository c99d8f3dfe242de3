"""The Triton kernels of k3.ops outside KDA (SiTU-GLU, norms, AttnRes, MoE, router, short conv, loss rows) against
their fp64 references in the Triton interpreter on CPU: tests/ops/triton_interpreter_checks.py, run in a subprocess
(TRITON_INTERPRET must be set before triton is imported), on CPU tensors also on a GPU machine."""

import pytest

from tests.interpreter import rerun_in_interpreter

pytest.importorskip("triton")

test_triton_kernels_in_interpreter = rerun_in_interpreter("tests/ops/triton_interpreter_checks.py", on_gpu=True)
