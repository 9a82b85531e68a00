"""
The device a training step runs on and its number formats: which device and precision, autocast, fp16
loss scaling by a GradScaler that works on any device (MPS too), and batches moved onto the device.
(A GPU's peak FLOP/s, for MFU, is model.py's: estimate_mfu's.)

Works the same on CUDA, Apple MPS and CPU, so the training scripts need no device branches.
"""

import math
from contextlib import nullcontext

import torch

from configurator import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device="auto"):
    """'auto' -> cuda if present, else mps, else cpu. An explicit device must exist here."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    kind, _, index = device.partition(":")
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if kind not in available:
        raise UserError(f"device={device!r} is not a device nanotrain knows; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    if not available[kind] or (kind == "cuda" and index and int(index) >= torch.cuda.device_count()):
        raise UserError(f"device={device!r} was requested but is not available on this machine "
                        f"(auto would pick {pick_device()!r}); set --device=auto or a device that exists.")
    return device


def bf16_supported(device):
    kind = device.split(":")[0]
    # without emulation: pre-Ampere GPUs emulate bf16 slowly, fp16 + scaling is faster there
    if kind == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if kind == "mps":
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def pick_dtype(device, dtype="auto"):
    """'auto' -> on GPUs bfloat16 where supported, else float16 (which needs GradScaler); on CPU
    float32, because CPU autocast to bf16 is many times slower without AMX/AVX512-BF16 units."""
    if dtype == "auto":
        if device.split(":")[0] == "cpu":
            return torch.float32
        return torch.bfloat16 if bf16_supported(device) else torch.float16
    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r} is not supported; use 'auto', {', '.join(map(repr, DTYPES))}.")
    if dtype == "bfloat16" and not bf16_supported(device):
        raise UserError(f"dtype='bfloat16' is not supported on {device} here; use --dtype=float16 "
                        f"(loss scaling is automatic) or --dtype=float32.")
    return DTYPES[dtype]


def autocast_context(device, dtype):
    """A reusable context manager: `with ctx:` may be entered any number of times."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=dtype)


def _f32(x):
    """Round to float32, as torch's GradScaler keeps its scale in a float32 tensor."""
    return torch.tensor(x, dtype=torch.float32).item()


class GradScaler:
    """Dynamic loss scaling for float16, with torch.amp.GradScaler's API and arithmetic, on any
    device (MPS included). The loss is multiplied by `scale` so small fp16 gradients do not flush to
    zero; before the optimizer step the gradients are divided back (once per step: after an explicit
    unscale_, step does not unscale again). If any gradient is inf/nan the step is skipped and the
    scale multiplied by backoff_factor; after growth_interval clean steps in a row it is multiplied
    by growth_factor. Disabled (bf16/fp32), every method passes straight through."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True):
        self.enabled = enabled
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._scale = _f32(init_scale)
        self._growth_tracker = 0  # clean steps since the last growth or backoff
        # id(optimizer) -> whether its grads had inf/nan, for optimizers unscaled this step
        self._found_inf = {}
        self._stepped = set()
        self.skipped = False  # did the last update() see inf/nan gradients (that step was skipped)

    def is_enabled(self):
        return self.enabled

    def get_scale(self):
        return self._scale if self.enabled else 1.0

    def scale(self, loss):
        # float32 so that a float16 loss times 65536 does not overflow before backward
        return loss.float() * self._scale if self.enabled else loss

    def unscale_(self, optimizer):
        if not self.enabled:
            return
        if id(optimizer) in self._stepped:
            raise RuntimeError("unscale_() is being called after step().")
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self._found_inf[id(optimizer)] = False
        if grads:  # check before dividing, like torch; one device sync for all gradients
            self._found_inf[id(optimizer)] = not torch.stack([g.isfinite().all() for g in grads]).all().item()
            torch._foreach_mul_(grads, _f32(1.0 / self._scale))

    def step(self, optimizer):
        if not self.enabled:
            return optimizer.step()
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if not self._found_inf[id(optimizer)]:
            return optimizer.step()

    def update(self):
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("GradScaler.update() was called without unscale_()/step() in this iteration.")
        self.skipped = any(self._found_inf.values())
        if self.skipped:
            self._scale, self._growth_tracker = _f32(self._scale * self.backoff_factor), 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = _f32(self._scale * self.growth_factor)
                if math.isfinite(grown):  # float32 overflow: keep the old scale
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf, self._stepped = {}, set()

    def state_dict(self):
        """Same keys as torch.amp.GradScaler.state_dict(), so checkpoints load into either."""
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state):
        # an empty state comes from a run without fp16 (e.g. bf16 on another machine): keep the
        # initial scale, it finds its level within a few steps (torch raises here instead)
        if not self.enabled or not state:
            return
        self._scale, self._growth_tracker = _f32(state["scale"]), state["_growth_tracker"]
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]


def to_device(tensors, device):
    """CPU tensors moved to device; to CUDA through pinned memory, so the copy overlaps compute."""
    if torch.device(device).type == 'cuda':
        return [t.pin_memory().to(device, non_blocking=True) for t in tensors]
    return [t.to(device) for t in tensors]
