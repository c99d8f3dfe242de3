"""`k3 serve` (the OpenAI-compatible server under uvicorn) and `k3 chat` (a multi-turn streaming REPL on the
same engine, no HTTP). `k3.cli` wires them in with `add_serve_parser(subparsers)`.

Both load a model with `--checkpoint DIR` (a run folder, using its newest checkpoint, or a checkpoint folder;
its tokenizer comes along) or `--preset NAME` (random weights, for tests, benchmarks and trying the API;
the tokenizer is `--tokenizer DIR`, else `k3.tokenizer.byte_tokenizer`: one token per byte, padded to the
preset's vocabulary, nothing to train). Every `EngineConfig` field is a flag (`--max-running`, `--pool-bytes`,
`--max-context`, ...; see `k3/infer/config.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import uuid

from k3.serve.state import MAX_REQUEST_BYTES

SKIP_ENGINE_FIELDS = {"eos_token_ids"}  # set from the model config
_TYPES = {"int": int, "float": float, "str": str}


def add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a run folder (its newest checkpoint) or a checkpoint folder")
    src.add_argument("--preset", help="random weights of a preset: debug | tiny | small | k3")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's; for --preset, one token per byte)")
    p.add_argument("--weights-seed", type=int, default=0, help="init seed of --preset weights")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (default auto)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--draft", help="a `k3 train-draft` run or checkpoint folder: speculative decoding with this draft "
                                   "(--speculative-tokens, default 4 with a draft; --spec-rollback snapshot|replay)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field (`max_running` → `--max-running`); unset flags keep its defaults."""
    from k3.infer.config import EngineConfig

    group = p.add_argument_group("engine (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in SKIP_ENGINE_FIELDS:
            continue
        kind = str(f.type).replace(" | None", "").strip()
        flag = "--" + f.name.replace("_", "-")
        help_ = f"default {f.default!r}" + (" (None: derived)" if f.default is None else "")
        if kind == "bool":
            group.add_argument(flag, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                               help=help_)
        elif kind in _TYPES:
            group.add_argument(flag, dest=f"engine_{f.name}", type=_TYPES[kind], default=None, help=help_,
                               metavar=kind.upper())


def engine_config_from_args(args: argparse.Namespace):
    from k3.infer.config import EngineConfig

    given = {k[len("engine_"):]: v for k, v in vars(args).items() if k.startswith("engine_") and v is not None}
    return EngineConfig(**given)


def serving_runtime(device: str) -> dict:
    """Runtime switches for serving on `device`: the fused KDA kernels on CUDA (the engine's paged decode step
    advances states in place with them; the torch recurrence would gather and write back every state)."""
    return {"kda_impl": "triton"} if str(device).startswith("cuda") else {}


def load_model(args: argparse.Namespace):
    """(model, tokenizer, name) from --checkpoint or --preset, on --device in --dtype."""
    import torch

    from k3.tokenizer import Tokenizer, byte_tokenizer

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device != "cpu" else torch.float32)
    if args.checkpoint:
        from pathlib import Path

        from k3.checkpoint import load_trained

        model, tokenizer, ckpt = load_trained(args.checkpoint, runtime=serving_runtime(device))
        name = Path(args.checkpoint).resolve().name
        model = model.to(device)
    else:
        from k3.config import get_preset
        from k3.model.model import build_model

        config = get_preset(args.preset).replace(**serving_runtime(device))
        model = build_model(config, seed=args.weights_seed, device=device)
        tokenizer = None
        name = f"k3-{args.preset}"
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    if tokenizer is None:
        tokenizer = byte_tokenizer(model.config.vocab_size)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}")
    if dtype != torch.float32:
        model.cast(dtype)
    return model.eval(), tokenizer, name


def build_engine(model, args: argparse.Namespace):
    from k3.infer.engine import AsyncEngine, Engine

    config, drafter = engine_config_from_args(args), None
    if getattr(args, "draft", None):
        from k3.spec.drafter import DraftRunner

        drafter = DraftRunner.load(args.draft, model)
        config = config if config.speculative_tokens else config.replace(speculative_tokens=4)
    return AsyncEngine(Engine(model, config, drafter=drafter))


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from k3.serve.app import create_app

    if args.tensor_parallel > 1 or args.expert_parallel or args.role != "both":
        # across devices (docs/serving.md): None on a rank that only follows rank 0, and on a prefill instance
        from k3.serve.across import serving_front

        front = serving_front(args, engine_config_from_args(args), load_model)
        if front is None:
            return 0
        engine, tokenizer, name = front
    else:
        model, tokenizer, name = load_model(args)
        engine = build_engine(model, args)
    try:
        app = create_app(engine, tokenizer, args.model_name or name, api_key=args.api_key,
                         default_max_tokens=args.default_max_tokens or None, medium_effort=args.medium_effort,
                         max_request_bytes=args.max_request_bytes, allow_local_images=args.allow_local_images)
        print(f"# serving {args.model_name or name} at http://{args.host}:{args.port}/v1 "
              f"(context {engine.max_context} tokens{', API key required' if args.api_key else ''}); "
              f"chat page http://{args.host}:{args.port}/, dashboard /dashboard", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0


CHAT_HELP = ("commands: /reset (new conversation), /effort none|low|medium|high|max, /system TEXT, /image PATH "
             "(attach to the next message), /exit")


async def chat_loop(engine, tokenizer, args: argparse.Namespace, out=None) -> None:
    """Read a line, stream the reply (thinking dimmed), keep the history (with its reasoning) for the next turn."""
    from k3.chat.template import ChatTemplate, ReplyAccumulator, ReplyStream, TemplateError, normalize_effort
    from k3.infer.api import SamplingParams

    out = out or sys.stdout
    template = ChatTemplate(tokenizer)
    effort = args.reasoning_effort
    system = args.system
    history: list[dict] = []
    images: list[str] = []  # /image paths, attached to the next message
    dim, reset = ("\x1b[2m", "\x1b[0m") if out.isatty() else ("", "")
    print(CHAT_HELP, file=out)
    while True:
        try:
            line = await asyncio.to_thread(input, "you> ")
        except EOFError:
            return
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = []
            continue
        if line.startswith("/effort"):
            value = line.partition(" ")[2].strip() or "none"
            try:
                normalize_effort(value)
                effort = None if value == "none" else value
            except TemplateError as e:
                print(e, file=out)
            continue
        if line.startswith("/system"):
            system = line.partition(" ")[2].strip() or None
            continue
        if line.startswith("/image"):
            path = os.path.expanduser(line.partition(" ")[2].strip())
            if not getattr(engine, "accepts_media", False):
                print("[this model is text-only: it takes no images]", file=out)
            elif not os.path.isfile(path):
                print(f"[no such file: {path}]", file=out)
            else:
                images.append(path)
                print(f"[attached {path}: it goes with your next message]", file=out)
            continue
        if line.startswith("/"):
            print(CHAT_HELP, file=out)
            continue
        messages = ([{"role": "system", "content": system}] if system else []) + history
        content = line if not images else ([{"type": "image_url", "image_url": {"url": p}} for p in images]
                                           + [{"type": "text", "text": line}])
        messages.append({"role": "user", "content": content})
        thinking = normalize_effort(effort) is not None
        try:
            ids = chat_prompt(template, messages, effort)
        except ValueError as e:  # a bad image (or message): say so, drop the attachments
            print(f"[{e}]", file=out)
            images = []
            continue
        images = []
        max_tokens = min(args.max_tokens, engine.max_context - len(ids))
        if max_tokens < 1:
            print(f"[the conversation fills the {engine.max_context}-token context: /reset]", file=out)
            continue
        # no per-request seed: the engine seeds each request from its own --seed stream
        sampling = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  stop_token_ids=tuple(tokenizer.stop_ids))
        reply, acc = ReplyStream(tokenizer, thinking), ReplyAccumulator()
        out.write("k3> ")
        in_thought = False
        async for result in engine.stream("chat-" + uuid.uuid4().hex, ids, sampling):
            delta = reply.feed(result.new_token_ids, result.finished)
            acc.add(delta)
            if delta.reasoning:
                out.write(("" if in_thought else dim) + delta.reasoning)
                in_thought = True
            if delta.content:
                out.write((reset + "\n" if in_thought else "") + delta.content)
                in_thought = False
            out.flush()
        out.write((reset if in_thought else "") + "\n")
        reply = acc.reply(thinking)
        history += [messages[-1], {"role": "assistant", "content": reply.content or "",
                                   "reasoning_content": reply.reasoning_content}]


def chat_prompt(template, messages: list[dict], effort: str | None) -> list[int]:
    """The prompt of `k3 chat`: the template's, or, when a message holds images (the user's own files), the ids
    carrying them for the engine (`k3.infer.api.MediaPrompt`)."""
    from k3.serve.handlers import image_parts

    if not image_parts(messages):
        return template.render(messages, reasoning_effort=effort)
    from k3.infer.api import MediaInput, MediaPrompt
    from k3.vision.chat import ImagePolicy, render_with_media

    ids, items = render_with_media(template, messages, ImagePolicy(allow_local_files=True), reasoning_effort=effort)
    return MediaPrompt(ids, [MediaInput(it.pixel_values, it.grid_thw, it.num_tokens()) for it in items])


def cmd_chat(args: argparse.Namespace) -> int:
    model, tokenizer, name = load_model(args)
    engine = build_engine(model, args)
    print(f"# {name}: context {engine.max_context} tokens", file=sys.stderr)
    try:
        asyncio.run(chat_loop(engine, tokenizer, args))
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0


def add_serve_parser(subparsers) -> None:
    """Add `serve` and `chat` to `k3`'s subcommands."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, models)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("K3_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $K3_API_KEY, else none)")
    p.add_argument("--model-name", help="the id clients use (default: k3-PRESET or the checkpoint folder's name)")
    p.add_argument("--default-max-tokens", type=int, default=4096,
                   help="completion budget when a request sets none (default 4096; 0: the rest of the context, "
                        "which admission then reserves in full)")
    p.add_argument("--medium-effort", choices=["low", "high", "max"], default="high",
                   help="trained level that reasoning_effort 'medium' maps to (default high)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help=f"larger request bodies get 413 before they are parsed (default {MAX_REQUEST_BYTES})")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    p.add_argument("--allow-local-images", action="store_true",
                   help="image_url parts may name files on this machine (default: base64 data URLs only; a "
                        "multimodal checkpoint)")
    across = p.add_argument_group("across devices (docs/serving.md)")
    across.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="shard heads, FFNs and experts over T processes (start them with torchrun "
                             "--nproc-per-node T -m k3.cli serve ...); default 1")
    across.add_argument("--expert-parallel", action="store_true",
                        help="with T > 1: whole routed experts per rank (E/T each) instead of a slice of every one")
    across.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                        help="prefill: compute prompts and ship their caches from --host:--port (no HTTP); decode: "
                             "serve HTTP and have --peer prefill each request; both (default): one instance")
    across.add_argument("--peer", help="with --role decode: the prefill instance's HOST:PORT")
    across.add_argument("--remote-prefill-min-tokens", type=int, default=1,
                        help="with --role decode: shorter prompts are prefilled locally (default 1: none)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("chat", help="interactive multi-turn chat on the engine (streaming, no HTTP)")
    add_model_args(p)
    p.add_argument("--system", help="a system prompt")
    p.add_argument("--reasoning-effort", choices=["none", "low", "medium", "high", "max"], default=None,
                   help="thinking mode at this effort (default: instruct, no thinking)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)
