"""`k3 serve` across devices: the engine front for `--tensor-parallel T [--expert-parallel]` under torchrun, and the
prefill/decode roles (`--role prefill|decode --peer HOST:PORT`) (docs/serving.md, "Across devices").

`serving_front(args, engine_config, load_model)` returns what `k3.serve.cli.cmd_serve` serves (an `AsyncEngine`, its
tokenizer and the model name) on the rank that serves HTTP, or None on a rank that only follows (it returns when the
serving rank shuts down) and on a prefill instance (which serves its transfer port until interrupted).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from k3.infer.engine import AsyncEngine, Engine
from k3.infer.transfer import DisaggregatedEngine, PrefillServer, PrefillWorker, parse_peer
from k3.parallel.inference import ParallelEngine, init_serving_group, load_sharded, serving_engine, shard_model


class _ReleasesRanks:
    """Shutting the front down also releases the ranks that follow rank 0."""

    def shutdown(self) -> None:
        super().shutdown()
        if isinstance(self.engine, ParallelEngine):
            self.engine.shutdown()


class ParallelAsyncEngine(_ReleasesRanks, AsyncEngine):
    pass


class ParallelDisaggregatedEngine(_ReleasesRanks, DisaggregatedEngine):
    pass


def _device(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def serving_front(args, engine_config, load_model):
    """See the module doc. `load_model(args)` is `k3.serve.cli.load_model` (the single-process loader)."""
    from k3.tokenizer import Tokenizer, byte_tokenizer

    tp_size = args.tensor_parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if getattr(args, "draft", None):
        raise ValueError("--draft (speculative decoding) is not combined with --tensor-parallel or --role yet")
    if tp_size != world:
        raise ValueError(f"--tensor-parallel {tp_size} must equal the number of processes ({world}); start "
                         f"{tp_size} with `torchrun --nproc-per-node {tp_size} -m k3.cli serve ...`")
    if args.expert_parallel and tp_size == 1:
        raise ValueError("--expert-parallel splits the experts over the --tensor-parallel ranks: give T > 1")
    if args.role == "decode" and not args.peer:
        raise ValueError("--role decode needs --peer HOST:PORT (the prefill instance's transfer port)")
    tp = init_serving_group() if world > 1 else None
    device = _device(args)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device != "cpu" else torch.float32)
    if device == "cuda" and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"
    runtime = {"kda_impl": "triton"} if device.startswith("cuda") else {}
    if tp is None:
        model, tokenizer, name = load_model(args)
    elif args.checkpoint:
        model = load_sharded(args.checkpoint, tp, args.expert_parallel, dtype, device, runtime)
        path = Path(args.checkpoint)
        tok_dir = path if (path / "tiktoken.model").exists() or (path / "tokenizer.json").exists() else None
        if tok_dir is None:
            from k3.checkpoint import resolve_checkpoint

            tok_dir = resolve_checkpoint(path) / "tokenizer"
        tokenizer = Tokenizer.load(args.tokenizer or tok_dir)
        name = path.resolve().name
    else:
        full, tokenizer, name = load_model(args)
        model = shard_model(full, tp, args.expert_parallel)
        del full
    if tokenizer is None:
        tokenizer = byte_tokenizer(model.config.vocab_size)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}")
    engine = Engine(model, engine_config)
    front = serving_engine(engine, tp) if tp is not None else engine
    if tp is not None and tp.rank != 0:
        front.follow()
        return None
    if args.role == "prefill":
        worker = PrefillWorker(front)
        server = PrefillServer(worker, args.host, args.port)
        print(f"# prefill instance of {name}: transfers at {server.address[0]}:{server.address[1]} "
              f"(tensor parallel {tp_size})", file=sys.stderr)
        try:
            server._thread.join()
        except KeyboardInterrupt:
            pass
        finally:
            server.shutdown()
            worker.shutdown()
            if isinstance(front, ParallelEngine):
                front.shutdown()
        return None
    if args.role == "decode":
        base = ParallelDisaggregatedEngine if tp is not None else DisaggregatedEngine
        return base(front, parse_peer(args.peer), min_prompt_tokens=args.remote_prefill_min_tokens), tokenizer, name
    return (ParallelAsyncEngine(front) if tp is not None else AsyncEngine(front)), tokenizer, name
