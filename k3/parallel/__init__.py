"""Distributed training for K3, applied to the single-device model afterwards (issue 7, systems.md §5).

So far this package holds two single-process building blocks: the MoonEP expert-parallel planner
(`moonep.py`) and the KDA context-parallel math (`kcp.py`). The torch.distributed wiring is still to
come. See docs/distributed.md.
"""
