import ast
import dataclasses
import glob
import io
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from configurator import (EMPTY_OR_FOLDER, FOLDER, POSITIVE, SEED, at_least, check_values, config_defaults,
                          configure, data_sources, dataclass_args, interval, one_of)
from conftest import ROOT, run, script_config_keys
from scheduler import SCHEDULES


@pytest.fixture(autouse=True)
def keep_excepthook(monkeypatch):
    monkeypatch.setattr(sys, 'excepthook', sys.excepthook)  # configure() installs its own; undo after each test
    monkeypatch.setattr(sys, 'stdout', sys.stdout)  # and wraps these (ClosedPipeSafe)
    monkeypatch.setattr(sys, 'stderr', sys.stderr)


def defaults():
    return {'batch_size': 64, 'learning_rate': 6e-4, 'compile': True, 'out_dir': 'out', 'device': 'auto',
            'max_tokens': None, 'betas': (0.9, 0.95), 'os': os, 'configure': configure, '_private': 1}


def config_error(argv, capsys, g=None, run=configure):
    with pytest.raises(SystemExit) as e:
        run(defaults() if g is None else g, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith('config error: ') and err.count('\n') == 1  # one paragraph
    return err


def test_keys_are_plain_values_only():
    g = defaults()
    config = configure(g, [])
    assert set(config) == {'batch_size', 'learning_rate', 'compile', 'out_dir', 'device', 'max_tokens', 'betas'}


def test_upper_case_constants_are_not_keys():
    config = configure(dict(defaults(), SCHEDULES=('cosine',), DATA_DIR='data', RULE=(print, 'positive')), [])
    assert set(config) == set(configure(defaults(), []))


def script_config(path):
    """A script's config keys ({key: default}: config_defaults of its globals where it calls configure, its top
    run in this process: imports, keys, the docstring) and the names its own assignments there bind."""
    body = ast.parse(open(path).read()).body
    at = next(i for i, node in enumerate(body)
              if isinstance(node, ast.Assign) and ast.unparse(node.value).startswith('configure(globals()'))
    namespace = {'__name__': '__config__', '__file__': str(path)}
    sys.path.insert(0, os.path.dirname(str(path)))  # as `python path` imports a module beside it
    try:
        exec(compile(ast.Module(body=body[:at], type_ignores=[]), str(path), 'exec'), namespace)
    finally:
        sys.path.remove(os.path.dirname(str(path)))
    own = {target.id for node in body[:at] if isinstance(node, (ast.Assign, ast.AnnAssign))
           for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(target, ast.Name)}
    return config_defaults(namespace), own


def config_problems(path):
    """Each config key of a script that a checkpoint cannot hold as the script's own plain value: one the script
    does not assign (an imported name of a plain value), or one whose value torch.load(weights_only=True) does
    not read back as saved (a function inside a tuple, list or dict)."""
    keys, own = script_config(path)
    problems = [f'{key}: imported, not assigned by the script' for key in keys if key not in own]
    for key, value in keys.items():
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
            buffer.seek(0)
            read_back = torch.load(buffer, weights_only=True)
        except Exception as e:
            read_back = e
        if type(read_back) is not type(value) or read_back != value:
            problems.append(f'{key}: {value!r} is read back as {read_back!r}')
    return problems


def test_a_config_holding_a_function_or_an_imported_constant_is_found(tmp_path):
    path = tmp_path / 'script.py'
    path.write_text("from math import pi\nfrom configurator import configure, at_least\nimport os\n"
                    "batch_size = 64\nrules = [(at_least(1), ('batch_size',))]\nbetas = (0.9, 0.95)\n"
                    "config = configure(globals())\n")
    problems = config_problems(path)
    assert len(problems) == 2 and problems[0].startswith('pi: imported') and problems[1].startswith('rules: ')


def test_scripts_configs_hold_only_plain_values():
    """A checkpoint stores its script's config and is read with weights_only=True: no functions, no imported
    constants, in every script with config keys."""
    scripts = [path for pattern in ('*.py', 'bench/*.py', 'runs/*.py')
               for path in glob.glob(os.path.join(ROOT, pattern))
               if re.search(r'^config = configure\(globals\(\)', open(path).read(), re.M)]
    names = {os.path.relpath(path, ROOT) for path in scripts}
    assert {'train.py', 'train_dpo.py', 'train_rl.py', 'train_tts.py', 'train_vocoder.py', 'sample.py',
            'sample_tts.py', 'eval.py', 'bench/bench_gpt.py'} <= names, names
    problems = {os.path.relpath(path, ROOT): config_problems(path) for path in scripts}
    assert not any(problems.values()), problems


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


def with_sources(g, argv):
    return configure(g, argv, sources=('data',))


def test_a_sources_key_takes_one_folder_or_named_sources(tmp_path, capsys):
    """A key configure() is told takes sources (train.py's sft_data): a folder as before, or {name: (folder,
    weight)} on the command line (a dict literal) or in a config file; checked, naming the key (and the line)."""
    def sources(argv):
        g = dict(defaults(), data='')
        configure(g, argv, sources=('data',))
        return data_sources(g['data'])
    assert sources([]) == [(None, '', 1.0)] and sources(['--data=data/mine']) == [(None, 'data/mine', 1.0)]
    assert sources(['--data=2024']) == [(None, '2024', 1.0)]  # a string, as for any string key
    assert sources(["--data={'math': ('data/math', 1), 'chat': 'data/chat', 'held': ('data/h', 0.0)}"]) == [
        ('math', 'data/math', 1.0), ('chat', 'data/chat', 1.0), ('held', 'data/h', 0.0)]
    path = tmp_path / 'mix.py'
    path.write_text("batch_size = 8\ndata = {'a': ('x', 0.5),\n        'b': ('y', 2.0)}\n")
    assert sources([str(path)]) == [('a', 'x', 0.5), ('b', 'y', 2.0)]
    for value, says in [("{'a': ('x', -1.0)}", "data['a'] = ('x', -1.0) must be (folder, weight)"),
                        ("{'a': ('x', True)}", 'finite weight >= 0'), ("{'a': ('x', 1.0, 2)}", 'must be (folder'),
                        ("{'a b': 'x'}", "source name 'a b'"), ("{'a': ('x', 0)}", 'every weight is 0'),
                        ('{}', 'named sources'),
                        # not a folder's name: a list, a tuple, a dict that is not a literal (was a folder "['x']")
                        ("['x']", 'data must be a folder (a string)'), ("('x', 1.0)", 'data must be a folder'),
                        ("{'a': ('x', float('nan'))}", "is not a Python literal (numbers and strings only")]:
        assert says in config_error([f'--data={value}'], capsys, g=dict(defaults(), data=''), run=with_sources)
    for value, says in [("{'a': ('x', float('nan'))}", 'finite weight'), ("['x']", 'data must be a folder (a string)')]:
        path.write_text(f"data = {value}\n")
        err = config_error([str(path)], capsys, g=dict(defaults(), data=''), run=with_sources)
        assert f'{path} line 1' in err and says in err, err
    g = dict(defaults(), data='')
    configure(g, ["--out_dir={'a': ('x', 1.0)}"], sources=('data',))
    assert g['out_dir'] == "{'a': ('x', 1.0)}"  # another string key keeps the text, as before


def test_malformed_argument(capsys):
    assert "'--batch_size'" in config_error(['--batch_size'], capsys)
    assert "'-x'" in config_error(['-x'], capsys)
    # bytes that are not UTF-8 reach sys.argv as lone surrogates (a traceback where a tokenizer or print met them)
    assert "--out_dir: its value is not UTF-8 text (bytes b'o\\xff')" in config_error([os.fsdecode(b'--out_dir=o\xff')],
                                                                                       capsys)


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
    for call, said in (('exit(0)', 'exit(0)'), ('import sys; sys.exit()', 'exit()')):  # was a silent exit 0, no run
        path.write_text(f"batch_size = 8\n{call}\n")
        err = config_error([str(path)], capsys)
        assert f'{path} line 2: SystemExit: it calls {said}, and a config file only sets keys' in err


def test_missing_config_file(tmp_path, capsys):
    """A missing file, a folder, a file not in UTF-8: each a config error naming it (the last was a traceback)."""
    err = config_error(['config/does_not_exist.py'], capsys)
    assert "'config/does_not_exist.py'" in err and 'not found' in err
    err = config_error([str(tmp_path)], capsys)
    assert f"config file {str(tmp_path)!r} is a folder" in err
    (tmp_path / 'latin1.py').write_bytes('out_dir = "caf\xe9"\n'.encode('latin-1'))
    err = config_error([str(tmp_path / 'latin1.py')], capsys)
    assert 'latin1.py' in err and "can't decode byte 0xe9" in err and 'Python source in UTF-8' in err


def test_shakespeare_config_fits_train_py():
    # train.py's own defaults (its top-level literal assignments), so keys and types are the real ones
    with open(os.path.join(ROOT, 'train.py')) as f:
        tree = ast.parse(f.read())
    train_globals = {node.targets[0].id: node.value.value for node in tree.body
                     if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    configure(train_globals, [os.path.join(ROOT, 'config', 'shakespeare_char.py')])
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
    env = {**os.environ, 'PYTHONPATH': ROOT}
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
    env = {**os.environ, 'PYTHONPATH': ROOT}
    p = subprocess.Popen([sys.executable, str(path), '--help'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=ROOT)
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


@pytest.mark.parametrize('script', ['train.py', 'sample.py', 'eval.py'])
def test_real_script_help_into_closed_pipe_exits_quietly(script):
    status, err = help_with_closed_pipe(os.path.join(ROOT, script))
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



# -- value checks: each script names its own keys, configurator.py none -----------------------------------------

def configure_and_check(g, argv):
    """configure, then the value checks, as a script does."""
    config = configure(g, argv)
    check_values(config, [(at_least(1), ('batch_size',)), (at_least(0), ('learning_rate',)),
                          (interval('[0, 1)'), ('dropout',)), (one_of(SCHEDULES), ('lr_schedule',)),
                          (FOLDER, ('out_dir',))])
    return config


@pytest.mark.parametrize('arg, message', [('--batch_size=0', 'batch_size=0 must be at least 1'),
                                          ('--learning_rate=-1', 'learning_rate=-1.0 must be at least 0'),
                                          ('--learning_rate=1e400', 'learning_rate=inf: must be a finite number'),
                                          ('--dropout=1.5', 'dropout=1.5 must be in [0, 1)'),
                                          ('--lr_schedule=cosin', "lr_schedule='cosin' must be one of cosine"),
                                          ('--out_dir=', "out_dir='' must be a folder"),
                                          (f'--out_dir={__file__}', 'no part of it an existing file'),
                                          (f'--out_dir={__file__}/run', 'no part of it an existing file')])
def test_meaningless_values_are_errors(arg, message, capsys):
    """A script's check_values call, right after configure, refuses meaningless values at start-up (config files
    too); every float must be finite in any script."""
    g = lambda: dict(defaults(), dropout=0.0, lr_schedule='cosine')
    assert message in config_error([arg], capsys, g(), run=configure_and_check)
    config = configure_and_check(g(), ['--batch_size=1', '--learning_rate=0', '--dropout=0.0', '--lr_schedule=wsd'])
    assert config['batch_size'] == 1 and config['lr_schedule'] == 'wsd'


def test_rules():
    for notation, inside, outside in [('[0, 1)', (0, 0.5), (-0.1, 1)), ('(0, 1)', (1e-9, 0.999), (0, 1)),
                                      ('[0, 1]', (0, 1), (-1e-9, 1.5))]:
        test, what = interval(notation)
        assert what == f'in {notation}' and all(map(test, inside)) and not any(map(test, outside))
    assert at_least(1)[0](1) and not at_least(1)[0](0) and at_least(0)[1] == 'at least 0'
    assert POSITIVE[0](1e-9) and not POSITIVE[0](0)
    assert one_of(('a', 'b'))[1] == 'one of a, b' and one_of(('a', 'b'))[0]('b') and not one_of(('a', 'b'))[0]('c')
    assert FOLDER[0]('runs/x') and not FOLDER[0]('') and not FOLDER[0](__file__)
    assert EMPTY_OR_FOLDER[0]('') and EMPTY_OR_FOLDER[0]('runs/x') and not EMPTY_OR_FOLDER[0](f'{__file__}/x')
    for seed in (-2 ** 63 - 1, -2 ** 63, -1, 0, 2 ** 64 - 1, 2 ** 64):  # SEED takes what torch takes
        try:
            torch.Generator().manual_seed(seed)
            takes = True
        except (ValueError, RuntimeError):
            takes = False
        assert SEED[0](seed) == takes and takes == (-2 ** 63 <= seed < 2 ** 64)


def test_check_values_names_key_value_and_rule(capsys):
    check_values({'top_p': 1.0, 'beta': 0.1}, [(interval('[0, 1]'), ('top_p',)), (POSITIVE, ('beta',))])
    with pytest.raises(SystemExit) as e:
        check_values({'top_p': 1.0, 'beta': -1.0}, [(interval('[0, 1]'), ('top_p',)), (POSITIVE, ('beta',))])
    assert e.value.code == 2 and capsys.readouterr().err == 'config error: beta=-1.0 must be positive.\n'
    with pytest.raises(KeyError):  # a rule for a key the script does not have is a bug in the script
        check_values({'beta': 0.1}, [(POSITIVE, ('beta', 'bta'))])


def test_dataclass_args_takes_given_then_config_in_field_order():
    @dataclasses.dataclass
    class Shape:
        width: int = 1
        depth: int = 2
        theta: float = 3.0  # no config key: left out, keeps its default
        vocab: int = 4

    config = {'depth': 5, 'width': 6, 'batch_size': 7}
    args = dataclass_args(Shape, config, vocab=8, width=9)
    assert list(args.items()) == [('width', 9), ('depth', 5), ('vocab', 8)]
    assert Shape(**args) == Shape(9, 5, 3.0, 8)


CONFIGURED_SCRIPTS = ['train.py', 'train_dpo.py', 'train_tts.py', 'sample.py', 'sample_tts.py', 'eval.py'] + sorted(
    os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, 'bench', '*.py')) + glob.glob(
        os.path.join(ROOT, 'runs', '*.py')) if 'configure(globals())' in open(path, encoding='utf-8').read())


def test_configurator_names_no_script_key():
    keys = set().union(*(script_config_keys(os.path.join(ROOT, script)) for script in CONFIGURED_SCRIPTS))
    assert {'batch_size', 'lr_schedule', 'top_p', 'cfg_drop', 'beta'} <= keys
    with open(os.path.join(ROOT, 'configurator.py'), encoding='utf-8') as f:
        tree = ast.parse(f.read())
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    # out_dir: the default key of require_writable_folder, which run/checkpoint.py and data.py call without one
    assert strings & keys <= {'out_dir'}
    imported = ({alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
                | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)})
    assert 'scheduler' not in imported


@pytest.mark.parametrize('script', CONFIGURED_SCRIPTS)
def test_scripts_check_only_their_own_keys(script):
    path = os.path.join(ROOT, script)
    with open(path, encoding='utf-8') as f:
        calls = [node for node in ast.walk(ast.parse(f.read()))
                 if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'check_values']
    checked = [key for call in calls for rule in call.args[1].elts for key in ast.literal_eval(rule.elts[1])]
    assert set(checked) <= script_config_keys(path) and len(checked) == len(set(checked))


@pytest.mark.parametrize('script, arg, message', [
    ('train.py', '--batch_size=0', 'batch_size=0 must be at least 1.'),
    ('train.py', '--learning_rate=-1', 'learning_rate=-1.0 must be at least 0.'),
    ('train.py', '--lr_schedule=cosin', "lr_schedule='cosin' must be one of cosine, cosine_restarts"),
    ('train_dpo.py', '--beta=-1', 'beta=-1.0 must be positive.'),
    ('train_dpo.py', '--out_dir=', "out_dir='' must be a folder path"),
    ('train_tts.py', '--cfg_drop=1.5', 'cfg_drop=1.5 must be in [0, 1).'),
    ('train_tts.py', '--val_fraction=0', 'val_fraction=0.0 must be in (0, 1).'),
    ('train_tts.py', f'--cache_dir={__file__}', f"cache_dir={__file__!r} must be '' or a folder path"),
    ('sample.py', '--top_p=2', 'top_p=2.0 must be in [0, 1].'),
    ('train.py', f'--seed={2 ** 64}', f'seed={2 ** 64} must be a seed torch takes'),
    ('sample_tts.py', f'--seed={-2 ** 63 - 1}', f'seed={-2 ** 63 - 1} must be a seed torch takes'),
    ('sample_tts.py', '-x', "overrides are written --key=value (e.g. --out_dir='out-tts')"),  # its own key
    ('bench/bench_gpt.py', '--n_head=0', 'n_head=0 must be at least 1.')])
def test_scripts_refuse_meaningless_values_at_start_up(script, arg, message):
    r = run([script, arg], check=False, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith('config error: ') and message in r.stderr, r.stderr
