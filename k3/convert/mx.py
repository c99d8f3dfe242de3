"""MX block formats for the converter: `k3.ops.mx`, the one implementation (the model's quantization-aware
training uses it too, and `model` may import `ops` only). See `k3.ops.mx` for the formats, the scale modes and the
relation to torchao."""

from k3.ops.mx import (  # noqa: F401
    BLOCK_SIZE,
    E2M1_MAGNITUDES,
    E8M0_BIAS,
    E8M0_NAN,
    Elem,
    ScaleMode,
    e2m1_decode,
    e2m1_encode,
    e8m0_scale,
    e8m0_to_float,
    mx_dequantize,
    mx_fake_quantize,
    mx_quantize,
    pack_e2m1,
    unpack_e2m1,
)
