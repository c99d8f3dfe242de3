"""`k3 chat` (piped stdin, in process) and `k3 serve` (a real subprocess on a free port)."""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from k3.serve.cli import add_serve_parser
from tests.serve.conftest import real_engine_available

pytestmark = pytest.mark.skipif(not real_engine_available(), reason="needs k3.infer.engine")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save(path)
    return str(path)


def test_engine_flags():
    args = _parser().parse_args(["serve", "--preset", "debug", "--max-running", "8", "--no-enable-prefix-caching",
                                 "--pool-bytes", "1000000"])
    from k3.serve.cli import engine_config_from_args

    config = engine_config_from_args(args)
    assert (config.max_running, config.enable_prefix_caching, config.pool_bytes) == (8, False, 1_000_000)
    assert config.prefill_chunk_tokens == 512  # untouched fields keep EngineConfig's defaults
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--preset", "debug", "--checkpoint", "x"])


def test_preset_serves_with_a_byte_tokenizer(tmp_path):
    """`--preset` without `--tokenizer` trains nothing: one token per byte, K3's specials where the preset has them."""
    from k3.config import get_preset
    from k3.serve.cli import load_model
    from k3.tokenizer import SPECIAL_TOKENS, Tokenizer

    model, tokenizer, name = load_model(_parser().parse_args(["serve", "--preset", "debug", "--device", "cpu"]))
    config = get_preset("debug")
    assert name == "k3-debug" and tokenizer.vocab_size == config.vocab_size
    assert (tokenizer.bos_id, tokenizer.pad_id) == (config.bos_token_id, config.pad_token_id)
    assert [tokenizer.special_id(n) for n in SPECIAL_TOKENS] == list(range(config.vocab_size - 256, config.vocab_size))
    text = "héllo 你好 <|open|>\n\x00"
    assert tokenizer.encode(text) == list(text.encode()) and tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.mergeable_ranks()[b"\xff"] == 255
    tokenizer.save(tmp_path)
    assert Tokenizer.load(tmp_path).encode(text) == list(text.encode())


def test_chat_repl(tokenizer_dir, monkeypatch, capsys):
    args = _parser().parse_args(["chat", "--preset", "debug", "--tokenizer", tokenizer_dir, "--max-tokens", "4",
                                 "--max-context", "512"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/effort high\nagain\n/reset\n/effort bogus\nthird\n/exit\n"))
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("k3> ") == 3 and "reasoning_effort must be one of" in out


def test_serve_subprocess(tokenizer_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys, argparse; from k3.serve.cli import add_serve_parser; p = argparse.ArgumentParser(); "
            "add_serve_parser(p.add_subparsers(required=True)); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    cmd = [sys.executable, "-c", code, "serve", "--preset", "debug", "--tokenizer", tokenizer_dir, "--port", str(port),
           "--max-context", "512", "--api-key", "k", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list()] == ["k3-debug"]
        r = client.chat.completions.create(model="k3-debug", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.usage.completion_tokens >= 1
        assert client.models.list().data[0].model_extra["max_model_len"] == 512
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in out, out
