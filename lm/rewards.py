"""
The rewards of online RL (train_rl.py), as TRL's GRPOTrainer combines them: the config key reward names one or
more functions, comma-separated, each the embedded number tasks' verifier ('number_tasks', 'number_tasks_exact':
number_task_reward, which compares answers as lm/metrics.py's exact_match does), the tool-call checker
('tool_calls': tool_call_reward, as lm/metrics.py's tool_calls compares calls) or a user's 'path.py:name'; a
completion's reward is their sum weighted by reward_weights (TRL's nansum).

A user's function is called once per completion as name(prompt=..., completion=..., row=...) with the prompt's
messages, the completion's text and the prompt's JSONL record; one whose attribute `batched` is true (for a
reward that runs a model or a program) once per batch of rollouts as name(prompts=[...], completions=[...],
rows=[...]), returning a list of as many values, and, as TRL calls its reward functions, with each other field of
the records as a list (solution=[...]) that it takes by name or through **kwargs. A value is a number (a bool, a
NumPy or 0-d tensor number) or None for a completion the function cannot score: that reward leaves it out of its
mean and adds 0 to its total (TRL's NaN). Whatever goes wrong (a missing file or function, a raise or an exit(),
a non-number, NaN, a number beyond float32's range) is a UserError naming the function and the row.
"""
import functools
import hashlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import signal
import sys
from typing import Callable, NamedTuple

from configurator import UserError
from lm.chat_data import reference_reply
from lm.metrics import call_key, normalize_answer, tool_calls_in

NUMBER_TASKS = ('number_tasks', 'number_tasks_exact')  # the built-in rewards: these and 'tool_calls'
FLOAT32_MAX = 3.4028234663852886e+38  # rewards are float32 tensors from here on


class Reward(NamedTuple):
    fn: Callable
    name: str  # its key in the logs, rewards/<name>/mean: the function's name, as TRL's
    spec: str  # as the config names it, for messages
    batched: bool  # called once per batch with lists


def load_rewards(spec, weights='', format_weight=0.0):
    """(Rewards, weights) of the config keys reward (comma-separated) and reward_weights ('' = 1 each)."""
    rewards = [load_reward(one.strip(), format_weight) for one in spec.split(',') if one.strip()]
    if not rewards:
        raise UserError("reward='' names no reward; e.g. --reward=number_tasks or --reward=my_rewards.py:score.")
    names = [r.name for r in rewards]
    if len(set(names)) < len(names):
        raise UserError(f"reward={spec!r} names a function twice ({', '.join(names)}); each reward is logged by its "
                        f"function's name, so give each its own.")
    try:
        values = [float(w) for w in weights.split(',')] if weights.strip() else [1.0] * len(rewards)
    except ValueError:
        values = []
    if len(values) != len(rewards) or not all(math.isfinite(w) for w in values):
        raise UserError(f"reward_weights={weights!r} must be {len(rewards)} comma-separated finite numbers, one for "
                        f"each reward of reward={spec!r} (or '' for 1 each).")
    return rewards, values


def load_reward(spec, format_weight=0.0):
    """The Reward of one spec: 'number_tasks' (the verifier of the final answer, with format_weight for a
    well-formed answer), 'number_tasks_exact' (of the whole answer), 'tool_calls' or 'path.py:name'."""
    if spec in NUMBER_TASKS:
        fn = functools.partial(number_task_reward, format_weight=format_weight, whole=spec.endswith('exact'))
        return Reward(fn, spec, spec, False)
    if spec == 'tool_calls':
        return Reward(tool_call_reward, spec, spec, False)
    path, _, name = spec.rpartition(':')
    if not path.endswith('.py') or not name:
        raise UserError(f"reward={spec!r} is neither 'number_tasks', 'number_tasks_exact', 'tool_calls' nor "
                        f"'path.py:name' (a Python file and the name of the function in it).")
    if not os.path.isfile(path):
        raise UserError(f"reward={spec!r}: {path} does not exist. Point reward at the Python file that defines "
                        f"{name}(prompt, completion, row).")
    # imported as Python imports a module: in sys.modules (dataclasses and pickle look it up
    # there), its folder importable (a helper module beside it)
    path = os.path.abspath(path)
    module_name = f"reward_{hashlib.sha256(path.encode()).hexdigest()[:12]}_{os.path.basename(path)[:-3]}"
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        if os.path.dirname(path) not in sys.path:
            sys.path.append(os.path.dirname(path))
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            del sys.modules[module_name]
            raise UserError(f"reward={spec!r}: importing {path} raised {type(e).__name__}: {e}. Fix the "
                            f"file.") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward={spec!r}: {path} defines no function {name!r}. Define {name}(prompt, completion, "
                        f"row) returning a number, or fix the name after the colon.")
    batched = bool(getattr(fn, 'batched', False))
    check_parameters(fn, spec, name, batched)
    return Reward(fn, name, spec, batched)


BATCH_INPUTS = ('prompts', 'completions', 'rows')  # what a batched reward is called with besides the rows' fields


def check_parameters(fn, spec, name, batched):
    """Before any rollout: a UserError when fn cannot take the keywords it will be called with (a TRL reward,
    fn(prompts, completions, **kwargs), without batched; a per-completion one with it), not a TypeError per row."""
    inputs = BATCH_INPUTS if batched else ('prompt', 'completion', 'row')
    try:
        # a batched one's other parameters may be fields of the records (check_rows sees the records)
        fields = record_fields(fn) if batched else ()
        inspect.signature(fn).bind(**dict.fromkeys(inputs + fields))
    except ValueError:  # no signature to read (a builtin): its call will say
        return
    except TypeError:
        head = (f"reward={spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                f"{name}({', '.join(k + '=...' for k in inputs)})")
        if batched:
            raise UserError(f"{head}, as train_rl.py calls a batched reward (its batched is True) once per batch "
                            f"of rollouts. Name its parameters so (or take **kwargs), or drop `{name}.batched = True` "
                            f"for a reward called once per completion as {name}(prompt, completion, row) "
                            f"(docs/rl.md).") from None
        raise UserError(f"{head}, as train_rl.py calls a reward once per completion. Name its parameters so (or take "
                        f"**kwargs); a function that takes the batch, as TRL's reward functions do, needs "
                        f"`{name}.batched = True` below it and is called as {name}(prompts=[...], completions=[...], "
                        f"rows=[...]) (docs/rl.md).") from None


def final_answer(text):
    """The answer a response gives: what follows the last ', so ' of a worked sum or difference ('8+6=14,
    4+2+1=7, so 74' -> '74'), else the whole response; normalised as exact match compares answers."""
    return normalize_answer(text.rpartition(', so ')[2])


def answer_shape(text):
    """The response with every number written as 0: the format of an answer, whatever its digits."""
    return re.sub(r'\d+', '0', normalize_answer(text))


def number_task_reward(prompt, completion, row, format_weight=0.0, whole=False):
    """train_rl.py's verifier of the number tasks: 1 when the completion's final answer is the reference's
    (row['response']), else 0; plus format_weight when the completion is shaped as the reference is (the
    working of a sum, one number for the others: answer_shape). With whole=True the whole answer must be the
    reference's (exact match, a sum's working included): a working that drifts while its final answer stays
    (a carry written where there is none) earns nothing."""
    reference = row['response']
    correct = (normalize_answer(completion) == normalize_answer(reference) if whole else
               final_answer(completion) == final_answer(reference))
    return float(correct) + format_weight * (answer_shape(completion) == answer_shape(reference))


def tool_call_reward(prompt, completion, row):
    """1 when the completion writes the tool calls of the row's reference turn (its final assistant turn, which
    the prompt leaves out; a turn without calls: none), compared as lm/metrics.py's tool_calls compares them
    (names and arguments as JSON values, any order, as any template writes them), else 0."""
    turn = reference_reply(row)
    calls = [call.get('function', call) for call in turn.get('tool_calls') or []]
    # a call of a function without parameters may give none
    expected = sorted(call_key(call if {'arguments', 'parameters'} & call.keys() else dict(call, arguments={}))
                      for call in calls)
    return float(tool_calls_in(completion) == expected)


def record_fields(fn):
    """The parameters of a batched reward without a default other than BATCH_INPUTS: fields of the records, each
    passed as a list (TRL's reward keywords); none for a function without a signature to read."""
    try:
        parameters = inspect.signature(fn).parameters
    except ValueError:
        return ()
    return tuple(name for name, p in parameters.items() if p.default is p.empty and name not in BATCH_INPUTS
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_rows(rewards, prompts):
    """Before any rollout: a UserError naming the first of prompts ((ids, record, where) triples) without what
    a built-in reward checks completions against (the number tasks' string "response"; tool_calls' reference
    turn), or without a field that a batched reward takes (a user's reward checks the rest itself)."""
    for reward in rewards:
        fields = record_fields(reward.fn) if reward.batched else ()
        for _, record, where in prompts:
            if reward.spec in NUMBER_TASKS and not isinstance(record.get('response'), str):
                raise UserError(f"{where} has no \"response\" (a string: the reference answer), which "
                                f"reward={reward.spec!r} checks each completion against. Add one to every prompt row, "
                                f"or score with your own function (--reward=path.py:name).")
            if reward.spec == 'tool_calls' and reference_reply(record) is None:
                raise UserError(f"{where} has no reference turn, which reward='tool_calls' checks each completion's "
                                f"calls against: end its \"messages\" (or \"conversations\") with the assistant turn "
                                f"that should be generated (with its \"tool_calls\", or without for no call).")
            for field in fields:
                if field not in record:
                    raise UserError(f"{where} has no \"{field}\", which reward={reward.spec!r} takes (a batched "
                                    f"reward's parameter is that field of the rows, as a list). Add it to every prompt "
                                    f"row, or give the parameter a default.")


def batch_fields(fn, rows):
    """{field: [its value in each row, None where a row lacks it]} of the records' fields that the batched reward fn
    takes by name or through **kwargs, as TRL passes a data set's columns (not prompt, completion: those are ours)."""
    try:
        parameters = inspect.signature(fn).parameters
    except ValueError:
        return {}
    any_name = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    fields = dict.fromkeys(k for row in rows for k in row if k not in ('prompt', 'completion', *BATCH_INPUTS))
    return {k: [row.get(k) for row in rows] for k in fields if any_name or k in parameters}


def reward_values(reward, prompts, completions, rows, wheres):
    """The values (floats, NaN for None) of one Reward for each completion of a batch: prompts (messages),
    completions (texts), rows (JSONL records) and wheres (each row's file and place, for messages)."""
    if reward.batched:
        values = call(reward, wheres[0] + ' and the rest of the batch', completions[0], prompts=prompts,
                      completions=completions, rows=rows, **batch_fields(reward.fn, rows))
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            raise UserError(f"the batched reward function {reward.spec} returned {type(values).__name__} "
                            f"{str(values)[:60]} for a batch of {len(completions)} completions; it must return a "
                            f"list of {len(completions)} numbers (or None).")
    else:
        values = [call(reward, where, completion, prompt=prompt, completion=completion, row=row)
                  for prompt, completion, row, where in zip(prompts, completions, rows, wheres)]
    return [checked(reward, value, where, completion) for value, completion, where in zip(values, completions, wheres)]


def call(reward, where, shown, **inputs):
    """reward.fn(**inputs); whatever it raises (an exit() too) is a UserError naming it, where and the
    completion shown."""
    try:
        return reward.fn(**inputs)
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        # a Ctrl-C that the run's stop signal does not handle (before the first step) is the user's
        if isinstance(e, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            raise
        what = (f"called exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}")
        # a TRL reward written for conversational data reads completion[0]["content"]
        texts = (" A completion is its text here, not TRL's conversational [{\"role\": \"assistant\", \"content\": "
                 "...}]: read it as a string." if isinstance(e, TypeError) and 'string indices' in str(e) else '')
        raise UserError(f"the reward function {reward.spec} {what} on the prompt of {where} (completion "
                        f"{shown[:60]!r}); a reward must return a number. Fix the function, or the row."
                        f"{texts}") from None


def checked(reward, value, where, completion):
    """value as a float (NaN for None); a non-number, NaN or a number beyond float32 is a UserError."""
    if value is None:
        return math.nan
    if getattr(value, 'shape', None) == () and hasattr(value, 'item'):  # numpy.bool_, 0-d arrays and tensors
        value = value.item()
    if not isinstance(value, numbers.Real) or not abs(value) <= FLOAT32_MAX:
        raise UserError(f"the reward function {reward.spec} returned {value!r} for the prompt of {where} (completion "
                        f"{completion[:60]!r}); it must return a finite number (a float or int) within float32's "
                        f"range (|r| <= 3.4e38), in which rewards are computed, or None when it cannot score it.")
    return float(value)
