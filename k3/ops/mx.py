"""MX block formats (OCP Microscaling Formats v1.0): MXFP4 (E2M1) and MXFP8 (E4M3, E5M2).

Legend: K the blocked (last, reduction) dim, G = K / block groups.

One implementation for the whole package: the release converter packs experts with it (`k3.convert.release`),
and quantization-aware training fake-quantizes the routed experts' GEMM operands with it (`k3.ops.qat`).

A block of `block_size` (32) consecutive elements along the last dim shares one E8M0 scale
X = 2^(code − 127): an 8-bit biased exponent, no sign, no zero, code 255 = NaN. Elements are stored as
v / X rounded to nearest, ties to even, saturating at the element format's largest finite value:
- E2M1 (FP4): {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, emax 2, no Inf/NaN. Two codes per byte, the first
  element of each pair in the **low** nibble (docs/architecture.md §9.3; torchao's `float4_e2m1fn_x2`).
  A nibble's bit 3 is the sign, bits 0–2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6].
- E4M3 (max 448, emax 8) and E5M2 (max 57344, emax 15): `torch.float8_e4m3fn` / `torch.float8_e5m2`.

Scale rounding (`mode`, torchao's `ScaleCalculationMode` names; amax = max |v| of the block in fp32):
- `floor` (default; the OCP rule, docs/architecture.md §9.3): e = ⌊log2 amax⌋ − emax. Largest element may
  saturate (amax/X ∈ [2^emax, 2^(emax+1))). Idempotent: quantize(dequantize(q)) == q, so a release
  checkpoint survives load (dequantize) → save (quantize) byte for byte.
- `ceil`: e = ⌈log2 amax⌉ − emax.   `even`: ⌊log2⌋ of amax with its mantissa first rounded half-up
  to the element's mantissa width.   `rceil`: e = ⌈log2(amax / max)⌉ (cuBLAS / Blackwell `cvt.rp`
  convention; never saturates), with amax / max computed in fp32 and the ceiling taken exactly.
All modes take ⌊log2⌋ from the fp32 exponent bits (zero and fp32-subnormal amax count as 2^-127,
Inf as 2^128), clamp the code to [0, 254] and give a NaN block (any NaN element) code 255; in such a
block the element bits are unspecified (decoding yields NaN everywhere). For `rceil`, Inf amax → 254.

Relation to torchao's `to_mx` (the test oracle): bit-identical scales and elements in every mode, except
in blocks whose scale code is 0 (amax below 2^(emax−126), e.g. < 2^-124 for E2M1): torchao divides by
2^-126 there (`floor`/`ceil`/`even`) or by 1 (`rceil`) while writing code 0 (= 2^-127), so its own
decode is off by 2× there; k3 divides by the 2^-127 the code means. And torchao's eager `rceil`
rounds ⌈log2⌉ through a float `log2`, which can miss by one when amax/max lies within an ulp of a
power of two; k3 takes the exact ceiling, as the hardware instruction does.
"""

from __future__ import annotations

from typing import Literal

import torch

Elem = Literal["e2m1", "e4m3", "e5m2"]
ScaleMode = Literal["floor", "ceil", "even", "rceil"]
SCALE_MODES = ("floor", "ceil", "even", "rceil")

E8M0_BIAS = 127
E8M0_NAN = 255
BLOCK_SIZE = 32

_EMAX = {"e2m1": 2, "e4m3": 8, "e5m2": 15}
_MAX = {"e2m1": 6.0, "e4m3": 448.0, "e5m2": 57344.0}
_MBITS = {"e2m1": 1, "e4m3": 3, "e5m2": 2}
_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# E2M1 magnitudes by 3-bit code. At a midpoint between neighbours, round-to-nearest-even picks the code whose
# lowest bit is 0: the lower code at 0.25, 1.25, 2.5, 5, the upper at 0.75, 1.75, 3.5.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _check(elem: str, mode: str | None = None) -> None:
    if elem not in _EMAX:
        raise ValueError(f"element format must be one of {sorted(_EMAX)}, got {elem!r}")
    if mode is not None and mode not in SCALE_MODES:
        raise ValueError(f"scale mode must be floor | ceil | even | rceil, got {mode!r}")


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by the block scale) -> the nearest E2M1 value in fp32, ties to even, saturating
    at ±6 (±Inf too); NaN stays NaN.

    The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 above, so v / spacing rounded half-to-even, times the
    spacing, is the grid value whose code is even at a tie; every step is exact (the spacings are powers of two).
    Also the rounding of `e2m1_encode`, so fake quantization and packing round alike."""
    assert v.dtype == torch.float32, v.dtype
    mag = v.abs()
    # spacing 2^(clamp(⌊log2 mag⌋, 0, 2) − 1), from the exponent bits (NaN and Inf land on 2)
    spacing = (((mag.view(torch.int32) >> 23).clamp(127, 129) - 1) << 23).view(torch.float32)
    return torch.copysign((torch.round(mag / spacing) * spacing).clamp(max=6.0), v)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by the block scale) -> E2M1 codes uint8 in [0, 15], RNE, saturating.

    NaN encodes as a signed zero (E2M1 has no NaN; MX marks a NaN block through its scale).
    """
    r = e2m1_round(v).abs().nan_to_num(0.0)
    # magnitude -> code: 2r below 2 (codes 0–3), r + 2 in [2, 4) (4, 5), r / 2 + 4 above (6, 7)
    code = torch.where(r < 2.0, 2.0 * r, torch.where(r < 4.0, r + 2.0, 0.5 * r + 4.0)).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes uint8 [...] -> fp32 values [...] (sign bit 3; -0.0 for code 8).

    Written as fp32 bits (exponent e = code bits 1–2, mantissa m = bit 0: 0.5·m when e = 0, else 2^(e−1)·(1 + m/2))
    rather than read from a table copied to the device, so a CUDA graph can capture it."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, c & 1
    bits = torch.where(e == 0, m * 0x3F000000, ((126 + e) << 23) | (m << 22))  # 0x3F000000 = 0.5
    magnitude = bits.view(torch.float32)
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2]: element 2j in the low nibble, 2j+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dim must be even to pack E2M1 pairs, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)  # [..., K/2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> uint8 codes [..., K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _exp2(k: torch.Tensor) -> torch.Tensor:
    """int32 exponents k in [-127, 127] -> fp32 2^k, exactly, from the bits (2^-127 is the subnormal 0x00400000)."""
    return torch.where(k > -127, (k + 127) << 23, 1 << 22).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 codes uint8 [...] -> fp32 2^(code − 127) [...], NaN for 255. Exact (2^-127 is an fp32 subnormal)."""
    s = scale.view(torch.uint8).to(torch.int32)
    return torch.where(s == E8M0_NAN, torch.nan, _exp2(s.clamp(max=254) - E8M0_BIAS))


def e8m0_scale(amax: torch.Tensor, elem: Elem, mode: ScaleMode = "floor") -> torch.Tensor:
    """Block amax fp32 [...] (≥ 0 or NaN) -> E8M0 codes uint8 [...] under `mode` (see the module docstring)."""
    _check(elem, mode)
    amax = amax.float()
    nan = torch.isnan(amax)
    if mode == "rceil":
        descale = amax / _MAX[elem]  # fp32 division, as the kernels do
        mant, exp = torch.frexp(descale.double())  # descale = mant · 2^exp, mant ∈ [0.5, 1); exact
        ceil_log2 = exp.to(torch.int32) - (mant == 0.5).to(torch.int32)
        code = torch.where(descale == 0, 0, (ceil_log2 + E8M0_BIAS).clamp(0, 254))
        code = torch.where(torch.isinf(descale), 254, code)
    else:
        bits = amax.view(torch.int32)
        if mode == "even":
            # round the mantissa half-up to the element's width, then drop it (a carry bumps the exponent)
            bits = (bits + (1 << (23 - _MBITS[elem] - 1))) & 0x7F800000
        exp = ((bits >> 23) & 0xFF) - E8M0_BIAS  # ⌊log2 amax⌋; −127 for zero/subnormal, 128 for Inf
        if mode == "ceil":
            exp = exp + ((bits & 0x7FFFFF) > 0).to(torch.int32)
        code = (exp - _EMAX[elem] + E8M0_BIAS).clamp(0, 254)
    return torch.where(nan, E8M0_NAN, code).to(torch.uint8)


def _scaled_blocks(x: torch.Tensor, elem: Elem, block_size: int, mode: ScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x / X in fp32 [..., K], E8M0 codes uint8 [..., K/block_size]): the elements before rounding."""
    _check(elem, mode)
    if not x.is_floating_point():
        raise ValueError(f"MX quantization needs a floating-point tensor, got {x.dtype}")
    K = x.shape[-1]
    if K % block_size:
        raise ValueError(f"the last dim ({K}) must be a multiple of the block size {block_size}")
    blocks = x.float().reshape(*x.shape[:-1], K // block_size, block_size)  # [..., G, block]
    amax = blocks.abs().amax(-1)  # [..., G]; NaN if any element is NaN
    scale = e8m0_scale(amax, elem, mode)
    # multiply by the exact power of two 2^(127 − code); NaN blocks get NaN (their elements are unspecified)
    inv = torch.where(scale == E8M0_NAN, torch.nan, _exp2(E8M0_BIAS - scale.to(torch.int32).clamp(max=254)))
    return (blocks * inv.unsqueeze(-1)).reshape(x.shape), scale


def _apply_scale(values: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Element values fp32 [..., K] times their block's 2^(code − 127) -> [..., K] in `dtype` (rounded once)."""
    K = values.shape[-1]
    blocks = values.reshape(*values.shape[:-1], K // block_size, block_size)  # [..., G, block]
    return (blocks * e8m0_to_float(scale).unsqueeze(-1)).reshape(values.shape).to(dtype)


def mx_quantize(x: torch.Tensor, elem: Elem = "e2m1", block_size: int = BLOCK_SIZE,
                mode: ScaleMode = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float (K a multiple of block_size) -> (data, scale).

    data: E2M1 → uint8 [..., K/2] packed pairs; E4M3/E5M2 → float8 [..., K].
    scale: uint8 [..., K/block_size] E8M0 codes.
    """
    v, scale = _scaled_blocks(x, elem, block_size, mode)
    if elem == "e2m1":
        return pack_e2m1(e2m1_encode(v)), scale
    limit = _MAX[elem]
    return v.clamp(-limit, limit).to(_FP8[elem]), scale


def mx_dequantize(data: torch.Tensor, scale: torch.Tensor, elem: Elem = "e2m1", block_size: int = BLOCK_SIZE,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(data, scale) from `mx_quantize` -> values [..., K] in `dtype` (computed in fp32, rounded once)."""
    _check(elem)
    if elem == "e2m1":
        if data.dtype != torch.uint8:
            raise ValueError(f"packed E2M1 data must be uint8, got {data.dtype}")
        values = e2m1_decode(unpack_e2m1(data))
    else:
        values = data.view(_FP8[elem]).float()
    K = values.shape[-1]
    if scale.shape[-1] * block_size != K or scale.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {K // block_size} blocks of "
                         f"{block_size} over data of logical shape {tuple(values.shape)}")
    return _apply_scale(values, scale, block_size, dtype)


def mx_fake_quantize(x: torch.Tensor, elem: Elem = "e2m1", block_size: int = BLOCK_SIZE,
                     mode: ScaleMode = "floor") -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: the values an MX kernel would see (no gradient rule attached;
    `k3.ops.qat.fake_quantize_ste` adds the straight-through one). Bit-identical to `mx_dequantize(*mx_quantize(x))`
    without packing the codes."""
    v, scale = _scaled_blocks(x, elem, block_size, mode)
    if elem == "e2m1":
        values = e2m1_round(v)
    else:
        limit = _MAX[elem]
        values = v.clamp(-limit, limit).to(_FP8[elem]).float()
    return _apply_scale(values, scale, block_size, x.dtype)
