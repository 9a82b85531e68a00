"""
The device a training step runs on and its number formats: which device and precision, autocast (fp16
also needs loss scaling: the scripts' torch.amp.GradScaler), and batches moved onto the device.
(A GPU's peak FLOP/s, for MFU, is model.py's: estimate_mfu's.)

Works the same on CUDA, Apple MPS and CPU, so the training scripts need no device branches.
"""

import os
import platform
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


def cpu_name(cpuinfo="/proc/cpuinfo"):
    """This CPU as benchmarks name it: its model, the kernels torch picked for it (AVX2, AVX512, ...) and, where
    it has them, native bf16 units (AVX512-BF16 or AMX: without them bf16 matmuls are emulated, many times
    slower, which decides what a bf16 figure means)."""
    name, flags = platform.processor() or platform.machine(), set()
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as f:
            lines = [line.split(":", 1) for line in f if ":" in line]
        name = next((v.strip() for k, v in lines if k.strip() == "model name"), name)
        flags = set(next((v.split() for k, v in lines if k.strip() == "flags"), []))
    bf16 = ", native bf16" if flags & {"avx512_bf16", "amx_bf16"} else ""
    return f"{name} ({torch.backends.cpu.get_cpu_capability()}{bf16})"


def pick_dtype(device, dtype="auto"):
    """'auto' -> on GPUs bfloat16 where supported, else float16 (which needs loss scaling); on CPU
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


def to_device(tensors, device):
    """CPU tensors moved to device; to CUDA through pinned memory, so the copy overlaps compute."""
    if torch.device(device).type == 'cuda':
        return [t.pin_memory().to(device, non_blocking=True) for t in tensors]
    return [t.to(device) for t in tensors]
