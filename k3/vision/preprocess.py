"""Images and short videos → normalised 14 × 14 patches, packed NaViT-style (docs/vision.md, "Preprocessing").

Legend: N patches of a packed batch, n items (images or videos), t frames, h × w patches per frame, p patch size.

Per image, with Pillow (docs/architecture.md §7.2):
1. decode, check the mode, composite transparency on a chessboard (8-px squares, 255 / 180, after the resize);
2. `scale = min(1, sqrt(in_patch_limit / (max(1, W // p) · max(1, H // p))), side·p / W, side·p / H)`,
   `W' = max(1, int(W · scale))`, `H'` alike; bicubic resize;
3. zero-pad right and bottom to multiples of 2p (before normalising, so padding reads −1), then
   `(x / 255 − 0.5) / 0.5`;
4. patchify row-major into [h·w, 3, p, p] with `grid_thw = (1, h, w)`.
A video item is t ≤ 4 frames of one size, each resized alike and patchified frame after frame ([t·h·w, 3, p, p],
`grid_thw = (t, h, w)`). `pack` concatenates the items of a batch; attention stays within each item.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Modes Pillow converts to RGB without inventing meaning; others (16/32-bit integer or float images) are refused.
SUPPORTED_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr")
# The chessboard behind transparent pixels (third-party reading of the release's preprocessor config, docs/vision.md)
CHESSBOARD_SQUARE = 8
CHESSBOARD_VALUES = (255, 180)  # (top-left square, the other squares)
MAX_VIDEO_FRAMES = 4


@dataclass(frozen=True)
class ImageProcessor:
    """The preprocessing settings of the release's processor (docs/architecture.md §7.2)."""

    patch_size: int = 14
    merge_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(W', H') of the scale rule (step 2): never larger, at most `in_patch_limit` patches before padding and
        `patch_limit_on_one_side` patches a side."""
        if width < 1 or height < 1:
            raise ValueError(f"an image needs at least 1 × 1 pixels, got {width} × {height}")
        p, side = self.patch_size, self.patch_limit_on_one_side
        patches = max(1, width // p) * max(1, height // p)
        scale = min(1.0, math.sqrt(self.in_patch_limit / patches), side * p / width, side * p / height)
        return min(max(1, int(width * scale)), side * p), min(max(1, int(height * scale)), side * p)

    def padded_size(self, width: int, height: int) -> tuple[int, int]:
        """(W'', H''): the resized size rounded up to multiples of the merged patch (2p)."""
        unit = self.patch_size * self.merge_size
        w, h = self.resized_size(width, height)
        return -(-w // unit) * unit, -(-h // unit) * unit

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(h, w) patches of an image of `width` × `height` pixels after resizing and padding."""
        w, h = self.padded_size(width, height)
        return h // self.patch_size, w // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        """Merged tokens (`<|media_pad|>` copies) of one image or one video item: (h/2)·(w/2)."""
        h, w = self.grid(width, height)
        return (h // self.merge_size) * (w // self.merge_size)


DEFAULT_PROCESSOR = ImageProcessor()


def open_image(source: str | Path | bytes) -> Image.Image:
    """An image from a file path, raw bytes or a `data:image/...;base64,` URL; ValueError if it cannot be read.

    Network URLs are refused: k3 never fetches.
    """
    if isinstance(source, str) and source.startswith("data:"):
        source = decode_data_url(source)
    elif isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https", "ftp"):
        raise ValueError(f"image {source[:80]!r} needs a network fetch, which k3 never does; pass a local file or "
                         "a base64 data URL")
    what = "image bytes" if isinstance(source, bytes) else f"image file {str(source)!r}"
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise ValueError(f"{what} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{what} cannot be decoded as an image ({type(e).__name__}: {e})") from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"{what} is too large to decode safely ({e})") from e
    return image


def image_size(source: str | Path | bytes) -> tuple[int, int]:
    """(width, height) from the header only (no pixel decode); ValueError if it is not an image."""
    if isinstance(source, str) and source.startswith("data:"):
        source = decode_data_url(source)
    what = "image bytes" if isinstance(source, bytes) else f"image file {str(source)!r}"
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise ValueError(f"{what} does not exist")
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            return image.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{what} cannot be decoded as an image ({type(e).__name__}: {e})") from e


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:[mime];base64,PAYLOAD` URL; ValueError otherwise."""
    header, _, payload = url.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64") or not payload:
        raise ValueError(f"data URL {url[:60]!r}… is not of the form data:image/...;base64,PAYLOAD")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URL {url[:60]!r}… holds invalid base64 ({e})") from e


def chessboard(width: int, height: int) -> Image.Image:
    """An L image of 8-px squares: 255 where (y // 8 + x // 8) is even (top-left), 180 elsewhere."""
    y, x = np.indices((height, width))
    odd = ((y // CHESSBOARD_SQUARE + x // CHESSBOARD_SQUARE) % 2).astype(bool)
    return Image.fromarray(np.where(odd, CHESSBOARD_VALUES[1], CHESSBOARD_VALUES[0]).astype(np.uint8), "L")


def to_rgb(image: Image.Image, size: tuple[int, int] | None = None) -> Image.Image:
    """RGB at `size` (bicubic; default: unchanged). Transparent images are resized with their alpha (Pillow
    premultiplies, so colour under transparent pixels never bleeds) and then composited on the chessboard."""
    if image.mode not in SUPPORTED_MODES:
        raise ValueError(f"unsupported image mode {image.mode!r}; supported: {', '.join(SUPPORTED_MODES)}")
    transparent = image.mode in ("LA", "La", "PA", "RGBA", "RGBa") or "transparency" in image.info
    image = image.convert("RGBA" if transparent else "RGB")
    if size is not None and image.size != size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    if transparent:
        background = chessboard(*image.size).convert("RGB")
        background.paste(image, mask=image.getchannel("A"))
        image = background
    return image


def normalized_pixels(image: Image.Image, processor: ImageProcessor = DEFAULT_PROCESSOR) -> torch.Tensor:
    """Steps 2–3: the resized, padded, normalised image as float32 [3, H'', W'']."""
    w, h = processor.resized_size(*image.size)
    rgb = np.asarray(to_rgb(image, (w, h)), dtype=np.float32)  # [H', W', 3], 0..255
    W2, H2 = processor.padded_size(*image.size)
    padded = np.zeros((H2, W2, 3), dtype=np.float32)
    padded[:h, :w] = rgb
    mean = np.asarray(processor.image_mean, dtype=np.float32)
    std = np.asarray(processor.image_std, dtype=np.float32)
    return torch.from_numpy(((padded / 255.0 - mean) / std).transpose(2, 0, 1).copy())


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[C, H, W] → [(H/p)·(W/p), C, p, p], patches in row-major order."""
    C, H, W = pixels.shape
    p = patch_size
    patches = pixels.view(C, H // p, p, W // p, p).permute(1, 3, 0, 2, 4)  # [h, w, C, p, p]
    return patches.reshape(-1, C, p, p)


@dataclass
class MediaItem:
    """One preprocessed image or video: its patches and grid, and the size the prompt names."""

    pixel_values: torch.Tensor  # [t·h·w, 3, p, p] float32
    grid_thw: tuple[int, int, int]
    width: int  # original size (the `image {W}x{H}` of the prompt)
    height: int

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def num_tokens(self, merge_size: int = 2) -> int:
        _, h, w = self.grid_thw
        return (h // merge_size) * (w // merge_size)


def preprocess_image(image: Image.Image | str | Path | bytes,
                     processor: ImageProcessor = DEFAULT_PROCESSOR) -> MediaItem:
    """One image (a PIL image, a path, bytes or a data URL) → a `MediaItem` with t = 1."""
    if not isinstance(image, Image.Image):
        image = open_image(image)
    pixels = normalized_pixels(image, processor)
    p = processor.patch_size
    return MediaItem(patchify(pixels, p), (1, pixels.shape[1] // p, pixels.shape[2] // p), *image.size)


def preprocess_video(frames: list[Image.Image | str | Path | bytes],
                     processor: ImageProcessor = DEFAULT_PROCESSOR) -> MediaItem:
    """1 to 4 frames of one size → one `MediaItem` with t = len(frames), patches frame after frame."""
    if not 1 <= len(frames) <= MAX_VIDEO_FRAMES:
        raise ValueError(f"a video item holds 1 to {MAX_VIDEO_FRAMES} frames, got {len(frames)}")
    images = [f if isinstance(f, Image.Image) else open_image(f) for f in frames]
    if len({im.size for im in images}) != 1:
        raise ValueError(f"the frames of a video item must share one size, got {sorted({im.size for im in images})}")
    items = [preprocess_image(im, processor) for im in images]
    _, h, w = items[0].grid_thw
    return MediaItem(torch.cat([it.pixel_values for it in items]), (len(items), h, w), *images[0].size)


@dataclass
class PackedMedia:
    """The media of one forward: every item's patches back to back (NaViT packing) and its grid."""

    pixel_values: torch.Tensor  # [N, 3, p, p] float32
    grid_thw: torch.Tensor  # [n, 3] int64

    def as_inputs(self) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values, "grid_thw": self.grid_thw}


def pack(items: list[MediaItem], max_patches: int | None = None) -> PackedMedia:
    """Concatenate items in order; ValueError when they hold more than `max_patches` patches together."""
    if not items:
        raise ValueError("pack needs at least one media item")
    total = sum(it.num_patches for it in items)
    if max_patches is not None and total > max_patches:
        raise ValueError(f"{len(items)} media item(s) need {total:,} patches, more than the limit of "
                         f"{max_patches:,} per forward; send fewer or smaller images")
    return PackedMedia(torch.cat([it.pixel_values for it in items]),
                       torch.tensor([it.grid_thw for it in items], dtype=torch.int64))
