"""Run a benchmark script with k3 launch settings changed (session 19's scripts).

    python benchmarks/sessions/with_settings.py "attn_res.READ_TILES.bwd_per_sm=8;..." benchmarks/train_throughput.py ARGS

Each `module.DICT.key=value` sets one key of a dict in `k3.ops.<module>` (value as a Python literal); an empty
string runs the script unchanged.
"""

import ast
import importlib
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

settings, script, *args = sys.argv[1:]
for item in filter(None, settings.split(";")):
    target, value = item.split("=", 1)
    module, table, key = target.split(".")
    getattr(importlib.import_module(f"k3.ops.{module}"), table)[key] = ast.literal_eval(value)
    print(f"setting k3.ops.{module}.{table}[{key!r}] = {value}", flush=True)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
