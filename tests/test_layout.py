"""The layout a reader relies on: no lambda standing for a function, the GPT side free of the TTS side's
dependencies, imports that point down the layers without a cycle. A file's size follows its topic:
bench/layout.py reports sizes, nothing caps them."""

import ast
import glob
import importlib.util
import os
import subprocess
import sys

from conftest import ROOT, run

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
               'scheduler, lm.muon, loading, lm.eval_tasks, lm.generate, lm.metrics, lm.shared_prompts')
    code = f"import sys; import {modules}; import tasks.number_tasks, lm.heldout_eval; print('torchaudio' in sys.modules)"
    p = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert p.stdout.strip() == 'False'


def layout_tool():
    spec = importlib.util.spec_from_file_location('bench_layout', os.path.join(ROOT, 'bench', 'layout.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_imports_point_down_the_layers_without_cycles():
    """Scripts (and the root modules they share: starting_model.py, loading.py, data.py); lm/, hf/, tts/,
    tasks/; run/; model.py, losses.py, scheduler.py, memory.py, configurator.py: no module imports one of a
    higher layer, and no modules or packages import each other (lazy imports count)."""
    layout = layout_tool()
    edges = layout.import_edges()
    assert not layout.upward(edges), [layout.shown(e) for e in layout.upward(edges)]
    cycles = layout.cycles(edges) + layout.cycles(edges, layout.package)
    assert not cycles, [layout.shown(e) for _, inside in cycles for e in inside]


def test_package_commands_run_by_module_and_by_path():
    """The two commands that live in packages run as `python -m ...` and by their path alike."""
    for args in (['-m', 'tts.data', '--help'], ['tts/data.py', '--help']):
        p = run(args, check=False)
        assert p.returncode == 0 and '--text_file' in p.stdout, (args, p.stderr)
    for args in (['-m', 'run.sharded_checkpoint'], ['run/sharded_checkpoint.py']):
        p = run(args, check=False)
        assert p.returncode == 1 and 'usage: python -m run.sharded_checkpoint' in p.stderr, (args, p.stderr)
        assert 'Traceback' not in p.stderr


def configures(node):
    """Whether an assignment is `config = configure(globals(), ...)`, where a script's config keys end."""
    return ast.unparse(node.value).startswith('configure(globals()')


def config_key_rebindings(path):
    """'name:line' of each config key (a global assigned above `config = configure(globals())`) that the
    script's own top-level code binds again below it: a derived value must have a name of its own."""
    body = ast.parse(open(path).read()).body
    at = next(i for i, node in enumerate(body) if isinstance(node, ast.Assign) and configures(node))
    keys = {target.id for node in body[:at] if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)}
    found = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            # a function's own locals are not the config; `global key` would be
            found.extend(f'{name}:{node.lineno}' for inner in ast.walk(node) if isinstance(inner, ast.Global)
                         for name in inner.names if name in keys)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in keys:
            found.append(f'{node.id}:{node.lineno}')
        for child in ast.iter_child_nodes(node):
            visit(child)

    for node in body[at + 1:]:
        visit(node)
    return found


def test_config_keys_keep_the_users_values():
    """After configure, a config key holds what the user set for the whole run, in every script: the resolved
    device, a continued run's origin, a resumed micro-batch are derived names (local_device, ptdtype, ...)."""
    scripts = [path for path in glob.glob(os.path.join(ROOT, '*.py'))
               if any(isinstance(node, ast.Assign) and configures(node) for node in ast.parse(open(path).read()).body)]
    assert {'train.py', 'train_dpo.py', 'train_rl.py', 'train_tts.py', 'sample.py', 'eval.py'} <= \
        {os.path.basename(path) for path in scripts}
    for path in scripts:
        assert not config_key_rebindings(path), path
