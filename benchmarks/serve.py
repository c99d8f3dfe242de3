"""The inference engine's throughput, prefix-cache time-to-first-token, and decode cost vs context length.

Random weights (`--preset`, default tiny), fp32 on CPU (or `--device cuda`), reference ops. Three tables:
1. prefill and decode tokens/s at several batch sizes (every request: a random prompt, greedy decoding);
2. time to first token of a prompt whose long prefix is cached (device pool, and CPU pool after the
   device copy was evicted) vs the same prompt cold;
3. decode time per token at several context lengths, batch 1, for the hybrid model and for the same
   model with every layer Gated MLA (its cache grows 3-4x faster and every layer reads it). The cache is
   filled with random contents instead of a prefill (`fast_forward`): a decode step's cost does not
   depend on the values, and a 128K-token reference prefill would take far longer than the measurement;
4. grammar-constrained decoding (`--constrained-batches`): decode tokens/s with a JSON-schema mask on vs off
   (greedy, the byte tokenizer of the preset's vocabulary), and the grammar compile time of a schema at first
   use vs from the cache. Gate: every constrained token is one the grammar accepts.

Correctness gate first: the engine's greedy tokens equal the model's own argmax decoding, and a
prefix-cache hit gives the cold run's tokens. Run: `python benchmarks/serve.py [--quick] [--constrained-only]`;
the tables go to benchmarks/results/serve-<device>.json (not with --quick).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.provenance import save_result  # noqa: E402
from benchmarks.provenance import table as result_table  # noqa: E402
from k3.chat.template import ChatTemplate  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.infer.api import SamplingParams  # noqa: E402
from k3.infer.config import EngineConfig  # noqa: E402
from k3.infer.engine import Engine  # noqa: E402
from k3.infer.scheduler import Batch  # noqa: E402
from k3.model.model import build_model  # noqa: E402
from k3.tokenizer import byte_tokenizer  # noqa: E402

CLAIM = ("The inference engine on the {preset} preset with random weights ({where}): throughput by batch, time to "
         "first token with a cached prefix, decode cost against context length, and the cost of grammar-constrained "
         "decoding (JSON-schema mask on vs off, grammar compile time)")
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["C", "F"]}, "alerts": {"type": "array", "items": {"type": "string"}},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
              "required": ["lat", "lon"], "additionalProperties": False}},
    "required": ["city", "days", "unit", "alerts", "where"], "additionalProperties": False}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab - 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def argmax_decode(model, ids: list[int], n: int) -> list[int]:
    device = next(model.parameters()).device
    cache = model.new_cache(1)
    logits = model(torch.tensor([ids], device=device), cache=cache).logits[0, -1]
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model(torch.tensor([[out[-1]]], device=device), cache=cache).logits[0, -1]
    return out


def correctness_gate(model, config: EngineConfig):
    V = model.config.vocab_size
    ids = random_prompt(300, V, 0)
    want = argmax_decode(model, ids, 8)
    engine = Engine(model, config)
    got = engine.generate(ids, greedy(8)).new_token_ids
    if got != want:
        raise SystemExit(f"correctness gate failed: engine {got} vs model argmax {want}")
    # shares 270 tokens: the first prompt's end-of-prompt KDA checkpoint (at 256 with 64-token hash blocks)
    # is the longest boundary with state
    other = ids[:270] + random_prompt(100, V, 1)
    warm = engine.generate(other, greedy(8))
    cold = Engine(model, config).generate(other, greedy(8))
    if warm.new_token_ids != cold.new_token_ids or warm.cached_tokens == 0:
        raise SystemExit("correctness gate failed: a prefix-cache hit changed the output")


def throughput(model, config: EngineConfig, batch: int, prompt_len: int, decode: int):
    """-> (prefill tok/s, decode tok/s) for `batch` requests submitted together."""
    engine = Engine(model, config.replace(enable_prefix_caching=False, max_running=max(batch, 1)))
    V = model.config.vocab_size
    for i in range(batch):  # warm-up at this batch size (compiles kernels, captures its decode graph)
        engine.add_request(f"w{i}", random_prompt(16, V, 99 + i), greedy(3))
    while engine.has_unfinished():
        engine.step()
    for i in range(batch):
        engine.add_request(f"r{i}", random_prompt(prompt_len, V, 1000 + i), greedy(decode))
    started = set()
    generated = 0
    t0 = time.perf_counter()
    while len(started) < batch:
        for out in engine.step():
            started.add(out.request_id)
            generated += len(out.new_token_ids)
    sync(engine.pool.device)
    t1 = time.perf_counter()
    first = generated
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    sync(engine.pool.device)
    t2 = time.perf_counter()
    return batch * prompt_len / (t1 - t0), (generated - first) / (t2 - t1)


def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    engine.add_request("ttft", ids, greedy(1))
    t0 = time.perf_counter()
    while True:
        outs = engine.step()
        if outs:
            sync(engine.pool.device)
            return time.perf_counter() - t0, outs[0].cached_tokens


def all_mla(config):
    L = config.num_hidden_layers
    lin = config.linear_attn_config
    return config.replace(linear_attn_config=lin.__class__(**{**lin.__dict__, "kda_layers": [],
                                                              "full_attn_layers": list(range(1, L + 1))}))


def fast_forward(engine: Engine, request_id: str) -> None:
    """Admit a waiting request and fill its cache with random contents up to its last token, instead of
    prefilling it (the cost of a decode step does not depend on the values in the cache)."""
    seq = engine.requests[request_id]
    sched, pool = engine.scheduler, engine.pool
    assert sched._admit(seq)
    sched.waiting.remove(seq)
    sched.running.append(seq)
    n = len(seq.tokens) - 1
    assert sched._ensure_pages(seq, n, Batch())
    g = torch.Generator(device=pool.device).manual_seed(0)
    for block in seq.blocks:
        for p in block.pages:
            pool.mla[p].normal_(generator=g)
    for p in seq.kda_pages:
        pool.kda_state[p].normal_(0, 0.1, generator=g)
        pool.kda_conv[p].normal_(generator=g)
    seq.num_computed = n


def decode_ms(model, config: EngineConfig, context: int, steps: int) -> float:
    """Batch-1 decode time per token with `context` tokens in the cache."""
    spec = Engine(model, config.replace(num_pages=64)).spec
    need = (context // spec.page_tokens + 2) * len(spec.mla_layers) + 2 * len(spec.kda_layers) + 4
    engine = Engine(model, config.replace(enable_prefix_caching=False, max_running=1, num_pages=need + 1))
    engine.add_request("d", random_prompt(context + 1, model.config.vocab_size, 7), greedy(steps + 1))
    fast_forward(engine, "d")
    engine.step()  # warm-up: the first token
    sync(engine.pool.device)
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished():
        n += len(engine.step())
    sync(engine.pool.device)
    return (time.perf_counter() - t0) / n * 1e3


def constrained_decode(model, config: EngineConfig, grammar, batch: int, prompt_len: int, decode: int) -> float:
    """Decode tokens/s of `batch` greedy requests submitted together, each under `grammar` (None: unconstrained).
    Checks that every constrained output is accepted by a fresh matcher of the grammar."""
    engine = Engine(model, config.replace(enable_prefix_caching=False, max_running=max(batch, 1)))
    V = model.config.vocab_size
    engine.generate(random_prompt(16, V, 99), greedy(2))  # warm-up
    sp = SamplingParams(max_tokens=decode, temperature=0.0, grammar=grammar)
    for i in range(batch):
        engine.add_request(f"r{i}", random_prompt(prompt_len, V, 1000 + i), sp)
    outputs = {f"r{i}": [] for i in range(batch)}
    started, generated, t1 = set(), 0, None
    while engine.has_unfinished():
        outs = engine.step()
        if t1 is not None:
            generated += sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            started.add(o.request_id)
            outputs[o.request_id] += o.new_token_ids
        if t1 is None and len(started) == batch:
            sync(engine.pool.device)
            t1 = time.perf_counter()
    sync(engine.pool.device)
    t2 = time.perf_counter()
    if grammar is not None:
        for rid, ids in outputs.items():
            if not grammar.matcher().consume_tokens(ids):
                raise SystemExit(f"correctness gate failed: {rid}'s constrained output breaks its grammar")
    return generated / (t2 - t1)


def constrained_tables(model, config: EngineConfig, batches: list[int], prompt_len: int, decode: int, where: str,
                       console: Console, repeats: int = 3) -> dict[str, list]:
    """Mask on vs off by batch, and compile times; -> rows of the two tables."""
    from k3.chat.constrain import grammar_vocabulary, reply_grammar
    from k3.infer.grammar import GrammarCompiler

    tokenizer = byte_tokenizer(model.config.vocab_size)
    template = ChatTemplate(tokenizer)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(**grammar_vocabulary(tokenizer))
    vocab_ms = (time.perf_counter() - t0) * 1e3
    lark = reply_grammar(template, thinking=False, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    t0 = time.perf_counter()
    grammar = compiler.compile(lark)
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    assert compiler.compile(lark) is grammar
    cached_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    grammar.matcher()
    matcher_ms = (time.perf_counter() - t0) * 1e3
    table = Table(title=f"grammar-constrained decoding ({where}; prompts of {prompt_len}, {decode} greedy tokens, "
                        f"JSON-schema response format; best of {repeats})")
    for col in ("batch", "decode tok/s (no mask)", "decode tok/s (mask)", "mask cost"):
        table.add_column(col, justify="right")
    rows = {"constrained-decoding": [], "grammar-compile": []}
    for b in batches:
        # alternating runs, best of each: the machine's noise hits both alike
        off = on = 0.0
        for _ in range(repeats):
            off = max(off, constrained_decode(model, config, None, b, prompt_len, decode))
            on = max(on, constrained_decode(model, config, grammar, b, prompt_len, decode))
        cost = f"{(off / on - 1) * 100:+.1f}%"
        table.add_row(str(b), f"{off:,.1f}", f"{on:,.1f}", cost)
        rows["constrained-decoding"].append([b, round(off, 1), round(on, 1), cost])
    console.print(table)
    table = Table(title=f"grammar compile time (llguidance, {model.config.vocab_size}-token vocabulary)")
    for col in ("step", "ms"):
        table.add_column(col, justify="right")
    for name, ms in (("vocabulary (once per tokenizer)", vocab_ms), ("schema, first use", first_ms),
                     ("schema, cached", cached_ms), ("matcher per request", matcher_ms)):
        table.add_row(name, f"{ms:.3f}")
        rows["grammar-compile"].append([name, round(ms, 3)])
    console.print(table)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--constrained-batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--constrained-tokens", type=int, default=48)
    parser.add_argument("--constrained-only", action="store_true", help="only the constrained-decoding tables")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--profile", action="store_true", help="GPU: where the fast engine's time goes (no tables)")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        return gpu_main(args)
    if args.quick:
        args.batches, args.prefix_len, args.contexts, args.decode_tokens = [1, 8], 512, [256, 1024], 4
        args.constrained_tokens = 8
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model_config = get_preset(args.preset)
    model = build_model(model_config, seed=0, device=device, dtype=dtype).eval()
    config = EngineConfig(eos_token_ids=(), max_step_tokens=4096)
    correctness_gate(model, config)
    console = Console()
    where = f"{args.preset}, {args.dtype}, {device}" + (f", {args.threads} threads" if device.type == "cpu" else "")
    columns = {"throughput": ["batch", "prefill tok/s", "decode tok/s", "decode ms/step"],
               "prefix-ttft": ["run", "TTFT ms", "cached tokens", "speed-up"],
               "decode-vs-context": ["context", "hybrid ms/token", "all-MLA ms/token", "all-MLA / hybrid",
                                     "hybrid cache MiB", "all-MLA cache MiB"],
               "constrained-decoding": ["batch", "decode tok/s (no mask)", "decode tok/s (mask)", "mask cost"],
               "grammar-compile": ["step", "ms"]}
    claim = CLAIM.format(preset=args.preset, where=where)
    constrained = constrained_tables(model, config, args.constrained_batches, args.prompt_len,
                                     args.constrained_tokens, where, console)
    if args.constrained_only:
        if not args.quick:
            save_result("serve", claim, {k: result_table(columns[k], v) for k, v in constrained.items()})
        return

    table = Table(title=f"engine throughput ({where}; prompts of {args.prompt_len}, {args.decode_tokens} "
                        f"greedy tokens each; budget {config.max_step_tokens} tokens/step)")
    for col in ("batch", "prefill tok/s", "decode tok/s", "decode ms/step"):
        table.add_column(col, justify="right")
    rows = {"throughput": [], "prefix-ttft": [], "decode-vs-context": [], **constrained}
    for b in args.batches:
        pre, dec = throughput(model, config, b, args.prompt_len, args.decode_tokens)
        table.add_row(str(b), f"{pre:,.0f}", f"{dec:,.1f}", f"{b / dec * 1e3:.1f}")
        rows["throughput"].append([b, round(pre), round(dec, 1), round(b / dec * 1e3, 1)])
    console.print(table)

    V = model_config.vocab_size
    prefix = random_prompt(args.prefix_len, V, 11)
    table = Table(title=f"time to first token with a cached {args.prefix_len}-token prefix ({where})")
    for col in ("run", "TTFT ms", "cached tokens", "speedup"):
        table.add_column(col, justify="right")
    engine = Engine(model, config.replace(cpu_pool_bytes=1 << 30))
    cold, _ = ttft(engine, prefix + random_prompt(32, V, 12))
    table.add_row("cold", f"{cold * 1e3:.1f}", "0", "1.0x")
    warm, cached = ttft(engine, prefix + random_prompt(32, V, 13))
    table.add_row("prefix in the device pool", f"{warm * 1e3:.1f}", str(cached), f"{cold / warm:.1f}x")
    while engine.prefix.evict_one():
        pass  # everything goes to the CPU pool
    host, cached_cpu = ttft(engine, prefix + random_prompt(32, V, 14))
    table.add_row("prefix in the CPU pool", f"{host * 1e3:.1f}", str(cached_cpu), f"{cold / host:.1f}x")
    console.print(table)
    rows["prefix-ttft"] = [["cold", round(cold * 1e3, 1), 0, "1.0×"],
                           ["prefix in the device pool", round(warm * 1e3, 1), cached, f"{cold / warm:.1f}×"],
                           ["prefix in the CPU pool (reloaded)", round(host * 1e3, 1), cached_cpu, f"{cold / host:.1f}×"]]

    baseline = build_model(all_mla(model_config), seed=0, device=device, dtype=dtype).eval()
    probe = Engine(model, config)
    probe_mla = Engine(baseline, config)
    table = Table(title=f"decode time per token at batch 1 ({where}): hybrid (3 KDA : 1 MLA) vs every layer "
                        f"Gated MLA")
    for col in ("context", "hybrid ms/token", "all-MLA ms/token", "all-MLA / hybrid", "hybrid cache MiB",
                "all-MLA cache MiB"):
        table.add_column(col, justify="right")
    for ctx in args.contexts:
        h = decode_ms(model, config, ctx, args.decode_steps)
        a = decode_ms(baseline, config, ctx, args.decode_steps)
        hb = ctx * len(probe.spec.mla_layers) * probe.spec.latent_dim * probe.spec.elt + len(
            probe.spec.kda_layers) * (probe.spec.kda_state_bytes + probe.spec.kda_conv_bytes)
        ab = ctx * len(probe_mla.spec.mla_layers) * probe_mla.spec.latent_dim * probe_mla.spec.elt
        table.add_row(f"{ctx:,}", f"{h:.1f}", f"{a:.1f}", f"{a / h:.2f}x", f"{hb / 2**20:.1f}", f"{ab / 2**20:.1f}")
        rows["decode-vs-context"].append([ctx, round(h, 1), round(a, 1), f"{a / h:.2f}×", round(hb / 2**20, 1),
                                          round(ab / 2**20, 1)])
    console.print(table)
    if args.quick:
        return
    save_result("serve", claim, {k: result_table(columns[k], v) for k, v in rows.items()})


# ---- the GPU run: the fast engine (bf16, paged decode, CUDA graphs) beside the reference engine ----------------

GPU_CLAIM = ("The inference engine on one GPU, {preset} preset, random weights: the fast engine (bf16 weights, fused "
             "KDA decode in pool slots, paged absorbed-MLA decode kernel, decode steps captured as CUDA graphs) beside "
             "the reference engine (the same bf16 weights through the gather/scatter data path and the torch KDA "
             "recurrence) in the same run: batch-1 decode against the memory roofline, throughput by batch, time to "
             "first token of an 8K prompt, and the hybrid model against an all-MLA twin by context length")


def gpu_engines(preset: str):
    """name -> (model config, weights dtype, engine config)."""
    base = get_preset(preset)
    block = 256 if base.vocab_size > 10_000 else 64
    common = EngineConfig(eos_token_ids=(), hash_block_size=block, max_step_tokens=8192, prefill_chunk_tokens=2048,
                          pool_bytes=16 << 30)
    return {"fast": (base.replace(kda_impl="triton"), torch.bfloat16, common.replace(decode_path="paged")),
            "reference": (base, torch.bfloat16, common.replace(decode_path="gather"))}


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of 20)."""
    x = torch.randn(2**28, device=device)  # 1 GiB
    y = torch.empty_like(x)
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    t = sorted(times[3:])[len(times[3:]) // 2]
    return 2 * x.numel() * x.element_size() / t


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter except the embedding table (one row) and
    the routed experts outside the top-k (docs/architecture.md's active count), at its stored dtype."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name.startswith("model.embed_tokens"):
            n = cfg.hidden_size * p.element_size()
        elif ".experts.w" in name:
            n = n * cfg.num_experts_per_token // cfg.num_experts
        total += n
    return total


def cache_bytes_per_token(engine: Engine, context: int) -> int:
    """Cache bytes a decode step at `context` tokens reads: every MLA latent row, every KDA state and conv tail."""
    s = engine.spec
    return context * len(s.mla_layers) * s.latent_dim * s.elt + len(s.kda_layers) * (s.kda_state_bytes + s.kda_conv_bytes)


def greedy_outputs(model, config: EngineConfig, prompts: list[list[int]], n: int) -> list[list[int]]:
    engine = Engine(model, config)
    return [engine.generate(p, greedy(n)).new_token_ids for p in prompts]


def gpu_profile(model, config: EngineConfig, V: int, console: Console) -> None:
    """Where the fast engine's time goes: a batch-1 engine step against its graph replay alone, the kernels of one
    eager paged decode step, and the ops of an 8K prefill (torch.profiler tables)."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(model, config)
    engine.add_request("p", random_prompt(128, V, 3), greedy(400))
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / 50 * 1e3
    graph, _ = engine.decoder.graphs[1]
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50):
        graph.replay()
    b.record()
    b.synchronize()
    console.print(f"batch-1 engine step {step_ms:.3f} ms; graph replay alone {a.elapsed_time(b) / 50:.3f} ms")
    eager = Engine(model, config.replace(cuda_graphs=False))
    eager.add_request("p", random_prompt(128, V, 3), greedy(400))
    for _ in range(8):
        eager.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eager.step()
        torch.cuda.synchronize()
    console.print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 5 / 1e3
    console.print(f"eager paged decode step: {len(kernels) / 5:.0f} kernels, {busy:.3f} ms of kernel time")
    cold = Engine(model, config)
    ttft(cold, random_prompt(8192, V, 12))  # compile and autotune the prefill shapes first
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ttft(cold, random_prompt(8192, V, 11))
    console.print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    console.print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


def gpu_main(args):
    device = torch.device(args.device)
    console = Console()
    preset = args.preset if args.preset != "tiny" else "small"
    engines = gpu_engines(preset)
    bw = copy_bandwidth(device)
    console.print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)")
    columns = {"gpu-decode": ["engine", "batch", "decode tok/s", "ms/step", "bytes/token (MB)", "roofline"],
               "gpu-ttft": ["engine", "8K prompt cold ms", "8K prefix cached ms", "cached tokens"],
               "gpu-decode-vs-context": ["engine", "context", "hybrid ms/token", "all-MLA ms/token",
                                         "all-MLA / hybrid"],
               "gpu-greedy": ["check", "result"]}
    rows = {k: [] for k in columns}
    models = {}
    for name, (mcfg, dtype, ecfg) in engines.items():
        models[name] = build_model(mcfg, seed=0, device=device, dtype=dtype).eval()
    V = models["fast"].config.vocab_size
    # correctness first, in fp32 (random bf16 weights give near-tied logits, where any rounding flips an argmax):
    # the same greedy tokens from both engines. On the tiny preset: the chunked KDA kernels are tiled for bf16, and
    # fp32 operands at head dim 128 overflow the 228 KB of shared memory an SM has.
    checked = gpu_engines("tiny")
    prompts = [random_prompt(n, checked["fast"][0].vocab_size, 50 + i) for i, n in enumerate((17, 300, 1200, 64))]
    outs = {}
    for name, (mcfg, _, ecfg) in checked.items():
        fp32 = build_model(mcfg, seed=0, device=device, dtype=torch.float32).eval()
        outs[name] = greedy_outputs(fp32, ecfg.replace(pool_bytes=4 << 30), prompts, 32)
        del fp32
    same = sum(a == b for a, b in zip(outs["fast"], outs["reference"]))
    agree = sum(x == y for a, b in zip(outs["fast"], outs["reference"]) for x, y in zip(a, b))
    rows["gpu-greedy"] += [["tiny preset, fp32: prompts with identical greedy output", f"{same} / {len(prompts)}"],
                           ["fp32 tokens equal", f"{agree} / {sum(len(a) for a in outs['reference'])}"]]
    console.print(f"greedy outputs equal (fp32): {same}/{len(prompts)} prompts, {agree} tokens")
    if args.profile:
        return gpu_profile(models["fast"], engines["fast"][2], V, console)
    for name, (mcfg, dtype, ecfg) in engines.items():
        model = models[name]
        wbytes = weight_bytes_per_token(model)
        for b in args.batches:
            _, dec = throughput(model, ecfg.replace(max_running=max(b, 8)), b, args.prompt_len, args.decode_tokens)
            ms = b / dec * 1e3
            probe = Engine(model, ecfg.replace(num_pages=64, decode_path="gather"))
            per_token = wbytes + cache_bytes_per_token(probe, args.prompt_len + args.decode_tokens // 2)
            roof = f"{per_token / bw / (ms / 1e3) * 100:.1f}%" if b == 1 else ""
            rows["gpu-decode"].append([name, b, round(dec, 1), round(ms, 3), round(per_token / 1e6, 1), roof])
            console.print(rows["gpu-decode"][-1])
        engine = Engine(model, ecfg)
        warm_prefix = random_prompt(8192, V, 21)  # the same shapes once first: kernel autotuning is not TTFT
        ttft(engine, warm_prefix + random_prompt(32, V, 22))
        ttft(engine, warm_prefix + random_prompt(32, V, 23))
        prefix = random_prompt(8192, V, 11)
        cold, _ = ttft(engine, prefix + random_prompt(32, V, 12))
        warm, cached = ttft(engine, prefix + random_prompt(32, V, 13))
        rows["gpu-ttft"].append([name, round(cold * 1e3, 1), round(warm * 1e3, 1), cached])
        console.print(rows["gpu-ttft"][-1])
        del engine
        twin = build_model(all_mla(mcfg), seed=0, device=device, dtype=dtype).eval()
        for ctx in args.contexts:
            h = decode_ms(model, ecfg.replace(pool_bytes=None), ctx, args.decode_steps)
            a = decode_ms(twin, ecfg.replace(pool_bytes=None), ctx, args.decode_steps)
            rows["gpu-decode-vs-context"].append([name, ctx, round(h, 3), round(a, 3), f"{a / h:.2f}×"])
            console.print(rows["gpu-decode-vs-context"][-1])
        del twin
        torch.cuda.empty_cache()
    for key, cols in columns.items():
        table = Table(title=key)
        for c in cols:
            table.add_column(c, justify="right")
        for r in rows[key]:
            table.add_row(*map(str, r))
        console.print(table)
    if not args.quick:
        claim = GPU_CLAIM.format(preset=preset)
        save_result("serve", claim, {k: result_table(columns[k], v) for k, v in rows.items()},
                    raw={"copy_bandwidth_bytes_per_s": bw})


if __name__ == "__main__":
    main()
