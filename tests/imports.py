"""
`python tests/imports.py OUT script.py args...` runs the script as `python script.py args...` would, then writes
to OUT (JSON) the names of the nanotrain modules it imported: what a command reads (test_train.py checks that
plain pretraining reads no fine-tuning, LoRA, 4-bit, Hugging Face or tracker code).
"""

import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def own_modules():
    """The names of the loaded modules whose files are the repository's own (not tests/, nor a virtual
    environment kept in it)."""
    names = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, '__file__', None) or ''
        path = os.path.relpath(file, ROOT) if os.path.isabs(file) else '..'  # torch.ops names no real file
        top = path.split(os.sep)[0]
        if not path.startswith('..') and top != 'tests' and not top.startswith('.') and 'site-packages' not in path:
            names.append(name)
    return sorted(set(names) - {'__main__', '__mp_main__'})


if __name__ == '__main__':
    out, script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    try:
        runpy.run_path(script, run_name='__main__')
    finally:
        with open(out, 'w') as f:
            json.dump(own_modules(), f)
