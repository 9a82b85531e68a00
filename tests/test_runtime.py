"""Unit tests of the plumbing the training scripts share (run/runtime.py, checkpoint.training_state); the
scripts' end-to-end tests (DDP, resume, SIGTERM, non-finite steps) run it through all three."""

import ast
import math
import os
import random

import pytest
import torch

from run.checkpoint import restore_training_state, training_state
from run import runtime
from run.runtime import all_reduce_metrics, bad_step, clip_grad_norm, compute_init, rank_batches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ('train.py', 'train_dpo.py', 'train_tts.py')


def tiny_step(loss_scale=1.0):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    (net(torch.randn(4, 3)).pow(2).sum() * loss_scale).backward()
    return net, optimizer


def test_compute_init_without_torchrun(monkeypatch):
    monkeypatch.delenv('RANK', raising=False)
    compute = compute_init('cpu', seed=5)
    assert compute == (False, 0, 0, 1, 'cpu') and (compute.ddp, compute.world_size, compute.device) == (False, 1, 'cpu')
    draw = torch.rand(3)
    torch.manual_seed(5)  # seed + rank
    assert torch.equal(draw, torch.rand(3))


def test_each_rank_is_seeded_within_torchs_range(monkeypatch):
    # the largest seed torch takes, on rank 1: seed + rank wraps to 0 instead of failing
    monkeypatch.setattr(runtime, 'install_excepthook', lambda: None)
    monkeypatch.setattr(runtime.dist, 'init_process_group', lambda backend: None)
    for name, value in (('RANK', '1'), ('LOCAL_RANK', '1'), ('WORLD_SIZE', '2')):
        monkeypatch.setenv(name, value)
    assert runtime.compute_init('cpu', seed=2 ** 64 - 1)[:4] == (True, 1, 1, 2)
    draw = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(draw, torch.rand(3))


@pytest.mark.comparison
def test_clip_grad_norm_clips_the_global_norm_and_returns_it_before_clipping():
    net, _ = tiny_step()
    expected = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    grad_norm = clip_grad_norm(net.parameters(), 0.5)
    assert grad_norm == pytest.approx(expected, rel=1e-6)  # the norm before clipping, as torch reports it
    clipped = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    assert clipped == pytest.approx(0.5, rel=1e-5)
    assert clip_grad_norm(net.parameters(), 0.0) == pytest.approx(0.5, rel=1e-5)  # 0: measured, not clipped
    assert torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item() == pytest.approx(0.5, rel=1e-5)


def test_clip_grad_norm_after_unscaling_fp16_gradients():
    scaler = torch.amp.GradScaler('cpu', enabled=True, init_scale=1024.0)
    reference, _ = tiny_step()
    net, optimizer = tiny_step(loss_scale=1024.0)  # what scaler.scale(loss).backward() leaves
    scaler.scale(torch.zeros(()))  # torch's scaler makes its scale tensor here
    scaler.unscale_(optimizer)
    assert clip_grad_norm(net.parameters(), 0.0) == pytest.approx(
        torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item(), rel=1e-6)


def test_all_reduce_metrics_passes_shares_and_flags():
    shares = {'loss': torch.tensor(1.5), 'ce': torch.tensor(0.25)}
    metrics, flags = all_reduce_metrics(shares, [True, False], ddp=False)
    assert metrics == {'loss': 1.5, 'ce': 0.25} and flags == [True, False]
    assert all_reduce_metrics({'loss': torch.tensor(2.0)}, [], ddp=False) == ({'loss': 2.0}, [])


def test_bad_step_counts_bad_steps_and_ends_the_run(tmp_path):
    config = {'max_bad_steps': 3, 'out_dir': str(tmp_path)}
    assert bad_step(0, config, 7, math.nan, 1.0) == 1
    assert bad_step(1, config, 8, 1.0, math.inf) == 2
    with pytest.raises(SystemExit, match=f'3 consecutive steps.*last at step 9.*checkpoint in {tmp_path} was left'):
        bad_step(2, config, 9, math.nan, 1.0)


def script_step(script):
    """The optimizer step of a training script's loop, from `if math.isfinite(loss)` to zero_grad, compiled."""
    with open(os.path.join(REPO, script), encoding='utf-8') as f:
        source = f.read()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, 'body', None)
        for i, statement in enumerate(body if isinstance(body, list) else []):
            if isinstance(statement, ast.If) and ast.unparse(statement.test).startswith('math.isfinite(loss)'):
                block = ast.Module(body=body[i:i + 3], type_ignores=[])
                assert ast.unparse(block.body[1:]) == 'scaler.update()\noptimizer.zero_grad(set_to_none=True)'
                return compile(block, script, 'exec')
    raise AssertionError(f'{script}: no optimizer step found')


@pytest.mark.parametrize('script', SCRIPTS)
def test_each_script_skips_bad_steps_and_leaves_fp16_overflow_to_the_scaler(script, tmp_path):
    step = script_step(script)
    w = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([w], lr=0.5)

    def run(loss, grad_norm, scaler, bad_steps=0, grad=1.0):
        w.grad = torch.full((2,), grad)
        if scaler.is_enabled():
            scaler.scale(torch.zeros(()))  # as the script's backward did
            scaler.unscale_(optimizer)
        scope = dict(math=math, scaler=scaler, optimizer=optimizer, loss=loss, grad_norm=grad_norm,
                     bad_steps=bad_steps, bad_step=bad_step, config={'max_bad_steps': 3, 'out_dir': str(tmp_path)},
                     iter_num=7)
        exec(step, scope)
        return scope['bad_steps']

    fp32 = torch.amp.GradScaler('cpu', enabled=False)
    assert run(1.0, 1.0, fp32, bad_steps=2) == 0  # a good step resets the count
    assert torch.equal(w.detach(), torch.full((2,), 0.5)) and w.grad is None
    assert run(math.nan, 1.0, fp32) == 1 and run(1.0, math.inf, fp32, bad_steps=1) == 2
    assert torch.equal(w.detach(), torch.full((2,), 0.5)) and w.grad is None  # skipped, gradients cleared
    with pytest.raises(SystemExit, match='3 consecutive steps'):
        run(math.nan, 1.0, fp32, bad_steps=2)
    fp16 = torch.amp.GradScaler('cpu', enabled=True)
    scale = fp16.get_scale()
    assert run(1.0, math.inf, fp16, grad=math.inf) == 0  # an overflow: the scaler skips the step and backs off
    assert torch.equal(w.detach(), torch.full((2,), 0.5)) and fp16.get_scale() < scale and w.grad is None


def test_training_state_round_trip(tmp_path):
    net, optimizer = tiny_step()
    optimizer.step()
    scaler = torch.amp.GradScaler('cpu', enabled=True, init_scale=256.0)
    random.seed(3)
    torch.manual_seed(3)
    state = training_state({'script': 'x.py'}, {'lr': 0.1}, optimizer, scaler, 12, 1.25, 2)
    expected_draws = (random.random(), torch.rand(2))
    fresh = torch.optim.AdamW(net.parameters(), lr=0.1)
    fresh_scaler = torch.amp.GradScaler('cpu', enabled=True)
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
