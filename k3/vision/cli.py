"""`k3 data make-vision`: render the generated image–text data set (k3.vision.synthetic; docs/vision.md).

    k3 data make-vision --out DIR [--train 4000] [--heldout 400] [--size 112] [--seed 0] [--tasks shape,count,…]
                                  [--chat]
"""

from __future__ import annotations

from k3.runfolder import positive


def cmd_make_vision(args) -> int:
    from k3.vision.synthetic import make_vision_dataset

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    meta = make_vision_dataset(args.out, args.train, args.heldout, args.size, args.seed, tasks, args.chat)
    train, heldout = meta["splits"]["train"], meta["splits"]["heldout"]
    print(f"wrote {args.out}: train.jsonl ({train['rows']:,} rows about {train['images']:,} images), heldout.jsonl "
          f"({heldout['rows']:,} questions about {heldout['images']:,} unseen images), {args.size}-px images")
    return 0


def add_make_vision_parser(data_subparsers) -> None:
    """Add `make-vision` to `k3 data`'s subcommands."""
    from k3.vision.synthetic import TASKS

    p = data_subparsers.add_parser("make-vision", help="render the generated image-text set: shapes, counts, bar "
                                                       "charts and code snippets, with questions about them")
    p.add_argument("--out", required=True, help="the folder to write (images/, train.jsonl, heldout.jsonl)")
    p.add_argument("--train", type=positive(int), default=4000, help="training images (default 4000)")
    p.add_argument("--heldout", type=positive(int), default=400, help="held-out images (default 400)")
    p.add_argument("--size", type=positive(int), default=112, help="image side in pixels (default 112)")
    p.add_argument("--seed", type=int, default=0, help="default 0; the same seed writes the same files")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated tasks (default {','.join(TASKS)})")
    p.add_argument("--chat", action="store_true", help="question rows as OpenAI-style conversations with image_url "
                                                       "parts (default: {\"image\", \"text\"} rows)")
    p.set_defaults(func=cmd_make_vision)
