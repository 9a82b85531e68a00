"""
The reward of online RL (train_rl.py): the embedded number tasks' verifier, or a user's Python function
named 'path.py:name', called as name(prompt=..., completion=..., row=...) with the prompt's messages, the
completion's text and the prompt's JSONL record, returning a number. Whatever goes wrong in it (a missing
file or function, a raise, a non-number, NaN) is a UserError naming the function and the row.
"""
import functools
import importlib.util
import math
import numbers
import os

from configurator import UserError
from tasks.number_tasks import number_task_reward


def load_reward(spec, format_weight=0.0):
    """(the reward function, its name for messages) of the config key reward: 'number_tasks' (the verifier of the
    final answer, with format_weight for a well-formed answer), 'number_tasks_exact' (of the whole answer) or
    'path.py:name'."""
    if spec in ('number_tasks', 'number_tasks_exact'):
        return functools.partial(number_task_reward, format_weight=format_weight, whole=spec.endswith('exact')), spec
    path, _, name = spec.rpartition(':')
    if not path.endswith('.py') or not name:
        raise UserError(f"reward={spec!r} is neither 'number_tasks', 'number_tasks_exact' nor 'path.py:name' (a "
                        f"Python file and the name of the function in it).")
    if not os.path.isfile(path):
        raise UserError(f"reward={spec!r}: {path} does not exist. Point reward at the Python file that defines "
                        f"{name}(prompt, completion, row).")
    module_spec = importlib.util.spec_from_file_location(f'reward_{name}', path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(f"reward={spec!r}: importing {path} raised {type(e).__name__}: {e}. Fix the file.") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward={spec!r}: {path} defines no function {name!r}. Define {name}(prompt, completion, "
                        f"row) returning a number, or fix the name after the colon.")
    return fn, spec


def score(fn, name, prompt, completion, row, where):
    """fn(prompt=prompt, completion=completion, row=row) as a float; where: the row's place (path:line), for
    messages. A raise, a non-number (bools are numbers: 0/1) or a non-finite number is a UserError."""
    try:
        value = fn(prompt=prompt, completion=completion, row=row)
    except Exception as e:
        raise UserError(f"the reward function {name} raised {type(e).__name__}: {e} on the prompt of {where} "
                        f"(completion {completion[:60]!r}). Fix the function, or the row.") from None
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"the reward function {name} returned {value!r} for the prompt of {where} (completion "
                        f"{completion[:60]!r}); it must return a finite number (a float or int).")
    return float(value)
