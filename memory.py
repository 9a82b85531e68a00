"""
Memory on the device a training step runs on: usage and pressure (MemoryMonitor), peak memory, and
out-of-memory recovery (freeing, halving the micro-batch, the split a resumed run keeps). Works the same
on CUDA, Apple MPS and CPU. (Which device and number formats: run/device.py.) And the host memory a
memory-mapped checkpoint takes once read (page_out).
"""

import ctypes
import gc
import math
import os
import sys
import time
from typing import NamedTuple

import torch

from configurator import UserError

def synchronize(device):
    kind = device.split(":")[0]
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def free_memory(device):
    """Collect unreachable tensors (reference cycles) and return cached blocks to the driver."""
    gc.collect()
    kind = device.split(":")[0]
    if kind == "cuda":
        torch.cuda.empty_cache()
    elif kind == "mps":
        torch.mps.empty_cache()


def emergency_free_memory(device):
    """free_memory after waiting for queued kernels, so the temporaries they hold are freed too."""
    synchronize(device)
    free_memory(device)


def page_out(tensor):
    """Drop the pages of a CPU tensor read from a memory-mapped file from this process's resident memory
    (Linux's madvise MADV_PAGEOUT): a checkpoint read once, as 4-bit quantization reads each weight, would
    otherwise stay counted in the process's memory, the whole file of it. The data stays in the file and is
    read again if used; anonymous memory without swap is left as it is. Elsewhere a no-op."""
    if not sys.platform.startswith('linux') or tensor.device.type != 'cpu' or not tensor.numel():
        return
    page = os.sysconf('SC_PAGE_SIZE')
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(start, end - start, 21)  # MADV_PAGEOUT (Linux 5.4); an older kernel refuses it: no harm


def return_freed_buffers(threshold=128 * 1024):
    """Have glibc's malloc serve every allocation of threshold bytes or more with its own mmap, returned to
    the system when freed. By default the threshold rises to the largest block freed (up to 32 MiB), after
    which FSDP's all-gathered weights and gradient buffers, freed and reallocated block by block, come from
    the heap, whose holes the process keeps: each CPU rank grew step by step to more than one unsharded
    process (bench/bench_fsdp_rss.py: 1.30x; with this 0.68x, for 1.22x the wall time of that short run,
    each large buffer's pages now faulted in afresh). Other C libraries (macOS, musl): a no-op."""
    if not sys.platform.startswith('linux'):
        return
    libc = ctypes.CDLL(None)
    if hasattr(libc, 'mallopt'):
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD; also turns glibc's rising threshold off


def _max_rss_bytes():
    import resource  # not on Windows; only needed for cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux KiB


def memory_usage(device):
    """Fraction of the device's memory in use, 0..1."""
    kind = device.split(":")[0]
    if kind == "cuda":  # whole-device view: other processes' memory also pushes us towards OOM
        free, total = torch.cuda.mem_get_info(device)
        return 1.0 - free / total
    if kind == "mps":
        return torch.mps.current_allocated_memory() / torch.mps.recommended_max_memory()
    if os.path.exists("/proc/meminfo"):  # cpu on Linux: system-wide, what the OOM killer looks at
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        return 1.0 - info["MemAvailable"] / info["MemTotal"]
    return _max_rss_bytes() / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


PRESSURE_LEVELS = ((0.60, "low"), (0.75, "moderate"), (0.85, "high"), (math.inf, "critical"))
SEVERITY = [name for _, name in PRESSURE_LEVELS]


def pressure_level(fraction):
    """low < 60% <= moderate < 75% <= high < 85% <= critical"""
    return next(name for limit, name in PRESSURE_LEVELS if fraction < limit)


class MemoryMonitor:
    """check() reads memory pressure and frees memory before it becomes an OOM: cached blocks when it
    rises to 'high', an emergency cleanup when it rises to 'critical'. Only on the rise: a device that
    stays full (other processes' memory, or the run's own steady use) gains nothing from a cleanup at every
    check, and on an H200 emptying the cache at every step cut a GPT-2-sized run to a quarter of its
    throughput (README, *Measured on GPU*). Time spent in check() is added to overhead_s so the cost of
    monitoring is visible. usage_fn/cleanup/emergency_cleanup are injectable for tests."""

    def __init__(self, device, usage_fn=None, cleanup=None, emergency_cleanup=None):
        self.usage_fn = usage_fn or (lambda: memory_usage(device))
        self.cleanup = cleanup or (lambda: free_memory(device))
        self.emergency_cleanup = emergency_cleanup or (lambda: emergency_free_memory(device))
        self.level, self.usage = "low", 0.0
        self.checks, self.overhead_s = 0, 0.0

    def check(self):
        t0 = time.perf_counter()
        self.usage = self.usage_fn()
        previous, self.level = self.level, pressure_level(self.usage)
        if SEVERITY.index(self.level) > SEVERITY.index(previous):
            if self.level == "high":
                self.cleanup()
            elif self.level == "critical":
                self.emergency_cleanup()
        self.checks += 1
        self.overhead_s += time.perf_counter() - t0
        return self.level


def peak_memory_bytes(device):
    """cuda: peak allocated by tensors; mps: current driver allocation (MPS has no peak counter);
    cpu: peak resident set size of this process."""
    kind = device.split(":")[0]
    if kind == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if kind == "mps":
        return torch.mps.driver_allocated_memory()
    return _max_rss_bytes()


# ---------------------------------------------------------------------------- OOM recovery


def is_oom(exc):
    # MPS raises a plain RuntimeError("MPS backend out of memory ..."), the CPU's allocator one that it "can't
    # allocate memory" (a request the kernel refuses; one it overcommits ends in the OOM killer instead)
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc)))


def recover_from_oom(error, ddp, optimizer, device):
    """In a training step's `except RuntimeError as error:`: re-raise anything but an out-of-memory error
    this process can retry on its own (not under DDP, where the ranks would disagree on the smaller split:
    torchrun restarts the job instead); else drop the step's gradients and free its memory, so the
    caller can retry the step in smaller pieces."""
    if not is_oom(error) or ddp:
        raise error
    optimizer.zero_grad(set_to_none=True)
    free_memory(device)


def in_parts(n, size, work, device, too_big, smaller=None):
    """work(start, stop) over range(n) in parts of at most size items, for work whose results do not depend on
    the part's size (no gradients). A part that runs out of memory is done again in halves, and so are the
    parts after it (smaller, if given, hears each new size); one item that does not fit is a UserError saying
    too_big. Returns the size the parts fit at. Not for work in lockstep with other ranks (FSDP's collectives):
    one rank's retry would leave the others waiting."""
    start = 0
    while start < n:
        stop = min(start + size, n)
        try:
            work(start, stop)
        except RuntimeError as error:
            if not is_oom(error):
                raise
            if stop - start == 1:
                raise UserError(too_big) from None
            free_memory(device)
            size = (stop - start + 1) // 2
            if smaller:
                smaller(size)
            continue
        start = stop
    return size


def halve_micro_batch(batch_size, grad_accum):
    """After an OOM: half the micro-batch, twice the accumulation, the same global batch."""
    if batch_size == 1:
        raise UserError("out of memory with micro-batch size 1, so it cannot shrink further. Lower block_size "
                        "(fine-tuning: max_length), use a smaller model, set activation_checkpointing=True, or use a "
                        "device with more memory.")
    if batch_size % 2:
        raise UserError(f"out of memory with micro-batch size {batch_size}; halving an odd size would change the "
                        f"global batch ({batch_size} x {grad_accum} accumulation steps). Set batch_size to a power "
                        f"of two (and raise gradient_accumulation_steps to keep the global batch), or lower it yourself.")
    return batch_size // 2, grad_accum * 2


def split_micro_batches(splits, longest, iter_num):
    """After an OOM with a frame-budget sampler's batches (train_tts.py): split each micro-batch into twice as
    many chunks, the same batch; longest: utterances in the largest micro-batch, which a chunk cannot go under."""
    if splits >= longest:
        raise UserError(f"out of memory with one utterance per micro-batch (step {iter_num}); lower "
                        f"frame_budget, use a smaller model, or use a device with more memory.")
    return splits * 2


class MicroBatch(NamedTuple):
    """The split of a step's batch a resumed run continues with (resumed_micro_batch)."""
    batch_size: int
    gradient_accumulation_steps: int
    note: str  # '' or a line saying that the split changed, or could not keep the global batch


def resumed_micro_batch(ckpt, batch_size, grad_accum, world_size):
    """The MicroBatch (batch_size, gradient_accumulation_steps, note) a resumed run continues with. The same
    command keeps the checkpoint's global batch: its split (an OOM may have halved it: halve_micro_batch),
    re-split over this launch's number of processes (2 -> 1: twice the accumulation); note says when it did,
    or could not. Another batch_size x gradient_accumulation_steps than the command that wrote the checkpoint
    (its config) is taken as given."""
    command = ckpt['config']['batch_size'] * ckpt['config']['gradient_accumulation_steps']
    saved_batch = ckpt.get('batch_size', ckpt['config']['batch_size'])
    saved_accum = ckpt.get('gradient_accumulation_steps', ckpt['config']['gradient_accumulation_steps'])
    saved_world = len(ckpt['rng'])  # one random state per process
    if command != batch_size * grad_accum:
        return MicroBatch(batch_size, grad_accum, '')
    if saved_world == world_size:
        return MicroBatch(saved_batch, saved_accum, '')
    total = saved_batch * saved_accum * saved_world
    if total % world_size:
        return MicroBatch(saved_batch, saved_accum, (
            f"note: the global batch changes from {total} to {saved_batch * saved_accum * world_size} "
            f"(batch_size x gradient_accumulation_steps x processes): {total} does not split over {world_size} "
            f"processes."))
    # the checkpoint's micro-batch where it divides the share
    micro = math.gcd(total // world_size, saved_batch)
    return MicroBatch(micro, total // world_size // micro, (
        f"note: the global batch of {total} is kept on {world_size} process{'es' * (world_size != 1)} instead of "
        f"{saved_world}: micro-batch {micro} x {total // world_size // micro} accumulation steps per process."))
