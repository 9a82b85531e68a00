"""
DDP against FSDP (run/fsdp.py) at the same global batch: what each rank holds of the parameters, gradients
and AdamW state (bytes of the tensors on that rank, counted exactly), and the median step time. Both
modes run in the same torchrun job, alternating blocks of steps, on the same model and batches.
`torchrun --nproc_per_node=2 bench/bench_fsdp.py` (CPU: gloo), or e.g. on GPUs
`torchrun --nproc_per_node=8 bench/bench_fsdp.py --n_layer=24 --n_embd=2048 --n_head=16 --device=cuda --dtype=bfloat16`
(cpu_offload=True adds FSDP with its shards in CPU memory; GPUs only). Writes results/fsdp.json.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import at_least, check_values, configure
from memory import synchronize
from model import GPT, GPTConfig
from run.device import autocast_context, pick_dtype
from run.fsdp import shard_model
from run.runtime import compute_cleanup, compute_init, log

# -----------------------------------------------------------------------------
batch_size = 4               # micro-batch per rank
block_size = 256
vocab_size = 8192
n_layer = 8
n_head = 8
n_embd = 512
device = 'auto'
dtype = 'auto'
cpu_offload = False          # also run FSDP with fsdp_cpu_offload (GPUs)
rounds = 3                   # each mode runs this many blocks of steps, alternating with the others
steps = 5                    # timed steps per block (after one untimed step per block)
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('batch_size', 'block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd',
                                     'rounds', 'steps'))])
ddp, rank, local_rank, world_size, device = compute_init(device, 0)
if not ddp:
    sys.exit("run under torchrun: torchrun --nproc_per_node=2 bench/bench_fsdp.py")
ptdtype = pick_dtype(device, dtype)
autocast = autocast_context(device, ptdtype)
shape = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size)


def local_bytes(tensors):
    """Bytes this rank stores of tensors (its shard of a DTensor)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def setup(mode):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape))
    if mode == 'ddp':
        model = DDP(model.to(device), device_ids=[local_rank] if device.startswith('cuda') else None)
    else:
        shard_model(model, device, ptdtype, cpu_offload=mode == 'fsdp+offload')
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not mode.endswith('offload'))
    return model, optimizer


def step(model, optimizer, x, y):
    with autocast:
        _, loss = model(x, y)
    (loss * world_size).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # gradients kept, so their bytes can be counted after the step


modes = ['ddp', 'fsdp'] + ['fsdp+offload'] * cpu_offload
runs = {mode: setup(mode) for mode in modes}
generator = torch.Generator().manual_seed(1 + rank)
batches = [torch.randint(0, vocab_size, (batch_size, block_size + 1), generator=generator) for _ in range(4)]
times = {mode: [] for mode in modes}
for _ in range(rounds):
    for mode in modes:
        model, optimizer = runs[mode]
        for i in range(steps + 1):
            batch = batches[i % len(batches)].to(device)
            synchronize(device)
            t0 = time.perf_counter()
            step(model, optimizer, batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
            synchronize(device)
            if i:
                times[mode].append(time.perf_counter() - t0)

results = dict(config=config, world_size=world_size, device=device, dtype=str(ptdtype),
               params=sum(p.numel() for p in runs['ddp'][0].parameters()), modes={})
for mode in modes:
    model, optimizer = runs[mode]
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    per_rank = torch.tensor([local_bytes(params), local_bytes(p.grad for p in params if p.grad is not None),
                             local_bytes(state), statistics.median(times[mode])], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world_size)]
    dist.all_gather(gathered, per_rank)
    worst = torch.stack(gathered).max(0).values.tolist()  # the rank holding most (shards can be uneven)
    results['modes'][mode] = dict(param_mb=worst[0] / 2**20, grad_mb=worst[1] / 2**20, optimizer_mb=worst[2] / 2**20,
                                  total_mb=sum(worst[:3]) / 2**20, step_s=worst[3])
if rank == 0:
    ddp_row = results['modes']['ddp']
    log(f"{results['params'] / 1e6:.1f}M params, {world_size} ranks, {device}, {ptdtype}, global batch "
        f"{batch_size * world_size} x {block_size}; per rank (the rank holding most):")
    log(f"{'mode':14s} {'params MB':>10s} {'grads MB':>10s} {'AdamW MB':>10s} {'total MB':>10s} {'vs DDP':>7s} "
        f"{'step s':>8s} {'vs DDP':>7s}")
    for mode, row in results['modes'].items():
        log(f"{mode:14s} {row['param_mb']:10.1f} {row['grad_mb']:10.1f} {row['optimizer_mb']:10.1f} "
            f"{row['total_mb']:10.1f} {row['total_mb'] / ddp_row['total_mb']:7.2f} {row['step_s']:8.3f} "
            f"{row['step_s'] / ddp_row['step_s']:7.2f}")
    os.makedirs(os.path.join(os.path.dirname(__file__), 'results'), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), 'results', 'fsdp.json'), 'w') as f:
        json.dump(results, f, indent=1)
compute_cleanup(ddp)
