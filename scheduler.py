"""
Learning-rate schedules as pure functions of the optimizer step (0-based).

Every schedule starts with the same linear warmup, max_lr*(step+1)/(warmup_iters+1) (nanoGPT's:
step 0 already gets a small nonzero lr, so no step is wasted), peaks at max_lr at step warmup_iters,
then follows its own shape. LRSchedule is the single entry point the training scripts use: built once
from every schedule's config keys (`get_lr = LRSchedule.from_config(config)`; a run counted in epochs
gives the step its decay ends at, its last), called as get_lr(step).
"""

import math
from dataclasses import dataclass, fields, replace

SCHEDULES = ("cosine", "cosine_restarts", "noam", "constant", "linear", "wsd")


def warmup_lr(step, max_lr, warmup_iters):
    return max_lr * (step + 1) / (warmup_iters + 1)


def cosine_lr(step, max_lr, min_lr, warmup_iters, decay_iters):
    if step < warmup_iters:
        return warmup_lr(step, max_lr, warmup_iters)
    if step >= decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def cosine_restarts_lr(step, max_lr, min_lr, warmup_iters, restart_iters, restart_mult):
    """SGDR (Loshchilov & Hutter): cosine from max_lr to min_lr over a cycle of restart_iters
    steps, then jump back to max_lr; each cycle is restart_mult times longer than the last."""
    if restart_iters < 1 or restart_mult < 1:
        raise ValueError(f"cosine_restarts needs restart_iters >= 1 and restart_mult >= 1 (integers), "
                         f"got restart_iters={restart_iters}, restart_mult={restart_mult}; fix them in the config.")
    if step < warmup_iters:
        return warmup_lr(step, max_lr, warmup_iters)
    t, cycle = step - warmup_iters, restart_iters
    # walk whole cycles in integers: exact at the restart boundaries, unlike log()
    while t >= cycle:
        t -= cycle
        cycle *= restart_mult
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * t / cycle)) * (max_lr - min_lr)


def noam_lr(step, max_lr, min_lr, warmup_iters):
    """'Attention is all you need' in ESPnet's/CosyVoice's WarmupLR form: linear rise to max_lr (the
    peak, unlike the paper's d_model**-0.5 scale factor), then inverse-square-root decay, floored at
    min_lr: max_lr * min(s/W, sqrt(W/s)) with s = step+1, W = warmup_iters+1, so the rise is the
    other schedules' warmup and the peak is at step warmup_iters. lr_decay_iters does not apply."""
    if step < warmup_iters:
        return warmup_lr(step, max_lr, warmup_iters)
    return max(min_lr, max_lr * math.sqrt((warmup_iters + 1) / (step + 1)))


def constant_lr(step, max_lr, warmup_iters):
    return warmup_lr(step, max_lr, warmup_iters) if step < warmup_iters else max_lr


def linear_lr(step, max_lr, min_lr, warmup_iters, decay_iters):
    if step < warmup_iters:
        return warmup_lr(step, max_lr, warmup_iters)
    if step >= decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / (decay_iters - warmup_iters)
    return max_lr + ratio * (min_lr - max_lr)


def wsd_lr(step, max_lr, min_lr, warmup_iters, decay_iters, decay_frac):
    """Warmup-stable-decay: hold max_lr, then decay linearly to min_lr over the last decay_frac
    of decay_iters (a stable-phase checkpoint can be resumed and cooled down at any length)."""
    if step < warmup_iters:
        return warmup_lr(step, max_lr, warmup_iters)
    if step >= decay_iters:
        return min_lr
    decay_start = decay_iters * (1.0 - decay_frac)
    if step < decay_start:
        return max_lr
    ratio = (step - decay_start) / (decay_iters - decay_start)
    return max_lr + ratio * (min_lr - max_lr)


@dataclass(frozen=True)
class LRSchedule:
    """A run's schedule, built once from its config keys (LRSchedule.from_config(config)); called with the
    optimizer step (0-based) it gives that step's lr. Fields are named like the keys, without defaults,
    so a script cannot leave one hidden."""
    lr_schedule: str
    learning_rate: float
    min_lr: float
    warmup_iters: int
    lr_decay_iters: int
    restart_iters: int
    restart_mult: int
    decay_frac: float

    @classmethod
    def from_config(cls, config, decay_end=None):
        """decay_end: where an epoch-counted run's decay ends, its last step (run/epochs.py), for lr_decay_iters."""
        schedule = cls(**{field.name: config[field.name] for field in fields(cls)})
        return schedule if decay_end is None else replace(schedule, lr_decay_iters=decay_end)

    def __call__(self, step):
        schedule, max_lr, min_lr, warmup = self.lr_schedule, self.learning_rate, self.min_lr, self.warmup_iters
        if schedule == "cosine":
            return cosine_lr(step, max_lr, min_lr, warmup, self.lr_decay_iters)
        elif schedule == "cosine_restarts":
            return cosine_restarts_lr(step, max_lr, min_lr, warmup, self.restart_iters, self.restart_mult)
        elif schedule == "noam":
            return noam_lr(step, max_lr, min_lr, warmup)
        elif schedule == "constant":
            return constant_lr(step, max_lr, warmup)
        elif schedule == "linear":
            return linear_lr(step, max_lr, min_lr, warmup, self.lr_decay_iters)
        elif schedule == "wsd":
            return wsd_lr(step, max_lr, min_lr, warmup, self.lr_decay_iters, self.decay_frac)
        raise ValueError(f"unknown lr schedule {schedule!r}; valid schedules are: {', '.join(SCHEDULES)}. "
                         f"Set the schedule in the config to one of them.")


def set_lr(optimizer, lr):
    """Give each param group the step's lr times its lr_scale: Muon's groups run at muon_lr / learning_rate
    of it, LoRA+'s B matrices at loraplus_lr_ratio times it, every other group at 1."""
    for group in optimizer.param_groups:
        group['lr'] = lr * group.get('lr_scale', 1.0)
