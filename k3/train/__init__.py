"""Pre-training: packed data (`data.py`), the loop (`loop.py`), where it runs (`runtime.py`), metrics and plots
(`metrics.py`) (systems.md §1–§4)."""
