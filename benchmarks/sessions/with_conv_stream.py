"""Run a benchmark script with the short conv's streaming kernels at one setting (session 18's scripts).

    python benchmarks/sessions/with_conv_stream.py SEGxBCxWARPSxSTAGES benchmarks/train_throughput.py ARGS...

An empty setting runs the script unchanged (the tile kernels, k3's default until the stream forms are measured).
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

setting, script, *args = sys.argv[1:]
if setting:
    import k3.ops.short_conv as short_conv

    short_conv._CONV_FWD_STREAM = short_conv._CONV_BWD_STREAM = tuple(map(int, setting.split("x")))
    print(f"short conv: streaming kernels at {short_conv._CONV_BWD_STREAM}", flush=True)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
