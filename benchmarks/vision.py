"""Claim: a tiny vision-language model trained from scratch on the generated image–text data within a CPU budget
answers held-out questions about unseen images far above a text-only baseline trained on the same text; the
tower's throughput at a few resolutions; and the time to first token of a follow-up turn about an image when the
engine has it cached (docs/vision.md).

1. `k3.vision.synthetic` renders the data set (shapes, counts, bar charts, code snippets; 112-px images).
2. The debug preset's model with its vision config (text D 128, 5 layers; tower 64 wide, 2 blocks) and a BPE of
   the training text (1024 tokens) trains from scratch, tower and language model jointly, with
   `k3.train.loop.train_step` (Muon/AdamW, QK-Clip, Quantile Balancing), for `--steps` steps or as many as fit
   `--time-budget` minutes (timed on a throwaway copy first, as `k3 train` does).
3. The baseline is the same text model trained the same number of steps on the same rows without their images.
4. Held-out accuracy is greedy exact match, computed by teacher forcing: a question counts when every answer token
   and the closing [EOS] is the argmax after `Q: <question> A:`.
5. Cached-image TTFT: a two-turn conversation about one image on the inference engine (`--ttft-preset`, random
   weights): the second turn's time to first token with nothing cached, after the first turn (prefix cache), and
   after the first turn with prefix caching off (the per-image row cache alone).
Correctness gate before any number is kept: the multimodal forward of a packed evaluation batch equals the
forward of each sample alone; the engine's cached second turn gives the same first token as the uncached one.

    python benchmarks/vision.py [--steps 800 | --time-budget MIN] [--threads 1] [--quick] [--only ttft]

On a shared CPU give it one thread: more threads spin while they wait for each other and burn CPU time.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.provenance import RESULTS as RESULTS_DIR  # noqa: E402
from benchmarks.provenance import device_slug, save_result  # noqa: E402
from benchmarks.provenance import table as result_table  # noqa: E402
from k3.config import get_preset  # noqa: E402
from k3.model.model import build_model  # noqa: E402
from k3.optim import MuonAdamW, cosine_schedule  # noqa: E402
from k3.tokenizer import train_bpe  # noqa: E402
from k3.train.config import TrainConfig  # noqa: E402
from k3.train.loop import train_step  # noqa: E402
from k3.vision.data import MultimodalBatches, SampleBuilder, read_samples  # noqa: E402
from k3.vision.model import build_vlm  # noqa: E402
from k3.vision.optim import add_vision_param_groups  # noqa: E402
from k3.vision.preprocess import pack, preprocess_image  # noqa: E402
from k3.vision.synthetic import make_vision_dataset  # noqa: E402
from k3.vision.tower import MoonViT  # noqa: E402

DEVICE = torch.device("cpu")  # --device
CLAIM = ("A tiny VLM trained from scratch on CPU answers held-out questions about unseen images far above a text-only "
         "baseline trained on the same text; tower throughput by resolution; an image the engine has cached costs "
         "its follow-up turn far less time to first token.")


def build(multimodal: bool, config, args):
    model = (build_vlm if multimodal else build_model)(config, seed=args.seed, device=DEVICE)
    text = model.text_named_parameters() if multimodal else model.named_parameters()
    optimizer = MuonAdamW(text, config, lr=args.lr)
    if multimodal:
        add_vision_param_groups(optimizer, model, lr=args.vision_lr)
    return model, optimizer


def batches_for(samples, args, pad_id):
    return MultimodalBatches(samples, args.rows, args.seq_len, seed=args.seed, pad_id=pad_id,
                             loader_workers=args.loader_workers)


def step_seconds(multimodal, config, samples, args, pad_id) -> float:
    """One warm training step on a throwaway model (the faster of two), as `k3 train`'s time-budget probe."""
    model, optimizer = build(multimodal, config, args)
    scheduler = cosine_schedule(optimizer, 10)
    batch = next(batches_for(samples, args, pad_id))
    cfg = TrainConfig(preset="debug", lr=args.lr)
    train_step(model, optimizer, scheduler, [batch], cfg, DEVICE)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        train_step(model, optimizer, scheduler, [batch], cfg, DEVICE)
        times.append(time.perf_counter() - start)
    return min(times)


def train(multimodal, config, samples, steps, args, pad_id, log):
    model, optimizer = build(multimodal, config, args)
    scheduler = cosine_schedule(optimizer, steps, warmup_frac=0.02, min_lr_ratio=0.1)
    cfg = TrainConfig(preset="debug", lr=args.lr)
    batches = batches_for(samples, args, pad_id)
    losses, start, cpu = [], time.perf_counter(), time.process_time()
    for step in range(steps):
        metrics = train_step(model, optimizer, scheduler, [next(batches)], cfg, DEVICE)
        losses.append(metrics["loss"])
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"  {'vlm' if multimodal else 'text'} step {step + 1}/{steps}: loss {metrics['loss']:.3f} "
                f"({time.perf_counter() - start:.0f} s)")
    return model.eval(), losses, time.perf_counter() - start, time.process_time() - cpu


def answer_spans(samples, rows, tokenizer):
    """(first answer position, end) per sample: the tokens after `Q: <question> A:`, then [EOS]."""
    spans = []
    for sample, row in zip(samples, rows):
        prefix = tokenizer.encode(f"Q: {row['question']} A:")
        text = tokenizer.encode(row["text"])
        assert text[: len(prefix)] == prefix, "the answer must tokenize after its question"
        end = len(sample.ids)  # ... answer [EOS]
        spans.append((end - (len(text) - len(prefix)) - 1, end))
    return spans


@torch.no_grad()
def accuracy(model, samples, rows, tokenizer, per_forward: int = 32, check: bool = False) -> dict[str, float]:
    """Teacher-forced exact match per task (and "all") on held-out question samples."""
    spans = answer_spans(samples, rows, tokenizer)
    hits: dict[str, list[bool]] = defaultdict(list)
    for first in range(0, len(samples), per_forward):
        group = list(range(first, min(first + per_forward, len(samples))))
        length = sum(len(samples[i].ids) for i in group)
        batch = MultimodalBatches(samples, 1, length, pad_id=tokenizer.pad_id).collate([group])
        logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, **batch.media).logits[0]  # [T, V]
        offset = 0
        for i in group:
            start, end = spans[i]
            target = torch.tensor(samples[i].ids[start:end], device=logits.device)
            hits[rows[i]["task"]].append(bool((logits[offset + start - 1:offset + end - 1].argmax(-1) == target).all()))
            if check and i == group[0]:  # the gate: packed = alone
                alone = MultimodalBatches([samples[i]], 1, len(samples[i].ids), pad_id=tokenizer.pad_id).collate([[0]])
                ref = model(alone.input_ids, **alone.media).logits[0]
                assert torch.allclose(ref, logits[:len(samples[i].ids)], atol=1e-4), "packed != alone"
            offset += len(samples[i].ids)
    out = {task: sum(v) / len(v) for task, v in sorted(hits.items())}
    out["all"] = sum(sum(v) for v in hits.values()) / sum(len(v) for v in hits.values())
    return out


@torch.no_grad()
def tower_throughput(preset: str, size: int, images: int, seconds: float) -> tuple[float, int]:
    """(images/s, patches per image) of the preset's tower in fp32 (the reference attention on the CPU, "auto" on
    CUDA), `images` per forward."""
    vc = get_preset(preset).vision_config
    tower = MoonViT(vc, attention_backend="auto").to(DEVICE)
    for p in tower.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    media = pack([preprocess_image(torch_image(size, k)) for k in range(images)])
    pixels = media.pixel_values.to(DEVICE)
    tower(pixels, media.grid_thw)  # warm-up
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)
    sync()
    done, start = 0, time.perf_counter()
    while done == 0 or time.perf_counter() - start < seconds:
        tower(pixels, media.grid_thw)
        sync()
        done += images
    return done / (time.perf_counter() - start), int(media.grid_thw[0].prod())


@torch.no_grad()
def image_ttft(preset: str, size: int, repeats: int) -> tuple[list[list], dict[str, list[float]]]:
    """Time to first token of a follow-up turn about an image, on the engine (fp32, one request at a time): with
    nothing cached, after the first turn (the prefix cache holds the conversation through the image), and after
    the first turn with prefix caching off (only the image's rows are cached). Median of `repeats` fresh engines
    (after one warm-up round); (table rows, the seconds of every case)."""
    from k3.chat.template import ChatTemplate
    from k3.infer.api import MediaInput, SamplingParams
    from k3.infer.config import EngineConfig
    from k3.infer.engine import Engine
    from k3.tokenizer import byte_tokenizer
    from k3.vision.chat import ImagePolicy, render_with_media

    base = get_preset(preset)
    tokenizer = byte_tokenizer(base.vocab_size)
    config = base.replace(media_placeholder_token_id=tokenizer.special_id("<|media_pad|>"))
    model = build_vlm(config, seed=0, device=DEVICE).eval()
    template, policy = ChatTemplate(tokenizer), ImagePolicy()
    buf = io.BytesIO()
    torch_image(size, 0).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "Describe this picture in one line."}]}]
    second = first + [{"role": "assistant", "content": "A square of coloured noise."},
                      {"role": "user", "content": "Which colour is most common in it?"}]
    prompts = []
    for messages in (first, second):
        ids, items = render_with_media(template, messages, policy)
        prompts.append((ids, [MediaInput(it.pixel_values, it.grid_thw, it.num_tokens()) for it in items]))
    sync = torch.cuda.synchronize if DEVICE.type == "cuda" else (lambda: None)

    def ttft(engine, prompt) -> tuple[float, int]:
        ids, media = prompt
        sync()
        start = time.perf_counter()
        out = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0), media=media)
        sync()
        return time.perf_counter() - start, out.new_token_ids[0]

    names = ["nothing cached (the image encoded, the whole prompt run)",
             "after turn 1: prefix cache through the image", "after turn 1, prefix caching off: image rows cached"]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    encoded, hit = {}, {}
    for r in range(repeats + 1):  # round 0 warms up and is dropped
        tokens = set()
        for name, prefix_caching in zip(names, (True, True, False)):
            engine = Engine(model, EngineConfig(enable_prefix_caching=prefix_caching, max_context=4096))
            if name.startswith("after"):
                engine.generate(prompts[0][0], SamplingParams(max_tokens=1, temperature=0.0), media=prompts[0][1])
            before = engine.media_cache.encoded
            cached = engine.metrics()["prefix_hits_total"]
            t, token = ttft(engine, prompts[1])
            tokens.add(token)
            encoded[name] = engine.media_cache.encoded - before
            hit[name] = engine.metrics()["prefix_hits_total"] - cached
            if r:
                seconds[name].append(t)
        assert len(tokens) == 1, "the cached turn must give the uncached turn's first token"
    rows = []
    for name in names:
        rows.append([preset, f"{size}×{size}", len(prompts[1][0]), prompts[1][1][0].num_tokens, name, hit[name],
                     encoded[name], f"{1000 * sorted(seconds[name])[len(seconds[name]) // 2]:,.1f}"])
    return rows, seconds


def torch_image(size: int, seed: int):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800, help="training steps of each model (default 800)")
    parser.add_argument("--time-budget", type=float, help="minutes of VLM training instead of --steps (the step count "
                                                           "that fits, timed on a throwaway copy)")
    parser.add_argument("--train-images", type=int, default=2000)
    parser.add_argument("--heldout-images", type=int, default=200)
    parser.add_argument("--rows", type=int, default=4, help="rows per step (default 4)")
    parser.add_argument("--vocab-size", type=int, default=1024, help="the BPE's vocabulary (default 1024)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--vision-lr", type=float, default=6e-3, help="the tower's and projector's learning rate")
    parser.add_argument("--loader-workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="an existing make-vision folder (default: render one into a temporary folder)")
    parser.add_argument("--device", default="cpu", help="cpu (the claim) or cuda")
    parser.add_argument("--ttft-preset", default="tiny", help="the engine's model for the TTFT table (default tiny)")
    parser.add_argument("--ttft-size", type=int, default=448, help="the TTFT image's side in pixels (default 448)")
    parser.add_argument("--ttft-repeats", type=int, default=5, help="fresh engines per TTFT case (default 5)")
    parser.add_argument("--only", choices=["ttft"], help="measure only this table (the result file keeps the others)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that the script runs (no result)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.quick:
        args.steps, args.train_images, args.heldout_images = 2, 16, 8
    torch.set_num_threads(args.threads)
    log = print
    if args.quick:
        args.ttft_preset, args.ttft_size, args.ttft_repeats = "debug", 112, 1
    ttft_rows, ttft_raw = image_ttft(args.ttft_preset, args.ttft_size, args.ttft_repeats)
    for row in ttft_rows:
        log(f"TTFT {row[4]}: {row[-1]} ms ({row[6]} image(s) encoded)")
    ttft_table = result_table(["engine preset", "image", "prompt tokens", "image tokens", "turn 2",
                               "prefix-cache hit (tokens)", "images encoded", "TTFT ms (median)"], ttft_rows,
                              note=f"fp32, random weights, one request at a time, median of {args.ttft_repeats} "
                                   f"fresh engines, {args.threads} thread(s)")
    if args.only == "ttft" and not args.quick:
        old = Path(os.environ.get("K3_RESULTS") or RESULTS_DIR) / f"vision-{device_slug()}.json"
        raw = json.loads(old.read_text()).get("raw", {}) if old.exists() else {}
        save_result("vision", CLAIM, {"cached-image-ttft": ttft_table}, raw=raw | {"ttft_seconds": ttft_raw})
        return

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data) if args.data else Path(tmp) / "vision-data"
        if not args.data:
            make_vision_dataset(data, args.train_images, args.heldout_images, seed=args.seed)
        rows = {split: [json.loads(line) for line in (data / f"{split}.jsonl").read_text().splitlines()]
                for split in ("train", "heldout")}
        # a BPE of the training text, as `k3 train` trains one: the questions' boilerplate costs a few tokens
        tokenizer = train_bpe([r["text"] for r in rows["train"]], args.vocab_size, show_progress=False)
        config = get_preset("debug").replace(
            vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id, media_placeholder_token_id=tokenizer.special_id("<|media_pad|>"))
        vlm_train = read_samples(data / "train.jsonl", tokenizer)
        vlm_heldout = read_samples(data / "heldout.jsonl", tokenizer)
        builder = SampleBuilder(tokenizer)
        text_train = [builder.from_row({"text": r["text"]}, data, f"train:{i}") for i, r in enumerate(rows["train"])]
        text_heldout = [builder.from_row({"text": r["text"]}, data, f"heldout:{i}")
                        for i, r in enumerate(rows["heldout"])]

        if args.time_budget is None:
            per_step, steps = None, args.steps
        else:
            per_step = step_seconds(True, config, vlm_train, args, tokenizer.pad_id)
            steps = max(2, int(args.time_budget * 60 * 0.95 / per_step))
            log(f"VLM: ~{per_step:.2f} s/step → {steps} steps in {args.time_budget:g} min")
        log(f"{len(vlm_train):,} training rows, {len(vlm_heldout):,} held-out questions, {steps} steps")
        vlm, vlm_losses, vlm_seconds, vlm_cpu = train(True, config, vlm_train, steps, args, tokenizer.pad_id, log)
        vlm_acc = accuracy(vlm, vlm_heldout, rows["heldout"], tokenizer, check=True)
        log(f"VLM held-out exact match: { {t: round(a, 3) for t, a in vlm_acc.items()} }")
        text, text_losses, text_seconds, text_cpu = train(False, config, text_train, steps, args, tokenizer.pad_id,
                                                          log)
        text_acc = accuracy(text, text_heldout, rows["heldout"], tokenizer)

    tasks = [t for t in vlm_acc if t != "all"] + ["all"]
    counts = defaultdict(int)
    for r in rows["heldout"]:
        counts[r["task"]] += 1
    counts["all"] = len(rows["heldout"])
    chance = {"shape": (1 / 5 + 1 / 7) / 2, "count": 1 / 5, "chart": 1 / 4, "code": 1 / 100}
    acc_rows = [[task, counts[task], f"{100 * vlm_acc[task]:.1f}%", f"{100 * text_acc[task]:.1f}%",
                 f"{100 * chance[task]:.0f}%" if task in chance else "—"] for task in tasks]
    train_rows = [["vision-language (tower + LM, from scratch)", steps, f"{vlm_seconds / 60:.1f}",
                   f"{vlm_cpu / 60:.1f}", f"{sum(vlm_losses[-20:]) / len(vlm_losses[-20:]):.3f}"],
                  ["text-only baseline (same rows, no images)", steps, f"{text_seconds / 60:.1f}",
                   f"{text_cpu / 60:.1f}", f"{sum(text_losses[-20:]) / len(text_losses[-20:]):.3f}"]]
    log("held-out exact match (vlm / text-only):", {t: (round(vlm_acc[t], 3), round(text_acc[t], 3)) for t in tasks})

    throughput_rows = []
    for preset in ("debug", "tiny", "small"):
        for size in (112, 224, 448):
            if args.quick and (preset != "debug" or size != 112):
                continue
            rate, patches = tower_throughput(preset, size, images=4, seconds=0.5 if args.quick else 3.0)
            vc = get_preset(preset).vision_config
            throughput_rows.append([preset, f"{vc.vt_hidden_size} × {vc.vt_num_hidden_layers}", f"{size}×{size}",
                                    patches, f"{rate:,.1f}", f"{rate * patches:,.0f}"])
            log(f"tower {preset} at {size} px: {rate:.1f} images/s")
    if args.quick:
        print("quick run: OK (no result written)")
        return
    save_result(
        "vision", CLAIM,
        {"cached-image-ttft": ttft_table,
         "accuracy": result_table(["task", "held-out questions", "vision-language", "text-only baseline", "chance"],
                                  acc_rows, note="greedy exact match (teacher-forced), images never seen in training"),
         "training": result_table(["model", "steps", "wall minutes", "CPU minutes (this process)",
                                   "train loss (last 20 steps)"], train_rows,
                                  note=f"debug preset + its vision config, {args.vocab_size}-token BPE, "
                                       f"{args.rows} × {args.seq_len} tokens/step, "
                                       f"lr {args.lr:g}, tower lr {args.vision_lr:g}, {args.threads} thread(s)"),
         "tower-throughput": result_table(["tower preset", "width × blocks", "image", "patches", "images/s",
                                           "patches/s"], throughput_rows,
                                          note="fp32 forward, 4 images per packed batch, " + (
                                              "reference attention" if DEVICE.type == "cpu" else "attention auto"))},
        raw={"vlm_losses": vlm_losses, "text_losses": text_losses, "vlm_accuracy": vlm_acc, "text_accuracy": text_acc,
             "steps": steps, "probe_step_seconds": per_step, "train_images": args.train_images,
             "heldout_images": args.heldout_images, "chance": chance, "ttft_seconds": ttft_raw})


if __name__ == "__main__":
    main()
