"""The released Kimi K3 checkpoint layout, both ways, and the MX block formats (docs/architecture.md §8–§9).

- `names`: the one mapping between k3 tensor names and the release's (stacked ↔ per-expert routed experts,
  A_log padding, the `language_model.` prefix, vision tower / projector names).
- `mx`: MXFP4 (E2M1) and MXFP8 (E4M3, E5M2) with E8M0 block-32 scales (OCP MX v1.0); re-exports `k3.ops.mx`.
- `release`: `load_release` / `save_release` for a release-layout directory.
- `cli`: `k3 convert to-release | from-release`.

The transformers integration over this layout is `k3.hf`, a front end like the CLI.
"""

# Lazy exports: `k3.convert.cli` is imported by `k3 --help`, which should not pay for torch.
_EXPORTS = {
    "mx_quantize": "k3.ops.mx", "mx_dequantize": "k3.ops.mx", "mx_fake_quantize": "k3.ops.mx",
    "ReleaseCheckpoint": "k3.convert.release", "load_release": "k3.convert.release",
    "save_release": "k3.convert.release", "dequantize_experts": "k3.convert.release",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
