"""
What a new model costs each process's memory under FSDP against one process holding it whole: a GPT started
from scratch as train.py starts it (one process: drawn whole; FSDP: built on the meta device, sharded, each rank
drawing its shards), one AdamW training step, then a checkpoint saved (run/checkpoint.py's write_checkpoint:
'file' gathers the weights and AdamW state one tensor at a time, rank 0 writing each into one file, 'sharded'
has each rank write its own). Per process and phase: the peak resident memory (VmHWM, reset before each phase
through /proc/self/clear_refs; with --trim=True after glibc's malloc_trim, as the step leaves ~250 MB of freed
memory with the allocator, in one process and in each rank alike), in all and above the process's memory before
the model (PyTorch's own, ~300 MB). Each case is a fresh job.

    nice python bench/bench_fsdp_memory.py          # CPU, gloo, 2 ranks; ~2 minutes (Linux, glibc)

Writes results/fsdp_memory.json (with --trim=True, results/fsdp_memory_trim.json).
"""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  imported before measuring (run/fsdp.py and run/checkpoint.py import
import torch.distributed.fsdp  # noqa: F401         these when first needed, ~130 MB)

from configurator import UserError, at_least, check_values, configure
from model import GPTConfig
from run.checkpoint import write_checkpoint
from run.fsdp import same_init_on_every_rank, shard_model
from run.runtime import compute_cleanup, compute_init
from starting_model import build_model

# -----------------------------------------------------------------------------
out_dir = '/tmp/nanotrain_fsdp_memory'
n_layer = 6
n_head = 16
n_embd = 1024
vocab_size = 16384
block_size = 128             # the training step's batch: 2 windows of block_size tokens
ranks = 2
case = ''                    # '' runs every case in its own job; 'single' | 'file' | 'sharded': one job's side
trim = False                 # malloc_trim before each phase (glibc keeps ~250 MB a step freed)
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'block_size', 'ranks'))])
MB = 2**20
CASES = {'single': 'one process, the whole model', 'file': f'FSDP, {ranks} ranks, one-file save',
         'sharded': f'FSDP, {ranks} ranks, sharded save'}


def status(key):
    with open('/proc/self/status') as f:
        return int(dict(line.split(':', 1) for line in f)[key].split()[0]) * 1024


def peak_of(work):
    """work()'s result and the peak resident bytes while it ran (VmHWM, reset first; with trim, after glibc
    has given back the memory it kept of what the last phase freed)."""
    if trim:
        ctypes.CDLL(None).malloc_trim(0)
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # VmHWM := VmRSS
    result = work()
    return result, status('VmHWM')


if not case:
    # deleted between the cases: a folder of the checkpoints they write, or none; never another folder
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and all(
            re.fullmatch(r'ckpt\.pt|ckpt-.+\.dcp|.+\.tmp', entry) for entry in os.listdir(out_dir))):
        raise UserError(f"out_dir={out_dir!r} holds other things than this benchmark's checkpoints, and it deletes "
                        f"its out_dir between cases: pass a new folder (--out_dir=...).")
    results = dict(config=config, cases={})
    for name in CASES:
        shutil.rmtree(out_dir, ignore_errors=True)
        launcher = [] if name == 'single' else ['-m', 'torch.distributed.run', '--standalone',
                                                f'--nproc_per_node={ranks}']
        args = [f'--{k}={v}' for k, v in config.items() if k not in ('case', 'ranks')]
        out = subprocess.run([sys.executable, *launcher, __file__, f'--case={name}', *args], capture_output=True,
                             text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        results['cases'][name] = json.loads(out.stdout.strip().splitlines()[-1])
    shutil.rmtree(out_dir, ignore_errors=True)
    single = results['cases']['single']
    print(f"{single['params'] / 1e6:.0f}M params ({single['params'] * 4 / MB:,.0f} MB in fp32); peak resident MB per "
          f"process: in all, against one process's; above the process before the model, against one process's")
    print(f"{'case':34s} {'rank':>4s} {'start-up':>26s} {'training step':>26s} {'save':>26s}")

    def cell(phases, alone, phase):
        above, above_alone = phases[phase] - phases['before'], alone[phase] - alone['before']
        return (f"{phases[phase] / MB:,.0f} {phases[phase] / alone[phase]:.2f}x; "
                f"{above / MB:,.0f} {above / above_alone:.2f}x")
    for name, row in results['cases'].items():
        for r, phases in enumerate(row['ranks']):
            cells = [cell(phases, single['ranks'][0], p) for p in ('start-up', 'step', 'save')]
            print(f"{CASES[name]:34s} {r:4d} {cells[0]:>26s} {cells[1]:>26s} {cells[2]:>26s}")
    os.makedirs(os.path.join(os.path.dirname(__file__), 'results'), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), 'results', f"fsdp_memory{'_trim' * trim}.json"), 'w') as f:
        json.dump(results, f, indent=1)
    sys.exit(0)

ddp, rank, local_rank, world_size, device = compute_init('cpu', 0)
shape = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=block_size)


def start_up(shape):
    """As train.py starts a new model: drawn whole by one process; under FSDP built on the meta device,
    sharded, each rank drawing its shards (run/fsdp.py)."""
    with same_init_on_every_rank(0, enabled=ddp):
        model = build_model(shape, None, assign=ddp)
    if ddp:
        shard_model(model, 'cpu', torch.float32, cpu_offload=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, optimizer):
    x = torch.randint(0, vocab_size, (2, block_size), generator=torch.Generator().manual_seed(0))
    model(x, x)[1].backward()
    optimizer.step()  # AdamW's two moments exist from here on
    optimizer.zero_grad(set_to_none=True)


# a tiny model first, so that what every first call loads or allocates once is in the memory before the model
step(*start_up(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=vocab_size, block_size=block_size)))
phases = dict(before=status('VmRSS'))
(model, optimizer), phases['start-up'] = peak_of(lambda: start_up(shape))
_, phases['step'] = peak_of(lambda: step(model, optimizer))
state = dict(model=model.state_dict(keep_vars=True), optimizer=optimizer.state_dict(), iter_num=1)
_, phases['save'] = peak_of(lambda: write_checkpoint(os.path.join(out_dir, 'ckpt.pt'), state, case == 'sharded',
                                                     rank == 0))
params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole tensor's
everyone = [phases]
if ddp:
    everyone = [None] * world_size
    dist.all_gather_object(everyone, phases)
if rank == 0:
    print(json.dumps({'params': params, 'ranks': everyone}))
compute_cleanup(ddp)
