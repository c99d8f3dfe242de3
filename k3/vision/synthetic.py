"""A generated image–text data set, so multimodal training runs offline (`k3 data make-vision`; docs/vision.md).

In the spirit of the K3 report's code ↔ render pairs (§2.4), every image is rendered with Pillow from a short
description, and the rows pair the image with that description and with questions whose answers are in the image:

| task | image | questions (answer) |
|---|---|---|
| shape | one shape (circle, square, triangle, diamond, cross) in one of 7 colours | which shape, which colour |
| count | 1–5 shapes of one kind and colour | how many |
| chart | a bar chart of bars A–D | which bar is highest, which is lowest |
| code | a one-line code snippet (`x = 42`, `print(17)`, `return 8`) | which number is written |

Layout of OUT: `images/{split}-{index:06d}.png`, `train.jsonl` (per image: a description row `{"image", "text"}`
and one row per question), `heldout.jsonl` (questions about images never seen in training), `meta.json`.
Question rows read `{"image", "text": "Q: <question> A: <answer>", "question", "answer", "task"}`, or with
`chat=True` an OpenAI-style `messages` conversation (an `image_url` part and the question, then the answer).
The same seed gives the same files.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLOURS = {"red": (220, 40, 40), "green": (30, 150, 60), "blue": (40, 80, 220), "yellow": (225, 195, 20),
           "purple": (140, 60, 180), "orange": (240, 130, 30), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
TASKS = ("shape", "count", "chart", "code")
CODE_TEMPLATES = ("x = {n}", "print({n})", "return {n}")
BACKGROUND = (255, 255, 255)


@dataclass
class Rendered:
    image: Image.Image
    description: str  # the text the image was rendered from
    questions: list[tuple[str, str]]  # (question, answer)
    task: str


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    """A shape of radius r centred at (cx, cy)."""
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r * 0.95, cy + r * 0.8), (cx + r * 0.95, cy + r * 0.8)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    elif shape == "cross":
        w = r * 0.35
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def render_shape(rng: random.Random, size: int) -> Rendered:
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    image = Image.new("RGB", (size, size), BACKGROUND)
    r = rng.uniform(0.2, 0.35) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    draw_shape(ImageDraw.Draw(image), shape, cx, cy, r, COLOURS[colour])
    return Rendered(image, f"a {colour} {shape}",
                    [("What shape is drawn?", shape), ("What colour is the shape?", colour)], "shape")


def render_count(rng: random.Random, size: int) -> Rendered:
    shape, colour, count = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.randint(1, 5)
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    r = size * 0.09
    centres: list[tuple[float, float]] = []
    while len(centres) < count:  # rejection sampling: shapes never touch
        c = (rng.uniform(r + 1, size - r - 1), rng.uniform(r + 1, size - r - 1))
        if all(math.dist(c, other) > 2.3 * r for other in centres):
            centres.append(c)
    for cx, cy in centres:
        draw_shape(draw, shape, cx, cy, r, COLOURS[colour])
    plural = shape + ("es" if shape.endswith("s") else "s") if count > 1 else shape
    return Rendered(image, f"{count} {colour} {plural}", [("How many shapes are there?", str(count))], "count")


def font(px: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=px)


def render_chart(rng: random.Random, size: int) -> Rendered:
    labels = "ABCD"
    values = rng.sample(range(1, 10), 4)  # distinct, so highest and lowest are unique
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    base, top = size * 0.82, size * 0.08
    slot = size / 4
    text_font = font(max(8, size // 9))
    draw.line([(size * 0.03, base), (size * 0.97, base)], fill=(0, 0, 0), width=max(1, size // 100))
    for i, (label, value) in enumerate(zip(labels, values)):
        x0, x1 = i * slot + slot * 0.2, (i + 1) * slot - slot * 0.2
        colour = COLOURS[rng.choice(["red", "green", "blue", "orange", "purple"])]
        draw.rectangle([x0, base - (base - top) * value / 9, x1, base], fill=colour)
        draw.text(((x0 + x1) / 2, base + size * 0.02), label, fill=(0, 0, 0), font=text_font, anchor="mt")
    highest, lowest = labels[values.index(max(values))], labels[values.index(min(values))]
    description = "bar chart: " + ", ".join(f"{k}={v}" for k, v in zip(labels, values))
    return Rendered(image, description, [("Which bar is highest?", highest), ("Which bar is lowest?", lowest)],
                    "chart")


def render_code(rng: random.Random, size: int) -> Rendered:
    n = rng.randint(0, 99)
    code = rng.choice(CODE_TEMPLATES).format(n=n)
    image = Image.new("RGB", (size, size), (250, 250, 245))
    draw = ImageDraw.Draw(image)
    px = max(8, size // 7)
    draw.text((rng.uniform(size * 0.05, size * 0.2), rng.uniform(size * 0.2, size * 0.6)), code, fill=(0, 0, 0),
              font=font(px))
    return Rendered(image, code, [("Which number is written?", str(n))], "code")


RENDERERS = {"shape": render_shape, "count": render_count, "chart": render_chart, "code": render_code}


def question_row(image: str, question: str, answer: str, task: str, chat: bool) -> dict:
    if chat:
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                          {"type": "text", "text": question}]},
                             {"role": "assistant", "content": answer}],
                "question": question, "answer": answer, "task": task}
    return {"image": image, "text": f"Q: {question} A: {answer}", "question": question, "answer": answer,
            "task": task}


def make_vision_dataset(out: str | Path, train_images: int = 4000, heldout_images: int = 400, size: int = 112,
                        seed: int = 0, tasks: tuple[str, ...] = TASKS, chat: bool = False,
                        progress: bool = True) -> dict:
    """Render the data set into `out` (see the module docstring); returns what meta.json holds."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"unknown or no tasks {unknown or list(tasks)}; choose from {', '.join(TASKS)}")
    if train_images < 1 or heldout_images < 1:
        raise ValueError(f"train and held-out image counts must be positive, got {train_images}, {heldout_images}")
    if size < 28:
        raise ValueError(f"images must be at least 28 pixels wide (one merged patch), got {size}")
    from tqdm.auto import tqdm

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, n, split_seed in (("train", train_images, seed * 2), ("heldout", heldout_images, seed * 2 + 1)):
        rng = random.Random(split_seed)
        rows = []
        for i in tqdm(range(n), desc=f"rendering {split}", unit="image", disable=not progress):
            task = tasks[i % len(tasks)]
            rendered = RENDERERS[task](rng, size)
            name = f"images/{split}-{i:06d}.png"
            rendered.image.save(out / name)
            if split == "train":
                rows.append({"image": name, "text": rendered.description, "task": task})
            rows += [question_row(name, q, a, task, chat) for q, a in rendered.questions]
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        counts[split] = {"images": n, "rows": len(rows)}
    meta = {"size": size, "seed": seed, "tasks": list(tasks), "chat": chat, "splits": counts}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
