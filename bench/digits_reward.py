"""
The reward of bench/bench_rl_trl.py, which train_rl.py (--reward=bench/digits_reward.py:digits) and TRL's
GRPOTrainer both call: the number of digits in a completion. A random model is never right on the number tasks,
so the verifier would give every completion 0 (no advantage, no gradient); this one varies within each group, and
counts the same whatever special tokens either side's decoding keeps or drops.
"""


def digits(prompt, completion, row):
    return sum(c.isdigit() for c in completion)
