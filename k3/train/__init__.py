"""Pre-training: settings (`config.py`), packed data (`data.py`), the loop (`loop.py`), the run folder and run.json
(`run_info.py`), where it runs (`runtime.py`), metrics and plots (`metrics.py`)."""
