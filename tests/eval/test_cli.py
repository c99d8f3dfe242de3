"""`k3 eval` and `k3 ablate` from the command line: a local model (preset:debug) served and evaluated end to end,
results.json and the plots written, the table printed; bad input is one line and exit code 2."""

from __future__ import annotations

import json

import pytest

from k3.cli import main


def test_eval_end_to_end(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    text = tmp_path / "heldout.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 30)
    out = tmp_path / "out"
    code = main(["eval", "preset:debug", "--tasks", "k3_python_mc,passkey,perplexity", "--limit", "2",
                 "--lengths", "1024", "--depths", "0,1", "--probes-per-cell", "1", "--text", str(text),
                 "--window", "128", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["tasks"]) == {"k3_python_mc", "passkey", "perplexity"}
    assert results["n"]["k3_python_mc"] == 2 and results["n"]["passkey"] == 2
    assert results["tasks"]["perplexity"]["bits_per_byte"] > 0
    assert (out / "passkey.png").exists() and (out / "perplexity_by_position.png").exists()
    printed = capsys.readouterr().out
    assert "k3_python_mc" in printed and "bits_per_byte" in printed


def test_bad_model_is_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nothing"), "--tasks", "passkey"]) == 2
    err = capsys.readouterr().err
    assert "neither a URL" in err and "Traceback" not in err
    assert main(["eval", "http://127.0.0.1:9", "--tasks", "passkey"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_ablate_list(capsys):
    assert main(["ablate", "list"]) == 0
    printed = capsys.readouterr().out
    assert "attn-res" in printed and "kda-gate-bound" in printed
