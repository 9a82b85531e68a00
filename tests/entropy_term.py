"""
Runs a training script with one loss term more, added as docs/configuration.md adds one: a function and
its entry in losses.LOSS_TERMS, weighted in loss_weights like the others:

    python tests/entropy_term.py train.py "--loss_weights={'ce': 1.0, 'entropy_bonus': 0.01}" ...

The script itself is not changed: its check of loss_weights, its step and its logs (train_entropy_bonus,
per source train_entropy_bonus/<name>) must take the term from LOSS_TERMS. Under torchrun every rank runs
this file.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
import losses  # noqa: E402


def entropy_bonus(logits, targets):
    """Minus each position's predictive entropy, sum(p log p): weighted in the loss, it keeps the model from
    growing overconfident (a maximum-entropy regularizer)."""
    logp = logits.log_softmax(-1)
    return (logp.exp() * logp).sum(-1)


if __name__ == '__main__':
    losses.LOSS_TERMS['entropy_bonus'] = (entropy_bonus, True)
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name='__main__')
