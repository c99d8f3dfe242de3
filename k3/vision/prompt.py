"""How media enter the token stream (docs/architecture.md §7.5): the media prompt and `<|media_pad|>` expansion.

Per image: `<|media_begin|>` + the plain text `image {W}x{H}` + `<|media_content|>` + N × `<|media_pad|>` +
`<|media_end|>`, where {W}x{H} is the original size and N the item's merged token count. A video item
(t frames) writes `video {W}x{H}x{t}` (k3's choice; the release's video form is unpublished). The model
replaces the pad rows' embeddings, in order, by the projector's rows; no loss is taken on predicting a pad.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3.tokenizer import Tokenizer

MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


def media_prompt(tokenizer: Tokenizer, width: int, height: int, num_tokens: int, frames: int = 1) -> list[int]:
    """The ids of one item's media prompt with its pad expanded to `num_tokens` copies."""
    begin, content, pad, end = (tokenizer.special_id(t) for t in MEDIA_TOKENS)
    text = f"image {width}x{height}" if frames == 1 else f"video {width}x{height}x{frames}"
    return [begin, *tokenizer.encode(text), content, *[pad] * num_tokens, end]


def expand_media_pads(ids: Sequence[int], num_tokens: Sequence[int], pad_id: int) -> list[int]:
    """A prompt written with one `<|media_pad|>` per item (as the release's chat encoder writes it) → each pad
    repeated to its item's token count, in order. ValueError when the counts do not match the pads."""
    pads = sum(1 for i in ids if i == pad_id)
    if pads != len(num_tokens):
        raise ValueError(f"the prompt holds {pads} <|media_pad|> token(s) for {len(num_tokens)} media item(s)")
    out, item = [], 0
    for i in ids:
        if i == pad_id:
            out += [pad_id] * num_tokens[item]
            item += 1
        else:
            out.append(i)
    return out


def mask_media_labels(labels: Sequence[int], pad_id: int, ignore_index: int = -100) -> list[int]:
    """Shifted labels (label t = token t+1) with every `<|media_pad|>` target replaced by `ignore_index`: the
    image rows are inputs, never predictions (the release's "labels at image positions are ignored")."""
    return [ignore_index if label == pad_id else label for label in labels]
