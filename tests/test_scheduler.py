import math

import pytest
import torch

from scheduler import get_lr

MAX, MIN, WARM, DECAY = 1.0, 0.1, 10, 110


def lr(step, schedule, **kw):
    return get_lr(step, schedule, MAX, MIN, WARM, DECAY, **kw)


@pytest.mark.parametrize("schedule", ["cosine", "cosine_restarts", "constant", "linear", "wsd"])
def test_warmup_is_linear_from_near_zero(schedule):
    # (step+1)/(warmup+1): 1/11 at step 0, 10/11 at the last warmup step, then the peak
    assert lr(0, schedule) == pytest.approx(1 / 11)
    assert lr(4, schedule) == pytest.approx(5 / 11)
    assert lr(9, schedule) == pytest.approx(10 / 11)
    assert lr(WARM, schedule) == pytest.approx(MAX)


def test_cosine():
    assert lr(60, "cosine") == pytest.approx(0.55)  # halfway: mean of max and min
    assert lr(35, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr(85, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)))
    assert lr(109, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert lr(110, "cosine") == pytest.approx(MIN)
    assert lr(10_000, "cosine") == MIN


def test_cosine_restarts_matches_torch_sgdr():
    # independent reference: torch's CosineAnnealingWarmRestarts stepped once per step after warmup
    for t0, mult in [(7, 1), (5, 2), (3, 3)]:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=MAX)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=t0, T_mult=mult, eta_min=MIN)
        for step in range(WARM, WARM + 60):
            want = opt.param_groups[0]["lr"]
            assert lr(step, "cosine_restarts", restart_iters=t0, restart_mult=mult) == pytest.approx(want), (t0, mult, step)
            opt.step()
            sched.step()


def test_cosine_restarts_boundaries():
    # T_0=5, T_mult=2: cycles of 5, 10, 20 steps start at 0, 5, 15, 35 steps after warmup
    for start in (0, 5, 15, 35):
        assert lr(WARM + start, "cosine_restarts", restart_iters=5, restart_mult=2) == pytest.approx(MAX)
    assert lr(WARM + 5 + 5, "cosine_restarts", restart_iters=5, restart_mult=2) == pytest.approx(0.55)
    assert lr(WARM + 34, "cosine_restarts", restart_iters=5, restart_mult=2) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 19 / 20)))
    with pytest.raises(ValueError, match="restart_iters"):
        lr(WARM, "cosine_restarts", restart_iters=0)


def test_noam():
    d_model, scale = 64, 2.0
    for step in (0, 1, 8, 9, 10, 50, 1000):
        s = step + 1
        want = scale / math.sqrt(d_model) * min(1 / math.sqrt(s), s / WARM ** 1.5)
        assert get_lr(step, "noam", scale, MIN, WARM, DECAY, d_model=d_model) == pytest.approx(want)
    # peak at s == warmup: scale / sqrt(d_model * warmup)
    peak = get_lr(WARM - 1, "noam", scale, MIN, WARM, DECAY, d_model=d_model)
    assert peak == pytest.approx(scale / math.sqrt(d_model * WARM))
    assert all(get_lr(s, "noam", scale, MIN, WARM, DECAY, d_model=d_model) <= peak for s in range(200))
    # no warmup: pure inverse square root
    assert get_lr(3, "noam", scale, MIN, 0, DECAY, d_model=d_model) == pytest.approx(scale / 8 / 2)


def test_constant():
    assert lr(WARM, "constant") == MAX
    assert lr(10_000, "constant") == MAX


def test_linear():
    assert lr(60, "linear") == pytest.approx(0.55)
    assert lr(35, "linear") == pytest.approx(1.0 - 0.9 * 0.25)
    assert lr(109, "linear") == pytest.approx(1.0 - 0.9 * 0.99)
    assert lr(110, "linear") == pytest.approx(MIN)
    assert lr(500, "linear") == MIN


def test_wsd():
    # decay_iters=110, decay_frac=0.2 -> stable until step 88, linear to MIN over steps 88..110
    assert lr(10, "wsd") == MAX
    assert lr(87, "wsd") == MAX
    assert lr(88, "wsd") == pytest.approx(MAX)
    assert lr(99, "wsd") == pytest.approx(0.55)
    assert lr(110, "wsd") == pytest.approx(MIN)
    assert lr(200, "wsd") == MIN
    # decay_frac=0.5 -> decay over steps 55..110
    assert lr(54, "wsd", decay_frac=0.5) == MAX
    assert lr(66, "wsd", decay_frac=0.5) == pytest.approx(1.0 - 0.9 * 11 / 55)


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(ValueError, match="cosine, cosine_restarts, noam, constant, linear, wsd"):
        lr(0, "cosin")
