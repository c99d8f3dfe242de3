"""Conversations with `image_url` parts → token ids and media items (docs/vision.md, "Serving").

`k3.chat.template` renders text: a message with image parts is refused there. A message with images renders
as the training data writes it (`k3.vision.data`): its header, then each part in order — text encoded, an image
as its media prompt (`<|media_begin|>image {W}x{H}<|media_content|>` + one `<|media_pad|>` per token +
`<|media_end|>`) — and `<|end_of_msg|>`. Every other piece (options, text messages, the generation prompt) is the
template's own: `render_with_media` renders the conversation with each image message replaced by a text message
holding a unique marker, then swaps the marker message's tokens for the real ones, so the template stays the
one source of the conversation's layout.

Image sources (`ImagePolicy`): `data:image/...;base64,` URLs always; local paths only when allowed (`k3 chat`,
`k3 generate`, `k3 serve --allow-local-images`); a network URL never (k3 does not fetch).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3.chat.template import ChatTemplate
from k3.vision.preprocess import DEFAULT_PROCESSOR, ImageProcessor, MediaItem, preprocess_image
from k3.vision.prompt import media_prompt

IMAGE_ROLES = ("user", "system", "developer")
NETWORK_SCHEMES = ("http", "https", "ftp")


class ImageError(ValueError):
    """A bad image part; `param` names it as the API does (`messages[0].content[1].image_url`)."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def has_images(message: Any) -> bool:
    """Does this OpenAI-style message hold an `image_url` content part."""
    content = message.get("content") if isinstance(message, Mapping) else None
    return isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") == "image_url"
                                             for p in content)


def image_url(part: Mapping[str, Any]) -> Any:
    """The url of an `image_url` part (`{"image_url": {"url": ...}}`, or the bare string some clients send)."""
    url = part.get("image_url")
    return url.get("url") if isinstance(url, Mapping) else url


def image_message_ids(template: ChatTemplate, message: Mapping[str, Any], image: Callable[[Any, str], list[int]],
                      param: str) -> list[int]:
    """One message with image parts: its header, each part in order (text encoded; an image → `image(url,
    where)`, which returns the item's prompt ids), `<|end_of_msg|>`. ValueError naming the part if it is bad."""
    role = message.get("role")
    if role not in IMAGE_ROLES:
        raise ImageError("images are supported in user and system messages only", param)
    ids = template.open_tag("message", role=role)
    for j, part in enumerate(message["content"]):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            ids += template.text(part["text"])
        elif kind == "image_url":
            ids += image(image_url(part), where)
        else:
            raise ImageError(f"content part of type {kind!r} is not supported (text and image_url)", where)
    return ids + [template.end_id]


@dataclass(frozen=True)
class ImagePolicy:
    """Which image sources a front end accepts, and the preprocessing settings."""

    allow_local_files: bool = False
    processor: ImageProcessor = DEFAULT_PROCESSOR

    def load(self, url: Any, where: str) -> MediaItem:
        """The preprocessed image of the `image_url` part at `where`; ImageError for anything else."""
        param = f"{where}.image_url"
        if not isinstance(url, str) or not url:
            raise ImageError('expected {"url": "data:image/...;base64,..."}', param)
        if url.split(":", 1)[0].lower() in NETWORK_SCHEMES:
            raise ImageError(f"{url[:80]!r} needs a network fetch, which k3 never does; send the image inline as a "
                             "base64 data URL (data:image/png;base64,...)", param)
        if not url.startswith("data:"):
            path = url.removeprefix("file://")
            if not self.allow_local_files:
                raise ImageError("local files are not read (start the server with --allow-local-images); send the "
                                 "image as a base64 data URL", param)
            url = str(Path(path).expanduser())
        try:
            return preprocess_image(url, self.processor)
        except ValueError as e:
            raise ImageError(str(e), param) from None


def render_with_media(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], policy: ImagePolicy,
                      **options: Any) -> tuple[list[int], list[MediaItem]]:
    """`template.render(messages, **options)` with image parts: (ids with every image's pads expanded, the
    preprocessed images in order). Raises `k3.chat.template.TemplateError` from the template, `ImageError` for a
    bad image part."""
    tokenizer = template.tokenizer
    items: list[MediaItem] = []

    def image(url: Any, where: str) -> list[int]:
        item = policy.load(url, where)
        items.append(item)
        return media_prompt(tokenizer, item.width, item.height, item.num_tokens(policy.processor.merge_size))

    # stand-ins: a text message with a unique marker, rendered context-free (a user or system message does not
    # depend on thinking or tool calls), so its tokens occur exactly once in the rendering
    marker = f"k3-media-message-{uuid.uuid4().hex}-"
    stand_ins, swaps = [], []
    for i, message in enumerate(messages):
        if has_images(message):
            stand_in = {"role": message["role"], "content": f"{marker}{len(swaps)}"}
            swaps.append((template.render_message(stand_in, thinking=False),
                          image_message_ids(template, message, image, f"messages[{i}]")))
            message = stand_in
        stand_ins.append(message)
    ids = template.render(stand_ins, **options)
    for stand_in, real in swaps:
        at = find(ids, stand_in)
        assert at >= 0, "the template did not render the stand-in message as render_message does"
        ids = ids[:at] + real + ids[at + len(stand_in):]
    return ids, items


def find(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """The first index of `needle` in `haystack`, -1 if absent."""
    n, first = len(needle), needle[0]
    for i in range(len(haystack) - n + 1):
        if haystack[i] == first and list(haystack[i:i + n]) == list(needle):
            return i
    return -1
