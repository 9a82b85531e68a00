"""
How much a reader must read, and which way the imports point.

- The lines of each of nanotrain's own modules, and for each script the lines of the script plus every
  nanotrain module it imports, directly or through another one (a read of the source: every import, lazy too).
- The project lines plain pretraining imports: the nanotrain modules in sys.modules when a tiny
  `python train.py` run (two steps, one eval) ends, and their lines with the script's.
- The import graph of the project's own modules, in layers from top to bottom: the scripts (and the root
  modules they share: starting_model.py, loading.py); lm/, hf/, tts/, tasks/; run/; model.py, losses.py,
  scheduler.py, memory.py, configurator.py. Every import counts, those inside a function or a branch too
  (marked lazy): a lazy import is still a dependency a reader follows.
  An upward edge is a module importing one of a higher layer; a cycle is a set of modules (or of packages:
  lm <-> tasks) each reaching the others. A module's `if __name__ == '__main__':` block is its command, an
  entry point like a script: its imports are the command's (`run.sharded_checkpoint:__main__`), at the top.
`python bench/layout.py` prints all of it (Markdown); run it from any folder. tests/test_layout.py checks
the graph: no upward edge, no cycle, but for the edges it lists as still being removed.
"""

import ast
import json
import os
import subprocess
import sys
import tempfile
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ('train.py', 'train_dpo.py', 'train_rl.py', 'train_tts.py', 'sample.py', 'sample_tts.py', 'eval.py', 'data.py')
# top to bottom; a root module not named here is a script, or a module the scripts share (layer 0)
LAYERS = (('lm', 'hf', 'tts', 'tasks'), ('run',), ('model', 'losses', 'scheduler', 'memory', 'configurator'))
LAYER_NAMES = ('scripts, starting_model, loading', 'lm/, hf/, tts/, tasks/', 'run/',
               'model, losses, scheduler, memory, configurator')
# a tiny pretraining run: what `python train.py` imports, in seconds
TINY_PRETRAINING = ['--max_iters=2', '--eval_iters=1', '--eval_interval=2', '--log_interval=1', '--sample_tokens=0',
                    '--tensorboard=False', '--compile=False', '--device=cpu', '--n_layer=1', '--n_head=2',
                    '--n_embd=32', '--block_size=32', '--batch_size=2']


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


# -- what plain pretraining imports ---------------------------------------------------------------------------

def runtime_modules(script, args, modules):
    """The nanotrain modules loaded when `python script *args`, run from the repository root, ends (as
    tests/imports.py writes them down)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, 'imports.json')
        p = subprocess.run([sys.executable, os.path.join('tests', 'imports.py'), out, script, *args], cwd=ROOT,
                           capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        if p.returncode or not os.path.exists(out):
            raise RuntimeError(f"{script} {' '.join(args)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        with open(out) as f:
            return sorted(set(json.load(f)) & set(modules) - {script[:-3]})


# -- the import graph -----------------------------------------------------------------------------------------

class Edge(NamedTuple):
    source: str  # the importing module (`name:__main__` for its command block)
    target: str
    lazy: bool  # inside a function or a branch
    line: int


def layer(name):
    """0 for the scripts (and a module's command block), then 1, 2, 3 down LAYERS."""
    top = name.split(':')[0].split('.')[0]
    if name.endswith(':__main__'):
        return 0
    return next((i + 1 for i, tops in enumerate(LAYERS) if top in tops), 0)


def is_main_block(node):
    return isinstance(node, ast.If) and ast.unparse(node.test).replace('"', "'") == "__name__ == '__main__'"


def import_targets(node, modules):
    """The own modules an Import or ImportFrom node names: the deepest one each name resolves to."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module and not node.level:
        names = [f'{node.module}.{alias.name}' for alias in node.names]
    else:
        return set()
    found = set()
    for name in names:
        parts = name.split('.')
        found.update(['.'.join(parts[:i]) for i in range(len(parts), 0, -1) if '.'.join(parts[:i]) in modules][:1])
    return found


def module_edges(name, path, modules):
    """The Edges of one module's imports of own modules."""
    edges = []

    def visit(node, source, lazy):
        for child in ast.iter_child_nodes(node):
            if is_main_block(child) and not lazy:
                visit(child, f'{name}:__main__', False)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                edges.extend(Edge(source, target, lazy, child.lineno) for target in import_targets(child, modules)
                             if target != name)
            else:
                inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.Try,
                                           ast.With, ast.For, ast.While, ast.Lambda))
                visit(child, source, lazy or inner)

    with open(path) as f:
        visit(ast.parse(f.read()), name, False)
    return edges


def import_edges(modules=None):
    """Every Edge of the import graph of the own modules."""
    modules = modules or own_modules()
    return [edge for name, path in sorted(modules.items()) for edge in module_edges(name, path, modules)]


def upward(edges):
    return [e for e in edges if layer(e.target) < layer(e.source)]


def package(name):
    """A module's package (lm, run, ...), or the root module itself (model, train)."""
    return name.split(':')[0].split('.')[0]


def cycles(edges, group=lambda name: name):
    """The cycles of the graph of edges with each module replaced by group(module): its strongly connected
    components of more than one node, each sorted, with the edges within it."""
    graph = {}
    for e in edges:
        source, target = group(e.source), group(e.target)
        if source != target:
            graph.setdefault(source, set()).add(target)
            graph.setdefault(target, set())
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(node):  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [(sorted(c), [e for e in edges if group(e.source) in c and group(e.target) in c
                         and group(e.source) != group(e.target)]) for c in components]


def shown(edge):
    return f"{edge.source}:{edge.line} -> {edge.target}{' (lazy)' if edge.lazy else ''}"


# -----------------------------------------------------------------------------

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

    with tempfile.TemporaryDirectory() as out_dir:
        loaded = runtime_modules('train.py', TINY_PRETRAINING + [f'--out_dir={out_dir}'], modules)
    total = line_count(os.path.join(ROOT, 'train.py')) + sum(line_count(modules[n]) for n in loaded)
    print(f"\nPlain pretraining (`python train.py {' '.join(TINY_PRETRAINING)}`) imports {len(loaded)} modules; "
          f"with train.py, {len(loaded) + 1} files, {total:,} lines:\n\n| module | lines |\n|---|---:|")
    for name in loaded:
        print(f'| {os.path.relpath(modules[name], ROOT)} | {line_count(modules[name])} |')

    edges = import_edges(modules)
    print(f"\nThe import graph: {len(edges)} imports of own modules ({sum(e.lazy for e in edges)} lazy), layers "
          f"top to bottom: {'; '.join(LAYER_NAMES)}.\n\nUpward edges (a module importing one of a higher layer):")
    for e in upward(edges) or ():
        print(f'- {shown(e)}')
    if not upward(edges):
        print('- none')
    print(f"\nModule cycles:{'' if cycles(edges) else ' none'}")
    for nodes, inside in cycles(edges):
        print(f"- {' <-> '.join(nodes)}: {'; '.join(shown(e) for e in inside)}")
    print(f"\nPackage cycles:{'' if cycles(edges, package) else ' none'}")
    for nodes, inside in cycles(edges, package):
        print(f"- {', '.join(nodes)}; the packages importing each other:")
        between = {}
        for e in inside:
            between.setdefault((package(e.source), package(e.target)), []).append(e)
        for a, b in sorted(pair for pair in between if pair < pair[::-1] and pair[::-1] in between):
            print(f"  - {a} <-> {b}: {'; '.join(shown(e) for e in between[a, b] + between[b, a])}")

if __name__ == '__main__':
    sys.exit(main())
