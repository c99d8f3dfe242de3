"""Cosine schedule with 1% linear warmup (docs/optimizer.md): linear warmup, peak at W, midpoint
(η_peak + η_min)/2, η_min at the end, monotone decay; one multiplier for both groups; the scheduler state
round-trips a checkpoint."""

import io
import math

import pytest
import torch

from k3.config import get_preset
from k3.model.model import K3ForCausalLM
from k3.optim import MuonAdamW, cosine_schedule, lr_multiplier, warmup_steps

CONFIG = get_preset("debug")


def optimizer(lr: float = 1e-2) -> MuonAdamW:
    with torch.device("meta"):
        model = K3ForCausalLM(CONFIG)
    return MuonAdamW(model.named_parameters(), CONFIG, lr=lr)


def test_shape_of_the_schedule():
    S, floor = 1000, 0.1
    W = warmup_steps(S, 0.01)
    assert W == 10
    assert [lr_multiplier(t, S) for t in range(W)] == pytest.approx([(t + 1) / W for t in range(W)])
    assert lr_multiplier(W - 1, S) == 1.0 and lr_multiplier(W, S) == 1.0  # peak reached at W
    assert lr_multiplier(W + (S - W) // 2, S) == pytest.approx((1 + floor) / 2, abs=1e-12)
    assert lr_multiplier(S, S) == pytest.approx(floor, abs=1e-12)
    assert lr_multiplier(S + 50, S) == pytest.approx(floor, abs=1e-12)  # stays at η_min past the end
    decay = [lr_multiplier(t, S) for t in range(W, S + 1)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_multiplier(0, S, min_lr_ratio=0.0) == 0.1 and lr_multiplier(S, S, min_lr_ratio=0.0) == 0.0


def test_warmup_is_ceil_of_one_percent():
    assert [warmup_steps(S, 0.01) for S in (1, 99, 100, 101, 700, 1234)] == [1, 1, 1, 2, 7, 13]
    assert warmup_steps(1000, 0.0) == 0 and lr_multiplier(0, 1000, warmup_frac=0.0) == 1.0
    assert lr_multiplier(0, 1) == 1.0  # one step: warmup of one step, nothing to decay


def test_bad_arguments_raise():
    for kwargs in ({"total_steps": 0}, {"warmup_frac": 1.0}, {"warmup_frac": -0.1},
                   {"min_lr_ratio": 1.5}, {"step": -1}):
        args = {"step": 0, "total_steps": 100} | kwargs
        with pytest.raises(ValueError):
            lr_multiplier(**args)
    with pytest.raises(ValueError):
        cosine_schedule(optimizer(), total_steps=0)


def test_lambda_lr_scales_both_groups():
    opt = optimizer(lr=2e-2)
    sched = cosine_schedule(opt, total_steps=200)
    for t in range(60):
        for group in opt.param_groups:
            assert group["lr"] == pytest.approx(2e-2 * lr_multiplier(t, 200), rel=1e-12)
        opt.step()  # no gradients: a no-op that keeps the scheduler's step-order check quiet
        sched.step()


def test_scheduler_state_round_trips_a_checkpoint():
    S = 300
    opt = optimizer()
    sched = cosine_schedule(opt, total_steps=S)
    for _ in range(37):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"optim": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    # the resumed run is built with other schedule arguments: the checkpoint's own values win
    opt2 = optimizer()
    sched2 = cosine_schedule(opt2, total_steps=5 * S, warmup_frac=0.05)
    opt2.load_state_dict(ckpt["optim"])
    sched2.load_state_dict(ckpt["sched"])
    for _ in range(100):
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
        assert sched2.last_epoch == sched.last_epoch
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()
    assert math.isclose(opt.param_groups[0]["lr"], 1e-2 * lr_multiplier(137, S), rel_tol=1e-12)
