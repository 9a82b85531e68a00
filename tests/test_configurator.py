import ast
import os
import subprocess
import sys
import textwrap

import pytest

from configurator import configure

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def keep_excepthook(monkeypatch):
    monkeypatch.setattr(sys, 'excepthook', sys.excepthook)  # configure() installs its own; undo after each test


def defaults():
    return {'batch_size': 64, 'learning_rate': 6e-4, 'compile': True, 'out_dir': 'out', 'device': 'auto',
            'max_tokens': None, 'betas': (0.9, 0.95), 'os': os, 'configure': configure, '_private': 1}


def config_error(argv, capsys, g=None):
    with pytest.raises(SystemExit) as e:
        configure(defaults() if g is None else g, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith('config error: ') and err.count('\n') == 1  # one paragraph
    return err


def test_keys_are_plain_values_only():
    g = defaults()
    config = configure(g, [])
    assert set(config) == {'batch_size', 'learning_rate', 'compile', 'out_dir', 'device', 'max_tokens', 'betas'}


def test_override_updates_globals_and_returns_config(capsys):
    g = defaults()
    config = configure(g, ['--batch_size=32', '--compile=False', "--out_dir='runs/a'"])
    assert g['batch_size'] == 32 and g['compile'] is False and g['out_dir'] == 'runs/a'
    assert config['batch_size'] == 32
    assert 'overriding batch_size = 32' in capsys.readouterr().out


def test_unknown_key_names_close_match(capsys):
    err = config_error(['--batch_sise=3'], capsys)
    assert "'batch_sise'" in err and "'batch_size'" in err
    assert "'learning_rate'" in config_error(['--learning_rat=1'], capsys)


@pytest.mark.parametrize('arg, key', [('--batch_size=abc', 'batch_size'), ("--learning_rate='x'", 'learning_rate'),
                                      ('--compile=1', 'compile'), ('--batch_size=2.5', 'batch_size'),
                                      ('--batch_size=True', 'batch_size'), ('--betas=0.9', 'betas')])
def test_wrong_type_is_an_error(arg, key, capsys):
    err = config_error([arg], capsys)
    assert f'--{key}=' in err and 'e.g.' in err


def test_int_accepted_for_float():
    g = defaults()
    configure(g, ['--learning_rate=1'])
    assert g['learning_rate'] == 1.0 and type(g['learning_rate']) is float


def test_none_default_accepts_anything():
    g = defaults()
    configure(g, ['--max_tokens=5'])
    assert g['max_tokens'] == 5
    g = defaults()
    configure(g, ['--max_tokens=abc'])  # not a literal: kept as the string
    assert g['max_tokens'] == 'abc'


def test_types_checked_against_script_defaults(tmp_path):
    path = tmp_path / 'c.py'
    path.write_text("max_tokens = 5\n")
    g = defaults()
    configure(g, [str(path), '--max_tokens=abc'])
    assert g['max_tokens'] == 'abc'


def test_str_default_falls_back_to_raw_string():
    g = defaults()
    configure(g, ['--device=cuda:0', '--out_dir=2024'])
    assert g['device'] == 'cuda:0' and g['out_dir'] == '2024'


def test_list_accepted_for_tuple():
    g = defaults()
    configure(g, ['--betas=[0.8, 0.99]'])
    assert g['betas'] == (0.8, 0.99)


def test_malformed_argument(capsys):
    assert "'--batch_size'" in config_error(['--batch_size'], capsys)
    assert "'-x'" in config_error(['-x'], capsys)


def test_config_file_then_overrides(tmp_path):
    path = tmp_path / 'small.py'
    path.write_text("import math\nbatch_size = 8\nlearning_rate = 1  # int for a float key\n"
                    "_helper = 3\nmax_tokens = math.floor(2.5)\n")
    g = defaults()
    configure(g, [str(path), '--batch_size=4'])
    assert g['batch_size'] == 4  # command line comes after the file
    assert g['learning_rate'] == 1.0 and type(g['learning_rate']) is float
    assert g['max_tokens'] == 2


def test_unknown_key_in_config_file_names_file_and_line(tmp_path, capsys):
    path = tmp_path / 'bad.py'
    path.write_text("batch_size = 8\n\nn_layers = 3\n")
    err = config_error([str(path)], capsys, g={**defaults(), 'n_layer': 4})
    assert f'{path} line 3' in err and "'n_layers'" in err and "'n_layer'" in err


def test_wrong_type_in_config_file(tmp_path, capsys):
    path = tmp_path / 'bad.py'
    path.write_text("compile = 0\n")
    err = config_error([str(path)], capsys)
    assert f'{path} line 1' in err and 'compile must be a bool' in err


def test_broken_config_file(tmp_path, capsys):
    path = tmp_path / 'broken.py'
    path.write_text("batch_size = 8\nlearning_rate = undefined_name\n")
    err = config_error([str(path)], capsys)
    assert f'{path} line 2' in err and 'NameError' in err


def test_missing_config_file(capsys):
    err = config_error(['config/does_not_exist.py'], capsys)
    assert "'config/does_not_exist.py'" in err and 'not found' in err


def test_shakespeare_config_fits_train_py():
    # train.py's own defaults (its top-level literal assignments), so keys and types are the real ones
    with open(os.path.join(REPO, 'train.py')) as f:
        tree = ast.parse(f.read())
    train_globals = {node.targets[0].id: node.value.value for node in tree.body
                     if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    configure(train_globals, [os.path.join(REPO, 'config', 'shakespeare_char.py')])
    assert train_globals['data_dir'] == 'data/shakespeare_char'
    assert (train_globals['n_layer'], train_globals['n_embd'], train_globals['block_size']) == (6, 384, 256)


# -- as a script: exit codes, --help, the UserError excepthook ------------------------------------

SCRIPT = '''
"""A tiny training script."""
from configurator import configure, UserError
batch_size = 64  # sequences per micro-batch
learning_rate = 6e-4 # peak learning rate
out_dir = 'out'  # where '#' checkpoints go
configure(globals())
if out_dir == 'fail':
    raise UserError("data/x.jsonl line 3: missing field 'text'. Add it.")
if out_dir == 'crash':
    raise ValueError('a bug')
print('ran', batch_size)
'''


def run_script(tmp_path, *args):
    path = tmp_path / 'script.py'
    path.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, 'PYTHONPATH': REPO}
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, env=env)


def test_script_help(tmp_path):
    r = run_script(tmp_path, '--help')
    assert r.returncode == 0 and 'ran' not in r.stdout
    assert 'A tiny training script.' in r.stdout
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip().startswith('--')}
    assert '64' in lines['--batch_size'] and 'sequences per micro-batch' in lines['--batch_size']
    assert '0.0006' in lines['--learning_rate'] and 'peak learning rate' in lines['--learning_rate']
    assert "where '#' checkpoints go" in lines['--out_dir']


def help_with_closed_pipe(path):
    """Run `python path --help`, read 100 bytes of its output, close the pipe (like `| head -c 100`);
    return (exit status, stderr)."""
    env = {**os.environ, 'PYTHONPATH': REPO}
    p = subprocess.Popen([sys.executable, str(path), '--help'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=REPO)
    assert len(p.stdout.read(100)) == 100
    p.stdout.close()
    err = p.stderr.read().decode()
    return p.wait(timeout=120), err


def test_help_into_closed_pipe_exits_quietly(tmp_path):
    # 2000 keys make ~200 KB of help, more than a pipe holds, so the script must still be writing when the
    # reader closes: deterministic, unlike a real script whose help may fit in the pipe
    path = tmp_path / 'many_keys.py'
    path.write_text('from configurator import configure\n'
                    + ''.join(f"key_{i} = {i}  # {'a comment ' * 8}\n" for i in range(2000))
                    + 'configure(globals())\n')
    status, err = help_with_closed_pipe(path)
    assert (status, err) == (0, '')


@pytest.mark.parametrize('script', ['train.py', 'sample.py'])
def test_real_script_help_into_closed_pipe_exits_quietly(script):
    status, err = help_with_closed_pipe(os.path.join(REPO, script))
    assert 'Traceback' not in err and 'BrokenPipeError' not in err and status == 0


def test_script_bad_input_exits_2_without_traceback(tmp_path):
    for args in (['--batch_sze=1'], ['--batch_size=abc'], ['missing.py']):
        r = run_script(tmp_path, *args)
        assert r.returncode == 2 and 'Traceback' not in r.stderr and r.stderr.startswith('config error:')
    r = run_script(tmp_path, '--batch_size=3')
    assert r.returncode == 0 and 'ran 3' in r.stdout


def test_user_error_prints_one_paragraph_and_exits_nonzero(tmp_path):
    r = run_script(tmp_path, '--out_dir=fail')
    assert r.returncode == 2
    assert r.stderr == "error: data/x.jsonl line 3: missing field 'text'. Add it.\n"


def test_other_exceptions_keep_their_traceback(tmp_path):
    r = run_script(tmp_path, '--out_dir=crash')
    assert r.returncode == 1 and 'Traceback' in r.stderr and 'ValueError: a bug' in r.stderr



@pytest.mark.parametrize('arg, message', [('--batch_size=0', 'batch_size=0 must be at least 1'),
                                          ('--learning_rate=-1', 'learning_rate=-1.0 must be at least 0'),
                                          ('--learning_rate=1e400', 'learning_rate=inf: must be a finite number'),
                                          ('--dropout=1.5', 'dropout=1.5 must be in [0, 1)'),
                                          ('--lr_schedule=cosin', "lr_schedule='cosin' must be one of cosine"),
                                          ('--out_dir=', "out_dir='' must be a folder"),
                                          (f'--out_dir={__file__}', 'no part of it an existing file'),
                                          (f'--out_dir={__file__}/run', 'no part of it an existing file')])
def test_meaningless_values_are_errors(arg, message, capsys):
    """Shared keys are range-checked at start-up (config files too), whatever script they belong to."""
    g = lambda: dict(defaults(), dropout=0.0, lr_schedule='cosine')
    assert message in config_error([arg], capsys, g())
    config = configure(g(), ['--batch_size=1', '--learning_rate=0', '--dropout=0.0', '--lr_schedule=wsd'])
    assert config['batch_size'] == 1 and config['lr_schedule'] == 'wsd'
