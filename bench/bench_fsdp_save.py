"""
What saving and resuming an FSDP run costs each rank, in the two checkpoint formats (run/checkpoint.py's
write_checkpoint): 'file' gathers every shard of the weights and AdamW state whole onto rank 0, which writes
one ckpt.pt; 'sharded' (run/sharded_checkpoint.py) has every rank write its own shards. Resuming reads the file
whole on every rank and keeps its shard, or each rank reads its shards only. Per rank: the peak resident
memory above what it was just before (sampled every 2 ms; mapped checkpoint pages included), and the
seconds taken. Saving and resuming run in separate torchrun jobs, so each starts from a fresh process.

    python bench/bench_fsdp_save.py          # CPU, gloo, 2 ranks

Writes results/fsdp_save.json.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  imported before measuring (run/fsdp.py and run/checkpoint.py import
import torch.distributed.fsdp  # noqa: F401         these when first needed, ~130 MB)

from configurator import UserError, at_least, check_values, configure
from model import GPTConfig
from run.checkpoint import load_checkpoint, restore_training_state, write_checkpoint
from run.fsdp import same_init_on_every_rank, shard_model
from run.runtime import compute_cleanup, compute_init
from starting_model import build_model

# -----------------------------------------------------------------------------
out_dir = '/tmp/nanotrain_fsdp_save'
n_layer = 24
n_head = 16
n_embd = 1024
vocab_size = 32768
ranks = 2
checkpoint_format = ''       # '' runs both formats in torchrun jobs; 'file' | 'sharded': one rank's side of a job
job = 'save'                 # that job's part: 'save' | 'resume'
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'ranks'))])
MB = 2**20


def resident():
    with open('/proc/self/status') as f:
        return int(dict(line.split(':', 1) for line in f)['VmRSS'].split()[0]) * 1024


def measured(work):
    """(peak resident bytes above the start while work() runs, seconds)."""
    start, peak, done = resident(), [0], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], resident())
    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    work()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    return max(peak[0], resident()) - start, seconds


def sharded_gpt_and_adamw(shape, ckpt=None):
    """The model sharded as train.py shards it: built around ckpt's (memory-mapped or placeholder) tensors."""
    with same_init_on_every_rank(0, enabled=True):
        model = build_model(GPTConfig(**shape), ckpt, assign=True)
    shard_model(model, 'cpu', torch.float32, cpu_offload=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


if not checkpoint_format:
    # deleted between the cases: a folder of the checkpoints they write, or none; never another folder
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and all(
            re.fullmatch(r'ckpt\.pt|ckpt-.+\.dcp|.+\.tmp', entry) for entry in os.listdir(out_dir))):
        raise UserError(f"out_dir={out_dir!r} holds other things than this benchmark's checkpoints, and it deletes "
                        f"its out_dir between cases: pass a new folder (--out_dir=...).")
    results = dict(config=config, modes={})
    for fmt in ('file', 'sharded'):
        shutil.rmtree(out_dir, ignore_errors=True)
        for part in ('save', 'resume'):
            out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                  f'--nproc_per_node={ranks}', __file__, f'--checkpoint_format={fmt}', f'--job={part}',
                                  f'--out_dir={out_dir}', f'--n_layer={n_layer}', f'--n_head={n_head}',
                                  f'--n_embd={n_embd}', f'--vocab_size={vocab_size}'],
                                 capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
            results['modes'].setdefault(fmt, {}).update(json.loads(out.stdout.strip().splitlines()[-1]))
    shutil.rmtree(out_dir, ignore_errors=True)
    print(f"{results['modes']['file']['params'] / 1e6:.0f}M params, {ranks} ranks (CPU, gloo, fp32); per rank:")
    print(f"{'format':8s} {'rank':>4s} {'save: peak MB':>14s} {'s':>6s} {'resume: peak MB':>16s} {'s':>6s}")
    for fmt, row in results['modes'].items():
        for r, (save, load) in enumerate(zip(row['save'], row['resume'])):
            print(f"{fmt:8s} {r:4d} {save[0] / MB:14,.0f} {save[1]:6.1f} {load[0] / MB:16,.0f} {load[1]:6.1f}")
    os.makedirs(os.path.join(os.path.dirname(__file__), 'results'), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), 'results', 'fsdp_save.json'), 'w') as f:
        json.dump(results, f, indent=1)
    sys.exit(0)

ddp, rank, local_rank, world_size, device = compute_init('cpu', 0)
shape = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=64)
path = os.path.join(out_dir, 'ckpt.pt')
if job == 'save':
    model, optimizer = sharded_gpt_and_adamw(shape)
    x = torch.randint(0, vocab_size, (1, 64))
    model(x, x)[1].backward()
    optimizer.step()  # AdamW's two moments exist now
    state = dict(model=model.state_dict(keep_vars=True), optimizer=optimizer.state_dict(), scaler={}, iter_num=1,
                 best_val_loss=0.0, evals_without_improvement=0, rng=[])
    dist.barrier()
    cost = measured(lambda: write_checkpoint(path, state, checkpoint_format == 'sharded', rank == 0))
    params = sum(p.numel() for p in model.parameters())
else:
    resumed = []  # kept alive until measured

    def resume():
        """As train.py continues a run: the file read whole (memory-mapped), or placeholders and each rank's shards."""
        ckpt = load_checkpoint(path, whole=checkpoint_format == 'file')
        model, optimizer = sharded_gpt_and_adamw(shape, ckpt)
        scaler = torch.amp.GradScaler('cpu', enabled=False)
        restore_training_state(ckpt, path, optimizer, scaler, rank, world_size, model)
        resumed.append((model, optimizer))
    dist.barrier()
    cost = measured(resume)
    params = sum(p.numel() for p in resumed[0][0].parameters())
row = torch.tensor(cost, dtype=torch.float64)
rows = [torch.zeros_like(row) for _ in range(world_size)]
dist.all_gather(rows, row)
if rank == 0:
    print(json.dumps({'params': params, job: [r.tolist() for r in rows]}))
compute_cleanup(ddp)
