"""`k3 recipe run`: the stages of a recipe, one after another, each its `k3` commands in processes of their own.

- Every stage works in DIR/<stage>/; its output (the command's own, progress bars included) goes to
  DIR/logs/<stage>.log, and its last line is shown under the progress view.
- DIR/recipe.json holds the recipe's text and each stage's state (status, exit code, seconds, attempts). A stage is
  complete when its commands exited 0 and its `outputs` exist; `--resume` continues at the first stage that is not.
  A stopped stage whose command continues runs (`resume` flags, or `--auto-resume` in the command) keeps its folder
  and continues from its checkpoint; any other unfinished stage starts again from an empty folder.
- A stage that fails stops the recipe: its last lines (the command's own message) are printed and the recipe exits
  with the stage's exit code. SIGINT / SIGTERM reach the running command (which stops at its next step with a
  checkpoint); the recipe then exits with the command's code. If the recipe itself dies, the kernel sends the
  command SIGTERM (PR_SET_PDEATHSIG), so no orphan keeps the stage's folder locked.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k3.recipe.recipe import Recipe, Stage, parse_recipe
from k3.runfolder import EXIT_REFUSED, EXIT_SYSTEM, RunFolder, check_writable_folder

STATE_FILE = "recipe.json"
LOGS = "logs"


def k3_command() -> list[str]:
    """How this installation is invoked as `k3` (the script beside this Python, else `python -m k3.cli`)."""
    script = Path(sys.executable).parent / "k3"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "k3.cli"]


def environment() -> dict:
    """Where the recipe runs: Python, torch, the machine, and the git revision of this k3 checkout."""
    root = Path(__file__).resolve().parents[2]
    revision = None
    try:
        revision = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if revision and dirty:
            revision += "+dirty"
    except (OSError, subprocess.SubprocessError):
        pass

    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"k3_revision": revision, "python": platform.python_version(), "torch": version("torch"),
            "platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "host": socket.gethostname()}


def load_state(out: Path) -> dict | None:
    path = out / STATE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def save_state(out: Path, state: dict) -> None:
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, out / STATE_FILE)


def outputs_exist(out: Path, stage: Stage) -> list[str]:
    """The stage's declared outputs that are missing (globs inside DIR/<stage>/)."""
    return [o for o in stage.outputs if not glob.glob(str(out / stage.name / o))]


def complete(out: Path, stage: Stage, state: dict) -> bool:
    return state["stages"].get(stage.name, {}).get("status") == "done" and not outputs_exist(out, stage)


def _continues(stage: Stage, folder: Path) -> bool:
    """Whether a stage that did not finish continues its run (else it starts again from an empty folder)."""
    command = stage.run[0] if isinstance(stage.run[0], str) else ""
    resumable = bool(stage.resume) or "--auto-resume" in shlex.split(command)
    checkpoint = glob.glob(str(folder / "checkpoints" / "step_*" / "COMMITTED"))
    return resumable and (folder / "run.json").is_file() and bool(checkpoint)


class StageFailed(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Runner:
    """Runs one recipe into one folder; `run()` returns the exit code."""

    def __init__(self, recipe: Recipe, out: Path, view):
        self.recipe, self.out, self.view = recipe, out, view
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None

    # the signal handlers: pass the signal to the running command, which stops at its next step with a checkpoint;
    # between commands the recipe stops before the next one
    def _handle(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def run(self, state: dict) -> int:
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run(state)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _run(self, state: dict) -> int:
        stages = self.recipe.stages
        state["status"] = "running"
        self.view.start(self.recipe, state)
        for index, stage in enumerate(stages):
            if complete(self.out, stage, state):
                self.view.skipped(index, stage, state["stages"][stage.name])
                continue
            record = state["stages"].setdefault(stage.name, {"seconds": 0.0, "attempts": 0})
            folder = self.out / stage.name
            continuing = folder.exists() and _continues(stage, folder)
            if folder.exists() and not continuing:
                shutil.rmtree(folder)
            record.update(status="running", attempts=record.get("attempts", 0) + 1, exit_code=None,
                          continued=continuing, started=time.strftime("%Y-%m-%d %H:%M:%S"))
            save_state(self.out, state)
            self.view.begin(index, stage, continuing)
            start = time.monotonic()
            try:
                self._run_stage(stage, continuing)
                missing = outputs_exist(self.out, stage)
                if missing:
                    raise StageFailed(EXIT_SYSTEM, f"{stage.name}: its commands exited 0 but its outputs are missing "
                                                   f"in {folder}: {', '.join(missing)}")
            except StageFailed as e:
                record.update(seconds=record["seconds"] + time.monotonic() - start, exit_code=e.code,
                              status="stopped" if e.code >= 128 else "failed", message=str(e))
                state["status"] = record["status"]
                save_state(self.out, state)
                self.view.failed(index, stage, e, self.out / LOGS / f"{stage.name}.log")
                return e.code
            record.update(seconds=record["seconds"] + time.monotonic() - start, exit_code=0, status="done",
                          finished=time.strftime("%Y-%m-%d %H:%M:%S"))
            record.pop("message", None)
            save_state(self.out, state)
            self.view.end(index, stage, record)
            if self.stop_signal is not None:  # the stage finished before it saw the signal: stop here
                state["status"] = "stopped"
                save_state(self.out, state)
                code = 128 + self.stop_signal
                stopped = StageFailed(code, f"stopped by {signal.Signals(self.stop_signal).name}")
                self.view.failed(index + 1, None, stopped, None)
                return code
        state["status"] = "done"
        save_state(self.out, state)
        self.view.finish(state)
        return 0

    def _env(self, stage: Stage) -> dict:
        # a stage's variables override the recipe's, which override the caller's environment
        return {**os.environ, **self.recipe.env, **stage.env}

    def _run_stage(self, stage: Stage, continuing: bool) -> None:
        (self.out / stage.name).mkdir(parents=True, exist_ok=True)
        log_path = self.out / LOGS / f"{stage.name}.log"
        log_path.parent.mkdir(exist_ok=True)
        with open(log_path, "ab") as log:
            for entry in stage.run:
                if self.stop_signal is not None:
                    raise StageFailed(128 + self.stop_signal, f"stopped by {signal.Signals(self.stop_signal).name}")
                if isinstance(entry, str):
                    words = shlex.split(self.recipe.expand(entry, self.out, stage))
                    if continuing and stage.resume:
                        words += shlex.split(stage.resume)
                    self._command(stage, words, log)
                elif "set_json" in entry:
                    path = Path(" ".join(shlex.split(self.recipe.expand(entry["set_json"], self.out, stage))))
                    set_json(path, entry["values"])
                    log.write(f"$ set {path}: {json.dumps(entry['values'])}\n".encode())
                else:
                    serve_probe(self, stage, entry, log)

    def _command(self, stage: Stage, words: list[str], log) -> None:
        argv = k3_command() + words[1:]
        log.write(f"$ {shlex.join(words)}\n".encode())
        log.flush()
        self.view.command(shlex.join(words))
        # the command writes to the log file itself (not a pipe), so its output and its clean stop outlive the recipe
        self.child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self._env(stage),
                                      preexec_fn=_die_with_parent)
        with open(log.name, "rb") as reader:
            reader.seek(0, os.SEEK_END)
            try:
                while (code := self.child.poll()) is None:
                    time.sleep(0.25)
                    lines = [s for s in re.split(rb"[\r\n]", reader.read()[-4000:]) if s.strip()]
                    if lines:
                        self.view.output(lines[-1].decode(errors="replace"))
            finally:
                if self.child.poll() is None:  # the recipe itself is failing: let the command stop cleanly
                    self.child.send_signal(signal.SIGTERM)
                    self.child.wait()
                self.child = None
        if code != 0:
            raise StageFailed(code if code > 0 else 128 - code, last_message(log.name))


def last_message(log_path: str | Path, lines: int = 6) -> str:
    """The last lines a command wrote (progress-bar redraws dropped): its own message on a failure."""
    text = Path(log_path).read_bytes()[-65536:].decode(errors="replace")
    kept = []
    for line in text.split("\n"):
        line = line.rsplit("\r", 1)[-1].rstrip()  # a progress bar's last redraw
        if line.strip():
            kept.append(line)
    return "\n".join(kept[-lines:])


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: receive SIGTERM when the recipe process dies (Linux), so it stops cleanly."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def set_json(path: Path, values: dict) -> None:
    """Set dotted keys ("text_config.qat") of a JSON file, as a user would edit it; missing objects are created."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StageFailed(EXIT_REFUSED, f"set_json: no file {path}") from None
    except ValueError as e:
        raise StageFailed(EXIT_REFUSED, f"set_json: {path} is not valid JSON ({e})") from None
    for key, value in values.items():
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path.write_text(json.dumps(data, indent=2) + "\n")


SERVE_PROMPTS = ["What is 7 * 8 + 13?", "Reverse the word 'kernel'.", "What is 45 - 17?", "Sort 5, 2, 9, 1.",
                 "How much do 3 apples at 4 each cost?", "Count the letter a in 'banana'.", "What is 12 + 30?",
                 "What is 9 * 9?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def serve_probe(runner: Runner, stage: Stage, entry: dict, log) -> None:
    """`k3 serve` the model as a user would, send `requests` chat completions at once (greedy, `max_tokens` each),
    and write DIR/<stage>/serve.json (or `file`): generated tokens per second over the batch and for one request,
    the drafted tokens accepted and rejected (with `--draft` in `args`), the command."""
    out = runner.out
    model = runner.recipe.expand(entry["serve"], out, stage)
    extra = shlex.split(runner.recipe.expand(entry.get("args", ""), out, stage))
    requests, max_tokens = int(entry.get("requests", 8)), int(entry.get("max_tokens", 64))
    port = _free_port()
    words = ["k3", "serve", "--checkpoint", *shlex.split(model), "--port", str(port), "--log-level", "warning", *extra]
    log.write(f"$ {shlex.join(words)}\n".encode())
    log.flush()
    runner.view.command(shlex.join(words))
    server = subprocess.Popen(k3_command() + words[1:], stdout=log, stderr=subprocess.STDOUT,
                              env=runner._env(stage), preexec_fn=_die_with_parent)
    runner.child = server
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        name = None
        while name is None:
            if server.poll() is not None:
                raise StageFailed(server.returncode or EXIT_SYSTEM, last_message(log.name))
            if time.monotonic() > deadline:
                raise StageFailed(EXIT_SYSTEM, f"k3 serve did not answer on {base} within 10 minutes")
            if runner.stop_signal is not None:
                raise StageFailed(128 + runner.stop_signal, "stopped before the server was up")
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                    name = json.loads(r.read())["data"][0]["id"]
            except OSError:
                time.sleep(0.5)
        runner.view.output(f"k3 serve is up on {base}: {requests} requests of {max_tokens} tokens")

        drafted = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}

        def one(i: int) -> tuple[int, float]:
            t = time.monotonic()
            prompt = SERVE_PROMPTS[i % len(SERVE_PROMPTS)]
            reply = _post(f"{base}/v1/chat/completions",
                          {"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                           "temperature": 0}, timeout=1800)
            details = reply["usage"].get("completion_tokens_details") or {}
            for key in drafted:
                drafted[key] += details.get(key) or 0
            return reply["usage"]["completion_tokens"], time.monotonic() - t

        one(0)  # warm-up: the first request pays for lazy initialisation
        start = time.monotonic()
        with ThreadPoolExecutor(requests) as pool:
            done = list(pool.map(one, range(requests)))
        wall = time.monotonic() - start
        single_tokens, single_s = one(0)
    except OSError as e:
        if runner.stop_signal is not None:
            name = signal.Signals(runner.stop_signal).name
            raise StageFailed(128 + runner.stop_signal, f"stopped by {name}") from None
        raise StageFailed(EXIT_SYSTEM, f"k3 serve on {base}: {e}") from None
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        runner.child = None
    tokens = sum(t for t, _ in done)
    command = shlex.join(["k3", "serve", "--checkpoint", *shlex.split(model), *extra])
    result = {"command": command, "requests": requests, "max_tokens": max_tokens, "completion_tokens": tokens,
              "seconds": wall, "tokens_per_s": tokens / wall if wall else None,
              "single_request_tokens_per_s": single_tokens / single_s if single_s else None,
              "mean_request_s": sum(s for _, s in done) / len(done), **drafted}
    (out / stage.name / entry.get("file", "serve.json")).write_text(json.dumps(result, indent=1) + "\n")


def start_recipe(recipe: Recipe | None, out: Path, resume: bool, view) -> int:
    """Check the folder and the state, lock DIR, run. Refusals raise ValueError (exit 2)."""
    check_writable_folder(out)
    state = load_state(out)
    if state is not None and not resume:
        raise ValueError(f"{out} holds a recipe run ({state.get('recipe')}, {state.get('status')}); add --resume to "
                         f"continue it, or choose another --out")
    if state is None and resume:
        if recipe is None:
            raise ValueError(f"{out} holds no recipe run ({STATE_FILE}) to resume")
        resume = False
    if state is not None:
        stored = parse_recipe(state["text"], f"{out / STATE_FILE}")
        if recipe is not None and recipe.text != stored.text:
            raise ValueError(f"{out} holds a run of another recipe text than {recipe.name!r}; resume it without a "
                             f"recipe name (its own recipe is in {STATE_FILE}) or choose another --out")
        recipe = stored
    elif out.exists() and any(p.name != "run.lock" for p in out.iterdir()):
        raise ValueError(f"--out {out} is not empty and holds no recipe run; choose an empty or new folder")
    with RunFolder(out, log=view.note) as folder:
        if state is None:
            state = {"recipe": recipe.name, "text": recipe.text, "environment": environment(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {}}
        else:
            state.setdefault("resumes", []).append(time.strftime("%Y-%m-%d %H:%M:%S"))
        save_state(out, state)
        folder.started()
        return Runner(recipe, out, view).run(state)
