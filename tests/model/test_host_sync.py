"""The training forward and backward of the GPU configuration never wait for the device.

A host sync (`.item()`, `.tolist()`, `bool(t)`, `bincount`, `nonzero`, `repeat_interleave` without
`output_size`, …) drains the GPU queue: the host stops launching until the device catches up, so host and
device time add up instead of overlapping. The small preset's step is host-bound (docs/fast-paths.md),
which makes every sync inside the layers cost GPU idle time.

The check runs on CPU: a function mode and a dispatch mode record every call that would sync on CUDA
made directly by k3 code (calls from Triton's interpreter or from torch internals are not ours). The
one allowed place is the model's entry, which validates the token ids and reads `cu_seqlens` once per
forward (`SequenceLayout.build`); nothing per layer, in forward, recompute or backward.

The fused Triton kernels run through the interpreter, so the test re-runs itself with TRITON_INTERPRET=1.
"""

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from k3.config import get_preset
from k3.model.checkpointing import apply_activation_checkpointing
from k3.model.model import build_model
from tests.interpreter import INTERPRETING, rerun_in_interpreter

ROOT = Path(__file__).resolve().parents[2]
K3 = str(ROOT / "k3") + os.sep

SYNCING_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
                   torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}
SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::unique",
               "aten::_unique2", "aten::unique_consecutive", "aten::masked_select", "aten::equal",
               "aten::repeat_interleave"}  # repeat_interleave only without output_size (checked below)
ALLOWED = {("k3/model/model.py", "forward"), ("k3/model/sequence.py", "build")}  # once per forward
# CPU stand-ins for CUDA-only kernels: the grouped GEMM loops run where torch._grouped_mm's bf16 CUDA path
# does not (tests/gpu/test_fast_paths.py checks the CUDA MoE under torch.cuda.set_sync_debug_mode("error"))
CPU_ONLY = {("k3/ops/grouped_gemm.py", "grouped_mm_reference"),
            ("k3/ops/grouped_gemm.py", "grouped_mm_wgrad_reference")}


def _caller():
    """The first frame outside torch and this file: (path relative to the repo, function), or None if
    that frame is not k3 code (e.g. Triton's interpreter reading a tensor)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename == __file__ or f"{os.sep}torch{os.sep}" in frame.filename:
            continue
        if frame.filename.startswith(K3):
            return os.path.relpath(frame.filename, ROOT), frame.name, frame.lineno
        return None
    return None


class SyncRecorder(TorchFunctionMode):
    """Records (file, function, line, call) for every would-be device sync made by k3 code."""

    def __init__(self):
        super().__init__()
        self.hits = []
        self.dispatch = _DispatchRecorder(self.hits)

    def __enter__(self):
        self.dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.dispatch.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_METHODS:
            where = _caller()
            if where is not None:
                self.hits.append((*where, func.__name__))
        return func(*args, **(kwargs or {}))


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, hits):
        super().__init__()
        self.hits = hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        kwargs = kwargs or {}
        if name in SYNCING_OPS and not (name == "aten::repeat_interleave" and kwargs.get("output_size") is not None):
            where = _caller()
            if where is not None:
                self.hits.append((*where, name))
        return func(*args, **kwargs)


def _gpu_config():
    # every fast path the GPU picks under "auto", chosen explicitly so the CPU runs the same code
    return get_preset("debug").replace(kda_impl="triton", attention_backend="sdpa", moe_impl="grouped",
                                       attn_res_impl="triton", situ_impl="triton", norm_impl="triton")


test_in_triton_interpreter = rerun_in_interpreter(__file__)


@pytest.mark.skipif(not INTERPRETING, reason="runs in the interpreter subprocess (test_in_triton_interpreter)")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_step_has_no_host_sync_per_layer(checkpointing):
    config = _gpu_config()
    model = build_model(config, seed=0)
    if checkpointing:
        apply_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    T = 96
    ids = torch.randint(0, 256, (2, T), generator=g)
    cu = torch.tensor([0, 17, 40, T, T + 65, 2 * T], dtype=torch.int32)  # packed documents, rows of T
    recorder = SyncRecorder()
    with recorder:
        out = model(ids, cu_seqlens=cu, return_router_infos=True, return_mla_max_logits=True)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
        loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n)  # the path ran
    per_layer = [h for h in recorder.hits if (h[0], h[1]) not in ALLOWED | CPU_ONLY]
    assert not per_layer, "host syncs inside the layers:\n" + "\n".join(map(str, per_layer))
    entry = {h[:3] for h in recorder.hits if (h[0], h[1]) in ALLOWED}
    assert len(entry) <= 2, entry  # the id range check and the one read of cu_seqlens


def test_recorder_sees_syncs():
    """The recorder itself: k3 code that syncs is caught, torch-internal calls are not blamed on k3."""
    from k3.model.quantile_balancing import expert_loads
    from k3.ops.short_conv import positions_in_documents

    recorder = SyncRecorder()
    with recorder:
        positions_in_documents(torch.tensor([0, 3, 5]), 5)  # output_size given: no sync
        expert_loads(torch.tensor([[0, 1]]), 4)  # scatter-add: no sync
    assert recorder.hits == []
    from k3.model.sequence import SequenceLayout

    with recorder:
        SequenceLayout.build(1, 5, torch.tensor([0, 3, 5]), "cpu")
    assert [h[3] for h in recorder.hits] == ["tolist"] and recorder.hits[0][:2] == ("k3/model/sequence.py", "build")
