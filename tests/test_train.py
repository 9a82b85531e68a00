"""End-to-end tests of train.py / sample.py through subprocesses, on a tiny generated corpus."""

import glob
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import (ROOT, TINY, assert_user_error, kill_and_relaunch, load, logged, read_log, run,
                      sigterm_after_steps, start, train, train_losses)


# what plain pretraining never imports (tests/imports.py)
NOT_PRETRAINING = {'lm.lora', 'lm.nf4', 'lm.chat_data', 'lm.heldout_eval', 'lm.generate', 'lm.metrics', 'lm.muon',
                   'lm.adamw8bit', 'loading', 'run.tracker', 'run.epochs', 'run.sharded_checkpoint'}


def file_hash(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.slow
def test_train_smoke_and_sample(tmp_path, data_dir):
    out, imports = tmp_path / 'out', tmp_path / 'imports.json'
    p = run(['tests/imports.py', str(imports), 'train.py', f'--out_dir={out}', f'--data_dir={data_dir}', *TINY,
             '--max_iters=12', '--eval_interval=6', '--lr_decay_iters=12'])
    assert 'sample' in p.stdout
    # plain pretraining reads only what it runs: a feature's code is imported where its branch starts
    with open(imports) as f:
        loaded = json.load(f)
    assert 'model' in loaded and 'run.runtime' in loaded, loaded
    assert not [name for name in loaded if name.startswith(('hf', 'tasks')) or name in NOT_PRETRAINING], loaded
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
    from model import GPT, GPTConfig
    GPT(GPTConfig(**ckpt['model_args'])).load_state_dict(ckpt['model'])
    s = run(['sample.py', f'--out_dir={out}', '--max_new_tokens=20', '--device=cpu', '--start=def'])
    generated = [line for line in s.stdout.splitlines() if not line.startswith('overriding')]
    assert generated[0].startswith('def') and len(''.join(generated)) > 10
    for args, message in [(['--start='], 'start is empty'), ([f'--start=FILE:{tmp_path / "none.txt"}'], 'cannot read'),
                          (['--top_p=1.5'], 'top_p=1.5 must be in [0, 1]'),
                          ([f'--out_dir={tmp_path / "none"}'], 'Train one there first (`python train.py --out_dir='),
                          (['--ckpt_name=merged.pt'], 'holds best.pt, ckpt.pt: pick one with --ckpt_name'),
                          # the model's own tokenizer: a new dataset prepared there would hold another
                          ([f'--data_dir={tmp_path}'], 'Point --data_dir at the dataset folder')]:
        s = run(['sample.py', f'--out_dir={out}', '--device=cpu', *args], check=False)
        assert_user_error(s, message)
        assert 'python data.py' not in s.stderr


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path, data_dir):
    common = ['--dropout=0.1', '--lr_decay_iters=8', '--eval_interval=100', '--gradient_accumulation_steps=2']
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    train(straight, data_dir, '--max_iters=8', *common)
    p = train(split, data_dir, '--max_iters=4', '--init_from=resume', *common, check=False)  # nanoGPT's spelling
    assert_user_error(p, "init_from='resume' continues the run in")
    assert 'there is none' in p.stderr and not split.exists()
    p = train(split, data_dir, '--max_iters=4', '--init_from=auto', *common, check=False)
    assert_user_error(p, "init_from='auto' is not a setting", "--help says which kinds this script takes")
    train(split, data_dir, '--max_iters=4', *common)
    assert load(split / 'ckpt.pt')['iter_num'] == 4
    p = train(split, data_dir, '--max_iters=8', '--init_from=resume', *common)  # as the default init_from
    assert 'resuming' in p.stdout + p.stderr
    assert load(split / 'ckpt.pt')['run']['init_from'] == 'scratch'  # the run's own, not a file named resume
    a, b = train_losses(straight), train_losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    assert all(a[s] == b[s] for s in a), (a, b)
    wa, wb = load(straight / 'ckpt.pt')['model'], load(split / 'ckpt.pt')['model']
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_sigterm_saves_and_exits_143(tmp_path, data_dir):
    out = tmp_path / 'out'
    sigterm_after_steps(['train.py', f'--out_dir={out}', f'--data_dir={data_dir}', *TINY, '--max_iters=100000',
                         '--lr_decay_iters=100000', '--eval_interval=100000'], out, 'train_loss')
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] >= 3
    assert ckpt['iter_num'] == max(train_losses(out))


@pytest.mark.slow
def test_a_closed_output_pipe_drops_the_output_and_the_run_goes_on(tmp_path, data_dir):
    # `python train.py | head -1`: the reader leaves after the first line; every later print, tqdm line and the
    # sample meet a closed pipe, and the run still trains, saves and logs to its files
    out = tmp_path / 'out'
    proc = start(['train.py', f'--out_dir={out}', f'--data_dir={data_dir}', *TINY, '--max_iters=6',
                  '--lr_decay_iters=6', '--eval_interval=3', '--tensorboard=True'],
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout.readline().startswith(b'overriding')
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert load(out / 'ckpt.pt')['iter_num'] == 6
    assert sorted(train_losses(out)) == list(range(1, 7))
    assert [e['step'] for e in read_log(out) if 'val_loss' in e] == [0, 3, 6]
    assert glob.glob(str(out / 'tb' / 'events.*'))


@pytest.mark.slow
def test_nan_step_is_skipped(tmp_path, data_dir):
    out = tmp_path / 'out'
    p = train(out, data_dir, '--max_iters=6', '--eval_interval=100', '--lr_decay_iters=6', faults='nan@2')
    assert 'step 2: non-finite loss' in p.stdout + p.stderr
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 6
    assert all(torch.isfinite(v).all() for v in ckpt['model'].values())


@pytest.mark.slow
def test_float16_scales_the_loss_and_skips_an_overflowing_step(tmp_path, data_dir):
    """--dtype=float16 (autocast, on the CPU too) trains with torch.amp.GradScaler: a NaN gradient at iter_num 2
    (logged as step 3) is an overflow, so that step is skipped and the scale halves; the checkpoint keeps it."""
    out = tmp_path / 'out'
    train(out, data_dir, '--dtype=float16', '--max_iters=4', '--eval_interval=100', '--lr_decay_iters=4',
          '--log_interval=1', faults='nan@2')
    assert {e['step']: e['loss_scale'] for e in read_log(out) if 'loss_scale' in e} == {
        1: 2.0**16, 2: 2.0**16, 3: 2.0**15, 4: 2.0**15}
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['scaler']['scale'] == 2.0**15 and all(torch.isfinite(v).all() for v in ckpt['model'].values())


@pytest.mark.slow
def test_repeated_nan_aborts_and_keeps_checkpoint(tmp_path, data_dir):
    out = tmp_path / 'out'
    train(out, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=10')
    before = file_hash(out / 'ckpt.pt')
    p = train(out, data_dir, '--max_iters=10', '--eval_interval=100', '--lr_decay_iters=10', '--max_bad_steps=3',
              faults='nan@2,nan@3,nan@4', check=False)
    assert p.returncode != 0
    assert '3 consecutive steps' in p.stderr
    assert file_hash(out / 'ckpt.pt') == before


@pytest.mark.slow
@pytest.mark.comparison
@pytest.mark.parametrize('fault, where', [('oom@1', 'step 1'), ('evaloom@0', 'eval')])
def test_oom_halves_micro_batch_and_keeps_global_batch(tmp_path, data_dir, fault, where):
    # evaloom@0: the step-0 eval is the first to meet a micro-batch too big; halved there for the steps too
    ref, oom = tmp_path / 'ref', tmp_path / 'oom'
    common = ['--max_iters=4', '--eval_interval=2', '--lr_decay_iters=4']
    train(ref, data_dir, *common)
    p = train(oom, data_dir, *common, faults=fault)
    assert f'{where}: out of memory, retrying with micro-batch 2 x 2' in p.stdout + p.stderr
    ckpt = load(oom / 'ckpt.pt')
    assert (ckpt['batch_size'], ckpt['gradient_accumulation_steps']) == (2, 2)
    for key in ('train_loss', 'val_loss'):
        a, b = logged(ref, key), logged(oom, key)
        assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-5 for s in a), (key, a, b)


@pytest.mark.slow
@pytest.mark.comparison
def test_ddp_matches_single_process_with_double_accumulation(tmp_path, data_dir):
    single, ddp = tmp_path / 'single', tmp_path / 'ddp'
    common = ['--max_iters=5', '--eval_interval=5', '--lr_decay_iters=5']
    train(single, data_dir, *common, '--gradient_accumulation_steps=2')
    train(ddp, data_dir, *common, '--gradient_accumulation_steps=1', ranks=2)
    # the same micro-batches of 4 on both sides, whose 2 gradients the all-reduce adds instead of the accumulation
    # (DDP's x2 and /2 are exact): the same float32 operations on any CPU, so equal to a few ulps (measured: bit-equal,
    # also on SSE kernels). The gradient norm catches a gradient scale error, which Adam's steps would hide.
    assert sorted(train_losses(single)) == list(range(1, 6))
    for key in ('train_loss', 'grad_norm', 'val_loss'):
        a, b = (logged(out, key) for out in (single, ddp))
        assert b == pytest.approx(a, rel=1e-6), (key, a, b)
    p = train(ddp, data_dir, *common, '--max_iters=6', '--gradient_accumulation_steps=1')
    assert 'global batch of 8 is kept on 1 process instead of 2' in p.stdout, p.stdout  # not halved
    assert 'written by 2 processes, now 1' in p.stdout and load(ddp / 'ckpt.pt')['gradient_accumulation_steps'] == 2
    # one val window: an eval batch on rank 0 and none on rank 1, whose DDP forward broadcast the RoPE buffers from
    # rank 0 (DDP's default) while rank 1 waited in the eval's all-reduce: hung until killed
    uneven = tmp_path / 'uneven'
    train(uneven, data_dir, '--max_iters=1', '--eval_interval=1', '--batch_size=1', '--eval_iters=1', ranks=2,
          timeout=120)
    assert sorted(logged(uneven, 'val_loss')) == [0, 1]


@pytest.mark.slow
def test_early_stopping(tmp_path, data_dir):
    out = tmp_path / 'out'
    # lr 0: val loss never improves after the first eval
    p = train(out, data_dir, '--max_iters=50', '--eval_interval=2', '--lr_decay_iters=50', '--learning_rate=0',
              '--min_lr=0', '--early_stopping_patience=2')
    assert 'early stopping' in p.stdout + p.stderr
    assert load(out / 'ckpt.pt')['iter_num'] == 6


@pytest.mark.slow
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


@pytest.mark.slow
def test_bad_inputs_exit_with_clear_errors(tmp_path, data_dir):
    p = train(tmp_path / 'a', data_dir, '--n_layr=3', check=False)
    assert_user_error(p, 'n_layer')
    p = train(tmp_path / 'b', data_dir, '--batch_size=big', check=False)
    assert_user_error(p, 'batch_size')
    p = run(['train.py', f'--out_dir={tmp_path / "c"}', f'--data_dir={tmp_path / "missing"}', *TINY], check=False)
    assert p.returncode != 0 and 'missing' in p.stderr and 'Traceback' not in p.stderr
    p = run(['train.py', '--help'])
    assert 'learning_rate' in p.stdout and 'init_from' in p.stdout
    assert 'num_train_epochs = 0.0' in p.stdout and 'wandb_log = False' in p.stdout


@pytest.mark.slow
def test_init_from_path_starts_new_run(tmp_path, data_dir):
    base, tuned = tmp_path / 'base', tmp_path / 'tuned'
    train(base, data_dir, '--max_iters=3', '--eval_interval=100', '--lr_decay_iters=3')
    train(tuned, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=2',
          f'--init_from={base / "ckpt.pt"}')
    first_val = [e for e in read_log(tuned) if 'val_loss' in e][0]
    base_val = [e for e in read_log(base) if 'val_loss' in e][-1]
    assert abs(first_val['val_loss'] - base_val['val_loss']) < 1e-6  # started from the base weights
    assert load(tuned / 'ckpt.pt')['iter_num'] == 2


@pytest.mark.slow
def test_eval_only(tmp_path, data_dir):
    out = tmp_path / 'out'
    train(out, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=2')
    before = file_hash(out / 'ckpt.pt')
    p = train(out, data_dir, '--eval_only=True')
    assert 'val loss' in p.stdout + p.stderr
    assert file_hash(out / 'ckpt.pt') == before


@pytest.mark.slow
def test_sample_tts_refuses_a_gpt_checkpoint(tmp_path, data_dir):
    """sample_tts.py speaks train_tts.py checkpoints only: a GPT's is an error pointing at sample.py."""
    out = tmp_path / 'out'
    train(out, data_dir, '--max_iters=2', '--eval_interval=100', '--lr_decay_iters=2')
    s = run(['sample_tts.py', f'--out_dir={out}', '--device=cpu', f'--wav={tmp_path / "x.wav"}'], check=False)
    assert_user_error(s, "is a 'gpt' checkpoint, not a text-to-speech one", f'python sample.py --out_dir={out}`')
    assert not (tmp_path / 'x.wav').exists()


@pytest.mark.slow
def test_relaunch_after_sigkill_continues_the_run(tmp_path, data_dir):
    out = tmp_path / 'out'
    args = ['train.py', f'--out_dir={out}', f'--data_dir={data_dir}', *TINY, '--max_iters=300', '--eval_interval=10',
            '--lr_decay_iters=300']
    killed_at, output, steps = kill_and_relaunch(args, out)
    assert killed_at >= 10 and f'resuming from {out / "ckpt.pt"} at step {killed_at}\n' in output
    assert steps == list(range(1, 301))  # one history: the killed run's steps past its checkpoint are dropped
    assert load(out / 'ckpt.pt')['iter_num'] == 300


@pytest.mark.slow
def test_out_dir_holds_one_run_at_a_time(tmp_path, data_dir):
    """Another run's weights into a folder that holds a run are refused (--resume=False replaces it); a second
    run on a folder in use is refused; a lock left by a killed run and the temporaries of a killed save are not."""
    out, other = tmp_path / 'out', tmp_path / 'other'
    quick = ['--eval_interval=2', '--lr_decay_iters=2']
    train(out, data_dir, '--max_iters=2', *quick)
    train(other, data_dir, '--max_iters=1', *quick)
    saved = (out / 'ckpt.pt').read_bytes()
    p = train(out, data_dir, f'--init_from={other / "ckpt.pt"}', '--max_iters=4', *quick, check=False)
    assert_user_error(p, 'holds another run', '--resume=False')
    assert 'Traceback' not in p.stderr and (out / 'ckpt.pt').read_bytes() == saved

    (out / 'best.pt.x1y2z3.tmp').write_bytes(b'half a checkpoint')  # a save killed mid-write
    holder = start(['train.py', f'--out_dir={out}', f'--data_dir={data_dir}', *TINY, '--max_iters=100000',
                    '--lr_decay_iters=100000', '--eval_interval=100000'], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / 'run.lock').read_text().strip() == str(holder.pid):
        time.sleep(0.05)
    p = train(out, data_dir, '--max_iters=4', check=False)
    assert_user_error(p, f'another run (process {holder.pid}) is training in {out}')
    assert not list(out.glob('*.tmp'))
    holder.kill()
    holder.wait()
    p = train(out, data_dir, f'--init_from={other / "ckpt.pt"}', '--resume=False', '--max_iters=2', *quick)
    assert 'resuming' not in p.stdout + p.stderr and load(out / 'ckpt.pt')['run']['init_from'] == str(other / 'ckpt.pt')
    assert [e['step'] for e in read_log(out) if 'val_loss' in e] == [0, 2]  # the replaced run's log is gone


@pytest.mark.slow
def test_out_dir_that_cannot_be_written_fails_before_any_work(tmp_path):
    for script in ('train.py', 'train_dpo.py', 'train_tts.py'):
        p = run([script, '--out_dir=/dev/null/x', '--device=cpu'], check=False)
        assert_user_error(p, "out_dir='/dev/null/x' cannot be created or written")
        assert 'Traceback' not in p.stderr
    (tmp_path / 'in.txt').write_text('some text\n' * 50)
    p = run(['data.py', f'--input={tmp_path / "in.txt"}', '--out_dir=/proc/x'], check=False)
    assert_user_error(p, "out_dir='/proc/x' cannot be created or written")


@pytest.mark.slow
def test_a_save_that_fails_for_lack_of_space_is_explained_and_keeps_the_checkpoint(tmp_path, data_dir):
    import resource
    out = tmp_path / 'out'
    quick = ['--eval_interval=2', '--lr_decay_iters=4']
    train(out, data_dir, '--max_iters=2', *quick)
    saved = (out / 'ckpt.pt').read_bytes()
    p = train(out, data_dir, '--max_iters=4', *quick, check=False,
              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (len(saved) // 4,) * 2))
    assert_user_error(p, 'could not write checkpoint', 'ulimit -f')
    assert 'Traceback' not in p.stderr and 'was left as it was' in p.stderr
    assert (out / 'ckpt.pt').read_bytes() == saved and not list(out.glob('*.tmp'))


@pytest.mark.slow
@pytest.mark.parametrize('command, made_by', [
    (['train.py', 'config/sft.py'], '`python train.py` (pretraining); run that first'),
    (['train_dpo.py'], '`python train.py` (pretraining, out/ckpt.pt) then `python train.py config/sft.py` (SFT)'),
    (['train_rl.py'], '`python train.py` (pretraining, out/ckpt.pt) then `python train.py config/sft.py` (SFT)')])
def test_fine_tuning_without_its_base_model_names_the_command_that_makes_it(tmp_path, command, made_by):
    """A fresh clone: config/sft.py starts from out/ckpt.pt, DPO and RL from out-sft/ckpt.pt (their defaults),
    which do not exist yet; no data is prepared first."""
    p = subprocess.run([sys.executable, *(os.path.join(ROOT, part) for part in command), '--out_dir=o',
                        '--device=cpu'], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert_user_error(p, "is not a checkpoint file", made_by)
    assert 'Traceback' not in p.stderr and not (tmp_path / 'data').exists()


def test_a_tts_run_from_a_missing_model_is_not_told_to_pretrain_a_gpt(tmp_path):
    """out/ckpt.pt is what `python train.py` writes: named for the language-model scripts only, since
    train_tts.py cannot start from a GPT."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'train_tts.py'), '--init_from=out/ckpt.pt', '--out_dir=o',
                        '--device=cpu'], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert_user_error(p, "init_from='out/ckpt.pt' is not a checkpoint file. Check the path")
    assert 'python train.py' not in p.stderr
