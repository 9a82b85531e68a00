import json
import math
import os
import random
import re
import shutil
import signal

import numpy as np
import pytest
import torch

from conftest import assert_user_error, run
from configurator import UserError
from run.checkpoint import check_compatible, load_checkpoint, rng_state, save_checkpoint, save_gathered, set_rng_state
from run.run_folder import run_log
from model import GPT, GPTConfig
from run.runtime import StopSignal


def test_save_load_round_trip(tmp_path):
    path = tmp_path / 'ckpt.pt'
    state = {'model': {'w': torch.randn(3, 4)}, 'iter_num': 7, 'config': {'lr': 1e-3, 'name': 'x', 'none': None}}
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert torch.equal(loaded['model']['w'], state['model']['w'])
    assert loaded['iter_num'] == 7 and loaded['config'] == state['config']
    assert os.listdir(tmp_path) == ['ckpt.pt']  # no temp files left behind


@pytest.mark.parametrize('fail_in', ['torch.save', 'os.replace'])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    path = tmp_path / 'ckpt.pt'
    save_checkpoint(path, {'iter_num': 1, 'w': torch.ones(1000)})

    def crash(obj, f, *args, **kwargs):  # write half a file, then die
        f.write(b'partial garbage' * 100)
        raise KeyboardInterrupt('killed mid-save')

    if fail_in == 'torch.save':
        monkeypatch.setattr(torch, 'save', crash)
    else:
        monkeypatch.setattr(os, 'replace', lambda *a: (_ for _ in ()).throw(OSError('disk gone')))
    expected = KeyboardInterrupt if fail_in == 'torch.save' else UserError  # a failed write is explained, not raw
    with pytest.raises(expected):
        save_checkpoint(path, {'iter_num': 2, 'w': torch.zeros(1000)})
    monkeypatch.undo()
    assert load_checkpoint(path)['iter_num'] == 1
    assert os.listdir(tmp_path) == ['ckpt.pt']


def test_load_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match='does not exist'):
        load_checkpoint(tmp_path / 'nope.pt')
    bad = tmp_path / 'bad.pt'
    bad.write_bytes(b'\x00garbage')
    with pytest.raises(UserError, match='corrupt'):
        load_checkpoint(bad)
    empty = tmp_path / 'empty.pt'
    empty.write_bytes(b'')
    with pytest.raises(UserError, match='empty or cut short'):
        load_checkpoint(empty)
    with pytest.raises(UserError, match='is a folder, not a checkpoint file'):
        load_checkpoint(tmp_path)
    # files that were never checkpoints are named, with no backup to restore: the path is wrong
    (tmp_path / 'notes.md').write_text('# my run\n')
    torch.save({'generator': {}}, tmp_path / 'old.pth.tar', _use_new_zipfile_serialization=False)
    for name, says in (('notes.md', 'is a text file, not a checkpoint'),
                       ('old.pth.tar', 'is a PyTorch file of the format before torch 1.6')):
        with pytest.raises(UserError, match=says) as e:
            load_checkpoint(tmp_path / name, fix='point --tts_ckpt at a train_tts.py checkpoint')
        assert 'backup' not in str(e.value) and str(e.value).endswith('point --tts_ckpt at a train_tts.py checkpoint.')
    hf = tmp_path / 'hf-model'  # a published model's weights: its folder is what the scripts take
    hf.mkdir()
    (hf / 'config.json').write_text('{}')
    (hf / 'model.safetensors').write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"__metadata__":{}}')
    with pytest.raises(UserError, match=f"is a safetensors file, not a checkpoint .*take its folder, {hf}"):
        load_checkpoint(hf / 'model.safetensors')
    torch.save([1, 2], tmp_path / 'list.pt')  # torch.save of something else: a list, a tensor (a cached mel)
    torch.save(torch.zeros(3), tmp_path / 'tensor.pt')
    for name, kind in (('list.pt', 'list'), ('tensor.pt', 'Tensor')):
        with pytest.raises(UserError, match=f"holds a {kind}, not a checkpoint"):
            load_checkpoint(tmp_path / name)


def test_a_language_models_checkpoint_that_lacks_a_field_is_refused_by_the_scripts_that_load_it(tmp_path):
    """sample.py, serve.py, eval.py (loading.py) and export.py read a model's fields: a checkpoint edited to lack
    one is named with the fields it lacks, exit 2, not a KeyError."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    save_checkpoint(tmp_path / 'edited.pt', dict(kind='gpt', model=model.state_dict(), config={}, data_dir='data',
                                                 tokenizer={}))
    for args in (['sample.py', f'--init_from={tmp_path / "edited.pt"}', '--device=cpu'],
                 ['export.py', str(tmp_path / 'edited.pt'), str(tmp_path / 'exported')]):
        assert_user_error(run(args, check=False), f"checkpoint {tmp_path / 'edited.pt'} lacks 'model_args', which a "
                                                  f"language model's checkpoint holds")
    assert not (tmp_path / 'exported').exists()


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    path = tmp_path / 'evil.pt'
    torch.save({'obj': object()}, path)
    with pytest.raises(UserError, match='does not load because loading them can run code') as error:
        load_checkpoint(path)
    assert 'set to `False`' not in str(error.value) and 'safe_globals' not in str(error.value)  # torch's advice to allow it


def test_rng_state_round_trip_through_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    save_checkpoint(tmp_path / 'rng.pt', {'rng': rng_state()})
    expected = (random.random(), np.random.randn(3).tolist(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_checkpoint(tmp_path / 'rng.pt')['rng'])
    got = (random.random(), np.random.randn(3).tolist(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_check_compatible_lists_every_difference():
    """Every differing field is named; the default advice is a continued run's (train.py's optimizer): set the keys
    back, or start over with another out_dir or --resume=False, never --init_from=scratch, which the run in out_dir
    ignores (it is continued whatever init_from says, so that advice was refused the same way)."""
    check_compatible({'a': 1, 'b': 2}, {'a': 1, 'b': 2}, 'model shape', 'x.pt')
    with pytest.raises(UserError) as e:
        check_compatible({'a': 1, 'b': 2, 'c': 3}, {'a': 1, 'b': 5, 'c': 4}, 'model shape', 'x.pt')
    msg = str(e.value)
    assert 'b: checkpoint has 2, config has 5' in msg and 'c: checkpoint has 3, config has 4' in msg and 'x.pt' in msg
    assert 'another --out_dir, or --resume=False' in msg and 'scratch' not in msg


def test_a_refused_run_leaves_its_out_dir_as_it_found_it(tmp_path):
    """A run refused (a UserError, through the excepthook) before it saved a checkpoint: a folder it created is
    gone, one that was there keeps only what it held (a user's *.tmp too; a killed save's temporary goes at the
    claim); a run that saved a checkpoint keeps everything."""
    import configurator
    from run.run_folder import claim_out_dir

    def refuse():
        with pytest.raises(SystemExit) as e:
            configurator._excepthook(UserError, UserError('refused'), None)
        assert e.value.code == 2

    new = tmp_path / 'new' / 'run'
    claim_out_dir(str(new))
    (new / 'log.jsonl').write_text('{}\n')
    (new / 'mel_cache').mkdir()
    refuse()
    assert not (tmp_path / 'new').exists()
    there = tmp_path / 'there'
    there.mkdir()
    (there / 'notes.tmp').write_text('a user file')
    (there / 'ckpt.pt.a1b2c3d4.tmp').write_bytes(b'half a save')
    (there / 'generator.pth.tar.q_v9hla.tmp').write_bytes(b'half a save')  # train_vocoder.py's, which stayed
    (there / 'config.json.x1y2z3.tmp').write_bytes(b'{')
    claim_out_dir(str(there))
    (there / 'tb').mkdir()
    (there / 'log.jsonl').write_text('{}\n')
    refuse()
    assert os.listdir(there) == ['notes.tmp']
    claim_out_dir(str(there))
    save_checkpoint(there / 'ckpt.pt', {'iter_num': 1})
    (there / 'log.jsonl').write_text('{}\n')
    refuse()  # stopped after its first save: a run to continue
    assert sorted(os.listdir(there)) == ['ckpt.pt', 'log.jsonl', 'notes.tmp', 'run.lock']


def test_a_new_run_replaces_only_checkpoints_of_its_own_or_on_request(tmp_path, capsys):
    """What a new run would save over in out_dir: a file nanotrain did not write (a ckpt.pt, best.pt or merged.pt
    holding no 'kind') is refused even with resume=False, and as ckpt.pt is not continued (a KeyError before);
    another run's best.pt without the ckpt.pt that continues it only with resume=False, which says what it
    replaces; this run's own (a kill between its first two saves) is replaced, saying so."""
    from run.run_folder import run_to_continue
    this = dict(script='train.py', training_type='from_scratch', init_from='scratch')
    out = tmp_path / 'out'
    out.mkdir()
    for own in ({'w': torch.zeros(2)}, torch.zeros(2)):  # someone's own weights: a dict, or no dict at all
        torch.save(own, out / 'ckpt.pt')
        for resume in (True, False):
            with pytest.raises(UserError, match=r"ckpt.pt is not a checkpoint nanotrain wrote .* never replaced"):
                run_to_continue(str(out), resume, this, eval_only=False)
    os.remove(out / 'ckpt.pt')
    torch.save(torch.zeros(2), out / 'best.pt')  # nor beside no ckpt.pt, where a corrupt one is replaced on request
    for resume in (True, False):
        with pytest.raises(UserError, match=r"best.pt is not a checkpoint nanotrain wrote .* never replaced"):
            run_to_continue(str(out), resume, this, eval_only=False)
    os.remove(out / 'best.pt')
    torch.save({'w': torch.zeros(2)}, out / 'ckpt.pt')
    os.remove(out / 'ckpt.pt')
    (out / 'log.jsonl').write_text('my own log\n')  # a new run empties a run's log, never another file
    with pytest.raises(UserError, match=r"log.jsonl is not a run's log .* never replaced"):
        run_to_continue(str(out), False, this, eval_only=False)
    (out / 'log.jsonl').write_text('{"step": 0, "val_loss": 1.0}\n')
    save_checkpoint(out / 'best.pt', {'kind': 'gpt', 'run': dict(this, init_from='/models/other.pt')})
    with pytest.raises(UserError, match=r"holds best.pt of another run \(or unreadable\) but no ckpt.pt to continue.*"
                                        r"--resume=False to start a new run there in its place"):
        run_to_continue(str(out), True, this, eval_only=False)
    capsys.readouterr()
    assert run_to_continue(str(out), False, this, eval_only=False) is None
    assert 'resume=False: a new run starts in' in capsys.readouterr().out
    assert run_to_continue(str(out), True, this, eval_only=True) is None  # eval_only saves nothing
    save_checkpoint(out / 'best.pt', {'kind': 'gpt', 'run': this, 'config': {'data_dir': 'data/a', 'n_layer': 2}})
    # another run from scratch of the same script, copied in: its settings tell it apart (it was replaced)
    with pytest.raises(UserError, match=r"holds best.pt of another run"):
        run_to_continue(str(out), True, this, eval_only=False, config={'data_dir': 'data/b', 'n_layer': 2})
    assert run_to_continue(str(out), True, this, eval_only=False, config={'data_dir': 'data/a', 'n_layer': 2}) is None
    assert 'its saves replace the best.pt there' in capsys.readouterr().out
    (out / 'merged.pt').write_text('my notes')  # unreadable as a checkpoint: replaced on request only
    with pytest.raises(UserError, match='holds merged.pt of another run'):
        run_to_continue(str(out), True, this, eval_only=False)
    # a corrupt ckpt.pt of the run there: init_from is no way out (that run is continued whatever it says)
    # with best.pt beside it, the advice to copy that over it, which continues the run
    (out / 'ckpt.pt').write_bytes(b'PK\x03\x04 cut short')
    with pytest.raises(UserError, match=re.escape(f"restore it from a backup, or copy {out / 'best.pt'} over it to "
                                                  f"continue from the best eval's step")) as e:
        run_to_continue(str(out), True, this, eval_only=False)
    assert '--init_from' not in str(e.value)
    shutil.copy(out / 'best.pt', out / 'ckpt.pt')
    (out / 'merged.pt').unlink()
    assert run_to_continue(str(out), True, this, eval_only=False)['run'] == this
    # a sharded best.pt names its own shard folders, which its next save removes: not offered; nor is no best.pt
    (out / 'ckpt.pt').write_bytes(b'PK\x03\x04 cut short')
    (out / 'best-000020.dcp').mkdir()
    for remove in (False, True):
        if remove:
            (out / 'best.pt').unlink()
        with pytest.raises(UserError, match=r"restore it from a backup, or start a new run \(another --out_dir, or "
                                            r"--resume=False to replace the run there\)"):
            run_to_continue(str(out), True, this, eval_only=False)


def test_only_the_shard_folders_a_save_wrote_are_its_own(tmp_path):
    """A sharded save removes its earlier shard folders (shard_folders), never a folder of a similar name a user
    keeps beside them (a copy of one)."""
    from run.checkpoint import shard_folders
    for name in ('ckpt-000004.dcp', 'ckpt-000004.1.dcp', 'ckpt-000004-copy.dcp', 'ckpt-old.dcp', 'best-000002.dcp'):
        (tmp_path / name).mkdir()
    assert sorted(os.path.basename(f) for f in shard_folders(str(tmp_path / 'ckpt.pt'))) == [
        'ckpt-000004.1.dcp', 'ckpt-000004.dcp']


def test_stop_signal_sets_flag_and_exit_code():
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        stop = StopSignal()
        assert stop.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM and stop.exit_code == 143
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.exit_code == 130
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])


@pytest.mark.parametrize('keep_until, kept', [(3, [1, 2, 3]), (math.inf, [1, 2, 3, 4, 5]), (-1, [])])
def test_run_log_keeps_one_history(tmp_path, keep_until, kept):
    """A continued run keeps the events up to its checkpoint's step, eval_only appends, a new run starts empty;
    a line cut short by a kill is dropped either way."""
    lines = [json.dumps({'step': s, 'train_loss': 1.0 / s}) for s in range(1, 6)] + ['{"step": 6, "train_lo']
    (tmp_path / 'log.jsonl').write_text('\n'.join(lines))
    record, writer = run_log(str(tmp_path), True, False, keep_until)
    record({'step': 9, 'val_loss': 0.5})
    with open(tmp_path / 'log.jsonl') as f:
        assert [json.loads(line)['step'] for line in f] == kept + [9]
    assert writer is None and run_log(str(tmp_path), False, False, 0)[1] is None


@pytest.mark.slow
def test_advice_names_keys_the_script_has(tmp_path):
    """A corrupt checkpoint given to export.py, sample_tts.py or eval.py, and train_rl.py / train_dpo.py told to
    resume a run that is not there: the advice names what that script can do (none of them starts from
    'scratch'; only the training scripts have --resume)."""
    bad = tmp_path / 'run' / 'ckpt.pt'
    os.makedirs(bad.parent)
    bad.write_bytes(b'\x00garbage')
    for args, says in [(['export.py', str(bad), str(tmp_path / 'hf')], 'export another checkpoint'),
                       (['sample_tts.py', f'--out_dir={bad.parent}', '--device=cpu'], 'speak with another checkpoint'),
                       (['eval.py', f'--init_from={bad}', '--device=cpu'], 'point --init_from (or --out_dir')]:
        p = run(args, check=False)
        assert_user_error(p, 'is corrupt', says)
        assert '--resume' not in p.stderr, args
    for script in ('train_rl.py', 'train_dpo.py'):
        p = run([script, '--init_from=resume', f'--out_dir={tmp_path / "none"}', '--device=cpu'], check=False)
        assert_user_error(p, "there is none", 'set --init_from to the model it starts from')
        assert 'scratch' not in p.stderr, script


def test_a_fine_tune_of_another_shape_is_told_to_match_it():
    """An SFT whose config's shape differs from its starting model's: set the keys or pick another model, not
    --init_from=scratch (which would not fine-tune anything)."""
    from starting_model import check_starting_model

    class Tokenizer:
        def identity(self):
            return {'vocab_size': 10, 'hash': 'h'}
    ckpt = dict(config={'training_type': 'from_scratch'}, tokenizer=Tokenizer().identity(),
                model_args=dict(n_layer=6, vocab_size=10))
    with pytest.raises(UserError, match=r"n_layer: checkpoint has 6, config has 4\). Set these keys") as e:
        check_starting_model(ckpt, 'out/ckpt.pt', dict(n_layer=4), Tokenizer(), base_tokenizer=Tokenizer())
    assert 'scratch' not in str(e.value) and 'point --init_from at a model' in str(e.value)
    # the checkpoint of the run being continued: init_from is not read, so only a new run changes the shape
    with pytest.raises(UserError, match=r"n_layer: checkpoint has 6, config has 4\). Set these keys") as e:
        check_starting_model(ckpt, 'out/ckpt.pt', dict(n_layer=4), Tokenizer(), Tokenizer(), resuming=True)
    assert '--init_from' not in str(e.value) and 'another --out_dir, or --resume=False' in str(e.value)


def test_save_gathered_writes_what_torch_save_would_with_valid_checksums(tmp_path):
    """One process saves through FSDP's gap-filling writer: the file loads as the state, and every record's CRC-32
    checks (zipfile.testzip), an empty tensor's too (a packed run's pending rows: its record has no data descriptor,
    which the writer once refused)."""
    state = {'w': torch.randn(5, 3), 'h': torch.arange(7).bfloat16(), 'pending': torch.empty(0, 1, dtype=torch.long),
             'step': 4, 'nested': [torch.ones(2, 2, dtype=torch.int8), torch.empty(0)]}
    path = str(tmp_path / 'ckpt.pt')
    save_gathered(path, state, master=True)
    import zipfile
    assert zipfile.ZipFile(path).testzip() is None
    back = torch.load(path, weights_only=True)
    assert back['step'] == 4 and back['pending'].shape == (0, 1) and back['nested'][1].shape == (0,)
    for a, b in [(back['w'], state['w']), (back['h'], state['h']), (back['nested'][0], state['nested'][0])]:
        assert a.dtype == b.dtype and torch.equal(a, b)
