"""Causal depthwise short convolution of the KDA q/k/v paths (architecture.md §2.2 step 2, §2.5).

Legend: B batch, T tokens, C channels, W kernel width.

    y_t[c] = Σ_{j=0..W-1} w[c, j] · x_{t-W+1+j}[c]      (tap W-1 multiplies the current token)

History before a sequence (or document) start is zero. For decoding, the caller keeps the last W-1
*pre-conv* inputs as `conv_state`; feeding them back reproduces the one-pass result exactly.
Packed input resets the history at every document start of `cu_seqlens`.

Two implementations of the same function:
- `naive_causal_conv1d`: the reference, one gather per tap (packed input) — about 70 small ops per call
  forward, as many backward;
- `causal_conv1d`: the same sums as one depthwise `F.conv1d` (forward: ~20 ops, backward: ~10).
  Packed documents are laid out once in a padded stream with each document's W-1 history columns in
  front of it, so one valid convolution serves all documents; one gather picks the outputs. No host sync.
"""

import torch
import torch.nn.functional as F


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens [N+1] offsets -> position of every token inside its document, [total] int64."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    # output_size: without it CUDA reads the lengths' sum back to the host (a sync per call)
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C]; weight [C, 1, W] or [C, W]; conv_state (pre-conv history) or None (zeros).

    Without `cu_seqlens`: conv_state is [B, W-1, C]; returns (y [B, T, C], new_state [B, W-1, C]).
    With `cu_seqlens` [N+1] (B must be 1, documents packed along T): conv_state is [N, W-1, C], one
    history per document, and the new state is [N, W-1, C] — the last W-1 inputs of each document's
    history followed by its tokens. Computed in fp32 (fp64 for fp64 input); y is in x's dtype.
    """
    B, T, C = x.shape
    w = weight.reshape(C, -1)
    W = w.shape[1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    if cu_seqlens is not None:
        return _varlen_conv(x, w, conv_state, cu_seqlens, compute)
    xs = _with_history(x, conv_state, W - 1)  # [B, W-1+T, C]
    y = torch.zeros(B, T, C, dtype=compute, device=x.device)
    for j in range(W):
        y = y + xs[:, j : j + T].to(compute) * w[:, j].to(compute)
    return y.to(x.dtype), xs[:, T:].clone()


def _with_history(x: torch.Tensor, conv_state: torch.Tensor | None, H: int) -> torch.Tensor:
    """Rows without documents: [conv_state (zeros if None) ; x] along time, [B, H+T, C] in x's dtype."""
    B, _, C = x.shape
    if conv_state is None:
        conv_state = x.new_zeros(B, H, C)
    elif conv_state.shape != (B, H, C):
        raise ValueError(f"conv_state must be [{B}, {H}, {C}], got {tuple(conv_state.shape)}")
    return torch.cat([conv_state.to(x.dtype), x], dim=1)


def _check_packed(x: torch.Tensor, conv_state: torch.Tensor | None, cu_seqlens: torch.Tensor, H: int) -> int:
    """Packed input's shape checks; returns N, the number of documents."""
    B, _, C = x.shape
    if B != 1:
        raise ValueError("cu_seqlens requires a batch of 1 (packed sequences)")
    N = cu_seqlens.numel() - 1
    if conv_state is not None and conv_state.shape != (N, H, C):
        raise ValueError(f"conv_state must be [{N}, {H}, {C}] (one history per document), "
                         f"got {tuple(conv_state.shape)}")
    return N


def _varlen_conv(x, w, conv_state, cu_seqlens, compute):
    """Packed documents, each with its own history. Every tap is a gather from [histories ; tokens], so a
    tap before a document's start reads that document's history (zeros by default), never a neighbour."""
    _, T, C = x.shape
    W = w.shape[1]
    N = _check_packed(x, conv_state, cu_seqlens, W - 1)
    if conv_state is None:
        conv_state = x.new_zeros(N, W - 1, C)
    H = W - 1
    pool = torch.cat([conv_state.to(x.dtype).reshape(N * H, C), x[0]])  # [N·H + T, C]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)  # [T]
    pos = positions_in_documents(cu_seqlens, T)  # [T]
    t = torch.arange(T, device=x.device)
    y = torch.zeros(T, C, dtype=compute, device=x.device)
    for j in range(W):
        lag = W - 1 - j
        # inside the document: token t - lag; before its start: history slot H - lag + pos of this document
        index = torch.where(pos >= lag, N * H + t - lag, doc * H + H - lag + pos)
        y = y + pool[index].to(compute) * w[:, j].to(compute)
    # new history of document n: the last H entries of [history_n ; tokens_n]
    i = torch.arange(H, device=x.device)
    k = lengths[:, None] - H + i[None, :]  # [N, H] position inside the document (negative: history)
    starts = cu_seqlens[:-1].long()[:, None]
    index = torch.where(k >= 0, N * H + starts + k, torch.arange(N, device=x.device)[:, None] * H + H + k)
    return y.unsqueeze(0).to(x.dtype), pool[index].clone()  # [1, T, C], [N, H, C]


def _channels_last(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, C, T] -> contiguous [B, T, C] in `dtype`, in one copy."""
    y = y.transpose(1, 2)
    return y.contiguous() if y.dtype == dtype else y.to(dtype, memory_format=torch.contiguous_format)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive_causal_conv1d` in a few ops (same contract; one depthwise `F.conv1d` in fp32, fp64 for fp64).

    Packed documents: token t of document n (s_n ≤ t < e_n) sits at column t + (n+1)(W-1) of a padded
    stream [C, T + N(W-1)] whose columns s_n + n(W-1) … s_n + n(W-1) + W-2 hold document n's history; one
    valid convolution over the stream then gives every token its output at column t + n(W-1).
    On CUDA the convolution follows `torch.backends.cudnn.allow_tf32` (PyTorch's default: TF32 on), which
    rounds the fp32 weights to 10 mantissa bits; the inputs are usually bf16 and exact in TF32.
    """
    _, T, C = x.shape
    if T == 0:  # nothing to convolve (and too short for F.conv1d): only the state passes through
        return naive_causal_conv1d(x, weight, conv_state, cu_seqlens)
    w = weight.reshape(C, 1, -1)
    W = w.shape[-1]
    H = W - 1
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    wc = w.to(compute)
    if cu_seqlens is None:
        xs = _with_history(x, conv_state, H)  # [B, H+T, C]
        with torch.autocast(x.device.type, enabled=False):  # autocast would run it in bf16
            y = F.conv1d(xs.to(compute).transpose(1, 2), wc, groups=C)  # [B, C, T]
        return _channels_last(y, x.dtype), xs[:, T:].clone()
    N = _check_packed(x, conv_state, cu_seqlens, H)
    column, history, tail = _stream_columns(cu_seqlens, T, H)
    stream = x.new_zeros(C, T + N * H).index_copy(1, column, x[0].t())
    if conv_state is not None:
        stream = stream.index_copy(1, history.reshape(-1), conv_state.to(x.dtype).reshape(N * H, C).t())
    with torch.autocast(x.device.type, enabled=False):  # autocast would run it (and round wc) in bf16
        y = F.conv1d(stream.to(compute).unsqueeze(0), wc, groups=C)  # [1, C, T + N·H − H]
    y = _channels_last(y.index_select(2, column - H), x.dtype)
    return y, stream[:, tail].permute(1, 2, 0).contiguous()  # [1, T, C], [N, H, C]


# (cu_seqlens, its version, T, H) -> columns; the layers of one forward pass the same cu_seqlens tensor,
# so its columns are computed once per forward instead of once per conv (identity and version, never
# contents, are compared: no host sync, and an in-place change is a miss)
_COLUMN_CACHE: list[tuple] = []


def _stream_columns(cu_seqlens: torch.Tensor, T: int, H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(column [T] of each token, history [N, H] columns of each document's history, tail [N, H] columns
    of each document's new history, i.e. the last H of its stretch) in the padded stream."""
    # inference tensors have no version counter, and columns made under inference mode cannot be saved
    # for a later backward
    cacheable = not (cu_seqlens.is_inference() or torch.is_inference_mode_enabled())
    for key, value in _COLUMN_CACHE if cacheable else ():
        if key[0] is cu_seqlens and key[1:] == (cu_seqlens._version, T, H):
            return value
    N, device = cu_seqlens.numel() - 1, cu_seqlens.device
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(N, device=device), lengths, output_size=T)  # [T]
    column = torch.arange(T, device=device) + (doc + 1) * H
    history = (cu[:-1] + torch.arange(N, device=device) * H)[:, None] + torch.arange(H, device=device)
    value = (column, history, history + lengths[:, None])
    if cacheable:
        _COLUMN_CACHE.insert(0, ((cu_seqlens, cu_seqlens._version, T, H), value))
        del _COLUMN_CACHE[4:]
    return value
