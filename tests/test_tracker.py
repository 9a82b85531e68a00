"""Weights & Biases (run/tracker.py): with the real wandb package offline, skipped where it is not installed (CI: it is
no dependency; docs/tests.md says how to run it); every script's error when it is missing. The stand-in package the
other tests use: conftest.assert_logged_to_wandb."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, load, read_log, script_env, start_up_refusal, train


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec('wandb') is None, reason='the wandb package is not installed')
def test_an_offline_run_and_its_relaunch_are_one_wandb_run_that_wandb_reads_back(tmp_path, data_dir):
    """WANDB_MODE=offline: each launch writes out_dir/wandb/offline-run-<time>-<id>, both with the id the checkpoint
    keeps; `wandb sync` would upload both to that one run, and wandb's own reader (`wandb leet inspect`, where the
    installed version has it) finds every number of log.jsonl in their history, and the config."""
    out = tmp_path / 'out'
    home = {k: str(tmp_path / 'wandb-home') for k in ('WANDB_CONFIG_DIR', 'WANDB_CACHE_DIR', 'WANDB_DATA_DIR')}
    env = dict(home, WANDB_MODE='offline', WANDB_SILENT='true')
    quick = ['--eval_interval=2', '--lr_decay_iters=4', '--wandb_log=True', '--wandb_project=nanotrain-test']
    train(out, data_dir, '--max_iters=2', *quick, env_extra=env)
    train(out, data_dir, '--max_iters=4', *quick, env_extra=env)
    run_id = load(out / 'ckpt.pt')['wandb_run_id']
    folders = sorted(glob.glob(str(out / 'wandb' / f'offline-run-*-{run_id}')))
    assert len(folders) == 2 and all(os.path.exists(os.path.join(f, f'run-{run_id}.wandb')) for f in folders)

    def wandb(*args):
        return subprocess.run([sys.executable, '-m', 'wandb', *args], cwd=ROOT, env=script_env(**env),
                              capture_output=True, text=True, timeout=120)

    p = wandb('sync', '--dry-run', *folders)
    assert p.returncode == 0 and 'Would sync 2 run(s)' in p.stdout + p.stderr, (p.stdout, p.stderr)
    history, config = {}, {}
    for folder in folders:
        p = wandb('leet', 'inspect', '--json', os.path.join(folder, f'run-{run_id}.wandb'))
        if p.returncode != 0:
            pytest.skip(f'this wandb has no reader of its .wandb files (`wandb leet inspect`): {p.stderr[-200:]}')
        for record in map(json.loads, p.stdout.splitlines()):
            if record['type'] == 'history':
                history.setdefault(record['history']['step']['num'], {}).update(record['history']['item'])
            if record['type'] == 'run':
                assert record['run']['run_id'] == run_id and record['run']['project'] == 'nanotrain-test'
                config.update(record['run']['config']['update'])
    assert config['learning_rate'] == 1e-2 and config['wandb_log'] is True
    for event in read_log(out):
        for k, v in event.items():
            if k != 'step' and isinstance(v, (int, float)):
                assert history[event['step']][k] == pytest.approx(v, rel=1e-12), (event['step'], k)


@pytest.mark.parametrize('script', ['train.py', 'train_dpo.py', 'train_rl.py', 'train_tts.py', 'train_vocoder.py'])
def test_a_missing_wandb_is_named_before_any_work(monkeypatch, tmp_path, script):
    """wandb_log=True without the wandb package (here hidden: find_spec finds nothing, import fails): a UserError that
    names `pip install wandb` and offline mode, raised before the script makes out_dir."""
    monkeypatch.setitem(sys.modules, 'wandb', None)
    message = start_up_refusal(monkeypatch, script, f'--out_dir={tmp_path / "out"}', '--wandb_log=True')
    assert 'wandb_log=True' in message and '`pip install wandb`' in message and 'WANDB_MODE=offline' in message
    assert not (tmp_path / 'out').exists()
