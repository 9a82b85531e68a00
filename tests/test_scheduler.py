import ast
import dataclasses
import math
import os

import pytest
import torch

from configurator import assignment_lines, configure
from conftest import ROOT
from scheduler import SCHEDULES, LRSchedule, set_lr

SCRIPTS = ('train.py', 'train_dpo.py', 'train_tts.py')
MAX, MIN, WARM, DECAY = 1.0, 0.1, 10, 110


def lr(step, schedule, max_lr=MAX, min_lr=MIN, warmup=WARM, restart_iters=1000, restart_mult=1, decay_frac=0.2):
    return LRSchedule(schedule, max_lr, min_lr, warmup, DECAY, restart_iters, restart_mult, decay_frac)(step)


@pytest.mark.parametrize("schedule", SCHEDULES)
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


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("warmup", [0, 1, WARM])
def test_every_schedule_peaks_at_learning_rate(schedule, warmup):
    # learning_rate is the peak of every schedule (noam's included), reached at the end of warmup
    lrs = [lr(step, schedule, max_lr=3e-3, min_lr=3e-4, warmup=warmup, restart_iters=20) for step in range(300)]
    assert max(lrs) == pytest.approx(3e-3, rel=1e-12)
    assert lrs[warmup] == pytest.approx(3e-3, rel=1e-12)


def test_noam():
    # ESPnet/CosyVoice WarmupLR with steps counted from 1: max_lr * min(s/W, sqrt(W/s)), s = step+1, W = warmup+1
    for step in (0, 4, 9, 10, 11, 50, 98):
        s, w = step + 1, WARM + 1
        assert lr(step, "noam", min_lr=0.0) == pytest.approx(MAX * min(s / w, math.sqrt(w / s)), rel=1e-12)
    assert lr(98, "noam", min_lr=0.0) == pytest.approx(MAX / 3)  # W/s = 11/99 = 1/9
    assert lr(43, "noam", warmup=0, min_lr=0.0) == pytest.approx(MAX / math.sqrt(44))  # no warmup: 1/sqrt(s)
    # min_lr is the floor of the decay: 1/sqrt(s/11) reaches 0.1 at s = 1100 and stays there
    lrs = [lr(step, "noam") for step in range(WARM, 5000)]
    assert min(lrs) == MIN and lrs[-1] == MIN
    assert lr(1000, "noam") == pytest.approx(math.sqrt(11 / 1001)) and lr(1000, "noam") > MIN
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay after the peak


def script_defaults(script):
    """A training script's config keys with their default values (its top-level literal assignments)."""
    with open(os.path.join(ROOT, script), encoding='utf-8') as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                defaults[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # computed, not a config key
    return defaults


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_set_and_pass_every_schedule_parameter(script):
    # LRSchedule's fields are named like the config keys and have no defaults: each must be a key at the top
    # of the script, which builds its schedule from its config once and calls it with the step
    parameters = [field.name for field in dataclasses.fields(LRSchedule)]
    assert all(field.default is dataclasses.MISSING for field in dataclasses.fields(LRSchedule))
    lines = assignment_lines(os.path.join(ROOT, script))
    config_end = lines['config']  # config = configure(globals()) ends the config block
    assert all(lines.get(name, config_end) < config_end for name in parameters), script
    with open(os.path.join(ROOT, script), encoding='utf-8') as f:
        calls = [ast.unparse(node) for node in ast.walk(ast.parse(f.read()))
                 if isinstance(node, ast.Call) and 'LRSchedule' in ast.unparse(node.func)
                 or isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'get_lr']
    # an epoch-counted run's decay ends at its last step (run/epochs.py)
    assert sorted(calls) == ['LRSchedule.from_config(config, epoch_plan.steps if epoch_plan else None)',
                             'get_lr(iter_num)']
    with pytest.raises(KeyError, match='decay_frac'):  # a key missing from the config is no hidden default
        LRSchedule.from_config({k: v for k, v in script_defaults(script).items() if k != 'decay_frac'})
    # and the keys can be set (--restart_iters was once rejected as unknown)
    config = configure(script_defaults(script), ['--lr_schedule=cosine_restarts', '--restart_iters=5',
                                                 '--restart_mult=2', '--decay_frac=0.5'])
    assert (config['restart_iters'], config['restart_mult'], config['decay_frac']) == (5, 2, 0.5)


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


def test_set_lr_scales_each_group():
    weight, bias = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([dict(params=[weight], lr_scale=16.0), dict(params=[bias])], lr=1.0)
    set_lr(optimizer, 0.5)
    assert [group['lr'] for group in optimizer.param_groups] == [8.0, 0.5]
