"""Causal depthwise short convolution of the KDA q/k/v paths (architecture.md §2.2 step 2, §2.5).

Legend: B batch, T tokens, C channels, W kernel width.

    y_t[c] = Σ_{j=0..W-1} w[c, j] · x_{t-W+1+j}[c]      (tap W-1 multiplies the current token)

History before a sequence (or document) start is zero. For decoding, the caller keeps the last W-1
*pre-conv* inputs as `conv_state`; feeding them back reproduces the one-pass result exactly.
Packed input resets the history at every document start of `cu_seqlens`.
"""

import torch


def positions_in_documents(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens [N+1] offsets -> position of every token inside its document, [total] int64."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths)
    return torch.arange(total, device=cu_seqlens.device) - starts


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C]; weight [C, 1, W] or [C, W]; conv_state [B, W-1, C] (pre-conv history) or None.

    Returns (y [B, T, C] in x's dtype, new_state [B, W-1, C] = the last W-1 inputs incl. history).
    Computed in fp32 (fp64 for fp64 input). `cu_seqlens` (with B == 1) may not be combined with a state.
    """
    B, T, C = x.shape
    w = weight.reshape(C, -1)
    W = w.shape[1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    if conv_state is None:
        conv_state = x.new_zeros(B, W - 1, C)
    elif conv_state.shape != (B, W - 1, C):
        raise ValueError(f"conv_state must be [{B}, {W - 1}, {C}], got {tuple(conv_state.shape)}")
    xs = torch.cat([conv_state.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
    valid = None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError("cu_seqlens requires a batch of 1 (packed sequences)")
        valid = positions_in_documents(cu_seqlens, T).unsqueeze(-1)  # [T, 1]
    y = torch.zeros(B, T, C, dtype=compute, device=x.device)
    for j in range(W):
        lag = W - 1 - j
        tap = xs[:, j : j + T].to(compute) * w[:, j].to(compute)
        if valid is not None and lag > 0:
            # a tap that reaches before this token's document start reads zero history
            # (where, not multiply: a NaN in one document must not leak into the next)
            tap = torch.where(valid >= lag, tap, torch.zeros((), dtype=compute, device=x.device))
        y = y + tap
    return y.to(x.dtype), xs[:, T:].clone() if W > 1 else xs[:, :0].clone()
