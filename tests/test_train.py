"""End-to-end tests of train.py / sample.py through subprocesses, on a tiny generated corpus."""

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=32', '--batch_size=4', '--eval_iters=2',
        '--log_interval=1', '--tensorboard=False', '--sample_tokens=10', '--warmup_iters=2', '--device=cpu',
        '--dtype=float32', '--learning_rate=1e-2', '--min_lr=1e-3']


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    sys.path.insert(0, ROOT)
    from data import prepare
    rng = random.Random(0)
    words = ['alpha', 'beta', 'gamma', 'delta', 'def', 'return', 'if', 'else', 'for', 'in', '(', ')', ':']
    text = '\n'.join(' '.join(rng.choice(words) for _ in range(12)) for _ in range(800))
    src = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
    src.write_text(text)
    out = tmp_path_factory.mktemp('prepared')
    prepare(str(src), str(out), tokenizer='char')
    return str(out)


def run(args, env_extra=None, check=True, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}")
    return p


def train(out_dir, data_dir, *extra, **kw):
    return run(['train.py', f'--out_dir={out_dir}', f'--data_dir={data_dir}', *TINY, *extra], **kw)


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir):
    return {e['step']: e['train_loss'] for e in read_log(out_dir) if 'train_loss' in e}


def file_hash(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def test_train_smoke_and_sample(tmp_path, data_dir):
    out = tmp_path / 'out'
    p = train(out, data_dir, '--max_iters=12', '--eval_interval=6', '--lr_decay_iters=12')
    assert 'sample' in p.stdout
    assert (out / 'ckpt.pt').exists() and (out / 'best.pt').exists()
    events = read_log(out)
    train_events = [e for e in events if 'train_loss' in e]
    val_events = [e for e in events if 'val_loss' in e]
    assert [e['step'] for e in train_events] == list(range(1, 13))
    assert all({'step', 'train_loss', 'lr', 'grad_norm', 'tokens_per_sec'} <= set(e) for e in train_events)
    assert [e['step'] for e in val_events] == [0, 6, 12]
    assert val_events[-1]['val_loss'] < val_events[0]['val_loss']  # it learns
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 12
    assert not any(k.startswith(('_orig_mod.', 'module.')) for k in ckpt['model'])
    sys.path.insert(0, ROOT)
    from model import GPT, GPTConfig
    GPT(GPTConfig(**ckpt['model_args'])).load_state_dict(ckpt['model'])
    s = run(['sample.py', f'--out_dir={out}', '--max_new_tokens=20', '--device=cpu', '--start=def'])
    generated = [line for line in s.stdout.splitlines() if not line.startswith('overriding')]
    assert generated[0].startswith('def') and len(''.join(generated)) > 10
    for args, message in [(['--start='], 'start is empty'), ([f'--start=FILE:{tmp_path / "none.txt"}'], 'cannot read'),
                          (['--top_p=1.5'], 'top_p=1.5 must be in [0, 1]')]:
        s = run(['sample.py', f'--out_dir={out}', '--device=cpu', *args], check=False)
        assert s.returncode == 2 and message in s.stderr and 'Traceback' not in s.stderr, (args, s.stderr)


def test_resume_is_bit_exact(tmp_path, data_dir):
    common = ['--dropout=0.1', '--lr_decay_iters=8', '--eval_interval=100', '--gradient_accumulation_steps=2']
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    train(straight, data_dir, '--max_iters=8', *common)
    train(split, data_dir, '--max_iters=4', *common)
    assert load(split / 'ckpt.pt')['iter_num'] == 4
    p = train(split, data_dir, '--max_iters=8', *common)  # init_from='auto' resumes
    assert 'resuming' in p.stdout + p.stderr
    a, b = train_losses(straight), train_losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert all(a[s] == b[s] for s in a), (a, b)
    wa, wb = load(straight / 'ckpt.pt')['model'], load(split / 'ckpt.pt')['model']
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigterm_saves_and_exits_143(tmp_path, data_dir):
    out = tmp_path / 'out'
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    proc = subprocess.Popen([sys.executable, 'train.py', f'--out_dir={out}', f'--data_dir={data_dir}', *TINY,
                             '--max_iters=100000', '--lr_decay_iters=100000', '--eval_interval=100000'],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / 'log.jsonl').exists() and len(train_losses(out)) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] >= 3
    assert ckpt['iter_num'] == max(train_losses(out))


def test_nan_step_is_skipped(tmp_path, data_dir):
    out = tmp_path / 'out'
    p = train(out, data_dir, '--max_iters=6', '--eval_interval=100', '--lr_decay_iters=6',
              env_extra={'NANOTRAIN_FAULT': 'nan@2'})
    assert 'step 2: non-finite loss' in p.stdout + p.stderr
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 6
    assert all(torch.isfinite(v).all() for v in ckpt['model'].values())


def test_repeated_nan_aborts_and_keeps_checkpoint(tmp_path, data_dir):
    out = tmp_path / 'out'
    train(out, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=10')
    before = file_hash(out / 'ckpt.pt')
    p = train(out, data_dir, '--max_iters=10', '--eval_interval=100', '--lr_decay_iters=10', '--max_bad_steps=3',
              env_extra={'NANOTRAIN_FAULT': 'nan@2,nan@3,nan@4'}, check=False)
    assert p.returncode != 0
    assert '3 consecutive steps' in p.stderr
    assert file_hash(out / 'ckpt.pt') == before


def test_oom_halves_micro_batch_and_keeps_global_batch(tmp_path, data_dir):
    ref, oom = tmp_path / 'ref', tmp_path / 'oom'
    common = ['--max_iters=4', '--eval_interval=100', '--lr_decay_iters=4']
    train(ref, data_dir, *common)
    p = train(oom, data_dir, *common, env_extra={'NANOTRAIN_FAULT': 'oom@1'})
    assert 'out of memory, retrying with micro-batch 2 x 2' in p.stdout + p.stderr
    ckpt = load(oom / 'ckpt.pt')
    assert (ckpt['batch_size'], ckpt['gradient_accumulation_steps']) == (2, 2)
    a, b = train_losses(ref), train_losses(oom)
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)


def test_ddp_matches_single_process_with_double_accumulation(tmp_path, data_dir):
    single, ddp = tmp_path / 'single', tmp_path / 'ddp'
    common = [f'--data_dir={data_dir}', *TINY, '--max_iters=5', '--eval_interval=5', '--lr_decay_iters=5']
    run(['train.py', f'--out_dir={single}', *common, '--gradient_accumulation_steps=2'])
    run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--out_dir={ddp}',
         *common, '--gradient_accumulation_steps=1'])
    a, b = train_losses(single), train_losses(ddp)
    assert sorted(a) == sorted(b) == list(range(1, 6))
    assert all(abs(a[s] - b[s]) < 1e-6 for s in a), (a, b)
    va = [e['val_loss'] for e in read_log(single) if 'val_loss' in e]
    vb = [e['val_loss'] for e in read_log(ddp) if 'val_loss' in e]
    assert all(abs(x - y) < 1e-6 for x, y in zip(va, vb))


def test_early_stopping(tmp_path, data_dir):
    out = tmp_path / 'out'
    # lr 0: val loss never improves after the first eval
    p = train(out, data_dir, '--max_iters=50', '--eval_interval=2', '--lr_decay_iters=50', '--learning_rate=0',
              '--min_lr=0', '--early_stopping_patience=2')
    assert 'early stopping' in p.stdout + p.stderr
    assert load(out / 'ckpt.pt')['iter_num'] == 6


def test_shape_mismatch_is_clear_and_keeps_checkpoint(tmp_path, data_dir):
    out = tmp_path / 'out'
    train(out, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=2')
    before = file_hash(out / 'ckpt.pt')
    p = train(out, data_dir, '--max_iters=4', '--n_embd=64', check=False)
    assert p.returncode != 0 and 'Traceback' not in p.stderr
    assert 'n_embd' in p.stderr and 'checkpoint has 32' in p.stderr
    assert file_hash(out / 'ckpt.pt') == before


def test_corrupt_checkpoint_is_clear_and_untouched(tmp_path, data_dir):
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'ckpt.pt').write_bytes(b'not a checkpoint')
    p = train(out, data_dir, '--max_iters=2', check=False)
    assert p.returncode != 0 and 'Traceback' not in p.stderr
    assert 'ckpt.pt' in p.stderr and 'corrupt' in p.stderr
    assert (out / 'ckpt.pt').read_bytes() == b'not a checkpoint'


def test_bad_inputs_exit_with_clear_errors(tmp_path, data_dir):
    p = train(tmp_path / 'a', data_dir, '--n_layr=3', check=False)
    assert p.returncode == 2 and 'n_layer' in p.stderr and 'Traceback' not in p.stderr
    p = train(tmp_path / 'b', data_dir, '--batch_size=big', check=False)
    assert p.returncode == 2 and 'batch_size' in p.stderr and 'Traceback' not in p.stderr
    p = run(['train.py', f'--out_dir={tmp_path / "c"}', f'--data_dir={tmp_path / "missing"}', *TINY], check=False)
    assert p.returncode != 0 and 'missing' in p.stderr and 'Traceback' not in p.stderr
    p = train(tmp_path / 'd', data_dir, '--init_from=resume', check=False)
    assert p.returncode != 0 and 'ckpt.pt' in p.stderr and 'Traceback' not in p.stderr
    p = run(['train.py', '--help'])
    assert 'learning_rate' in p.stdout and 'init_from' in p.stdout


def test_init_from_path_starts_new_run(tmp_path, data_dir):
    base, tuned = tmp_path / 'base', tmp_path / 'tuned'
    train(base, data_dir, '--max_iters=3', '--eval_interval=100', '--lr_decay_iters=3')
    train(tuned, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=2',
          f'--init_from={base / "ckpt.pt"}')
    first_val = [e for e in read_log(tuned) if 'val_loss' in e][0]
    base_val = [e for e in read_log(base) if 'val_loss' in e][-1]
    assert abs(first_val['val_loss'] - base_val['val_loss']) < 1e-6  # started from the base weights
    assert load(tuned / 'ckpt.pt')['iter_num'] == 2


def test_eval_only(tmp_path, data_dir):
    out = tmp_path / 'out'
    train(out, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=2')
    before = file_hash(out / 'ckpt.pt')
    p = train(out, data_dir, '--eval_only=True')
    assert 'val loss' in p.stdout + p.stderr
    assert file_hash(out / 'ckpt.pt') == before
