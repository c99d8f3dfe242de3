"""`k3 train` against what users do to it, on the debug preset: signals (real ones, to a real `k3 train` process),
a second trainer on the same folder, stale locks, resuming nothing, bad arguments and data, folders left by a
killed start, unfinished checkpoints, a full disk, non-finite router statistics, a longer run after the end, and a
moved run folder. Each asserts the one-line message, the exit code, that nothing the user had is lost and that
nothing stray is left."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k3.checkpoint import COMMITTED, latest_checkpoint, load_checkpoint, verify_checkpoint
from k3.cli import main
from k3.runfolder import LOCK_FILE, RunLock, disk_full
from k3.train.data import read_documents
from tests.train.test_loop import read_metrics, write_corpus

REPO = Path(__file__).resolve().parents[2]
# both runs of an exactness check in fresh processes with one thread: CPU reductions round alike
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def cli_args(corpus: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "debug", "--data", str(corpus), "--out", str(out), "--seq-len", "32",
            "--tokens-per-step", "128", "--vocab-size", "600", "--eval-every", "4", *extra]


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def k3_train(args: list[str], code: str | None = None) -> subprocess.Popen:
    """A real `k3 train` process; `code` runs first (in the same process) to slow a chosen stage down."""
    cmd = [sys.executable, "-m", "k3.cli", "train", *args] if code is None else [
        sys.executable, "-c", code + "\nfrom k3.cli import main\nsys.exit(main(['train'] + sys.argv[1:]))", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _started.append(proc)
    return proc


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"k3 train ended (exit {proc.returncode}) before {what}:\n{proc.stderr.read()}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [r["step"] for r in map(json.loads, path.read_text().splitlines()[:-1]) if r["kind"] == "train"]
    return max(steps, default=0)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`k3 <args>` in this process: (exit code, stdout, stderr); argparse refusals count as exit code 2."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_tidy(out: Path) -> None:
    """No temporary or unfinished file anywhere, every checkpoint committed, and the folder's lock released."""
    stray = [p for p in out.rglob("*") if p.name.endswith(".tmp") or ".tmp-" in p.name or ".old-" in p.name]
    assert not stray, stray
    for ckpt in (out / "checkpoints").iterdir():
        assert (ckpt / COMMITTED).exists(), ckpt
    lock = RunLock(out)
    assert lock.acquire() is None  # free, and released cleanly (no record of a holder left behind)
    lock.release()


def test_sigint_stops_at_a_step_boundary_with_a_checkpoint_and_resumes_exactly(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    args = cli_args(corpus, out, "--max-steps", "16", "--checkpoint-every", "100")
    proc = k3_train(args)
    wait_for(lambda: steps_logged(out) >= 2, proc, "step 2")

    # a second trainer, or a resume, while it runs: refused, naming the process, touching nothing
    for extra in ([], ["--resume"]):
        code, _, err = cli(capsys, "train", *args, *extra)
        assert code == 2 and f"in use by another k3 process (pid {proc.pid}" in err, err
        assert f"kill -INT {proc.pid}" in err and len(err.strip().splitlines()) == 1

    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    step = steps_logged(out)
    assert 2 <= step < 16
    assert f"stopped by SIGINT at step {step} of 16" in stderr
    # every step trained before the signal is in the checkpoint, and the plots show them
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt.name == f"step_{step:08d}"
    verify_checkpoint(ckpt)
    assert all((out / "plots" / name).stat().st_size > 1000 for name in ("loss.png", "optim.png"))
    assert_tidy(out)

    resume = shlex.split(stderr.split("resume with: ")[1].splitlines()[0])
    assert resume[:2] == ["k3", "train"] and resume[-1] == "--resume"
    resumed = subprocess.run([sys.executable, "-m", "k3.cli", *resume[1:]], cwd=REPO, env=ENV, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    straight_out = tmp_path / "straight"
    straight = subprocess.run([sys.executable, "-m", "k3.cli", "train",
                               *cli_args(corpus, straight_out, "--max-steps", "16", "--checkpoint-every", "100")],
                              cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr
    want, got = read_metrics(straight_out, "train"), read_metrics(out, "train")
    assert [r["step"] for r in got] == list(range(1, 17))
    for a, b in zip(want, got):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    assert_tidy(out)


SLOW_CHECKPOINT = """
import sys, time
import k3.train.loop as loop
real = loop.write_train_state
def slow(tmp, state, *args, **kwargs):
    if state["step"] > 2:  # checkpoint 2 is written normally; later ones hang until a signal ends them
        open(tmp.parent.parent / "saving", "w").close()
        time.sleep(120)
    return real(tmp, state, *args, **kwargs)
loop.write_train_state = slow
"""


def test_a_second_signal_stops_at_once_without_a_half_checkpoint(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    proc = k3_train(cli_args(corpus, out, "--max-steps", "1000", "--checkpoint-every", "2"), SLOW_CHECKPOINT)
    wait_for(lambda: steps_logged(out) >= 3, proc, "step 3")
    proc.send_signal(signal.SIGTERM)
    first = time.time()
    wait_for(lambda: (out / "saving").exists(), proc, "a checkpoint being written")
    (out / "saving").unlink()
    assert list((out / "checkpoints").glob("*.tmp")), "the checkpoint in progress"
    # a copy within a second counts as the same request (a launcher forwarding the terminal's signal)
    time.sleep(max(0.0, first + 1.2 - time.time()))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert "k3 train: stopped by SIGTERM at once; the last checkpoint is" in stderr
    assert "resume with: k3 train" in stderr and "--resume" in stderr
    # the half-written checkpoint is gone; checkpoint 2 is intact
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt.name == "step_00000002" and str(ckpt) in stderr
    load_checkpoint(ckpt)
    # the plots were drawn with checkpoint 2, so even a run stopped at once has them
    assert (out / "plots" / "loss.png").stat().st_size > 1000
    assert_tidy(out)


SLOW_START = """
import sys, time
import k3.tokenizer as tokenizer
real = tokenizer.Tokenizer.encode_batch
def slow(self, texts):
    open(sys.argv[-1] + ".preparing", "w").close()  # tells the test the corpus is half prepared
    time.sleep(120)
    return real(self, texts)
tokenizer.Tokenizer.encode_batch = slow
"""


def test_a_stop_while_starting_leaves_nothing_and_a_killed_start_is_rebuilt(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    marker = Path(f"{out}.preparing")
    args = cli_args(corpus, out, "--max-steps", "2", "--out", str(out))

    proc = k3_train(args, SLOW_START)
    wait_for(marker.exists, proc, "data preparation")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "k3 train: stopped by SIGINT before the run started (nothing to save)"
    assert not out.exists()  # the folder this start created is gone with it

    # SIGKILL mid-preparation leaves a folder without run.json: a rerun (here, even with --resume) rebuilds it
    marker.unlink()
    proc = k3_train(args, SLOW_START)
    wait_for(marker.exists, proc, "data preparation")
    proc.kill()
    proc.communicate()
    assert (out / LOCK_FILE).exists() and list((out / "data").glob(".train.tmp-*"))
    assert not (out / "run.json").exists()
    code, stdout, err = cli(capsys, "train", *args, "--resume")
    assert code == 0, err
    assert "never finished starting; starting it again" in stdout + err
    assert "taking over from a process that ended without releasing it" in stdout + err
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2]
    assert_tidy(out)


def test_a_held_lock_names_its_process_and_a_stale_one_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from k3.runfolder import RunLock; "
                               "RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)",
                               str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    _started.append(holder)
    assert holder.stdout.readline().strip() == "locked"
    corpus = write_corpus(tmp_path / "corpus")
    code, _, err = cli(capsys, "train", *cli_args(corpus, out, "--max-steps", "2"))
    assert code == 2 and f"in use by another k3 process (pid {holder.pid}" in err, err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    holder.kill()
    holder.wait()
    # the kernel dropped the dead holder's lock; its record remains and is reported, then replaced
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid
    code, stdout, err = cli(capsys, "train", *cli_args(corpus, out, "--max-steps", "2"))
    assert code == 0, err
    assert f"taking over from a process that ended without releasing it (pid {holder.pid}" in stdout + err
    assert_tidy(out)


def test_resume_needs_a_run_and_auto_resume_starts_one(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    missing = tmp_path / "missing"
    code, _, err = cli(capsys, "train", *cli_args(corpus, missing, "--resume"))
    assert code == 2 and "there is no run to resume in" in err and "it does not exist" in err, err
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = cli(capsys, "train", *cli_args(corpus, empty, "--resume"))
    assert code == 2 and "it is empty" in err, err
    assert list(empty.iterdir()) == []

    # what `make demo` runs: start when there is no run, and on a second call find it complete
    args = cli_args(corpus, empty, "--auto-resume", "--max-steps", "2")
    code, stdout, err = cli(capsys, "train", *args)
    assert code == 0 and "trained 2 steps" in stdout, err
    code, stdout, err = cli(capsys, "train", *args)
    assert code == 0 and "is complete (2 of 2 steps" in stdout, err
    code, _, err = cli(capsys, "train", *cli_args(corpus, empty, "--max-steps", "2"))
    assert code == 2 and "already holds a training run; pass --resume" in err
    # a run folder that lost its run.json is left alone, checkpoints and all
    (empty / "run.json").unlink()
    for resume in ([], ["--resume"], ["--auto-resume"]):
        code, _, err = cli(capsys, "train", *cli_args(corpus, empty, "--max-steps", "2", *resume))
        assert code == 2 and "holds checkpoints but no run.json" in err, err
    assert latest_checkpoint(empty / "checkpoints").name == "step_00000002"


def test_arguments_are_validated_before_anything_is_written(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    out = tmp_path / "run"
    cases = [(["--checkpoint-every", "0"], "argument --checkpoint-every: must be a positive int, got 0"),
             (["--eval-every", "0"], "argument --eval-every: must be a positive int"),
             (["--max-steps", "-3"], "argument --max-steps: must be a positive int"),
             (["--lr", "nan"], "argument --lr: must be a positive float"),
             (["--time-budget", "0"], "argument --time-budget: must be a positive float"),
             (["--micro-batches", "x"], "argument --micro-batches: invalid int value"),
             (["--seq-len", "1"], "seq_len >= 2"),
             (["--tokens-per-step", "100"], "must be a multiple of seq_len"),
             (["--vocab-size", "100"], "vocab_size must be at least 512"),
             (["--seed", "-1"], "seed must be >= 0"),
             (["--device", "tpu9"], "unknown device 'tpu9'"),
             (["--preset", "enormous"], "unknown preset"),
             (["--data", str(tmp_path / "absent")], "does not exist"),
             (["--out", str(a_file)], "is a file, not a folder"),
             (["--out", str(a_file / "run")], "cannot be created"),
             (["--resume", "--auto-resume"], "not allowed with argument")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA is not available"))
    before = sorted(tmp_path.rglob("*"))
    for extra, message in cases:
        code, _, err = cli(capsys, "train", *cli_args(corpus, out, "--max-steps", "2"), *extra)
        assert code == 2 and message in err, (extra, err)
        assert "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before and a_file.read_text() == "mine"


def test_data_errors_name_the_file_and_the_line_or_row_group(tmp_path, capsys):
    bad_utf8 = tmp_path / "bad.jsonl"
    bad_utf8.write_bytes(b'{"text": "fine"}\n{"text": "fine"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=rf"{bad_utf8}:3: not valid UTF-8"):
        read_documents(bad_utf8)
    bad_json = tmp_path / "json.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=rf"{bad_json}:2: expected a JSON object"):
        read_documents(bad_json)

    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ValueError, match=rf"{garbage}: not a readable Parquet file"):
        read_documents(garbage)
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "c"]}), numbers)
    assert [name for name, _ in read_documents(numbers)] == ["numbers.parquet:0", "numbers.parquet:1",
                                                              "numbers.parquet:3"]
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    with pytest.raises(ValueError, match=rf"{numbers}: row 0 \(row group 0\): 'text' must be a string"):
        read_documents(numbers)
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 50 for i in range(40)]}), damaged, row_group_size=20,
                   compression="snappy")
    chunk = pq.ParquetFile(damaged).metadata.row_group(1).column(0)
    data = bytearray(damaged.read_bytes())
    start = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size // 3
    data[start:start + chunk.total_compressed_size // 3] = b"\x17" * (chunk.total_compressed_size // 3)
    damaged.write_bytes(bytes(data))  # the middle of row group 1's pages: the footer and row group 0 stay readable
    with pytest.raises(ValueError, match=rf"{damaged}: row group 1 cannot be read"):
        read_documents(damaged)

    # through the command: one line, exit code 2, and no run folder left behind
    out = tmp_path / "run"
    code, _, err = cli(capsys, "train", *cli_args(bad_utf8, out, "--max-steps", "2"))
    assert code == 2 and f"{bad_utf8}:3: not valid UTF-8" in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_corpus_smaller_than_one_batch_writes_no_run(tmp_path, capsys):
    small = tmp_path / "small"
    small.mkdir()
    for i in range(3):
        (small / f"{i}.txt").write_text(f"tiny document {i}")
    out = tmp_path / "new" / "run"
    args = ["--max-steps", "1", "--tokens-per-step", "1024", "--seq-len", "256"]
    code, _, err = cli(capsys, "train", *cli_args(small, out, *args))
    assert code == 2 and "fewer than one batch" in err, err
    assert not (tmp_path / "new").exists()  # with the folders created for it
    # with enough data, the same command starts the run
    code, _, err = cli(capsys, "train", *cli_args(write_corpus(tmp_path / "corpus"), out, *args))
    assert code == 0, err
    assert_tidy(out)


def test_unfinished_checkpoints_and_leftovers_never_block_a_step(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    args = cli_args(corpus, out, "--max-steps", "4", "--checkpoint-every", "2")
    assert cli(capsys, "train", *args)[0] == 0
    # what a SIGKILL or a careless copy leaves: a checkpoint without its marker, a .tmp checkpoint, a half
    # prepared corpus and a half written metrics log
    (out / "checkpoints" / "step_00000004" / COMMITTED).unlink()
    (out / "checkpoints" / "step_00000006.tmp").mkdir()
    (out / "data" / ".train.tmp-12345").mkdir()
    (out / "metrics.jsonl.tmp").write_text("{")
    code, stdout, err = cli(capsys, "train", *args, "--resume")
    assert code == 0, err
    assert "removed what an interrupted process left unfinished: step_00000004, step_00000006.tmp" in stdout + err
    assert "resumed from" in stdout + err and "step_00000002 (step 2)" in stdout + err
    # step 4 was trained and checkpointed again where the unfinished one stood
    assert sorted(c.name for c in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2, 3, 4]
    assert_tidy(out)


def test_a_full_disk_removes_the_partial_checkpoint_and_keeps_the_last_good_one(tmp_path, capsys, monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    import k3.train.loop as loop

    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    real = loop.write_train_state

    def full_disk(tmp, state, *args, **kwargs):
        if state["step"] > 2:
            # every write to train_state.pt now fails with the kernel's ENOSPC, as on a full disk
            (tmp / "train_state.pt").symlink_to("/dev/full")
        return real(tmp, state, *args, **kwargs)

    monkeypatch.setattr(loop, "write_train_state", full_disk)
    code, _, err = cli(capsys, "train", *cli_args(corpus, out, "--max-steps", "6", "--checkpoint-every", "2"))
    assert code == 1, err
    assert "k3 train: error: no space left on device for the step-4 checkpoint" in err
    assert "the partial checkpoint was removed and the last good one" in err and "step_00000002" in err
    assert "resume with: k3 train" in err and "Traceback" not in err
    load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert [c.name for c in (out / "checkpoints").iterdir()] == ["step_00000002"]
    assert_tidy(out)
    assert disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))


def test_nonfinite_router_statistics_take_the_skip_then_stop_path(tmp_path, capsys, monkeypatch):
    from k3.model.moe import StableLatentMoE

    real_route = StableLatentMoE.route
    calls = {"n": 0}

    def poisoned(self, h):
        scores, topk_idx, weights, cutoff = real_route(self, h)
        calls["n"] += 1
        # from the third training step on (4 MoE layers per forward), the balancer sees NaN scores while the
        # routing itself, and so the loss, stay finite: only the router statistics are bad
        if torch.is_grad_enabled() and calls["n"] > 8:
            scores = torch.full_like(scores, float("nan"))
        return scores, topk_idx, weights, cutoff

    monkeypatch.setattr(StableLatentMoE, "route", poisoned)
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    code, stdout, err = cli(capsys, "train", *cli_args(corpus, out, "--max-steps", "12", "--checkpoint-every", "2"))
    assert code == 3, err
    assert "k3 train: 5 non-finite steps in a row at step 7; stopping. The last good checkpoint is" in err
    assert "non-finite router scores" in stdout + err and "Traceback" not in err
    records = read_metrics(out, "train")
    assert [r.get("skipped", False) for r in records] == [False, False] + [True] * 5
    assert all(r["nonfinite"] == ["router scores"] for r in records[2:])
    tensors, _ = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert (out / "plots" / "loss.png").exists()
    assert_tidy(out)


def test_a_moved_run_resumes_and_a_longer_length_trains_on(tmp_path, capsys, monkeypatch):
    write_corpus(tmp_path / "corpus")
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    args = ["--preset", "debug", "--seq-len", "32", "--tokens-per-step", "128", "--vocab-size", "600",
            "--eval-every", "4", "--checkpoint-every", "2"]
    code, _, err = cli(capsys, "train", *args, "--data", "../corpus", "--out", "run", "--max-steps", "4")
    assert code == 0, err
    # the folder moves, and both paths are now spelled differently (absolute, through a `..`)
    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    (tmp_path / "a" / "run").rename(moved)
    data = str(tmp_path / "a" / ".." / "corpus")
    code, stdout, err = cli(capsys, "train", *args, "--data", data, "--out", str(moved), "--resume")
    assert code == 0 and "is complete (4 of 4 steps" in stdout, err
    code, stdout, err = cli(capsys, "train", *args, "--data", data, "--out", str(moved), "--resume", "--max-steps", "6")
    assert code == 0 and "trained 6 steps (resumed at step 4)" in stdout, err
    assert json.loads((moved / "run.json").read_text())["total_steps"] == 6
    assert [r["step"] for r in read_metrics(moved, "train")] == list(range(1, 7))
    assert read_metrics(moved, "event")[-1] == {"kind": "event", "step": 4, "event": "length", "total_steps": 6}
    code, _, err = cli(capsys, "train", *args, "--data", data, "--out", str(moved), "--resume", "--max-steps", "3")
    assert code == 2 and "has a checkpoint at step 6; a length of 3 steps would end before it" in err
    # other data under the run's name is refused: the run is identified by its data's content, not its path
    other = write_corpus(tmp_path / "other", n_files=25)
    code, _, err = cli(capsys, "train", *args, "--data", str(other), "--out", str(moved), "--resume",
                       "--max-steps", "8")
    assert code == 2 and "differs from the data this run was prepared from" in err, err
    assert [r["step"] for r in read_metrics(moved, "train")] == list(range(1, 7))
    assert_tidy(moved)


def test_torch_save_reports_the_full_disk_behind_its_stream_error(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    from k3.checkpoint import write_train_state

    (tmp_path / "train_state.pt").symlink_to("/dev/full")
    with pytest.raises(OSError) as caught:
        write_train_state(tmp_path, {"weights": torch.zeros(1 << 16)})
    assert caught.value.errno == 28 and disk_full(caught.value)


def _stop_one_rank(rank, world, data, out):
    """A distributed run where only rank 1 gets SIGINT (during step 2): every rank must stop after that step."""
    import k3.train.loop as loop
    from k3.train.config import ContextStage, TrainConfig
    from k3.train.loop import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    real, calls = loop.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    loop.train_step = step
    cfg = TrainConfig(preset="debug", data=data, out=out, max_steps=50, tokens_per_step=256,
                      stages=[ContextStage(64, 1.0)], eval_every=100, checkpoint_every=100, eval_tokens=256,
                      muon_ns_dtype="float32", device="cpu", vocab_size=600, heldout_fraction=0.1)
    summary = train(cfg, progress=False, log=lambda *_: None)
    return summary.steps, summary.stopped, summary.checkpoint.name


def test_every_rank_stops_at_the_step_where_any_rank_was_asked_to(tmp_path):
    from tests.parallel.spawn import run_workers

    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    assert run_workers(_stop_one_rank, 2, str(corpus), str(out)) == [(2, "SIGINT", "step_00000002")] * 2
    ckpt = latest_checkpoint(out / "checkpoints")
    verify_checkpoint(ckpt)
    assert (ckpt / ".metadata").exists()  # every rank wrote its shards of the same step
    assert [r["step"] for r in read_metrics(out, "train")] == [1, 2]
    assert_tidy(out)
