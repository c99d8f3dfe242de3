#!/usr/bin/env bash
# Session 25, run 3 (one H200): `pipelined` enqueues every prepare before the first state pass (run 2's timeline:
# the second prepare started 68 µs after the first ended, waiting for the host). The pipeline's GPU tests (CUDA
# graph, side stream, bit-identical segments), the steady-state timeline (the last of three back-to-back calls)
# old order against new, then the order and the segment tails timed, rotated.
# As run, `pipelined` in the tree enqueued the producers first and the key "_interleaved" chose the old order; the
# order was then reverted (a tie at steady state) and the probe's key renamed, as below.
#     OUT=/tmp/out bash benchmarks/sessions/s25_run3.sh
. benchmarks/sessions/prelude.sh
{
step 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kda_triton_gpu.py \
    tests/ops/test_kda_triton.py -k "prefill or segment or pipelin"
step 120 python3 benchmarks/sessions/s25_timeline.py --shapes "1,8192,96;1,8192,64" \
    --configs '[{"_producers_first": true}, {}, {"prefill_segments": 3, "prefill_segment_tail": [0.5, 0.2]}]'
step 240 python3 benchmarks/sessions/s22_pipeline_probe.py --rounds 5 --rotate --no-accuracy \
    --shapes "B=1 T=8192 H=96,B=1 T=8192 H=64,B=1 T=32768 H=32" --out "$OUT/s25_run3_order.json" \
    --configs '[{"_producers_first": true}, {}, {"prefill_segment_tail": [0.5]},
                {"prefill_segments": 3, "prefill_segment_tail": [0.5, 0.2]},
                {"prefill_segments": 2, "prefill_segment_tail": [0.5, 0.25]},
                {"prefill_segment_tokens": 2730, "prefill_segment_tail": [0.5, 0.2]}]'
} 2>&1 | grep --line-buffered -v "Warning\|warn_once" > "$OUT/log.txt"
grep -v "^\s*$" "$OUT/log.txt" | grep -v "^\[fwd.*median" | tail -c 11500
