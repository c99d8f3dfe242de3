"""Run a benchmark script with k3 launch settings changed (session 19's scripts).

    python benchmarks/sessions/with_settings.py "attn_res.READ_TILES.bwd_per_sm=8;..." benchmarks/train_throughput.py ARGS

Each `module.DICT.key=value` sets one key of a dict in `k3.ops.<module>` (value as a Python literal); an empty
string runs the script unchanged.
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.step_ab import parse_setting  # noqa: E402

settings, script, *args = sys.argv[1:]
for mapping, key, value in parse_setting(settings):  # checked: an unknown key stops here
    mapping[key] = value
if settings:
    print(f"settings: {settings}", flush=True)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
