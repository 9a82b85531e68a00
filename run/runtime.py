"""
The plumbing every training script runs on, written once (after nanochat's compute_init): the
processes and the device (torchrun's DDP), files prepared once by rank 0, the model the loop calls
(compiled, DDP-wrapped), logging on rank 0, the parts of an optimizer step torch does not give (FSDP's
gradient norm, one all-reduce of the step's metrics and stop flags, bad steps), each rank's share of an
eval, the stop signal and the way out. Each script keeps its own loop (batch, forward, loss, backward,
unscale, clip, step, eval, save) and calls these for what is the same in all.
"""

import os
import signal
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from configurator import install_excepthook
from memory import synchronize
from run.device import pick_device
from run.fsdp import is_dtensor, is_sharded


class Compute(NamedTuple):
    """This process's share of the run (compute_init)."""
    ddp: bool  # under torchrun
    rank: int
    local_rank: int
    world_size: int
    device: str


def compute_init(device, seed, num_threads=0):
    """Start this process's share of the run: a Compute (ddp, rank, local_rank, world_size, device). torchrun
    sets RANK/LOCAL_RANK/WORLD_SIZE: then each process takes its GPU and joins the group (nccl on
    CUDA, gloo elsewhere). Seeds torch with seed + rank (modulo 2**64): different dropout masks and noise on
    each rank."""
    ddp = int(os.environ.get('RANK', -1)) != -1
    device = pick_device(device)
    rank, local_rank, world_size = 0, 0, 1
    if ddp:
        rank, local_rank, world_size = int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), int(os.environ['WORLD_SIZE'])
        if device.startswith('cuda'):
            device = f'cuda:{local_rank}'
            torch.cuda.set_device(device)
        # on GPUs gloo serves the CPU tensors (FSDP's CPU offload reduces its gradient norm there)
        dist.init_process_group(backend='cpu:gloo,cuda:nccl' if device.startswith('cuda') else 'gloo')
        # init_process_group wraps the hook in one that loses a UserError's message
        install_excepthook()
    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed((seed + rank) % 2 ** 64)  # torch's range; the same stream as seed + rank where it fits
    if device.startswith('cuda'):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Compute(ddp, rank, local_rank, world_size, device)


def compute_cleanup(ddp, exit_code=0):
    """End the run's W&B run if any (run/tracker.py). Under torchrun: leave the process group together, then
    end the process here with exit_code, skipping the interpreter's teardown. A gloo worker thread may still
    be releasing finished collectives (tensors Python holds) when Python shuts down, and one that then needs
    the GIL aborts the process: seen at the end of FSDP runs on a busy CPU, 1 run in 15, the job reported
    failed after saving everything."""
    if 'wandb' in sys.modules:  # imported by a W&B run only (run/tracker.py)
        from run.tracker import finish_wandb
        finish_wandb(exit_code)
    if ddp:
        # leave together: a rank tearing down while another still works can abort gloo
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def prepare_once(prepare, compute, **kwargs):
    """prepare(**kwargs), which writes files every rank reads (the default corpus, the number tasks), on rank 0
    only; the other ranks wait until it is done (compute: compute_init's)."""
    if compute.rank == 0:
        prepare(**kwargs)
    if compute.ddp:
        dist.barrier()


def wrap_model(model, compile_model, ddp, local_rank, device_type):
    """The model the training loop calls: compiled block by block in place (compile_model: GPT.compile_blocks)
    and DDP-wrapped (ddp; False under FSDP, which shards the model in place). Checkpoints and samples use the
    model itself."""
    if compile_model:
        model.compile_blocks()
    if ddp:
        # the models' buffers are constants (RoPE tables, a 4-bit base's weights, TTS's mel statistics): broadcast
        # from rank 0 at the forwards (DDP's default) they cost an 8B NF4 base at least 3.6 GB a step, and a
        # collective that a rank with no eval batch never joins (it waits in the eval's all-reduce: both hang)
        model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None, broadcast_buffers=False)
    return model


def log(msg):
    """Print on rank 0 only, above the progress bar."""
    if int(os.environ.get('RANK', 0)) == 0:
        tqdm.write(msg)


def gradient_sync(model, raw_model, sync):
    """The context of one micro-batch's forward and backward: gradients are reduced across ranks only when
    sync (the step's last micro-batch). model: what the loop calls (DDP-wrapped, compiled); raw_model: the
    GPT itself (under FSDP, sharded)."""
    if is_sharded(raw_model):
        raw_model.set_requires_gradient_sync(sync)
    return model.no_sync() if isinstance(model, DDP) and not sync else nullcontext()


def clip_grad_norm(parameters, grad_clip):
    """clip_grad_norm_ to grad_clip (0: only measure) that returns the norm before clipping as a float;
    under FSDP the norm over every rank's gradient shards (a DTensor, gathered here)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip if grad_clip > 0 else float('inf'))
    if is_dtensor(grad_norm):
        grad_norm = grad_norm.full_tensor()
    return grad_norm.item()


def all_reduce_metrics(shares, flags, ddp):
    """One all-reduce of this rank's shares of the step's metrics (shares add up over ranks to the global
    batch's values) together with flags any rank may raise (a stop signal, a time limit). Returns
    (metrics, [each flag raised on any rank])."""
    device = next(iter(shares.values())).device
    stats = torch.stack([*shares.values(), *(torch.tensor(float(flag), device=device) for flag in flags)])
    if ddp:
        dist.all_reduce(stats)
    values = stats.tolist()
    return dict(zip(shares, values)), [value > 0 for value in values[len(shares):]]


def bad_step(bad_steps, config, iter_num, loss, grad_norm):
    """A step skipped for a non-finite loss or gradient norm, after bad_steps in a row: logs it and returns
    the new count; ends the run at max_bad_steps, leaving the last good checkpoint in out_dir as it is
    (config: the script's config keys)."""
    max_bad_steps, out_dir = config['max_bad_steps'], config['out_dir']
    bad_steps += 1
    log(f"step {iter_num}: non-finite loss {loss} / grad norm {grad_norm}, step skipped ({bad_steps}/{max_bad_steps})")
    if bad_steps >= max_bad_steps:
        raise SystemExit(f"error: {bad_steps} consecutive steps had a non-finite loss or gradient norm (last at step "
                         f"{iter_num}); training is diverging. Lower learning_rate, raise warmup_iters, or use "
                         f"dtype='float32'. The last good checkpoint in {out_dir} was left untouched.")
    return bad_steps


def rank_batches(indices, batch_size, rank, world_size, lockstep=False):
    """This rank's share of indices (examples to evaluate) in batches of batch_size, as (batch, counted)
    pairs. lockstep (FSDP, where every forward pass is collective): every rank runs as many batches, a rank
    with fewer adding filler batches (counted False), whose results it drops."""
    mine = [(batch, True) for batch in indices.tensor_split(world_size)[rank].split(batch_size) if len(batch)]
    if not lockstep:
        return mine
    # the first share is the largest
    most = -(-len(indices.tensor_split(world_size)[0]) // batch_size)
    return mine + [(indices[:1], False)] * (most - len(mine))


class StopSignal:
    """SIGTERM/SIGINT set a flag; the training loop finishes its step, saves, and exits 143/130."""

    def __init__(self):
        self.requested = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = signum

    @property
    def exit_code(self):
        return 128 + self.requested

    def exit(self, ckpt_path, iter_num, ddp):
        """Leave after the step's checkpoint is saved; a rank that was not signalled itself exits 143 (SIGTERM)."""
        log(f"stop signal received: saved {ckpt_path} at step {iter_num}")
        code = self.exit_code if self.requested else 143
        compute_cleanup(ddp, code)
        sys.exit(code)


class StepProfiler:
    """Wall time of the parts of a training step: `with prof.section('forward'): ...`.
    On GPUs the device is synchronized at both ends of a section, otherwise asynchronous kernels
    would be billed to whichever section waits for them; that costs some overlap, so profile only
    when asked (enabled=False makes sections free no-ops)."""

    def __init__(self, device, enabled=True):
        self.device, self.enabled = device, enabled
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def section(self, name):
        return self._timed(name) if self.enabled else nullcontext()

    @contextmanager
    def _timed(self, name):
        synchronize(self.device)
        t0 = time.perf_counter()
        yield
        synchronize(self.device)
        self.seconds[name] += time.perf_counter() - t0
        self.calls[name] += 1

    def throughput(self, tokens):
        """tokens per second of profiled time in the current window (call before summary())."""
        total = sum(self.seconds.values())
        return tokens / total if total else 0.0

    def summary(self):
        """{section: mean ms per call} since the last summary(); starts a new window (one per log line)."""
        result = {name: 1000 * self.seconds[name] / self.calls[name] for name in self.seconds}
        self.seconds, self.calls = defaultdict(float), defaultdict(int)
        return result
