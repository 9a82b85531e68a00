"""Unit tests of the plumbing the training scripts share (run/runtime.py, checkpoint.training_state); the
scripts' end-to-end tests (DDP, resume, SIGTERM, non-finite steps) run it through all three."""

import math
import random

import pytest
import torch

from run.checkpoint import restore_training_state, training_state
from memory import GradScaler
from run.runtime import after_eval, clip_and_reduce, compute_init, patience_exhausted, rank_batches, step_or_skip


def tiny_step(loss_scale=1.0):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    (net(torch.randn(4, 3)).pow(2).sum() * loss_scale).backward()
    return net, optimizer


def test_compute_init_without_torchrun(monkeypatch):
    monkeypatch.delenv('RANK', raising=False)
    ddp, rank, local_rank, world_size, device = compute_init('cpu', seed=5)
    assert (ddp, rank, local_rank, world_size, device) == (False, 0, 0, 1, 'cpu')
    draw = torch.rand(3)
    torch.manual_seed(5)  # seed + rank
    assert torch.equal(draw, torch.rand(3))


@pytest.mark.comparison
def test_clip_and_reduce_clips_the_global_norm_and_passes_shares_and_flags():
    net, optimizer = tiny_step()
    expected = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    shares = {'loss': torch.tensor(1.5), 'ce': torch.tensor(0.25)}
    metrics, grad_norm, flags = clip_and_reduce(optimizer, GradScaler(enabled=False), net.parameters(), 0.5, shares,
                                                [True, False], ddp=False)
    assert metrics == {'loss': 1.5, 'ce': 0.25} and flags == [True, False]
    assert grad_norm == pytest.approx(expected, rel=1e-6)  # the norm before clipping, as torch reports it
    clipped = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    assert clipped == pytest.approx(0.5, rel=1e-5)


def test_clip_and_reduce_unscales_fp16_gradients():
    scaler = GradScaler(enabled=True, init_scale=1024.0)
    reference, _ = tiny_step()
    net, optimizer = tiny_step(loss_scale=1024.0)  # what scaler.scale(loss).backward() leaves
    _, grad_norm, _ = clip_and_reduce(optimizer, scaler, net.parameters(), 0.0, {'loss': torch.tensor(1.0)}, [], False)
    assert grad_norm == pytest.approx(torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item(),
                                      rel=1e-6)


def test_step_or_skip_counts_bad_steps_and_ends_the_run(tmp_path):
    net, optimizer = tiny_step()
    before = [p.detach().clone() for p in net.parameters()]
    scaler = GradScaler(enabled=False)
    assert step_or_skip(optimizer, scaler, math.nan, 1.0, 0, 3, 7, str(tmp_path)) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # skipped
    assert step_or_skip(optimizer, scaler, 1.0, math.inf, 1, 3, 8, str(tmp_path)) == 2
    with pytest.raises(SystemExit, match='3 consecutive steps.*last at step 9'):
        step_or_skip(optimizer, scaler, math.nan, 1.0, 2, 3, 9, str(tmp_path))
    net.weight.grad = torch.ones_like(net.weight)
    assert step_or_skip(optimizer, scaler, 1.0, 1.0, 2, 3, 10, str(tmp_path)) == 0  # a good step resets the count
    assert not torch.equal(before[0], net.weight)


def test_eval_bookkeeping():
    assert after_eval(2.0, math.inf, 0) == (True, 2.0, 0)
    assert after_eval(2.5, 2.0, 0) == (False, 2.0, 1)
    assert after_eval(2.0, 2.0, 1) == (False, 2.0, 2)  # a tie is no improvement
    assert after_eval(1.0, 2.0, 2) == (True, 1.0, 0)
    assert not patience_exhausted(0, 100)  # 0: never
    assert not patience_exhausted(3, 2) and patience_exhausted(3, 3)


def test_training_state_round_trip(tmp_path):
    net, optimizer = tiny_step()
    optimizer.step()
    scaler = GradScaler(enabled=True, init_scale=256.0)
    random.seed(3)
    torch.manual_seed(3)
    state = training_state({'script': 'x.py'}, {'lr': 0.1}, optimizer, scaler, 12, 1.25, 2)
    expected_draws = (random.random(), torch.rand(2))
    fresh = torch.optim.AdamW(net.parameters(), lr=0.1)
    fresh_scaler = GradScaler(enabled=True)
    counters = restore_training_state(state, 'ckpt.pt', fresh, fresh_scaler, rank=0, world_size=1)
    assert counters == (12, 1.25, 2)
    assert random.random() == expected_draws[0] and torch.equal(torch.rand(2), expected_draws[1])
    assert fresh_scaler.get_scale() == 256.0
    saved, restored = optimizer.state_dict()['state'], fresh.state_dict()['state']
    assert all(torch.equal(saved[k]['exp_avg'], restored[k]['exp_avg']) for k in saved)


@pytest.mark.parametrize('n, batch_size, world_size', [(7, 2, 2), (3, 1, 2), (1, 4, 3), (9, 4, 4)])
def test_rank_batches_cover_every_index_once_and_in_lockstep_as_many_batches_on_every_rank(n, batch_size, world_size):
    indices = torch.arange(n)
    for lockstep in (False, True):
        per_rank = [rank_batches(indices, batch_size, rank, world_size, lockstep) for rank in range(world_size)]
        counted = sorted(i for batches in per_rank for batch, c in batches if c for i in batch.tolist())
        assert counted == list(range(n))  # fillers excluded, nothing twice
        assert all(len(batch) <= batch_size and len(batch) > 0 for batches in per_rank for batch, _ in batches)
        if lockstep:  # under FSDP a rank that ran fewer forward passes would hang the others
            assert len({len(batches) for batches in per_rank}) == 1
        else:  # DDP: each rank's share as before, no fillers
            assert all(c for batches in per_rank for _, c in batches)
