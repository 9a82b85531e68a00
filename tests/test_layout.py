"""The layout a reader relies on: no lambda standing for a function, and the GPT side free of the TTS
side's dependencies. A file's size follows its topic: bench/layout.py reports sizes, nothing caps them."""

import ast
import glob
import os
import subprocess
import sys

from conftest import ROOT

SOURCES = sorted(glob.glob(os.path.join(ROOT, '*.py')) + glob.glob(os.path.join(ROOT, 'tasks', '*.py')))


def test_no_lambda_is_named():
    named = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
                named.append(f'{os.path.relpath(path, ROOT)}:{node.lineno}')
    assert not named, f'write a def instead: {named}'


def test_gpt_side_does_not_import_torchaudio():
    modules = 'model, lora, losses, data, tokenizer, chat_data, checkpoint, runtime, memory, scheduler, muon'
    code = f"import sys; import {modules}; import tasks.number_tasks, tasks.exact_match; print('torchaudio' in sys.modules)"
    p = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert p.stdout.strip() == 'False'
