"""
How much a reader must read: the lines of each of nanotrain's own modules, and for each script the
lines of the script plus every nanotrain module it imports, directly or through another one.
`python bench/layout.py` prints both tables (Markdown); run it from any folder.
"""

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ('train.py', 'train_dpo.py', 'train_rl.py', 'train_tts.py', 'sample.py', 'sample_tts.py', 'eval.py', 'data.py')


def own_modules():
    """{module name: path} of the .py files at the top of the repository and in its packages."""
    modules = {}
    for folder, _, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        top = rel.split(os.sep)[0]
        if rel != '.' and (top in ('tests', 'bench', 'runs', 'config', 'data') or rel.startswith('.')):
            continue
        for name in files:
            if name.endswith('.py'):
                parts = [] if rel == '.' else rel.split(os.sep)
                stem = name[:-3]
                modules['.'.join(parts + ([] if stem == '__init__' else [stem]))] = os.path.join(folder, name)
    return modules


def line_count(path):
    with open(path) as f:
        return sum(1 for _ in f)


def imported(path, modules):
    """The nanotrain modules a file imports (a package's __init__ too, for `from tasks.x import y`)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f'{node.module}.{alias.name}' for alias in node.names)
    found = set()
    for name in names:
        parts = name.split('.')
        found.update('.'.join(parts[:i]) for i in range(1, len(parts) + 1) if '.'.join(parts[:i]) in modules)
    return found


def reader_modules(script, modules):
    """Every nanotrain module a reader of script meets, following imports."""
    seen, todo = set(), [script]
    while todo:
        path = todo.pop()
        for name in imported(path, modules):
            if name not in seen:
                seen.add(name)
                todo.append(modules[name])
    return seen


def main():
    modules = own_modules()
    print('| file | lines |\n|---|---:|')
    for name, path in sorted(modules.items(), key=lambda item: -line_count(item[1])):
        print(f'| {os.path.relpath(path, ROOT)} | {line_count(path)} |')
    print('\n| script | its lines | with the modules it imports | modules |\n|---|---:|---:|---|')
    for script in SCRIPTS:
        path = os.path.join(ROOT, script)
        names = sorted(reader_modules(path, modules) - {script[:-3]})
        total = line_count(path) + sum(line_count(modules[n]) for n in names)
        print(f"| {script} | {line_count(path)} | {total} | {', '.join(names)} |")


if __name__ == '__main__':
    sys.exit(main())
