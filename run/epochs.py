"""
A run counted in epochs (num_train_epochs, Hugging Face Trainer's key) instead of optimizer steps
(max_iters): train.py's fine-tuning, train_dpo.py and train_tts.py, which read a data set in epochs.

The script plans the run before its first step: the steps of each epoch, from the data, the global
batch (batch_size x gradient_accumulation_steps x processes) and, where rows are packed, the packing
itself (the epochs' rows are drawn as the run will draw them, from the seed), so the run ends, and
the learning rate reaches min_lr, exactly where its last epoch ends. No step holds two epochs'
examples: an epoch's last step takes what is left, as Trainer's last batch of an epoch is smaller.
The plan is deterministic, so a relaunch computes it again and continues mid-epoch where it was.

num_train_epochs and max_iters both say how long the run is. The one set later counts (a
command-line key overrides a config file's, as for any key; Trainer's max_steps likewise overrides
num_train_epochs); both set in one place is refused as ambiguous.
"""

import bisect
import itertools
import math

from configurator import UserError, where_set

DECAYING = ('cosine', 'linear', 'wsd')  # the schedules that end at lr_decay_iters, here at the run's last step


def counts_epochs(config):
    """Whether the run is counted in epochs: num_train_epochs > 0, and not overridden by a max_iters set after it.
    A UserError when a config file or the command line sets both, or lr_decay_iters beside or after num_train_epochs
    (an epoch-counted run decays over all its steps)."""
    if not config['num_train_epochs']:
        return False
    epochs, iters, decay = (where_set(k) for k in ('num_train_epochs', 'max_iters', 'lr_decay_iters'))
    epochs_set = f"num_train_epochs={config['num_train_epochs']:g}"
    if iters and iters.source == epochs.source:
        raise UserError(f"{epochs.source} sets both {epochs_set} and max_iters={config['max_iters']}, two lengths for "
                        f"one run: keep one (a run counted in epochs has its steps worked out from the data).")
    if iters and iters.order > epochs.order:
        print(f"note: max_iters={config['max_iters']} ({iters.source}) overrides {epochs_set} ({epochs.source}): the "
              f"run is counted in steps")
        return False
    if decay and (decay.source == epochs.source or decay.order > epochs.order):
        raise UserError(f"lr_decay_iters={config['lr_decay_iters']} ({decay.source}) with {epochs_set}: a run counted "
                        f"in epochs decays its learning rate to min_lr over all its steps, worked out from the data. "
                        f"Drop lr_decay_iters, or count the run in max_iters.")
    return True


def by_epochs_checked(config):
    """counts_epochs(config), refusing eval_every_epochs in a run counted in max_iters."""
    by_epochs = counts_epochs(config)
    if config['eval_every_epochs'] and not by_epochs:
        raise UserError(f"eval_every_epochs={config['eval_every_epochs']} evaluates at the end of epochs, which a run "
                        f"counted in max_iters does not plan: set num_train_epochs (with nothing setting max_iters "
                        f"after it), or use eval_interval.")
    return by_epochs


def plan_epochs(epoch_steps, config, ckpt, ckpt_path):
    """The EpochPlan of an epoch-counted run (epoch_steps: the data's steps of each epoch), checked against the
    continued run's checkpoint ckpt (None for a new run) and against the config's warmup."""
    plan = EpochPlan(epoch_steps, config['num_train_epochs'])
    if ckpt is not None:
        plan.check_resumed(ckpt.get('epoch_steps'), ckpt_path)
    warmup_fits(config['warmup_iters'], plan)
    return plan


class EpochPlan:
    """The steps of an epoch-counted run: epoch_steps[k] optimizer steps in epoch k + 1, for each epoch it begins
    (a fractional num_train_epochs, as Trainer's, ends within the last: its share of that epoch's steps, rounded up)."""

    def __init__(self, epoch_steps, num_train_epochs):
        self.epoch_steps, self.num_train_epochs = list(epoch_steps), num_train_epochs
        self.ends = list(itertools.accumulate(self.epoch_steps))  # the step at which each epoch ends
        whole = int(num_train_epochs)
        part = num_train_epochs - whole
        self.steps = (self.ends[whole - 1] if whole else 0) + (math.ceil(part * self.epoch_steps[whole]) if part else 0)

    def epoch(self, step):
        """The epochs trained after `step` steps: whole ones, and the share of the one under way (Trainer's 'epoch')."""
        done = bisect.bisect_right(self.ends, step)
        if done == len(self.ends):
            return float(done)
        start = self.ends[done - 1] if done else 0
        return done + (step - start) / self.epoch_steps[done]

    def ending(self, step):
        """The number of the epoch (1, 2, ...) that ends at `step`, else 0."""
        k = bisect.bisect_left(self.ends, step)
        return k + 1 if k < len(self.ends) and self.ends[k] == step else 0

    def under_way(self, step):
        """The number of the epoch that the step after `step` steps is in (the last one's after the run's end)."""
        return min(bisect.bisect_right(self.ends, step) + 1, len(self.ends))

    def after(self, step, progress):
        """After `step` steps: ({'epoch': the epochs done}, the epoch that ended at step, else 0); the progress bar
        (tqdm) names the epoch under way."""
        progress.set_description(f'epoch {self.under_way(step)}/{len(self.epoch_steps)}', refresh=False)
        return {'epoch': self.epoch(step)}, self.ending(step)

    def describe(self, per_step, lr_schedule):
        """The plan in a line, per_step: what a step holds ('8 rows of up to 48 tokens')."""
        first = self.epoch_steps[0]
        each = (f"{first} step{'s' * (first != 1)} each" if len(set(self.epoch_steps)) == 1 else
                f"{', '.join(map(str, self.epoch_steps))} steps (each epoch's shuffle packs its own rows)")
        return (f"num_train_epochs={self.num_train_epochs:g}: {len(self.epoch_steps)} epoch(s) of {each}, {per_step} "
                f"a step (an epoch's last takes what is left): {self.steps} steps, "
                + ("the lr decaying to min_lr where they end" if lr_schedule in DECAYING else
                   f"lr_schedule={lr_schedule!r} keeping its own shape (only cosine, linear and wsd end)"))

    def check_resumed(self, saved, ckpt_path):
        """A UserError unless saved (a continued run's checkpoint's epoch_steps) agrees with this plan over the
        epochs both have: other data or another global batch would end its epochs elsewhere."""
        if saved is None:
            raise UserError(f"{ckpt_path} is a run counted in max_iters, whose batches run across its epochs' ends; it "
                            f"cannot be continued in epochs. Continue it with --max_iters, or start a new run (another "
                            f"out_dir, or --resume=False).")
        common = min(len(saved), len(self.epoch_steps))
        if saved[:common] != self.epoch_steps[:common]:
            raise UserError(f"{ckpt_path} planned its epochs as {saved} steps, this launch as {self.epoch_steps}: the "
                            f"data or the global batch (a micro-batch x gradient_accumulation_steps x processes) "
                            f"changed. Continue with the run's own, or start a new run (another out_dir, or "
                            f"--resume=False).")


def warmup_fits(warmup_iters, plan):
    """A UserError when the warmup takes the whole epoch-counted run (its length is only known now)."""
    if warmup_iters >= plan.steps:
        raise UserError(f"warmup_iters={warmup_iters} is as long as the whole run ({plan.steps} step"
                        f"{'s' * (plan.steps != 1)} for num_train_epochs={plan.num_train_epochs:g}): the learning "
                        f"rate would never decay. Lower warmup_iters, e.g. --warmup_iters={plan.steps // 10} (a tenth "
                        f"of the run).")
