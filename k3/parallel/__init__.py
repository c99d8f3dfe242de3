"""Distributed training for K3, applied to the single-device model afterwards (docs/distributed.md; docs/distributed.md).

`runtime.py` (process group, mesh, how a global batch is cut), `parallelize.py` (EP → CP → activation
checkpointing → FSDP2, the per-step reductions and DCP checkpoints), `expert_parallel.py` with the MoonEP planner
(`moonep.py`), `context_parallel.py` with the KCP math (`kcp.py`), and P2P Muon (`muon.py`).
"""
