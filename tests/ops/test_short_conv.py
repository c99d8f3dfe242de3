"""Causal depthwise short conv (architecture.md §2.2 step 2, §2.5): against torch's conv1d, split with a
carried state, and packed documents (cu_seqlens).

Legend: B batch, T tokens, C channels, W kernel width.
"""

import pytest
import torch
import torch.nn.functional as F

from k3.ops.short_conv import naive_causal_conv1d


def _inputs(B: int, T: int, C: int, W: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=dtype)
    weight = torch.randn(C, 1, W, generator=g, dtype=dtype)
    return x, weight


def torch_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise conv1d with W-1 zeros of left padding: y_t = Σ_j w[j] · x_{t-W+1+j}."""
    C, _, W = weight.shape
    xt = F.pad(x.transpose(1, 2), (W - 1, 0))  # [B, C, W-1+T]
    return F.conv1d(xt, weight, groups=C).transpose(1, 2)  # [B, T, C]


@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_matches_torch_conv1d(T, W):
    x, weight = _inputs(2, T, 5, W, seed=T * 10 + W)
    ref = torch_conv(x, weight)
    tri, state = naive_causal_conv1d(x, weight)
    # fp64, same products in a different order: ≤ 1e-12
    torch.testing.assert_close(tri, ref, atol=1e-12, rtol=0)
    assert state.shape == (2, W - 1, 5)
    # the state is the last W-1 inputs, with zero history in front when T < W-1
    padded = torch.cat([x.new_zeros(2, W - 1, 5), x], dim=1)
    assert torch.equal(state, padded[:, padded.shape[1] - (W - 1):])


def test_weight_2d_and_fp32_dtype():
    x, weight = _inputs(1, 9, 4, 4, seed=1, dtype=torch.float32)
    a, _ = naive_causal_conv1d(x, weight)
    b, _ = naive_causal_conv1d(x, weight.view(4, 4))
    assert torch.equal(a, b)
    assert a.dtype == torch.float32
    # fp32 compute against torch's fp32 conv: ≤ 1e-5
    torch.testing.assert_close(a, torch_conv(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T1", [0, 1, 2, 3, 5, 11])
def test_split_with_state_equals_one_pass(T1):
    T, W = 11, 4
    x, weight = _inputs(2, T, 6, W, seed=100 + T1)
    full, full_state = naive_causal_conv1d(x, weight)
    y1, s1 = naive_causal_conv1d(x[:, :T1], weight)
    y2, s2 = naive_causal_conv1d(x[:, T1:], weight, conv_state=s1)
    # same products in the same order: bit-identical
    assert torch.equal(torch.cat([y1, y2], dim=1), full)
    assert torch.equal(s2, full_state)


def test_token_by_token_equals_one_pass():
    T, W = 9, 4
    x, weight = _inputs(1, T, 3, W, seed=7)
    full, full_state = naive_causal_conv1d(x, weight)
    state, outs = None, []
    for t in range(T):
        y, state = naive_causal_conv1d(x[:, t : t + 1], weight, conv_state=state)
        outs.append(y)
    assert torch.equal(torch.cat(outs, dim=1), full)
    assert torch.equal(state, full_state)


def test_bad_state_shape_raises():
    x, weight = _inputs(1, 5, 3, 4, seed=0)
    with pytest.raises(ValueError):
        naive_causal_conv1d(x, weight, conv_state=torch.zeros(1, 2, 3, dtype=x.dtype))


@pytest.mark.parametrize("lengths", [[5, 7], [1, 2, 9, 1], [3, 3, 3], [12]])
def test_varlen_equals_separate_runs(lengths):
    W, C = 4, 5
    total = sum(lengths)
    x, weight = _inputs(1, total, C, W, seed=sum(lengths) + len(lengths))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    packed, _ = naive_causal_conv1d(x, weight, cu_seqlens=cu)
    separate = torch.cat([naive_causal_conv1d(x[:, s:e], weight)[0] for s, e in zip(cu[:-1], cu[1:])], dim=1)
    # fp64; same taps, products masked instead of skipped: ≤ 1e-14
    torch.testing.assert_close(packed, separate, atol=1e-14, rtol=0)


def test_varlen_no_leakage_across_document_start():
    W, C = 4, 3
    cu = torch.tensor([0, 6, 8, 15])
    x, weight = _inputs(1, 15, C, W, seed=3)
    base, _ = naive_causal_conv1d(x, weight, cu_seqlens=cu)
    # a large finite change to document 1 (positions 6, 7) moves document 1 only, bit for bit
    x2 = x.clone()
    x2[:, 6:8] += 1e6
    moved, _ = naive_causal_conv1d(x2, weight, cu_seqlens=cu)
    assert torch.equal(moved[:, :6], base[:, :6])
    assert torch.equal(moved[:, 8:], base[:, 8:])
    assert not torch.equal(moved[:, 6:8], base[:, 6:8])
    # changing the last tokens of document 0 (what document 1's first taps would reach) moves document 0 only
    x3 = x.clone()
    x3[:, 3:6] -= 3.0
    moved, _ = naive_causal_conv1d(x3, weight, cu_seqlens=cu)
    assert torch.equal(moved[:, 6:], base[:, 6:])


def test_varlen_nan_stays_in_its_document():
    W, C = 4, 3
    cu = torch.tensor([0, 6, 8, 15])
    x, weight = _inputs(1, 15, C, W, seed=3)
    base, _ = naive_causal_conv1d(x, weight, cu_seqlens=cu)
    # NaN-poison the tail of document 0 and all of document 1
    x2 = x.clone()
    x2[:, 3:8] = float("nan")
    poisoned, _ = naive_causal_conv1d(x2, weight, cu_seqlens=cu)
    assert torch.equal(poisoned[:, :3], base[:, :3])
    assert torch.equal(poisoned[:, 8:], base[:, 8:])


def test_varlen_with_per_document_history_equals_separate_calls():
    """Each packed document continues from its own history (the engine's ragged decode/prefill)."""
    W, C = 4, 5
    lengths = [6, 1, 0, 2, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    x, weight = _inputs(1, sum(lengths), C, W, seed=7)
    states = torch.randn(len(lengths), W - 1, C, dtype=x.dtype, generator=torch.Generator().manual_seed(8))
    y, new_states = naive_causal_conv1d(x, weight, states, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_y, ref_state = naive_causal_conv1d(x[:, a:b], weight, states[n : n + 1])
        assert torch.equal(y[:, a:b], ref_y)
        assert torch.equal(new_states[n], ref_state[0])
