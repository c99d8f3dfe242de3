"""`k3 recipe run` orchestration with cheap real stages: completion, refusal of a used folder, a failing stage that
stops the recipe with its own message and exit code, and a kill inside a middle stage followed by a resume that
redoes no completed stage and continues the stopped one from its checkpoint."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3.recipe.recipe import load_recipe, parse_recipe
from k3.recipe.run import Runner, last_message, set_json

K3 = [sys.executable, "-m", "k3.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")

CHEAP = """
name = "cheap"
about = "three cheap stages"
[env]
OMP_NUM_THREADS = "1"
[[stage]]
name = "data"
kind = "sft-data"
minutes = 0.1
run = ["k3 data make-sft --out {out}/sft.jsonl --problems 4"]
outputs = ["sft.jsonl"]
[[stage]]
name = "pretrain"
kind = "pretrain"
minutes = 0.5
run = ["k3 train --preset debug --data {stdlib}/json --out {out} --max-steps STEPS --seq-len 128 --tokens-per-step 512 --eval-every 1000 --checkpoint-every 1000 --auto-resume"]
env = { OMP_NUM_THREADS = "1" }
[[stage]]
name = "last"
kind = "sft-data"
minutes = 0.1
run = ["k3 data make-sft --out {out}/sft.jsonl --problems 2", { set_json = "{pretrain}/run.json", values = { "recipe_note.stage" = "last" } }]
outputs = ["sft.jsonl"]
"""


def _recipe(tmp_path: Path, steps: int = 3, text: str = CHEAP) -> Path:
    path = tmp_path / "cheap.toml"
    path.write_text(text.replace("STEPS", str(steps)))
    return path


def _run(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(K3 + ["recipe", "run", *map(str, args)], capture_output=True, text=True, env=ENV,
                          timeout=600, **kw)


def test_a_stage_environment_overrides_the_recipe_and_the_caller(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setenv("K3_RECIPE_TEST", "caller")
    recipe = parse_recipe(CHEAP.replace('OMP_NUM_THREADS = "1"', 'OMP_NUM_THREADS = "2"', 1))
    runner = Runner(recipe, tmp_path, view=None)
    data, pretrain = recipe.stages[0], recipe.stages[1]
    assert runner._env(data)["OMP_NUM_THREADS"] == "2"
    assert runner._env(pretrain)["OMP_NUM_THREADS"] == "1"
    assert runner._env(pretrain)["K3_RECIPE_TEST"] == "caller"


def test_cheap_recipe_runs_and_refuses_a_used_folder(tmp_path):
    out = tmp_path / "run"
    done = _run(_recipe(tmp_path), "--out", out, "--no-report")
    assert done.returncode == 0, done.stderr
    state = json.loads((out / "recipe.json").read_text())
    assert state["status"] == "done"
    assert [state["stages"][s]["status"] for s in ("data", "pretrain", "last")] == ["done"] * 3
    assert (out / "data" / "sft.jsonl").is_file() and (out / "logs" / "pretrain.log").is_file()
    assert json.loads((out / "pretrain" / "run.json").read_text())["recipe_note"] == {"stage": "last"}
    assert state["environment"]["python"]
    # a second run into the same folder is refused; --resume of a finished recipe does nothing
    again = _run(_recipe(tmp_path), "--out", out)
    assert again.returncode == 2 and "--resume" in again.stderr
    resumed = _run("--out", out, "--resume", "--no-report")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("done earlier") == 3


def test_failing_stage_stops_the_recipe_with_its_message(tmp_path):
    text = CHEAP.replace("k3 train --preset debug --data {stdlib}/json",
                         "k3 sft --from {dir}/nowhere --data {data}/sft.jsonl")
    out = tmp_path / "run"
    done = _run(_recipe(tmp_path, text=text), "--out", out, "--no-report")
    assert done.returncode == 2
    assert "nowhere" in done.stderr and "pretrain: stopped with exit code 2" in done.stderr
    state = json.loads((out / "recipe.json").read_text())
    assert state["status"] == "failed"
    assert state["stages"]["pretrain"]["exit_code"] == 2 and "nowhere" in state["stages"]["pretrain"]["message"]
    assert "last" not in state["stages"] and not (out / "last").exists()


def _wait_gone(pid: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise AssertionError(f"process {pid} is still running")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_kill_in_a_middle_stage_then_resume(tmp_path, signum):
    """SIGTERM reaches the running command through the recipe; SIGKILL of the recipe reaches it through the kernel
    (PR_SET_PDEATHSIG). Either way the command stops with a checkpoint and --resume continues it."""
    out = tmp_path / "run"
    proc = subprocess.Popen(K3 + ["recipe", "run", str(_recipe(tmp_path, steps=12)), "--out", str(out),
                                  "--no-report"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    metrics = out / "pretrain" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    data_mtime = (out / "data" / "sft.jsonl").stat().st_mtime_ns
    command = json.loads((out / "pretrain" / "run.lock").read_text())["pid"]
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    _wait_gone(command)
    state = json.loads((out / "recipe.json").read_text())
    assert state["stages"]["data"]["status"] == "done"
    if signum == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert state["stages"]["pretrain"]["status"] == "stopped"
    else:  # the recipe had no chance to record the stop
        assert proc.returncode == -signal.SIGKILL and state["stages"]["pretrain"]["status"] == "running"
    assert "stopped by SIGTERM" in (out / "logs" / "pretrain.log").read_text()
    stopped_at = json.loads((out / "pretrain" / "run.json").read_text())
    checkpoints = sorted((out / "pretrain" / "checkpoints").glob("step_*/COMMITTED"))
    assert checkpoints, "k3 train stops with a checkpoint"
    assert int(checkpoints[-1].parent.name.split("_")[1]) < 12
    assert stopped_at["train_config"]["max_steps"] == 12

    done = _run("--out", out, "--resume", "--no-report")
    assert done.returncode == 0, done.stderr
    assert "data: done earlier" in done.stderr and "pretrain: continuing its stopped run" in done.stderr
    assert (out / "data" / "sft.jsonl").stat().st_mtime_ns == data_mtime
    state = json.loads((out / "recipe.json").read_text())
    assert state["stages"]["pretrain"]["attempts"] == 2 and state["status"] == "done"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 12, "the resumed run continues, it does not start again"


def test_recipe_files_parse_and_refuse_bad_input(tmp_path):
    for name in ("debug", "tiny", "small"):
        recipe = load_recipe(name)
        kinds = {s.kind for s in recipe.stages}
        assert {"pretrain", "sft-data", "sft", "rl", "qat", "mopd", "export", "draft", "eval", "serve"} <= kinds
    with pytest.raises(ValueError, match="names no earlier stage"):
        parse_recipe('name = "x"\n[[stage]]\nname = "a"\nrun = ["k3 info --out {b}"]\n')
    with pytest.raises(ValueError, match="must start with k3"):
        parse_recipe('name = "x"\n[[stage]]\nname = "a"\nrun = ["rm -rf /"]\n')
    with pytest.raises(ValueError, match="kind must be one of"):
        parse_recipe('name = "x"\n[[stage]]\nname = "a"\nkind = "nope"\nrun = ["k3 info"]\n')
    with pytest.raises(ValueError, match="second stage"):
        parse_recipe('name = "x"\n[[stage]]\nname = "a"\nrun = ["k3 info"]\n[[stage]]\nname = "a"\nrun = ["k3 info"]\n')
    with pytest.raises(ValueError, match="no recipe named"):
        load_recipe("nope")


def test_shipped_recipes_commands_parse_with_k3s_parser(tmp_path, capsys):
    """Every command of every shipped recipe, with its resume flags, is one k3's own parser accepts (a misspelt flag
    in a recipe nobody has run on this machine, like `small`, fails here, not an hour into a GPU run)."""
    from k3.cli import build_parser

    parser = build_parser()
    for name in ("debug", "tiny", "small"):
        recipe = load_recipe(name)
        runner = Runner(recipe, tmp_path / name, view=None)
        for stage in recipe.stages:
            assert runner._env(stage)["OMP_NUM_THREADS"]
            for entry in stage.run:
                if isinstance(entry, str):
                    words = shlex.split(recipe.expand(entry, tmp_path / name, stage)) + shlex.split(stage.resume)
                elif "serve" in entry:
                    words = ["k3", "serve", "--checkpoint", "m", *shlex.split(recipe.expand(entry.get("args", ""),
                                                                                        tmp_path / name, stage))]
                else:
                    continue
                try:
                    parser.parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"{name}/{stage.name}: {shlex.join(words)}\n{capsys.readouterr().err}")


def test_set_json_and_last_message(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": {"hidden_size": 8}}))
    set_json(path, {"text_config.qat": "mxfp4", "new.key": 1})
    assert json.loads(path.read_text()) == {"text_config": {"hidden_size": 8, "qat": "mxfp4"}, "new": {"key": 1}}
    log = tmp_path / "log"
    log.write_bytes(b"start\nbar  10%\rbar  50%\rbar 100%\nk3 sft: error: --from x does not exist\n")
    assert last_message(log, 2) == "bar 100%\nk3 sft: error: --from x does not exist"


def test_progress_view_on_a_terminal():
    import io

    from rich.console import Console

    from k3.recipe.view import StageView

    recipe = load_recipe("debug")
    buffer = io.StringIO()
    view = StageView(Console(file=buffer, force_terminal=True, width=100))
    view.start(recipe, {"stages": {}})
    view.begin(2, recipe.stages[2], continuing=False)
    view.output("train debug:  50%|█████     | 2/4")
    rendered = view._render().plain
    assert rendered.startswith(f"stage 3 of {len(recipe.stages)}: sft") and "remaining ≈" in rendered
    assert "2/4" in rendered
    # remaining: the running stage's estimate (it has just started) plus every later stage's
    later = sum(s.minutes for s in recipe.stages[3:]) * 60 + recipe.stages[2].minutes * 60
    assert abs(view._remaining() - later) < 5
    view.end(2, recipe.stages[2], {"seconds": 1.0})
    view.finish({"stages": {"sft": {"seconds": 1.0}}})
    assert "[3/18] sft: done in" in buffer.getvalue()
