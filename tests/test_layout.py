"""The layout a reader relies on: no lambda standing for a function, and the GPT side free of the TTS
side's dependencies. A file's size follows its topic: bench/layout.py reports sizes, nothing caps them."""

import ast
import glob
import os
import subprocess
import sys

from conftest import ROOT

PACKAGES = ('.', 'lm', 'hf', 'run', 'tts', 'tasks')
SOURCES = sorted(path for folder in PACKAGES for path in glob.glob(os.path.join(ROOT, folder, '*.py')))


def test_no_lambda_is_named():
    named = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
                named.append(f'{os.path.relpath(path, ROOT)}:{node.lineno}')
    assert not named, f'write a def instead: {named}'


def test_gpt_side_does_not_import_torchaudio():
    modules = ('model, lm.lora, losses, data, lm.tokenizer, lm.chat_data, run.checkpoint, run.runtime, memory, '
               'scheduler, lm.muon, lm.loading, lm.eval_tasks, lm.generate, lm.metrics, lm.shared_prompts')
    code = f"import sys; import {modules}; import tasks.number_tasks, lm.heldout_eval; print('torchaudio' in sys.modules)"
    p = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert p.stdout.strip() == 'False'


def test_package_commands_run_by_module_and_by_path():
    """The two commands that live in packages run as `python -m ...` and by their path alike."""
    for args in (['-m', 'tts.data', '--help'], ['tts/data.py', '--help']):
        p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 0 and '--text_file' in p.stdout, (args, p.stderr)
    for args in (['-m', 'run.sharded_checkpoint'], ['run/sharded_checkpoint.py']):
        p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 1 and 'usage: python -m run.sharded_checkpoint' in p.stderr, (args, p.stderr)
        assert 'Traceback' not in p.stderr


def is_configure(statement):
    """`config = configure(globals())`."""
    return isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call) \
        and getattr(statement.value.func, 'id', None) == 'configure'


def rebound_config_keys(path):
    """Config keys (the globals assigned above `configure(globals())`) that the script assigns again below it,
    as 'name:line': the config dict saved in checkpoints and the globals would disagree."""
    tree = ast.parse(open(path).read())
    keys, rebound, configured = set(), [], False
    for statement in tree.body:
        if not configured:
            configured = is_configure(statement)
            if not configured and isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                keys.update(t.id for t in targets if isinstance(t, ast.Name))
            continue
        # module-level code, and functions that declare a key global
        nodes = [statement] if not isinstance(statement, (ast.FunctionDef, ast.ClassDef)) else [
            n for n in ast.walk(statement) if isinstance(n, ast.Global) and keys & set(n.names)]
        for node in (n for top in nodes for n in ast.walk(top)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in keys:
                rebound.append(f'{node.id}:{node.lineno}')
            if isinstance(node, ast.Global):
                rebound.extend(f'{name}:{node.lineno}' for name in keys & set(node.names))
    return keys, rebound


def test_config_keys_are_never_rebound_after_configure():
    """A derived value gets its own name (start_from, local_device, ...), so `config` and the globals agree."""
    scripts = [path for path in glob.glob(os.path.join(ROOT, '*.py'))
               if any(is_configure(statement) for statement in ast.parse(open(path).read()).body)]
    assert len(scripts) >= 4
    for path in scripts:
        keys, rebound = rebound_config_keys(path)
        assert len(keys) >= 5, path
        assert not rebound, f'{os.path.basename(path)} rebinds config keys after configure: {rebound}'
