"""
The embedded number tasks: a synthetic, verifiable instruction set that fine-tuning uses when no data of
one's own is given. prepare_number_tasks writes it as JSONL in lm/chat_data.py's formats: questions and
answers for SFT (train.py training_type='sft' | 'lora'), or questions with the answer and a plausible
wrong answer as preference pairs for DPO (train_dpo.py). Online RL (train_rl.py) trains on their prompts, its
reward checking an answer against the response (lm/rewards.py: number_task_reward).
"""

import hashlib
import json
import os
import random
import re

from configurator import UserError

NUMBER_TASKS_DIR = os.path.join('data', 'number_tasks')
PREFERENCES_DIR = os.path.join('data', 'number_preferences')
# the tasks split by kind, each a folder of its own in the tasks' folder (two sources of a mixture, config/sft_mix.py):
# sums and differences, worked column by column, and the four one-line kinds
NUMBER_TASK_KINDS = ('arithmetic', 'digits')


def task_kind(question):
    """The NUMBER_TASK_KINDS entry of a question: 'arithmetic' for a sum or difference, else 'digits'."""
    return 'arithmetic' if re.fullmatch(r'What is \d+[+-]\d+\?', question) else 'digits'


def is_number_tasks(folder, tasks_dir=NUMBER_TASKS_DIR):
    """Whether folder is the embedded tasks' (tasks_dir: NUMBER_TASKS_DIR or PREFERENCES_DIR, or a kind's folder
    in it), which are written on first use."""
    return os.path.abspath(folder) in [os.path.abspath(os.path.join(tasks_dir, kind))
                                       for kind in ('', *NUMBER_TASK_KINDS)]


def addition_working(a, b, carry=True, units_slip=0, tens_slip=0):
    """a + b worked column by column, units first: '8+6=14, 4+2+1=7, so 74'. The other arguments
    make the slips of DPO's rejected answers (a carry forgotten, a column off by one), worked on
    consistently; None if a slip takes a column below 0 (or the units above 9 + 9)."""
    units = a % 10 + b % 10 + units_slip
    carried = units >= 10 and carry
    tens = a // 10 + b // 10 + carried + tens_slip
    if not 0 <= units <= 18 or tens < 0:
        return None
    return f"{a % 10}+{b % 10}={units}, {a // 10}+{b // 10}{'+1' * carried}={tens}, so {10 * tens + units % 10}"


def subtraction_working(a, b, borrow=True, units_slip=0, tens_slip=0):
    """a - b (a >= b) worked column by column, units first, borrowing ten: '12-7=5, 5-2-1=2, so 25'.
    With borrow=False the slip of taking the smaller units digit from the larger instead; None if a
    slip takes a column outside 0-9 (units) or below 0 (tens)."""
    needs_borrow = a % 10 < b % 10
    if needs_borrow and not borrow:
        units_text, units = f"{b % 10}-{a % 10}", b % 10 - a % 10
    else:
        units_text, units = f"{a % 10 + 10 * needs_borrow}-{b % 10}", a % 10 + 10 * needs_borrow - b % 10
    borrowed = needs_borrow and borrow
    units, tens = units + units_slip, a // 10 - b // 10 - borrowed + tens_slip
    if not 0 <= units <= 9 or tens < 0:
        return None
    return f"{units_text}={units}, {a // 10}-{b // 10}{'-1' * borrowed}={tens}, so {10 * tens + units}"


def digit_copies(answer, other):
    """answer with one digit replaced by a digit of other: the slip of a model that mixes up two numbers."""
    return [answer[:i] + d + answer[i + 1:] for i in range(len(answer)) for d in sorted(set(other)) if d != answer[i]]


def number_task(rng):
    """A question of the embedded instruction set, its answer, and typical wrong answers, one of six
    kinds: two-digit addition and subtraction, reversing digits, the larger of two numbers, counting
    digits, and the next number. Each checks a skill the pretrained model lacks: following the
    instruction. Sums and differences are worked column by column, units first: written in one go,
    most significant digit first, they were beyond the default model (README: 14 of 172 right).
    The wrong answers (DPO's rejected completions) are the slips a model makes: off by one or ten,
    the wrong operation or number, a digit lost, swapped or copied from the other number, a carry or
    borrow forgotten."""
    a, b = rng.randrange(100), rng.randrange(100)
    high, low = max(a, b), min(a, b)
    x, y = (rng.randrange(10 ** rng.randint(1, 4)) for _ in range(2))
    digits = str(rng.randrange(10 ** rng.randint(2, 6)))
    slips = [dict(units_slip=1), dict(units_slip=-1), dict(tens_slip=1), dict(tens_slip=-1)]
    sum_slips = [addition_working(a, b, **slip) for slip in [dict(carry=False), *slips]]
    difference_slips = [subtraction_working(high, low, **slip) for slip in [dict(borrow=False), *slips]]
    return rng.choice([
        (f"What is {a}+{b}?", addition_working(a, b), [w for w in sum_slips if w] + [subtraction_working(high, low)]),
        (f"What is {high}-{low}?", subtraction_working(high, low),
         [w for w in difference_slips if w] + [addition_working(high, low)]),
        (f"Reverse the digits of {digits}.", digits[::-1], [digits, digits[:0:-1], digits[::-1] + digits[0]]),
        (f"Which is larger, {x} or {y}?", str(max(x, y)), [min(x, y), max(x, y) + 1, max(x, y) - 1,
                                                           *digit_copies(str(max(x, y)), str(min(x, y)))]),
        (f"How many digits does {digits} have?", str(len(digits)), [len(digits) + 1, len(digits) - 1]),
        (f"What comes after {x}?", str(x + 1), [x, x + 2, x - 1, x + 11]),
    ])


def task_split(question):
    """'test' for a tenth of all questions, 'val' for another tenth, else 'train', by a hash of the
    text: a question lies in one split only, whatever the seed or the sizes."""
    h = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 10
    return 'test' if h == 0 else 'val' if h == 1 else 'train'


def plausible_wrong(answer, mistakes, rng):
    """A wrong answer for DPO's rejected completion: one of the task's typical mistakes, or (for a
    plain number) a digit of the answer changed by one or two neighbouring digits swapped; never the
    answer, never negative. A worked answer's slips are all in mistakes: a digit changed at random
    would break its working rather than make a slip."""
    while True:
        if rng.random() < 0.5 or not answer.isdigit():
            wrong = str(rng.choice(mistakes))
        else:
            i = rng.randrange(len(answer))
            if rng.random() < 0.5:
                wrong = answer[:i] + str((int(answer[i]) + rng.choice((-1, 1))) % 10) + answer[i + 1:]
            else:
                i = min(i, len(answer) - 2)
                wrong = answer[:i] + answer[i + 1:i + 2] + answer[i:i + 1] + answer[i + 2:]
        if wrong and wrong != answer and not wrong.startswith('-'):
            return wrong


def prepare_number_tasks(out_dir=NUMBER_TASKS_DIR, n_train=10_000, n_eval=500, seed=0, preferences=False):
    """The embedded SFT task, a verifiable instruction set (number_task): questions and answers as
    {"prompt", "response"} JSONL in out_dir/train.jsonl, val.jsonl and test.jsonl, disjoint splits, and
    the same lines split by kind (task_kind) into out_dir/<kind>/train.jsonl, ... (NUMBER_TASK_KINDS).
    With preferences=True, DPO's version: {"prompt", "chosen", "rejected"} pairs, chosen the answer and
    rejected a plausible wrong answer. Written once; reused while the parameters are unchanged."""
    sizes = {'train': n_train, 'val': n_eval, 'test': n_eval}
    # 3: sums and differences worked column by column; the kinds of wrong answers; 4: the kinds' folders
    meta = {'task': 'number_preferences' if preferences else 'number_tasks', 'sizes': sizes, 'seed': seed,
            'version': 4}
    meta_path = os.path.join(out_dir, 'meta.json')
    old = None
    if os.path.exists(meta_path):
        try:
            with open(meta_path) as f:
                old = json.load(f)
        except (ValueError, RecursionError):  # cut short (written last, whole: not by this function)
            pass
        if old == meta:
            return out_dir
    # what is replaced: an earlier version's task files (its meta.json), or none; a user's own are never
    ours = isinstance(old, dict) and old.get('task') in ('number_tasks', 'number_preferences')
    if not ours and any(os.path.exists(os.path.join(out_dir, f'{split}.jsonl')) for split in sizes):
        raise UserError(f"{out_dir} holds task files the embedded number tasks did not write (no meta.json of theirs), "
                        f"and they would be written there. Move your files to a folder of their own (then point "
                        f"sft_data, dpo_data, rl_data or eval_data at it), or delete them if they can go.")
    rng, wrong_rng = random.Random(seed), random.Random(seed + 1)
    splits = {split: {} for split in sizes}  # question -> (answer, mistakes): no duplicates within a split either
    while any(len(splits[s]) < sizes[s] for s in sizes):
        question, answer, mistakes = number_task(rng)
        split = task_split(question)
        if len(splits[split]) < sizes[split]:
            splits[split][question] = answer, mistakes
    for kind in NUMBER_TASK_KINDS:
        os.makedirs(os.path.join(out_dir, kind), exist_ok=True)
    files = {}
    for split, pairs in splits.items():
        lines = []
        for q, (a, mistakes) in pairs.items():
            record = {'prompt': q, 'chosen': a, 'rejected': plausible_wrong(a, mistakes, wrong_rng)} \
                if preferences else {'prompt': q, 'response': a}
            lines.append((task_kind(q), json.dumps(record) + '\n'))
        files[f'{split}.jsonl'] = ''.join(line for _, line in lines)
        for kind in NUMBER_TASK_KINDS:
            files[os.path.join(kind, f'{split}.jsonl')] = ''.join(line for k, line in lines if k == kind)
    files['meta.json'] = json.dumps(meta)  # written last: marks a complete task folder
    for name, text in files.items():
        # whole files only: another run preparing the same folder at once reads old or new, never half
        tmp = os.path.join(out_dir, f'{name}.{os.getpid()}.tmp')
        with open(tmp, 'w') as f:
            f.write(text)
        os.replace(tmp, os.path.join(out_dir, name))
    return out_dir
