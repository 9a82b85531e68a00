"""
Learning-rate schedules as pure functions of the optimizer step (0-based).

Every schedule except noam starts with the same linear warmup, max_lr*(step+1)/(warmup_iters+1)
(nanoGPT's: step 0 already gets a small nonzero lr, so no step is wasted), then hands over to its
own shape. get_lr is the single entry point the training scripts call.
"""

import math

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
    while t >= cycle:  # walk whole cycles in integers: exact at the restart boundaries, unlike log()
        t -= cycle
        cycle *= restart_mult
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * t / cycle)) * (max_lr - min_lr)


def noam_lr(step, max_lr, warmup_iters, d_model):
    """'Attention is all you need': linear rise for warmup_iters steps, then 1/sqrt(step) decay.
    max_lr is the scale factor, not the peak (the peak is max_lr/sqrt(d_model*warmup_iters))."""
    s = step + 1
    rise = s * warmup_iters ** -1.5 if warmup_iters > 0 else math.inf
    return max_lr * d_model ** -0.5 * min(s ** -0.5, rise)


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


def get_lr(step, schedule, max_lr, min_lr, warmup_iters, decay_iters, *,
           restart_iters=1000, restart_mult=1, d_model=512, decay_frac=0.2):
    if schedule == "cosine":
        return cosine_lr(step, max_lr, min_lr, warmup_iters, decay_iters)
    elif schedule == "cosine_restarts":
        return cosine_restarts_lr(step, max_lr, min_lr, warmup_iters, restart_iters, restart_mult)
    elif schedule == "noam":
        return noam_lr(step, max_lr, warmup_iters, d_model)
    elif schedule == "constant":
        return constant_lr(step, max_lr, warmup_iters)
    elif schedule == "linear":
        return linear_lr(step, max_lr, min_lr, warmup_iters, decay_iters)
    elif schedule == "wsd":
        return wsd_lr(step, max_lr, min_lr, warmup_iters, decay_iters, decay_frac)
    raise ValueError(f"unknown lr schedule {schedule!r}; valid schedules are: {', '.join(SCHEDULES)}. "
                     f"Set the schedule in the config to one of them.")
