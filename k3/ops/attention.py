"""Document-masked causal attention for training and prefill: FlashAttention varlen, flex_attention, SDPA.

Legend: B rows, T queries, S keys, H heads, Dq query/key head dim, Dv value head dim.

One contract for every backend (`document_attention`): queries at absolute positions offset + t with
document ids q_doc [B, T], keys at positions s ∈ [0, S) with document ids kv_doc [B, S]; query t may
attend key s iff s ≤ offset + t and the documents match (no ids: plain causal). Context parallelism
passes a gathered key latent with its own ids; training passes offset 0 and the same ids twice.

- `flash`: `flash_attn_varlen_func` when the `flash_attn` package is installed; self-attention over the
  packed documents only (offset 0, the same ids). The value head is zero-padded to Dq (FA2 wants one
  head dim). Needs the document lengths on the host (one sync per forward).
- `flex`: `flex_attention` with a block mask built from the ids (blocks wholly outside every document
  are skipped), compiled on CUDA. Its per-row max score gives the QK-Clip logits for free.
- `sdpa`: `scaled_dot_product_attention` with an explicit [B, 1, T, S] boolean mask (or `is_causal`).
All three accumulate in fp32 inside the kernel; the output comes back in the input dtype.
The per-head max logit (QK-Clip) comes from flex's max scores on CUDA and otherwise from
`max_logits_chunked`, a query-chunked pass over the scores without gradient.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # optional dependency
    flash_attn_varlen_func = None

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:
    flex_attention = create_block_mask = None

try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch without flex's auxiliary outputs: max logits by the chunked pass
    AuxRequest = None

BACKENDS = ("flash", "flex", "sdpa")


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> flash (installed) or flex on CUDA, "reference" elsewhere; explicit names are checked."""
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        return "flash" if flash_attn_varlen_func is not None else ("flex" if flex_attention is not None else "sdpa")
    if backend == "flash" and flash_attn_varlen_func is None:
        raise ValueError("attention_backend 'flash' needs the flash_attn package")
    if backend == "flex" and flex_attention is None:
        raise ValueError("attention_backend 'flex' needs torch.nn.attention.flex_attention")
    if backend not in BACKENDS + ("reference",):
        raise ValueError(f"attention_backend must be auto|reference|flash|flex|sdpa, got {backend!r}")
    return backend


def document_mask(T: int, S: int, offset: int, q_doc: torch.Tensor | None, kv_doc: torch.Tensor | None,
                  device) -> torch.Tensor:
    """[B or 1, T, S] bool: key s visible to query t (the reference of every backend's mask)."""
    q_pos = torch.arange(T, device=device) + offset
    mask = (torch.arange(S, device=device)[None, :] <= q_pos[:, None]).unsqueeze(0)  # [1, T, S]
    if q_doc is not None:
        mask = mask & (q_doc[:, :, None] == kv_doc[:, None, :])  # [B, T, S]
    return mask


@torch.no_grad()
def max_logits_chunked(q: torch.Tensor, k: torch.Tensor, scale: float, offset: int, q_doc, kv_doc,
                       budget: int = 1 << 28) -> torch.Tensor:
    """Per-head max of the scaled logits over visible pairs: q [B, T, H, Dq], k [B, S, H, Dq] -> [H] fp32.

    Query chunks keep the fp32 score block under `budget` elements.
    """
    B, T, H, _ = q.shape
    S = k.shape[1]
    chunk = max(1, min(T, budget // max(1, B * H * S)))
    out = torch.full((H,), float("-inf"), device=q.device, dtype=torch.float32)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        scores = torch.einsum("bthd,bshd->bhts", q[:, t0:t1], k).float() * scale
        mask = document_mask(t1 - t0, S, offset + t0, q_doc[:, t0:t1] if q_doc is not None else None, kv_doc,
                             q.device)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out


_compiled: dict[str, object] = {}
_mask_cache: dict = {}


def _flex_fn(device: torch.device):
    if device.type != "cuda":
        return flex_attention  # eager on CPU (forward only): used by tests
    if "flex" not in _compiled:
        _compiled["flex"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["flex"]


def document_block_mask(B: int, T: int, S: int, offset: int, q_doc, kv_doc, device):
    """flex BlockMask for `document_mask`; the last one is reused while its inputs are the same tensors
    (every MLA layer of one forward, and the recomputation under activation checkpointing)."""
    key = (B, T, S, offset, str(device), id(q_doc), id(kv_doc),
           None if q_doc is None else q_doc._version, None if kv_doc is None else kv_doc._version)
    hit = _mask_cache.get("last")
    if hit is not None and hit[0] == key:
        return hit[1]
    if q_doc is None:
        def mask_mod(b, h, t, s):
            return s <= t + offset
    else:
        def mask_mod(b, h, t, s):
            return (s <= t + offset) & (q_doc[b, t] == kv_doc[b, s])
    block_mask = create_block_mask(mask_mod, B if q_doc is not None else None, None, T, S, device=device,
                                   _compile=device.type == "cuda")
    # keep the id-keyed tensors alive so their ids are not reused while cached
    _mask_cache["last"] = (key, block_mask, q_doc, kv_doc)
    return block_mask


def _flex(q, k, v, scale, offset, q_doc, kv_doc, want_max):
    B, T, H, _ = q.shape
    S = k.shape[1]
    block_mask = document_block_mask(B, T, S, offset, q_doc, kv_doc, q.device)
    fn = _flex_fn(q.device)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, *, D]
    # the options tune the backward: inference calls (and flex's decoding kernel) keep flex's own choice
    options = FLEX_KERNEL_OPTIONS if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)) else None
    if want_max and q.is_cuda and AuxRequest is not None:
        o, aux = fn(qt, kt, vt, block_mask=block_mask, scale=scale, kernel_options=options,
                    return_aux=AuxRequest(max_scores=True))
        return o.transpose(1, 2), aux.max_scores.detach().float().amax(dim=(0, 2))
    o = fn(qt, kt, vt, block_mask=block_mask, scale=scale, kernel_options=options)
    ml = max_logits_chunked(q, k, scale, offset, q_doc, kv_doc) if want_max else None
    return o.transpose(1, 2), ml


def _sdpa(q, k, v, scale, offset, q_doc, kv_doc, want_max):
    T, S = q.shape[1], k.shape[1]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if q_doc is None and offset == 0 and T == S:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        mask = document_mask(T, S, offset, q_doc, kv_doc, q.device)[:, None]  # [B, 1, T, S]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    ml = max_logits_chunked(q, k, scale, offset, q_doc, kv_doc) if want_max else None
    return o.transpose(1, 2), ml


def _flash(q, k, v, scale, offset, q_doc, kv_doc, want_max):
    B, T, H, Dq = q.shape
    if offset != 0 or k.shape[1] != T or (q_doc is not kv_doc):
        raise ValueError("the flash backend handles self-attention over packed documents only; use flex")
    if q_doc is None:
        cu = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int32)
        max_len = T
    else:
        flat = q_doc.reshape(-1)
        starts = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
        cu = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), B * T)]).to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
    Dv = v.shape[-1]
    v_pad = F.pad(v, (0, Dq - Dv)) if Dv < Dq else v
    o = flash_attn_varlen_func(q.reshape(B * T, H, Dq), k.reshape(B * T, H, Dq), v_pad.reshape(B * T, H, -1),
                               cu, cu, max_len, max_len, softmax_scale=scale, causal=True)
    o = o[..., :Dv].reshape(B, T, H, Dv)
    ml = max_logits_chunked(q, k, scale, offset, q_doc, kv_doc) if want_max else None
    return o, ml


# flex_attention's launch options where a backward can follow (None: flex's own choice), timed by
# `benchmarks/flex_options.py` at the small preset's MLA shape (docs/fast-paths.md): the backward on 128-row key
# blocks for dK/dV and 128-row query blocks for dQ against 32-row blocks of the other side, 8 warps, 3 stages; the
# forward on 128 × 64 blocks, 8 warps, 2 stages. Outputs and gradients are bitwise those of flex's defaults.
FLEX_KERNEL_OPTIONS: dict | None = {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32,
                                    "bwd_num_stages": 3, "bwd_num_warps": 8, "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64,
                                    "fwd_num_warps": 8, "fwd_num_stages": 2}

# Set when flex_attention failed on this machine (e.g. its kernels do not compile for these head dims);
# later calls then use SDPA. Benchmarks print it: a fallback must never pass silently.
FLEX_FAILURE: list[str] = []


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int = 0,
                       q_doc: torch.Tensor | None = None, kv_doc: torch.Tensor | None = None,
                       backend: str = "flex", want_max: bool = False):
    """q [B, T, H, Dq], k [B, S, H, Dq], v [B, S, H, Dv] (one dtype) -> (o [B, T, H, Dv] in q's dtype,
    per-head max logit [H] fp32 over visible pairs, or None unless `want_max`)."""
    if (q_doc is None) != (kv_doc is None):
        raise ValueError("give document ids for both queries and keys, or for neither")
    if backend == "flex" and q.is_cuda and not FLEX_FAILURE:
        try:
            return _flex(q, k, v, scale, offset, q_doc, kv_doc, want_max)
        except Exception as e:  # compile or launch failure: SDPA computes the same function
            FLEX_FAILURE.append(f"{type(e).__name__}: {str(e)[:500]}")
            warnings.warn(f"flex_attention failed, using SDPA from now on: {FLEX_FAILURE[0]}", stacklevel=2)
    if backend == "flex" and q.is_cuda:
        backend = "sdpa"
    fn = {"flex": _flex, "sdpa": _sdpa, "flash": _flash}[backend]
    return fn(q, k, v, scale, offset, q_doc, kv_doc, want_max)
