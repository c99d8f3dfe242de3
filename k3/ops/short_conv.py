"""Causal depthwise short convolution of the KDA q/k/v paths (K3 report §2.1.1).

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

from k3.ops import interpreting, triton_runs_on


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


# (tag, cu_seqlens, its version, T, H) -> index tensors; the layers of one forward pass the same cu_seqlens
# tensor, so what depends only on it is computed once per forward instead of once per conv (identity and
# version, never contents, are compared: no host sync, and an in-place change is a miss)
_INDEX_CACHE: list[tuple] = []


def _per_layout(tag: str, cu_seqlens: torch.Tensor, T: int, H: int, build):
    # inference tensors have no version counter, and tensors made under inference mode cannot be saved
    # for a later backward
    cacheable = not (cu_seqlens.is_inference() or torch.is_inference_mode_enabled())
    for key, value in _INDEX_CACHE if cacheable else ():
        if key[0] == tag and key[1] is cu_seqlens and key[2:] == (cu_seqlens._version, T, H):
            return value
    value = build()
    if cacheable:
        _INDEX_CACHE.insert(0, ((tag, cu_seqlens, cu_seqlens._version, T, H), value))
        del _INDEX_CACHE[8:]
    return value


def _stream_columns(cu_seqlens: torch.Tensor, T: int, H: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(column [T] of each token, history [N, H] columns of each document's history, tail [N, H] columns
    of each document's new history, i.e. the last H of its stretch) in the padded stream."""

    def build():
        N, device = cu_seqlens.numel() - 1, cu_seqlens.device
        cu = cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        doc = torch.repeat_interleave(torch.arange(N, device=device), lengths, output_size=T)  # [T]
        column = torch.arange(T, device=device) + (doc + 1) * H
        history = (cu[:-1] + torch.arange(N, device=device) * H)[:, None] + torch.arange(H, device=device)
        return column, history, history + lengths[:, None]

    return _per_layout("columns", cu_seqlens, T, H, build)


# --- fused short conv + SiLU (training and prefill without a carried history) -----------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the KDA layer keeps `causal_conv1d` + SiLU
    triton = None


def naive_short_conv_silu(x: torch.Tensor, weight: torch.Tensor,
                          cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of `short_conv_silu`: SiLU(naive_causal_conv1d(x)) from zero history, in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.reshape(x.shape[-1], -1).to(compute)
    return F.silu(naive_causal_conv1d(x.to(compute), w, cu_seqlens=cu_seqlens)[0]).to(x.dtype)


if triton is not None:

    @triton.jit
    def _shifted(X, u, in_u, pos, lag, c, in_c, stride_x):
        """x[u − lag] in fp32 on the tile's rows u and channels c; zero where u − lag is outside u's document."""
        ok = in_u & (pos >= lag)
        return tl.load(X + (u - lag)[:, None] * stride_x + c[None, :], mask=ok[:, None] & in_c[None, :],
                       other=0.0).to(tl.float32)

    @triton.jit
    def _conv_taps(X, Wt, pos, u, in_u, c, in_c, stride_x, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        """The conv output a[u] = Σ_j w[j] · x[u − (W−1−j)] in fp32, each tap only inside u's document."""
        a = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            wv = tl.load(Wt + c * W + j, mask=in_c, other=0.0)
            a += _shifted(X, u, in_u, pos, W - 1 - j, c, in_c, stride_x) * wv[None, :]
        return a

    @triton.jit
    def _silu_grad_tile(X, Wt, POS, DY, G, t, c, in_c, R, C, stride_x, stride_dy, W: tl.constexpr,
                        BT: tl.constexpr, BC: tl.constexpr):
        """Kernel 1's per-tile part: g = dy · SiLU'(a) on tokens t (a recomputed from x), stored into G [R, C];
        returns (g, the tokens' positions in their documents, the tokens' mask)."""
        in_t = t < R
        pos = tl.load(POS + t, mask=in_t, other=0)
        a = _conv_taps(X, Wt, pos, t, in_t, c, in_c, stride_x, W, BT, BC)
        dy = tl.load(DY + t[:, None] * stride_dy + c[None, :], mask=in_t[:, None] & in_c[None, :], other=0.0)
        sig = tl.sigmoid(a)
        g = dy.to(tl.float32) * sig * (1.0 + a * (1.0 - sig))  # zero outside the tile's rows and channels
        tl.store(G + t[:, None] * C + c[None, :], g.to(G.dtype.element_ty), mask=in_t[:, None] & in_c[None, :])
        return g, pos, in_t

    @triton.jit
    def _tile(BT: tl.constexpr, BC: tl.constexpr):
        """This program's token block, its tokens t (int64) and its channels c (grid: token blocks, channel
        blocks)."""
        tb, cb = tl.program_id(0), tl.program_id(1)
        return tb, (tb * BT + tl.arange(0, BT)).to(tl.int64), cb * BC + tl.arange(0, BC)

    @triton.jit
    def _conv_silu_fwd_kernel(X, Wt, POS, Y, R, C, stride_x, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        _, t, c = _tile(BT, BC)
        in_t, in_c = t < R, c < C
        pos = tl.load(POS + t, mask=in_t, other=0)
        acc = _conv_taps(X, Wt, pos, t, in_t, c, in_c, stride_x, W, BT, BC)
        y = acc * tl.sigmoid(acc)
        tl.store(Y + t[:, None] * C + c[None, :], y.to(Y.dtype.element_ty), mask=in_t[:, None] & in_c[None, :])

    @triton.jit
    def _conv_silu_grad_kernel(X, Wt, POS, DY, G, DW, R, C, stride_x, stride_dy, W: tl.constexpr,
                               BT: tl.constexpr, BC: tl.constexpr):
        """Backward, kernel 1: g = dy · SiLU'(a) at the tile's tokens (a recomputed from x) into G [R, C], and
        dw[j] = Σ_t g[t] · x[t−(W−1−j)] over them (a row of partial sums [C, W] per token block, summed by the
        caller: deterministic, no atomics)."""
        tb, t, c = _tile(BT, BC)
        in_c = c < C
        g, pos, in_t = _silu_grad_tile(X, Wt, POS, DY, G, t, c, in_c, R, C, stride_x, stride_dy, W, BT, BC)
        for j in tl.static_range(W):
            # the same shifted tiles as the taps, again: from L1, and not held live across the SiLU
            xv = _shifted(X, t, in_t, pos, W - 1 - j, c, in_c, stride_x)
            tl.store(DW + (tb * C + c) * W + j, tl.sum(g * xv, axis=0), mask=in_c)

    @triton.jit
    def _conv_silu_grad_blocks_kernel(X, Wt, POS, DY, G, DW, R, C, stride_x, stride_dy, W: tl.constexpr,
                                    BT: tl.constexpr, BC: tl.constexpr, BLOCKS: tl.constexpr, STAGES: tl.constexpr):
        """Kernel 1 over BLOCKS consecutive token blocks per program, for W ≤ 4: the same g, and one row of dw
        partials per BLOCKS blocks. Each tap's products g · x are summed elementwise in fp32 registers across
        the blocks and reduced across the tile's rows (threads, then warps through shared memory) once at
        the end, where `_conv_silu_grad_kernel` reduces W times per block. STAGES > 1 prefetches the next
        blocks' tiles (cp.async into shared memory)."""
        pb, cb = tl.program_id(0), tl.program_id(1)
        # 4-channel vectors for every access: g is then stored (fp32, 16 bytes) from the layout it is computed
        # in, where 8-channel bf16 loads would make Triton convert each g tile through shared memory
        c = tl.max_contiguous(cb * BC + tl.arange(0, BC), 4)
        in_c = c < C
        # one accumulator per tap, named because a loop cannot carry a list; those past W stay unused
        acc0 = tl.zeros([BT, BC], dtype=tl.float32)
        acc1 = tl.zeros([BT, BC], dtype=tl.float32)
        acc2 = tl.zeros([BT, BC], dtype=tl.float32)
        acc3 = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.range(BLOCKS, num_stages=STAGES):
            t = ((pb * BLOCKS + i) * BT + tl.arange(0, BT)).to(tl.int64)
            g, pos, in_t = _silu_grad_tile(X, Wt, POS, DY, G, t, c, in_c, R, C, stride_x, stride_dy, W, BT, BC)
            for j in tl.static_range(W):
                gx = g * _shifted(X, t, in_t, pos, W - 1 - j, c, in_c, stride_x)
                if j == 0:
                    acc0 += gx
                elif j == 1:
                    acc1 += gx
                elif j == 2:
                    acc2 += gx
                else:
                    acc3 += gx
        row = DW + (pb * C + c) * W
        tl.store(row, tl.sum(acc0, axis=0), mask=in_c)
        if W > 1:
            tl.store(row + 1, tl.sum(acc1, axis=0), mask=in_c)
        if W > 2:
            tl.store(row + 2, tl.sum(acc2, axis=0), mask=in_c)
        if W > 3:
            tl.store(row + 3, tl.sum(acc3, axis=0), mask=in_c)

    @triton.jit
    def _conv_silu_dx_kernel(G, Wt, POS, DX, R, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        """Backward, kernel 2: dx[t] = Σ_d w[W−1−d] · g[t+d] over the d with t+d in t's document (t+d < R and
        pos[t+d] ≥ d), written in DX's dtype."""
        _, t, c = _tile(BT, BC)
        in_t, in_c = t < R, c < C
        dx = tl.zeros([BT, BC], dtype=tl.float32)
        for d in tl.static_range(W):
            u = t + d
            ok = u < R
            if d > 0:  # token t+d reaches back to t inside its document
                ok = ok & (tl.load(POS + u, mask=ok, other=0) >= d)
            gv = tl.load(G + u[:, None] * C + c[None, :], mask=ok[:, None] & in_c[None, :], other=0.0)
            dx += gv.to(tl.float32) * tl.load(Wt + c * W + (W - 1 - d), mask=in_c, other=0.0)[None, :]
        tl.store(DX + t[:, None] * C + c[None, :], dx.to(DX.dtype.element_ty), mask=in_t[:, None] & in_c[None, :])


    @triton.jit
    def _lag_weight(Wt, c, in_c, W: tl.constexpr, LAG: tl.constexpr, BC: tl.constexpr):
        """The weight of x[t − LAG] in y[t] (tap W−1−LAG), fp32; zero for LAG ≥ W (the stream kernels carry 4)."""
        if LAG < W:
            return tl.load(Wt + c * W + (W - 1 - LAG), mask=in_c, other=0.0)
        else:
            return tl.zeros([BC], dtype=tl.float32)

    @triton.jit
    def _stream_row(X, u, R, c, in_c, stride):
        """Row u of X in fp32 on channels c; zero outside [0, R)."""
        ok = (u >= 0) & (u < R)
        return tl.load(X + u * stride + c, mask=in_c & ok, other=0.0).to(tl.float32)

    @triton.jit
    def _stream_start(X, Wt, R, C, stride_x, W: tl.constexpr, SEG: tl.constexpr, BC: tl.constexpr):
        """A streaming program's start: its channels c (and mask), first token t0, the taps' weights by lag and
        the three input rows before t0."""
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        in_c = c < C
        t0 = tl.program_id(0).to(tl.int64) * SEG
        return (c, in_c, t0, _lag_weight(Wt, c, in_c, W, 0, BC), _lag_weight(Wt, c, in_c, W, 1, BC),
                _lag_weight(Wt, c, in_c, W, 2, BC), _lag_weight(Wt, c, in_c, W, 3, BC),
                _stream_row(X, t0 - 1, R, c, in_c, stride_x), _stream_row(X, t0 - 2, R, c, in_c, stride_x),
                _stream_row(X, t0 - 3, R, c, in_c, stride_x))

    @triton.jit
    def _conv_silu_fwd_stream_kernel(X, Wt, POS, Y, R, C, stride_x, W: tl.constexpr, SEG: tl.constexpr,
                                     BC: tl.constexpr, STAGES: tl.constexpr):
        """Forward, streaming: a program walks SEG consecutive tokens of BC channels one row at a time, keeping
        the last three input rows in registers, so each row of x is read once (plus three rows before the
        segment) instead of once per tap; W ≤ 4."""
        c, in_c, t0, w0, w1, w2, w3, x1, x2, x3 = _stream_start(X, Wt, R, C, stride_x, W, SEG, BC)
        for i in tl.range(0, SEG, num_stages=STAGES):
            u = t0 + i
            ok = u < R
            xu = tl.load(X + u * stride_x + c, mask=in_c & ok, other=0.0).to(tl.float32)
            p = tl.load(POS + u, mask=ok, other=0)
            # a tap reaches back only inside the token's document (p = its position there)
            a = w0 * xu + tl.where(p >= 1, w1 * x1, 0.0) + tl.where(p >= 2, w2 * x2, 0.0) \
                + tl.where(p >= 3, w3 * x3, 0.0)
            tl.store(Y + u * C + c, (a * tl.sigmoid(a)).to(Y.dtype.element_ty), mask=in_c & ok)
            x3, x2, x1 = x2, x1, xu

    @triton.jit
    def _conv_silu_bwd_stream_kernel(X, Wt, POS, DY, DX, DW, R, C, stride_x, stride_dy, W: tl.constexpr,
                                     SEG: tl.constexpr, BC: tl.constexpr, STAGES: tl.constexpr):
        """The whole backward in one streaming pass, W ≤ 4: a program walks tokens t0 .. t0 + SEG + 2 of BC
        channels one row at a time with the last three rows of x and of g = dy · SiLU'(a) in registers. At row u
        it forms g[u] (a from the carried x rows), adds g[u] · x[u − lag] into the dw sums (rows of its own
        segment only) and writes dx[u − 3] = Σ_d w_lag=d · g[u − 3 + d], whose last g it has just formed; the
        three rows past the segment recompute the next segment's first g (its halo). x and dy are read once,
        dx written once, no g round trip (the two-kernel form writes g in fp32 and reads it back). dw: one row
        of partial sums [C, W] per segment, summed by the caller (deterministic, no atomics)."""
        s = tl.program_id(0)
        c, in_c, t0, w0, w1, w2, w3, x1, x2, x3 = _stream_start(X, Wt, R, C, stride_x, W, SEG, BC)
        # g at u − 1, u − 2, u − 3 (not read while i < 3). Each starts from its own zeros: Triton carries a name
        # through the loop only if its value changes there, and `g3 = g2` from one shared zeros tensor looked
        # unchanged, so g2 and g3 stayed zero on the GPU (the interpreter runs Python and did not show it)
        g1 = tl.zeros([BC], dtype=tl.float32)
        g2 = tl.zeros([BC], dtype=tl.float32)
        g3 = tl.zeros([BC], dtype=tl.float32)
        acc0 = tl.zeros([BC], dtype=tl.float32)
        acc1 = tl.zeros([BC], dtype=tl.float32)
        acc2 = tl.zeros([BC], dtype=tl.float32)
        acc3 = tl.zeros([BC], dtype=tl.float32)
        for i in tl.range(0, SEG + 3, num_stages=STAGES):
            u = t0 + i
            ok = u < R
            xu = tl.load(X + u * stride_x + c, mask=in_c & ok, other=0.0).to(tl.float32)
            dy = tl.load(DY + u * stride_dy + c, mask=in_c & ok, other=0.0).to(tl.float32)
            p = tl.load(POS + u, mask=ok, other=0)
            # the positions of rows u − 1 and u − 2, again (L1): two scalars fewer to carry
            p1 = tl.load(POS + u - 1, mask=(u >= 1) & (u - 1 < R), other=0)
            p2 = tl.load(POS + u - 2, mask=(u >= 2) & (u - 2 < R), other=0)
            x1m = tl.where(p >= 1, x1, 0.0)  # the taps inside u's document
            x2m = tl.where(p >= 2, x2, 0.0)
            x3m = tl.where(p >= 3, x3, 0.0)
            a = w0 * xu + w1 * x1m + w2 * x2m + w3 * x3m
            sig = tl.sigmoid(a)
            g = dy * sig * (1.0 + a * (1.0 - sig))  # zero past R (dy is)
            gs = tl.where(i < SEG, g, 0.0)  # dw from this segment's rows only
            acc0 += gs * xu
            acc1 += gs * x1m
            acc2 += gs * x2m
            acc3 += gs * x3m
            # dx[u − 3]: g[u − 3 + d] reaches back d rows only inside its document
            dx = w0 * g3 + tl.where(p2 >= 1, w1 * g2, 0.0) + tl.where(p1 >= 2, w2 * g1, 0.0) \
                + tl.where(p >= 3, w3 * g, 0.0)
            v = u - 3
            tl.store(DX + v * C + c, dx.to(DX.dtype.element_ty), mask=in_c & (i >= 3) & (v < R))
            x3, x2, x1 = x2, x1, xu
            g3, g2, g1 = g2, g1, g
        row = DW + (s * C + c) * W + (W - 1)  # the lag-0 tap is tap W − 1
        tl.store(row, acc0, mask=in_c)
        if W > 1:
            tl.store(row - 1, acc1, mask=in_c)
        if W > 2:
            tl.store(row - 2, acc2, mask=in_c)
        if W > 3:
            tl.store(row - 3, acc3, mask=in_c)


# Tiles, from the offline sm_90 compile (benchmarks/spills.py) at the model's shapes, where the JIT
# specialises C, R and the strides as multiples of 16 (so masked loads are 16-byte vectors). Forward: 88
# registers. The backward is two memory-bound passes (kernel 1 reads x and dy and writes g; kernel 2 reads g
# and writes dx; the W − 1 shifted re-reads of each tile come from L1): 64 × 64 tiles with 4 warps (32
# elements per thread) compile to 150 and 102 registers without spills: three and four programs per SM,
# 50-70 KB of loads in flight per SM. 64 × 128 or 128 × 64 with 4 warps reach 255 registers and spill (ptxas
# hoists all W shifted loads); 64 × 64 with 8 warps (92 and 76 registers) fits fewer tiles per SM (2 and 3).
_CONV_BT, _CONV_BC = 64, 64
_CONV_BWD_BT, _CONV_BWD_BC, _CONV_BWD_WARPS = 64, 64, 4
# Kernel 1 as `_conv_silu_grad_blocks_kernel` (BT, BC, warps, token blocks per program, stages), or None for
# `_conv_silu_grad_kernel` at the tiles above (kernel 2 keeps them either way); width ≤ 4 only. 16 × 64 tiles,
# 4 warps, 8 blocks: the best of the settings `benchmarks.short_conv --bwd-tiles` times (docs/fast-paths.md).
_CONV_GRAD_BLOCKS: tuple[int, int, int, int, int] | None = (16, 64, 4, 8, 1)
# The interpreter pays per tile operation, not per element: there kernel 1 takes one 128-row block per program
# (less than half the time of the GPU's 16-row tiles there; the same kernel, tested at both)
_CONV_GRAD_BLOCKS_INTERPRETED: tuple[int, int, int, int, int] | None = (128, 64, 4, 1, 1)
# g between the backward's two kernels, for bf16/fp16 input (fp32 input always keeps fp32 g): fp32 costs 14
# bytes per element against 10 in x's dtype, but the bf16 dx of the small preset's shape is then 18% closer to
# fp64 than the unfused path's instead of 2% (CPU emulation; the GPU test allows 5% further)
_CONV_G_FP32 = True
# The streaming kernels (`_conv_silu_fwd_stream_kernel`, `_conv_silu_bwd_stream_kernel`; W ≤ 4) as (SEG tokens per
# program, BC channels, warps, pipeline stages), or None for the tile kernels above. BC = 8 · 32 · warps gives each
# thread one 16-byte vector of a bf16 row. Faster than the tile kernels at the small preset's and K3's widths,
# most in the backward, and 128-token segments beat 256 (`benchmarks.short_conv --stream`, docs/fast-paths.md).
# The interpreter keeps the tile kernels (it pays per loop step; the tests run the stream kernels there through
# `_CONV_STREAM_INTERPRETED`).
_CONV_FWD_STREAM: tuple[int, int, int, int] | None = (128, 1024, 4, 3)
_CONV_BWD_STREAM: tuple[int, int, int, int] | None = (128, 1024, 4, 3)
_CONV_STREAM_INTERPRETED: tuple[int, int, int, int] | None = None


def _stream_setting(direction: str) -> tuple[int, int, int, int] | None:
    """The streaming kernels' setting for "fwd" or "bwd" here (None: the tile kernels)."""
    if interpreting():
        return _CONV_STREAM_INTERPRETED
    return _CONV_FWD_STREAM if direction == "fwd" else _CONV_BWD_STREAM


def _conv_grid(R: int, C: int, BT: int, BC: int) -> tuple[int, int]:
    return triton.cdiv(R, BT), triton.cdiv(C, BC)


def _token_positions(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    """Position of every token of the flattened [B·T] input inside its document (rows are documents when
    there are no cu_seqlens), int32; cached per forward like the stream columns."""
    if cu_seqlens is None:
        return (torch.arange(B * T, device=device, dtype=torch.int32) % T)
    return _per_layout("positions", cu_seqlens, B * T, 0,
                       lambda: positions_in_documents(cu_seqlens, B * T).to(torch.int32))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, T, C] with unit channel stride (e.g. a slice of a wider projection) as [B·T, C], without a copy
    where the strides allow it."""
    return (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, x.shape[-1])


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, pos):
        B, T, C = x.shape
        w = weight.reshape(C, -1).to(torch.float32).contiguous()
        W = w.shape[1]
        xr = _rows(x)
        R = xr.shape[0]
        y = torch.empty(R, C, dtype=x.dtype, device=x.device)
        stream = _stream_setting("fwd")
        if stream is not None and W <= 4:
            SEG, BC, warps, stages = stream
            _conv_silu_fwd_stream_kernel[_conv_grid(R, C, SEG, BC)](xr, w, pos, y, R, C, xr.stride(0), W=W, SEG=SEG,
                                                                    BC=BC, STAGES=stages, num_warps=warps)
        else:
            _conv_silu_fwd_kernel[_conv_grid(R, C, _CONV_BT, _CONV_BC)](xr, w, pos, y, R, C, xr.stride(0), W=W,
                                                                        BT=_CONV_BT, BC=_CONV_BC)
        ctx.save_for_backward(xr, w, pos)
        ctx.shape, ctx.weight_shape, ctx.weight_dtype = x.shape, weight.shape, weight.dtype
        return y.view(B, T, C)

    @staticmethod
    def backward(ctx, dy):
        xr, w, pos = ctx.saved_tensors
        R, C = xr.shape
        W = w.shape[1]
        dyr = _rows(dy)
        stream = _stream_setting("bwd")
        if stream is not None and W <= 4:
            SEG, BC, warps, stages = stream
            dw = torch.empty(triton.cdiv(R, SEG), C, W, dtype=torch.float32, device=xr.device)  # per segment
            dx = torch.empty(R, C, dtype=xr.dtype, device=xr.device)
            _conv_silu_bwd_stream_kernel[_conv_grid(R, C, SEG, BC)](xr, w, pos, dyr, dx, dw, R, C, xr.stride(0),
                                                                    dyr.stride(0), W=W, SEG=SEG, BC=BC,
                                                                    STAGES=stages, num_warps=warps)
            return dx.view(ctx.shape), dw.sum(0).reshape(ctx.weight_shape).to(ctx.weight_dtype), None
        grid = _conv_grid(R, C, _CONV_BWD_BT, _CONV_BWD_BC)
        tiles = dict(W=W, BT=_CONV_BWD_BT, BC=_CONV_BWD_BC, num_warps=_CONV_BWD_WARPS)
        g = torch.empty(R, C, dtype=torch.float32 if _CONV_G_FP32 else xr.dtype, device=xr.device)
        blocks_setting = _CONV_GRAD_BLOCKS_INTERPRETED if interpreting() else _CONV_GRAD_BLOCKS
        if blocks_setting is not None and W <= 4:
            BT, BC, warps, blocks, stages = blocks_setting
            grad_kernel, block, grad_tiles = _conv_silu_grad_blocks_kernel, BT * blocks, dict(
                W=W, BT=BT, BC=BC, BLOCKS=blocks, STAGES=stages, num_warps=warps)
        else:
            grad_kernel, block, BC, grad_tiles = _conv_silu_grad_kernel, _CONV_BWD_BT, _CONV_BWD_BC, tiles
        dw = torch.empty(triton.cdiv(R, block), C, W, dtype=torch.float32, device=xr.device)  # partials per block
        grad_kernel[_conv_grid(R, C, block, BC)](xr, w, pos, dyr, g, dw, R, C, xr.stride(0), dyr.stride(0),
                                                 **grad_tiles)
        dx = torch.empty(R, C, dtype=xr.dtype, device=xr.device)
        _conv_silu_dx_kernel[grid](g, w, pos, dx, R, C, **tiles)
        dweight = dw.sum(0).reshape(ctx.weight_shape).to(ctx.weight_dtype)
        return dx.view(ctx.shape), dweight, None


def short_conv_silu_available(x: torch.Tensor) -> bool:
    """The fused kernel runs here: Triton on CUDA (or its interpreter), fp32/bf16/fp16 input."""
    return (triton is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and triton_runs_on(x))


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv of x) from zero history, fused: one Triton kernel forward, two backward.

    x [B, T, C] (channels contiguous; a column slice of a wider projection is read in place), weight [C, 1, W]
    or [C, W] (fp32 master), cu_seqlens [N+1] for packed documents (B = 1). Returns y [B, T, C] in x's dtype;
    taps and SiLU in fp32. The forward reads x once and writes y. The backward's first kernel recomputes the
    conv from x, writes g = dy · SiLU'(conv) (fp32) and per-block dw partials; the second forms dx from W
    shifted tiles of g — against the ~20 ops, two transposes and fp32 copies of `causal_conv1d` + `F.silu`
    each way. No carried history: decoding and context parallelism (which hands in a halo) keep
    `causal_conv1d`.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.numel() % C or weight.shape[0] != C:
        raise ValueError(f"weight must be [C, 1, W] or [C, W] with C = {C}, got {tuple(weight.shape)}")
    if cu_seqlens is not None:
        _check_packed(x, None, cu_seqlens, 0)
    if not short_conv_silu_available(x):
        raise RuntimeError("short_conv_silu needs Triton on CUDA (or TRITON_INTERPRET=1) and fp32/bf16/fp16 input")
    if T == 0:
        return x.new_empty(x.shape)
    pos = _token_positions(cu_seqlens, B, T, x.device)
    with torch.autocast(x.device.type, enabled=False):
        return _ShortConvSiLU.apply(x, weight, pos)


def conv_decode_step(x: torch.Tensor, weights: torch.Tensor, tails: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token of several causal depthwise convs at once: what `causal_conv1d` computes for T = 1 with a
    state, in a few elementwise ops instead of a convolution per conv (a decode step is launch-bound).

    x [B, G, C] (G convs, one new token each); weights [G, C, W]; tails [B, G, W-1, C] (the previous W-1 inputs).
    Returns (y [B, G, C] in x's dtype, the new tails [B, G, W-1, C] in x's dtype). Accumulates in fp32 (fp64 for
    fp64), as `causal_conv1d` does.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    window = torch.cat([tails.to(x.dtype), x[:, :, None]], dim=2)  # [B, G, W, C]
    y = (window.to(compute) * weights.to(compute).transpose(1, 2)[None]).sum(2)
    return y.to(x.dtype), window[:, :, 1:]
