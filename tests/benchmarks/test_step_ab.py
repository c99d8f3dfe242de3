"""benchmarks/step_ab.py's settings: parsed against the real k3.ops dicts, applied for one step and restored, bad
ones refused with the keys that exist."""

import pytest

from benchmarks.step_ab import Applied, parse_setting
from k3.ops import attn_res, weight_grads


def test_settings_apply_for_the_block_and_restore():
    items = parse_setting("weight_grads.OPTIONS.in_place=False; attn_res.READ_TILES.bwd_per_sm=8")
    before = (weight_grads.OPTIONS["in_place"], attn_res.READ_TILES["bwd_per_sm"])
    with Applied(items):
        assert weight_grads.OPTIONS["in_place"] is False and attn_res.READ_TILES["bwd_per_sm"] == 8
    assert (weight_grads.OPTIONS["in_place"], attn_res.READ_TILES["bwd_per_sm"]) == before
    assert parse_setting("") == []


@pytest.mark.parametrize("text", ["attn_res.READ_TILES.no_such_key=256", "attn_res.READ_TILES=1",
                                  "weight_grads.OPTIONS"])
def test_bad_settings_are_refused(text):
    with pytest.raises(SystemExit):
        parse_setting(text)
