"""Parameter accounting against the release's arithmetic (docs/architecture.md §8.2)."""

import json
import subprocess
import sys

import pytest

from k3.config import get_preset
from k3.model.accounting import account

# docs/architecture.md §8.2 (the released tensor listing): 2,779,484,478,208 total, 104,189,614,848 active.
K3_TOTAL, K3_ACTIVE = 2_779_484_478_208, 104_189_614_848
# k3 stores A_log as [H] = 96 per KDA layer; the release zero-pads it to [128] (docs/architecture.md §9.4).
A_LOG_PADDING = 69 * (128 - 96)


def test_k3_parameter_counts_match_the_release_exactly():
    acc = account(get_preset("k3"), "k3")
    assert acc.total_params + A_LOG_PADDING == K3_TOTAL
    assert acc.active_params + A_LOG_PADDING == K3_ACTIVE
    assert abs(acc.total_params / 2.78e12 - 1) < 0.005
    assert abs(acc.active_params / 104.2e9 - 1) < 0.005
    c = acc.components
    assert c["moe_routed_experts"]["total"] == 2_722_740_830_208
    assert c["moe_routed_experts"]["active"] == 48_620_371_968
    assert c["mla"]["total"] == 5_572_706_304
    assert c["kda"]["total"] + 69 * 32 == 30_618_088_704
    assert c["embedding"]["active"] == 0 and c["lm_head"]["active"] == c["lm_head"]["total"]


def test_k3_cache_bytes():
    acc = account(get_preset("k3"))
    assert acc.mla_cache_bytes_per_token == 27_648  # 24 layers × 576 values × 2 B
    assert acc.kda_state_bytes_per_sequence == 69 * 96 * 128 * 128 * 4


@pytest.mark.parametrize("name, total, active", [("debug", 1.93e6, 1.17e6), ("tiny", 30.3e6, 10.5e6),
                                                 ("small", 854e6, 316e6)])
def test_preset_sizes(name, total, active):
    acc = account(get_preset(name))
    assert abs(acc.total_params / total - 1) < 0.01
    assert abs(acc.active_params / active - 1) < 0.01


def test_cli_info_json():
    out = subprocess.run([sys.executable, "-m", "k3.cli", "info", "--preset", "k3", "--json"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert isinstance(data["total_params"], int) and isinstance(data["active_params"], int)
    assert abs(data["total_params"] / 2.78e12 - 1) < 0.005
    assert abs(data["active_params"] / 104.2e9 - 1) < 0.005


def test_cli_errors_are_clear():
    out = subprocess.run([sys.executable, "-m", "k3.cli", "info", "--preset", "giant"], capture_output=True, text=True)
    assert out.returncode != 0 and "unknown preset 'giant'" in out.stderr
