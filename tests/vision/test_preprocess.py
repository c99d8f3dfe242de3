"""Image and video preprocessing against hand-computed sizes and pixel values (docs/architecture.md §7.2)."""

import base64
import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from k3.vision.preprocess import (ImageProcessor, chessboard, image_size, open_image, pack, patchify,
                                  preprocess_image, preprocess_video)

P = ImageProcessor()


def norm(v):
    return (v / 255.0 - 0.5) / 0.5


@pytest.mark.parametrize("size, resized, grid, tokens", [
    # no downscale: 100 × 60 pads to 112 × 84 (multiples of 28) → 8 × 6 patches → 4 × 3 merged tokens
    ((100, 60), (100, 60), (6, 8), 12),
    ((1, 1), (1, 1), (2, 2), 1),  # one pixel still makes one merged token
    ((28, 28), (28, 28), (2, 2), 1),
    ((29, 28), (29, 28), (2, 4), 2),
    # 8000 × 1000: 571 · 71 patches fit the 65,536 budget (√ > 1) but a side may hold 512 · 14 = 7168 px:
    # scale 7168 / 8000 = 0.896 → 7168 × 896 → 512 × 64 patches → 256 × 32 tokens
    ((8000, 1000), (7168, 896), (64, 512), 8192),
    # 3584 × 3584 (the report's largest input): exactly 256 × 256 patches, no scaling, 16,384 tokens
    ((3584, 3584), (3584, 3584), (256, 256), 16384),
])
def test_sizes_by_hand(size, resized, grid, tokens):
    assert P.resized_size(*size) == resized
    assert P.grid(*size) == grid
    assert P.num_tokens(*size) == tokens


def test_patch_budget_scale_by_hand():
    # 10000 × 10000: 714 · 714 = 509,796 patches → scale √(65536 / 509796) = 0.358545…
    # → W' = int(3585.45…) = 3585
    scale = math.sqrt(65536 / (714 * 714))
    assert P.resized_size(10000, 10000) == (int(10000 * scale), int(10000 * scale)) == (3585, 3585)
    # padded to 3612 = 129 · 28 → 258 × 258 patches, 129² merged tokens
    assert P.grid(10000, 10000) == (258, 258) and P.num_tokens(10000, 10000) == 129 * 129


def test_pixel_values_by_hand():
    image = Image.new("RGB", (2, 1))
    image.putpixel((0, 0), (255, 0, 128))
    image.putpixel((1, 0), (10, 20, 30))
    item = preprocess_image(image)
    assert item.grid_thw == (1, 2, 2) and item.pixel_values.shape == (4, 3, 14, 14)
    assert (item.width, item.height) == (2, 1)
    x = item.pixel_values
    assert torch.allclose(x[0, :, 0, 0], torch.tensor([1.0, -1.0, norm(128)]), atol=1e-6)
    assert torch.allclose(x[0, :, 0, 1], torch.tensor([norm(10), norm(20), norm(30)]), atol=1e-6)
    # everything else is zero padding, read after normalising as −1
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, :, 0, :2] = False
    assert bool((x[mask] == -1).all())


def test_patchify_is_row_major():
    pixels = torch.arange(3 * 28 * 42, dtype=torch.float32).view(3, 28, 42)
    patches = patchify(pixels, 14)  # 2 rows × 3 columns of patches
    assert patches.shape == (6, 3, 14, 14)
    for r in range(2):
        for c in range(3):
            assert torch.equal(patches[r * 3 + c], pixels[:, 14 * r:14 * r + 14, 14 * c:14 * c + 14])


def test_downscale_is_pillow_bicubic():
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (100, 100, 3), dtype=np.uint8))
    small = ImageProcessor(in_patch_limit=4)  # 49 patches → scale √(4/49), 100 → int(28.57) = 28 px
    assert small.resized_size(100, 100) == (28, 28)
    item = preprocess_image(image, small)
    want = np.asarray(image.resize((28, 28), Image.Resampling.BICUBIC), dtype=np.float32)
    got = item.pixel_values.permute(0, 2, 3, 1).reshape(2, 2, 14, 14, 3).permute(0, 2, 1, 3, 4).reshape(28, 28, 3)
    assert torch.allclose(got, torch.from_numpy(norm(want)), atol=1e-6)


def test_transparent_pixels_composite_on_the_chessboard():
    clear = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    x = preprocess_image(clear).pixel_values  # one 28 × 28 padded image → 2 × 2 patches
    assert x[0, 0, 0, 0] == 1.0  # (0, 0): white square
    assert torch.isclose(x[0, 0, 0, 8], torch.tensor(norm(180)))  # (x=8, y=0): grey
    assert torch.isclose(x[0, 1, 8, 8], torch.tensor(1.0))  # (8, 8): white again
    half = Image.new("RGBA", (16, 16), (0, 0, 0, 128))
    y = preprocess_image(half).pixel_values
    # Pillow's 8-bit blend: background·(255 − 128)/255, rounded
    assert abs(float(y[0, 0, 0, 0]) - norm(255 * 127 / 255)) < 2 / 255
    assert abs(float(y[0, 0, 0, 8]) - norm(180 * 127 / 255)) < 2 / 255
    # a palette image with a transparent index is composited too; an opaque RGBA stays as it is
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([9, 9, 9] * 256)
    pal.info["transparency"] = 0
    assert preprocess_image(pal).pixel_values[0, 0, 0, 0] == 1.0
    solid = preprocess_image(Image.new("RGBA", (4, 4), (10, 20, 30, 255))).pixel_values
    assert torch.allclose(solid[0, :, 0, 0], torch.tensor([norm(10), norm(20), norm(30)]), atol=1e-6)


def test_chessboard_pattern():
    board = np.asarray(chessboard(24, 16))
    assert board[0, 0] == 255 and board[0, 8] == 180 and board[8, 0] == 180 and board[8, 8] == 255
    assert board[15, 23] == 180


def png_bytes(image):
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def test_sources_and_clear_errors(tmp_path):
    image = Image.new("RGB", (30, 20), (1, 2, 3))
    data = png_bytes(image)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for source in (path, str(path), data, url):
        assert open_image(source).size == (30, 20) and image_size(source) == (30, 20)
    with pytest.raises(ValueError, match="cannot be decoded as an image"):
        open_image(b"certainly not an image")
    with pytest.raises(ValueError, match="cannot be decoded as an image"):
        open_image(data[:40])  # truncated PNG
    with pytest.raises(ValueError, match="does not exist"):
        open_image(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="invalid base64"):
        open_image("data:image/png;base64,@@@@")
    with pytest.raises(ValueError, match="data:image/...;base64"):
        open_image("data:image/png,abc")
    with pytest.raises(ValueError, match="network fetch"):
        open_image("https://example.com/cat.png")
    for mode in ("I;16", "F", "I"):
        with pytest.raises(ValueError, match=f"unsupported image mode '{mode}'"):
            preprocess_image(Image.new(mode, (4, 4)))
    for mode in ("1", "L", "LA", "CMYK", "YCbCr", "RGBX"):
        assert preprocess_image(Image.new(mode, (4, 4))).grid_thw == (1, 2, 2)


def test_video_items():
    frames = [Image.new("RGB", (40, 30), (i * 50, 0, 0)) for i in range(2)]
    video = preprocess_video(frames)
    images = [preprocess_image(f) for f in frames]
    assert video.grid_thw == (2, 4, 4) and video.num_tokens() == 4
    assert torch.equal(video.pixel_values, torch.cat([im.pixel_values for im in images]))  # frame after frame
    with pytest.raises(ValueError, match="1 to 4 frames"):
        preprocess_video(frames * 3)
    with pytest.raises(ValueError, match="share one size"):
        preprocess_video([frames[0], Image.new("RGB", (41, 30))])


def test_packing_and_the_patch_limit():
    items = [preprocess_image(Image.new("RGB", s)) for s in ((28, 28), (56, 28), (10, 70))]
    packed = pack(items)
    assert packed.grid_thw.tolist() == [[1, 2, 2], [1, 2, 4], [1, 6, 2]]
    assert packed.pixel_values.shape == (4 + 8 + 12, 3, 14, 14)
    assert torch.equal(packed.pixel_values[4:12], items[1].pixel_values)
    with pytest.raises(ValueError, match="need 24 patches, more than the limit of 20"):
        pack(items, max_patches=20)
