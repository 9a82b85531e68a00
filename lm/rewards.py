"""
The reward of online RL (train_rl.py): the embedded number tasks' verifier, or a user's Python function
named 'path.py:name', called as name(prompt=..., completion=..., row=...) with the prompt's messages, the
completion's text and the prompt's JSONL record, returning a number (a bool, a NumPy or 0-d tensor number).
Whatever goes wrong in it (a missing file or function, a raise or an exit(), a non-number, NaN, a number beyond
float32's range) is a UserError naming the function and the row.
"""
import functools
import hashlib
import importlib.util
import math
import numbers
import os
import signal
import sys

from configurator import UserError
from tasks.number_tasks import number_task_reward


BUILT_IN = ('number_tasks', 'number_tasks_exact')


def check_rows(spec, prompts):
    """Before any rollout: a UserError naming the first of prompts ((ids, record, where) triples) without the
    string "response" that the built-in rewards check completions against (a user's reward checks its own)."""
    for _, record, where in prompts if spec in BUILT_IN else ():
        if not isinstance(record.get('response'), str):
            raise UserError(f"{where} has no \"response\" (a string: the reference answer), which reward={spec!r} "
                            f"checks each completion against. Add one to every prompt row, or score with your own "
                            f"function (--reward=path.py:name).")


def load_reward(spec, format_weight=0.0):
    """(the reward function, its name for messages) of the config key reward: 'number_tasks' (the verifier of the
    final answer, with format_weight for a well-formed answer), 'number_tasks_exact' (of the whole answer) or
    'path.py:name'."""
    if spec in BUILT_IN:
        return functools.partial(number_task_reward, format_weight=format_weight, whole=spec.endswith('exact')), spec
    path, _, name = spec.rpartition(':')
    if not path.endswith('.py') or not name:
        raise UserError(f"reward={spec!r} is neither 'number_tasks', 'number_tasks_exact' nor 'path.py:name' (a "
                        f"Python file and the name of the function in it).")
    if not os.path.isfile(path):
        raise UserError(f"reward={spec!r}: {path} does not exist. Point reward at the Python file that defines "
                        f"{name}(prompt, completion, row).")
    # imported as Python imports a module: registered in sys.modules (dataclasses and pickle look it up
    # there) and with its folder importable (a helper module beside it)
    path = os.path.abspath(path)
    module_name = f"reward_{hashlib.sha256(path.encode()).hexdigest()[:12]}_{os.path.basename(path)[:-3]}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    if os.path.dirname(path) not in sys.path:
        sys.path.append(os.path.dirname(path))
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[module_name]
        raise UserError(f"reward={spec!r}: importing {path} raised {type(e).__name__}: {e}. Fix the file.") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward={spec!r}: {path} defines no function {name!r}. Define {name}(prompt, completion, "
                        f"row) returning a number, or fix the name after the colon.")
    return fn, spec


FLOAT32_MAX = 3.4028234663852886e+38  # rewards are float32 tensors from here on


def score(fn, name, prompt, completion, row, where):
    """fn(prompt=prompt, completion=completion, row=row) as a float; where: the row's place (path:line), for
    messages. A raise (an exit() too), a non-number (bools are numbers: 0/1; NumPy numbers and 0-d arrays
    count) or a number that is not finite in float32 is a UserError."""
    try:
        value = fn(prompt=prompt, completion=completion, row=row)
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        # a Ctrl-C that the run's stop signal does not handle (before the first step) is the user's
        if isinstance(e, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            raise
        what = (f"called exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}")
        raise UserError(f"the reward function {name} {what} on the prompt of {where} (completion "
                        f"{completion[:60]!r}); a reward must return a number. Fix the function, or the "
                        f"row.") from None
    if getattr(value, 'shape', None) == () and hasattr(value, 'item'):  # numpy.bool_, 0-d arrays and tensors
        value = value.item()
    if not isinstance(value, numbers.Real) or not abs(value) <= FLOAT32_MAX:
        raise UserError(f"the reward function {name} returned {value!r} for the prompt of {where} (completion "
                        f"{completion[:60]!r}); it must return a finite number (a float or int) within float32's "
                        f"range (|r| <= 3.4e38), in which rewards are computed.")
    return float(value)
