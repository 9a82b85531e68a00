"""
Fault injection for the end-to-end tests: runs a training script as `python script.py ...` would,
with an out-of-memory error or a NaN loss injected at the named training steps:

    python tests/faults.py nan@2,oom@1 train.py --max_iters=6 ...

Every training script scales each micro-batch's loss with memory.GradScaler.scale right before
backward, so that is where the faults go in: oom@N raises torch.OutOfMemoryError there (inside
train_step, before backward: the script's OOM retry catches it), nan@N makes the loss going into
backward NaN (the gradients and their norm turn NaN: a non-finite step, skipped; the logged loss
stays finite, and under float16 the scaler takes it for an overflow). N is the script's own
iter_num. Each fault fires once, so the step retried after an injected OOM goes through.
"""

import os
import runpy
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
import memory  # noqa: E402


def faulty_scale(spec, scale=memory.GradScaler.scale):
    """GradScaler.scale with the faults of spec ("oom@3,nan@5") injected, each once."""
    faults = set()
    for fault in spec.replace(' ', '').split(','):
        name, _, step = fault.partition('@')
        assert name in ('oom', 'nan') and step.isdigit(), f"fault {fault!r}: expected oom@N or nan@N"
        faults.add((name, int(step)))

    def scale_with_faults(self, loss):
        step = sys._getframe(1).f_globals['iter_num']  # the caller is the script's train_step
        if ('oom', step) in faults:
            faults.remove(('oom', step))
            raise torch.OutOfMemoryError('injected OOM')
        scaled = scale(self, loss)
        if ('nan', step) in faults:
            faults.remove(('nan', step))
            return scaled * float('nan')
        return scaled

    return scale_with_faults


if __name__ == '__main__':
    spec, script, *args = sys.argv[1:]
    memory.GradScaler.scale = faulty_scale(spec)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name='__main__')
