"""The commands the documentation shows run as written: each script a documented command runs exists, every
`--key=value` it passes is a key of that script (a config global, or a flag its argparse spells out) and every
config file it names exists. A user copies these lines; a key renamed in a script and not in its docs would stop
them with an error."""

import functools
import glob
import os
import re

from conftest import ROOT, script_config_keys

DOCS = ['README.md', *sorted(glob.glob('docs/*.md', root_dir=ROOT)), 'bench/README.md', 'runs/README.md',
        'runs/RESULTS.md', *sorted(glob.glob('config/*.py', root_dir=ROOT))]
# a command: python or torchrun and what follows, up to where a shell or markdown line ends it
COMMAND = re.compile(r'(?:python3?|torchrun)\s((?:[^`|;&#\n]|#(?=\S))*)')
# what it runs: -m a module, or a script
SCRIPT = re.compile(r'(?:^|\s)(?:-m\s+([\w.]+)|([\w./-]+\.py))(?=\s|$)')
# nanoGPT's commands, quoted where we compare with it: its train.py and configs, not ours
PEER_CONFIGS = ('config/train_shakespeare_char.py',)


def commands(path):
    """(line number, command text) of each command in path; a line ending in a backslash goes on."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().split('\n')
    found, n = [], 0
    while n < len(lines):
        start, text = n + 1, lines[n]
        while text.rstrip().endswith('\\') and n + 1 < len(lines):
            n += 1
            text = text.rstrip()[:-1] + ' ' + lines[n]
        found += [(start, m.group(1)) for m in COMMAND.finditer(text)]
        n += 1
    return found


@functools.cache
def script_keys(script):
    """The keys script takes: its config keys (conftest.script_config_keys) and the flags its source spells out
    ('--key', argparse's)."""
    path = os.path.join(ROOT, script)
    with open(path) as f:
        return script_config_keys(path) | set(re.findall(r"""['"]--([\w-]+)""", f.read()))


def ours(module):
    """The file python -m module runs, if it is one of ours (tts.data); None for another's (pytest, venv, pip)."""
    path = module.replace('.', '/')
    return next((p for p in (path + '.py', path + '/__main__.py') if os.path.exists(os.path.join(ROOT, p))), None)


def problems(doc):
    """(what would fail in doc's commands, how many keys were checked)."""
    wrong, checked = [], 0
    for line, command in commands(doc):
        m = SCRIPT.search(command)
        rest = command[m.end():] if m else ''
        if not m or m.group(1) and not ours(m.group(1)) or any(c in rest for c in PEER_CONFIGS):
            continue
        script = ours(m.group(1)) if m.group(1) else m.group(2)
        if script.startswith(('../', '/')):  # a shared tool's, or a path of the reader's
            continue
        if not os.path.exists(os.path.join(ROOT, script)):
            if doc != 'runs/RESULTS.md':  # whose older measurements name the commit their commands ran at
                wrong.append(f'{doc}:{line}: {script} does not exist')
            continue
        keys = script_keys(script)
        for key in re.findall(r'(?:^|\s)--([\w-]+)(?==)', rest):
            checked += 1
            if key not in keys:
                wrong.append(f'{doc}:{line}: {script} takes no --{key}')
        wrong += [f'{doc}:{line}: {config} does not exist' for config in re.findall(r'(?:^|\s)(config/\S+\.py)', rest)
                  if not os.path.exists(os.path.join(ROOT, config))]
    return wrong, checked


def test_documented_commands_pass_only_keys_their_scripts_take():
    found = [problems(doc) for doc in DOCS]
    assert sum(checked for _, checked in found) > 200  # the patterns still find the docs' commands
    wrong = [problem for problems_, _ in found for problem in problems_]
    assert not wrong, 'documented commands that would fail:\n' + '\n'.join(wrong)


def test_a_wrong_key_a_missing_script_or_config_is_found(tmp_path):
    doc = tmp_path / 'doc.md'
    doc.write_text("```\npython train.py config/sft.py --learning_rate=1e-4 --lr=1 \\\n    --batch_size=2 --bs=2\n"
                   "python -m tts.data --text_file=a.txt --out_dir=x  # a comment --nope=1\n"
                   "python -m pytest -x --tb=short\npython gone.py --a=1\npython train.py --model_args=1\n"
                   "torchrun --nproc_per_node=8 train.py config/none.py\n```\n")
    wrong, checked = problems(str(doc))
    assert checked == 7 and [w.split(': ', 1)[1] for w in wrong] == [  # model_args: train.py's, set after configure
        'train.py takes no --lr', 'train.py takes no --bs', 'gone.py does not exist', 'train.py takes no --model_args',
        'config/none.py does not exist']
    assert wrong[0].startswith(f'{doc}:2: ') and wrong[-1].startswith(f'{doc}:8: ')


def test_keys_the_docs_name_in_prose_exist():
    """A `--key=value` in a sentence ('--lora_dropout=0 saves it') names no script, but some script takes it."""
    scripts = [p for folder in ('.', 'bench', 'runs') for p in glob.glob(f'{folder}/*.py', root_dir=ROOT)]
    keys = set().union(*(script_keys(p) for p in scripts + ['tts/data.py']))
    keys |= {'key', 'nnodes', 'node_rank', 'master_addr', 'master_port', 'nproc_per_node'}  # a placeholder; torchrun's
    unknown = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            unknown += [f'{doc}:{n}: --{key}' for n, line in enumerate(f, 1)
                        for key in re.findall(r'(?<![\w-])--([a-z]\w*)=', line) if key not in keys]
    assert not unknown, 'keys no script takes:\n' + '\n'.join(unknown)
