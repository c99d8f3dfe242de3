"""Load and save the released Kimi K3 checkpoint layout (docs/architecture.md §8.1, §9).

A release directory holds `config.json` (nested: top level + `text_config` + `vision_config`),
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file) with its shards, and the
tokenizer files (`tiktoken.model`, `tokenizer_config.json`, ...). `k3.convert.names` is the mapping.

Loading (`load_release`):
1. config.json -> ModelConfig; the model is built on the meta device (no memory).
2. Every shard's safetensors header is read and checked against the expected listing before anything is
   allocated: the first missing, unexpected or mis-shaped tensor is named in a ValueError.
3. The model is materialised empty in its final dtypes (bf16, fp32 for the KDA gate/conv/norm tensors and
   router biases), then filled shard by shard through `safe_open` (memory-mapped; the shard is re-mapped
   every `MAP_WINDOW` bytes, because touched pages of a mapping count in RSS until it is unmapped). Peak
   host memory is therefore the model plus about one window (`benchmarks/convert_memory.py`: ≤ 1.16×).
4. MXFP4 routed experts (uint8 `weight_packed` + E8M0 `weight_scale`, group 32) are either dequantised
   into the stacked `experts.w1/w2/w3` (`experts="dequantize"`), or kept packed (`experts="packed"`):
   then the model's expert parameters stay on the meta device and the stacked packed tensors are returned
   in `ReleaseCheckpoint.packed_experts` for an MXFP4 kernel (`dequantize_experts` fills them later).
5. Vision tower / projector tensors are returned as stored, by release name (`ReleaseCheckpoint.vision`), so a
   save writes them back unchanged; `k3.vision.model.K3VisionLanguageModel.from_parts(ckpt.model, ckpt.vision)`
   builds the multimodal model, and `save_release(vlm, vision=vlm.vision_state_dict())` writes it.

Saving (`save_release`): the same names, shapes and dtypes; shards of at most `shard_size` bytes in a
fixed order (text stack in layer order, then vision), the index, config.json (with the release's
`quantization_config` exactly when experts are packed), and the tokenizer files copied. Routed experts
are written packed when kept packed or when `mxfp4=True` (quantised with `k3.ops.mx`, scale mode
`floor` by default, which reproduces the packed bytes of a dequantised release exactly; a model trained with QAT
uses its `qat_scale_mode`, so the packed experts decode to exactly the weights its forward used, docs/qat.md).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3.config import ModelConfig
from k3.convert import names as N
from k3.ops.mx import ScaleMode, mx_dequantize, mx_quantize
from k3.model.model import K3ForCausalLM
from k3.model.moe import LatentExperts

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files of a checkpoint directory that are not carried over when copying "the other files" of a release
# or a k3 training checkpoint (weights, index, config and k3's checkpoint bookkeeping).
# Bytes read from one mapping of a shard before it is closed and re-opened (see `_stream`).
MAP_WINDOW = 32 * 2**20
_NOT_COPIED = {"config.json", INDEX_FILE, "manifest.json", "COMMITTED", "train_state.pt"}

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "U8": torch.uint8,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class ReleaseCheckpoint:
    """What `load_release` returns."""

    model: K3ForCausalLM
    # kept-packed routed experts: `model.layers.ℓ.block_sparse_moe.experts.w1.weight_packed` [E, I, L/2] uint8,
    # `….w1.weight_scale` [E, I, L/32] uint8 (w3 alike; w2 [E, L, I/2], [E, L, I/32]); empty when dequantised
    packed_experts: dict[str, torch.Tensor] = field(default_factory=dict)
    # vision tower and projector tensors by release name, as stored (empty for a text-only checkpoint)
    vision: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None


def parse_size(size: int | str) -> int:
    """'5GB' -> 5·10^9 bytes; also KB/MB/TB, KiB/MiB/GiB/TiB, or a plain byte count."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B|B)?\s*", size, re.IGNORECASE)
    if m is None:
        raise ValueError(f"cannot parse size {size!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    unit = (m.group(2) or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


def read_release_config(path: str | Path, **runtime: Any) -> ModelConfig:
    """config.json of a release directory -> ModelConfig (runtime switches such as `kda_impl` passed through)."""
    return ModelConfig.load(Path(path) / "config.json", **runtime)


def read_weight_map(path: str | Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index (or a single `model.safetensors`)."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path / INDEX_FILE}: not a safetensors index with a weight_map ({e})") from e
    elif (path / SINGLE_FILE).is_file():
        with safe_open(path / SINGLE_FILE, "pt") as f:
            weight_map = {name: SINGLE_FILE for name in f.keys()}
    else:
        raise ValueError(f"{path}: no {INDEX_FILE} or {SINGLE_FILE}; not a checkpoint directory")
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise ValueError(f"{path}: shard {shard} named in the index does not exist")
    return weight_map


def _by_shard(weight_map: dict[str, str]) -> dict[str, list[str]]:
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    return dict(sorted(shards.items()))


def read_headers(path: Path, weight_map: dict[str, str]) -> dict[str, N.TensorSpec]:
    """Shape and dtype of every tensor, from the shard headers (no tensor data is read)."""
    found: dict[str, N.TensorSpec] = {}
    for shard, tensor_names in _by_shard(weight_map).items():
        with safe_open(path / shard, "pt") as f:
            present = set(f.keys())
            for name in tensor_names:
                if name not in present:
                    raise ValueError(f"{path}: tensor {name!r} is mapped to {shard} by the index but that shard "
                                     "does not contain it")
                sl = f.get_slice(name)
                if sl.get_dtype() not in _ST_DTYPES:
                    raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {sl.get_dtype()}")
                found[name] = N.TensorSpec(tuple(sl.get_shape()), _ST_DTYPES[sl.get_dtype()])
    return found


def check_layout(path: Path, expected_text: dict[str, N.TensorSpec], expected_vision: dict[str, N.TensorSpec],
                 found: dict[str, N.TensorSpec], num_heads: int) -> bool:
    """Raise ValueError naming the first missing, unexpected and mis-shaped tensor. Returns whether vision
    tensors are present (the vision tower and projector are all there or all absent)."""
    has_vision = any(N.is_vision_name(n) for n in found)
    expected = expected_text | (expected_vision if has_vision else {})
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected]
    problems = []
    if missing:
        spec = expected[missing[0]]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        problems.append(f"missing tensor {missing[0]!r} (expected shape {list(spec.shape)}){more}")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        why = " (this config.json has no vision_config)" if N.is_vision_name(unexpected[0]) and not expected_vision \
            else ""
        problems.append(f"unexpected tensor {unexpected[0]!r}{why}: not part of the K3 release layout for this "
                        f"config.json{more}")
    for name, spec in expected.items():
        if name not in found:
            continue
        got = found[name]
        shape_ok = got.shape == spec.shape
        if name.endswith(".A_log"):  # any length >= H with a zero tail (docs/architecture.md §9.4)
            shape_ok = len(got.shape) == 1 and got.shape[0] >= num_heads
        if not shape_ok:
            problems.append(f"tensor {name!r} has shape {list(got.shape)}, expected {list(spec.shape)}")
            break
        if (spec.dtype == torch.uint8) != (got.dtype == torch.uint8) or \
                (spec.dtype.is_floating_point and not got.dtype.is_floating_point):
            problems.append(f"tensor {name!r} has dtype {got.dtype}, expected {spec.dtype}")
            break
    if problems:
        raise ValueError(f"{path} does not match the K3 release layout: " + "; ".join(problems))
    return has_vision


def _stream(shard: Path, tensor_names: list[str], window: int | None = None):
    """Yield (name, tensor) from one shard through `safe_open`, re-mapping the file after every `window` bytes
    (default MAP_WINDOW): the pages a process has touched in a mapping count in its RSS until it is unmapped,
    so this bounds the loader's extra memory by about one window, whatever the shard size. The consumer
    copies each tensor and drops it (a kept reference would keep its pages resident)."""
    window = window or MAP_WINDOW
    i = 0
    while i < len(tensor_names):
        with safe_open(shard, "pt", device="cpu") as f:
            mapped = 0
            while i < len(tensor_names) and mapped < window:
                t = f.get_tensor(tensor_names[i])
                yield tensor_names[i], t
                mapped += t.numel() * t.element_size()
                i += 1


def _materialize(model: K3ForCausalLM, device: torch.device | str, skip_experts: bool) -> None:
    for module in model.modules():
        if skip_experts and isinstance(module, LatentExperts):
            continue
        module.to_empty(device=device, recurse=False)


@torch.no_grad()
def load_release(path: str | Path, *, dtype: torch.dtype | None = None,
                 experts: Literal["dequantize", "packed"] = "dequantize", device: str | torch.device = "cpu",
                 load_vision: bool = True, **runtime: Any) -> ReleaseCheckpoint:
    """Load a release-layout directory into a `K3ForCausalLM` (eval mode).

    dtype: the model dtype (default: config.json's `dtype`, bf16); the fp32 tensors stay fp32.
    experts: "dequantize" MXFP4 experts into the model, or keep them "packed" (see ReleaseCheckpoint).
    runtime: k3 runtime switches for ModelConfig (`kda_impl`, `mla_impl`, ...).
    """
    path = Path(path)
    if experts not in ("dequantize", "packed"):
        raise ValueError(f"experts must be 'dequantize' or 'packed', got {experts!r}")
    config = read_release_config(path, **runtime)
    packed = N.experts_are_packed(config)
    if experts == "packed" and not packed:
        raise ValueError(f"{path} stores its routed experts unquantised (no mxfp4 quantization_config); "
                         "there is nothing to keep packed")
    keep_packed = experts == "packed"
    if not keep_packed:
        config = config.replace(quantization_config=None)  # the loaded model holds plain experts
    dtype = dtype or getattr(torch, config.dtype)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.cast(dtype)

    weight_map = read_weight_map(path)
    found = read_headers(path, weight_map)
    text = N.release_layout(model, packed, dtype, vision=False)
    vision_expected = N.vision_layout(config.vision_config, dtype) if config.vision_config is not None else {}
    check_layout(path, text, vision_expected, found, config.num_attention_heads)

    _materialize(model, device, skip_experts=keep_packed)
    targets = model.state_dict(keep_vars=True)
    H = config.num_attention_heads
    filled: set[str] = set()
    packed_out: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # one expert's packed/scale halves
    vision: dict[str, torch.Tensor] = {}

    for shard, tensor_names in _by_shard(weight_map).items():
        for name, t in _stream(path / shard, tensor_names):
            where = N.from_release(name)
            if where is None:
                if load_vision:
                    vision[name] = t.clone()
                continue
            target = targets[where.k3_name]
            if where.expert is None:
                if name.endswith(".A_log"):
                    t = N.unpad_a_log(t, H, f"{path}: {name}")
                target.copy_(t)
                filled.add(where.k3_name)
            elif where.field == "weight":
                target[where.expert].copy_(t)
                filled.add(f"{where.k3_name}.{where.expert}")
            elif keep_packed:
                key = N.packed_k3_name(where.k3_name, where.field)
                if key not in packed_out:
                    packed_out[key] = torch.empty(config.num_experts, *t.shape, dtype=torch.uint8, device=device)
                packed_out[key][where.expert].copy_(t)
                filled.add(f"{key}.{where.expert}")
            else:
                halves = pending.setdefault((where.k3_name, where.expert), {})
                halves[where.field] = t.clone()
                if len(halves) == 2:
                    w = mx_dequantize(halves["weight_packed"], halves["weight_scale"], "e2m1",
                                      N.MXFP4_GROUP, dtype=target.dtype)
                    target[where.expert].copy_(w)
                    del pending[(where.k3_name, where.expert)]
                    filled.add(f"{where.k3_name}.{where.expert}")
    # check_layout guarantees every tensor was present; this catches a mapping bug, not user input
    expected_fills = sum(config.num_experts * (2 if keep_packed else 1) if N.is_expert_name(n) else 1
                         for n in targets)
    assert not pending and len(filled) == expected_fills, "release loader left tensors unfilled"
    return ReleaseCheckpoint(model.eval(), packed_out, vision, path)


@torch.no_grad()
def dequantize_experts(model: K3ForCausalLM, packed_experts: dict[str, torch.Tensor],
                       device: str | torch.device | None = None) -> K3ForCausalLM:
    """Fill a model's kept-packed (meta) routed experts from `packed_experts` (as `load_release` returns them)."""
    dtype = _model_dtype(model)
    for name, module in model.named_modules():
        if not isinstance(module, LatentExperts):
            continue
        for kind in N.EXPERT_KINDS:
            param = getattr(module, kind)
            key = f"{name}.{kind}"
            packed, scale = packed_experts[f"{key}.weight_packed"], packed_experts[f"{key}.weight_scale"]
            w = mx_dequantize(packed, scale, "e2m1", N.MXFP4_GROUP, dtype=dtype)
            target = device or packed.device
            setattr(module, kind, torch.nn.Parameter(w.to(target), requires_grad=param.requires_grad))
    return model


def _model_dtype(model: K3ForCausalLM) -> torch.dtype:
    """The dtype of the non-fp32-pinned tensors (the embedding is one of them)."""
    return model.model.embed_tokens.weight.dtype


def _shard_plan(layout: dict[str, N.TensorSpec], max_bytes: int) -> list[list[str]]:
    """Greedy, in layout order: a new shard starts when the next tensor would overflow the current one."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in layout.items():
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def copy_other_files(source: str | Path, out: str | Path) -> list[str]:
    """Copy the non-weight files of a checkpoint directory (tokenizer files, chat template, the release's
    code and processor config) into `out`; returns their names. config.json, weights and index are not copied."""
    source, out = Path(source), Path(out)
    copied: list[str] = []
    if source.resolve() == out.resolve():
        return copied
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out / f.name)
            copied.append(f.name)
    return copied


@torch.no_grad()
def save_release(model: K3ForCausalLM, out: str | Path, *, mxfp4: bool = False,
                 packed_experts: dict[str, torch.Tensor] | None = None, vision: dict[str, torch.Tensor] | None = None,
                 shard_size: int | str = "5GB", copy_files_from: str | Path | None = None,
                 dtype: torch.dtype | None = None, scale_mode: ScaleMode | None = None) -> Path:
    """Write `model` in the release layout into directory `out`; returns `out`.

    mxfp4: quantise the routed experts to MXFP4 with `scale_mode`: by default the model's `qat_scale_mode` when it
    trained with QAT (the packed experts then decode to exactly the weights of its forward; another mode is refused),
    else the OCP `floor` rule.
    packed_experts: write these kept-packed experts as they are (implies packed; see `load_release`).
    vision: vision tower / projector tensors by release name, written unchanged.
    dtype: dtype of the non-fp32 tensors (default: the config's `dtype`, bf16).
    copy_files_from: a directory whose tokenizer (and other non-weight) files are copied in.
    """
    out = Path(out)
    config = model.config
    dtype = dtype or getattr(torch, config.dtype)
    packed = mxfp4 or packed_experts is not None
    if config.qat == "mxfp4" and scale_mode not in (None, config.qat_scale_mode):
        raise ValueError(f"this model trained with QAT under scale mode {config.qat_scale_mode!r}; exporting with "
                         f"{scale_mode!r} would change the expert weights its forward used")
    scale_mode = scale_mode or (config.qat_scale_mode if config.qat == "mxfp4" else "floor")
    experts_on_meta = any(p.is_meta for n, p in model.named_parameters() if N.is_expert_name(n))
    if experts_on_meta and packed_experts is None:
        raise ValueError("the model's routed experts are kept packed (on the meta device); pass packed_experts")
    if vision:
        want = N.vision_layout(config.vision_config) if config.vision_config is not None else {}
        if set(vision) != set(want):
            odd = sorted(set(vision) ^ set(want))
            raise ValueError(f"vision tensors do not match the config's vision_config, e.g. {odd[0]!r}")
    layout = N.release_layout(model, packed, dtype, vision=False)
    if vision:
        layout |= {name: N.TensorSpec(tuple(vision[name].shape), vision[name].dtype) for name in want}
    sources = model.state_dict(keep_vars=True)

    quantized: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def tensor(name: str) -> torch.Tensor:
        where = N.from_release(name)
        if where is None:
            return vision[name].detach().to("cpu", copy=True).contiguous()
        spec = layout[name]
        if where.expert is None:
            t = sources[where.k3_name].detach()
            if name.endswith(".A_log"):
                return N.pad_a_log(t, spec.shape[0], spec.dtype)
            return t.to("cpu", spec.dtype, copy=True).contiguous()
        if packed_experts is not None:
            key = N.packed_k3_name(where.k3_name, where.field)
            return packed_experts[key][where.expert].to("cpu", copy=True).contiguous()
        w = sources[where.k3_name].detach()[where.expert]
        if not packed:
            return w.to("cpu", spec.dtype, copy=True).contiguous()
        key = (where.k3_name, where.expert)
        if key not in quantized:  # packed and scale come from one quantisation; keep only the latest
            quantized.clear()
            quantized[key] = mx_quantize(w.to("cpu"), "e2m1", N.MXFP4_GROUP, scale_mode)
        return quantized[key][0 if where.field == "weight_packed" else 1].clone()

    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    plan = _shard_plan(layout, parse_size(shard_size))
    weight_map: dict[str, str] = {}
    for i, shard_names in enumerate(plan, 1):
        file = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        tensors = {name: tensor(name) for name in shard_names}
        for name, t in tensors.items():
            assert tuple(t.shape) == layout[name].shape and t.dtype == layout[name].dtype, name
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in shard_names}
        del tensors
    total = sum(math.prod(s.shape) * s.dtype.itemsize for s in layout.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2) + "\n")
    if copy_files_from is not None:
        copy_other_files(copy_files_from, out)
    saved = config.replace(quantization_config=copy.deepcopy(N.MXFP4_QUANTIZATION_CONFIG) if packed else None,
                           dtype=str(dtype).removeprefix("torch."))
    saved.save(out / "config.json")
    return out


def save_draft_release(state_dict: dict[str, torch.Tensor], config: ModelConfig, out: str | Path,
                       info: dict[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a speculative draft's tensors (`k3.spec.draft.Draft.state_dict()` of a draft for `config`) into the
    release directory `out` as `draft.safetensors`, named by `names.draft_to_release` (routed experts one tensor per
    expert, unpacked; `dtype`, the router bias fp32), and `info` as `draft_config.json`. The release's index and
    shards are not touched. Returns the safetensors path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        names = N.draft_to_release(name, config)
        kind = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        parts = t.unbind(0) if len(names) > 1 else [t]  # stacked experts [E, …] -> one tensor per expert
        for release_name, part in zip(names, parts, strict=True):
            tensors[release_name] = part.detach().to("cpu", kind).contiguous()
    path = out / N.DRAFT_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    (out / N.DRAFT_CONFIG_FILE).write_text(json.dumps(info or {}, indent=2) + "\n")
    return path


def load_draft_release(path: str | Path, config: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the draft's state dict, draft_config.json) from a release directory's `draft.safetensors`: the inverse of
    `save_draft_release`, per-expert tensors stacked back into `experts.w1/w2/w3`. ValueError for a tensor outside the
    draft layer or an expert missing."""
    path = Path(path)
    if not (path / N.DRAFT_FILE).is_file():
        raise ValueError(f"{path} holds no {N.DRAFT_FILE}")
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    with safe_open(str(path / N.DRAFT_FILE), framework="pt") as f:
        for release_name in f.keys():
            where = N.draft_from_release(release_name, config)
            if where.expert is None:
                state[where.k3_name] = f.get_tensor(release_name)
            else:
                experts.setdefault(where.k3_name, {})[where.expert] = f.get_tensor(release_name)
    for name, parts in experts.items():
        if sorted(parts) != list(range(config.num_experts)):
            raise ValueError(f"{path / N.DRAFT_FILE}: {name} holds experts {sorted(parts)[:4]}…, not all "
                             f"{config.num_experts}")
        state[name] = torch.stack([parts[e] for e in range(config.num_experts)])
    info_path = path / N.DRAFT_CONFIG_FILE
    return state, json.loads(info_path.read_text()) if info_path.is_file() else {}
