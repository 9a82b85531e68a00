"""
Fault injection for the end-to-end tests: runs a training script as `python script.py ...` would,
with an out-of-memory error, a NaN loss or a SIGTERM injected at the named training steps (or an
out-of-memory error in an evaluation, in train_rl.py's sampling or scoring of its rollouts, or on a device with
room for fewer of train_vocoder.py's segments):

    python tests/faults.py nan@2,oom@1 train.py --max_iters=6 ...

N in oom@N / nan@N / term@N / evaloom@N / sampleoom@N / scoreoom@N is the script's iter_num: the step the
run started at, plus the training steps it has finished since (train_rl.py with num_iterations > 1: its
optimizer steps). The scripts have no code for this; before the script runs, three library functions that
every training script calls, the evaluations' batch splitter, the batched generation and train_rl.py's
rollout batcher are wrapped (each still does all it did):

- checkpoint.restore_training_state: a resumed run's step counters; the count starts at the iter_num it
  returns (at 0 in a run that starts afresh and never calls it).
- torch.amp.GradScaler.update (the scripts' loss scaler; disabled outside fp16, still called): called once
  at the end of every training step, taken or skipped (each script's step block), never in an evaluation
  or between an OOM and its retry; each call counts one step.
- torch.amp.GradScaler.scale: scales each micro-batch's loss right before backward, inside the script's
  train_step, so that is where the faults go in. oom@N raises torch.OutOfMemoryError there (before
  backward: the script's OOM retry catches it), nan@N makes the loss going into backward NaN (the
  gradients and their norm turn NaN: a non-finite step, skipped; the logged loss stays finite, and under
  float16 the scaler takes it for an overflow), term@N sends the process SIGTERM there (the step finishes,
  the run saves at step N + 1 and exits 143, as on a real SIGTERM: a stop at a step of the test's choosing).
- run.runtime.rank_batches: what train.py's and train_dpo.py's evaluations split their batches with (and
  lm/dpo.py's reference pass; never a training step). evaloom@N raises torch.OutOfMemoryError there, at its
  first call at step N (before any batch: the scripts' eval retries catch it, and the reference pass's).
- lm.generate.generate_batch: train_rl.py's rollouts sample with it (as its evals do, and every script's
  held-out answers). sampleoom@N raises torch.OutOfMemoryError at its first call at step N.
- lm.rl.completion_batches: lays a train_rl.py step's rollouts out in micro-batches, first for the no-grad
  scoring passes (the policy's and the reference's log-probs). scoreoom@N raises torch.OutOfMemoryError at its
  first call at step N, inside the scoring's OOM retry.
- tts.vocoder.HiFiGAN.forward and tts.discriminators.loss_mel, for train_vocoder.py (which has no loss scaler, so
  no steps are counted): K in genroom@K / melroom@K is a number of segments, not a step. genroom@K raises
  torch.OutOfMemoryError whenever the generator runs with gradients on more than K segments (the discriminators'
  pass, before their step), melroom@K whenever the mel loss gets more than K (the generator's pass, after the
  discriminators' step): a device with room for K, every time, not once. The evaluations (one utterance, no
  gradients) fit.

Each fault at a step fires once, at the first micro-batch of its step, so the step retried after an injected OOM
goes through. Under torchrun every rank runs this file and counts its own steps.
"""

import os
import runpy
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
from lm import generate, rl  # noqa: E402
from run import checkpoint, runtime  # noqa: E402
from tts import discriminators, vocoder  # noqa: E402


class Faults:
    """The faults of a spec ("oom@3,nan@5"), each to fire once, and the step they are matched against."""

    def __init__(self, spec):
        self.pending, self.room = set(), {}
        for fault in spec.replace(' ', '').split(','):
            name, _, step = fault.partition('@')
            assert name in ('oom', 'nan', 'term', 'evaloom', 'sampleoom', 'scoreoom', 'genroom', 'melroom') and \
                step.isdigit(), (f"fault {fault!r}: expected oom@N, nan@N, term@N, evaloom@N, sampleoom@N, "
                                 f"scoreoom@N, genroom@K, melroom@K")
            if name.endswith('room'):
                self.room[name] = int(step)
            else:
                self.pending.add((name, int(step)))
        self.step = 0  # the script's iter_num

    def fires(self, name):
        if (name, self.step) in self.pending:
            self.pending.remove((name, self.step))
            return True
        return False

    def install(self, patch=setattr):
        """Wrap the functions the module docstring names. patch: setattr, or a test's
        monkeypatch.setattr (undone after the test)."""
        Scaler = torch.amp.GradScaler
        scale, update, restore = Scaler.scale, Scaler.update, checkpoint.restore_training_state
        split, lay_out, sample = runtime.rank_batches, rl.completion_batches, generate.generate_batch
        speak, loss_mel = vocoder.HiFiGAN.forward, discriminators.loss_mel

        def scale_with_faults(scaler, loss):
            if self.fires('term'):
                os.kill(os.getpid(), signal.SIGTERM)
            if self.fires('oom'):
                raise torch.OutOfMemoryError(f'injected OOM at step {self.step}')
            scaled = scale(scaler, loss)
            return scaled * float('nan') if self.fires('nan') else scaled

        def update_and_count(scaler):
            update(scaler)
            self.step += 1

        def restore_and_start_there(*args, **kwargs):
            counters = restore(*args, **kwargs)
            self.step = counters[0]
            return counters

        def split_with_faults(*args, **kwargs):
            if self.fires('evaloom'):
                raise torch.OutOfMemoryError(f'injected OOM in the eval at step {self.step}')
            return split(*args, **kwargs)

        def sample_with_faults(*args, **kwargs):
            if self.fires('sampleoom'):
                raise torch.OutOfMemoryError(f'injected OOM in the sampling at step {self.step}')
            return sample(*args, **kwargs)

        def lay_out_with_faults(*args, **kwargs):
            if self.fires('scoreoom'):
                raise torch.OutOfMemoryError(f'injected OOM in the scoring at step {self.step}')
            return lay_out(*args, **kwargs)

        def speak_in_room(generator, mel):
            if torch.is_grad_enabled() and len(mel) > self.room.get('genroom', len(mel)):
                raise torch.OutOfMemoryError(f'injected OOM: the generator with {len(mel)} segments')
            return speak(generator, mel)

        def loss_mel_in_room(audio, *args, **kwargs):
            if len(audio) > self.room.get('melroom', len(audio)):
                raise torch.OutOfMemoryError(f'injected OOM: the mel loss of {len(audio)} segments')
            return loss_mel(audio, *args, **kwargs)

        patch(Scaler, 'scale', scale_with_faults)
        patch(vocoder.HiFiGAN, 'forward', speak_in_room)
        patch(discriminators, 'loss_mel', loss_mel_in_room)  # before the script imports it
        patch(runtime, 'rank_batches', split_with_faults)  # before the script imports it
        patch(rl, 'completion_batches', lay_out_with_faults)
        patch(generate, 'generate_batch', sample_with_faults)  # before the script imports it
        patch(Scaler, 'update', update_and_count)
        patch(checkpoint, 'restore_training_state', restore_and_start_there)  # before the script imports it
        return self


if __name__ == '__main__':
    spec, script, *args = sys.argv[1:]
    Faults(spec).install()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name='__main__')
