"""
Training throughput of a GPT shape: tokens/s (median over timed steps) and, on known GPUs, MFU.
`python bench/bench_gpt.py` (the default train.py shape), or e.g.
`python bench/bench_gpt.py --n_layer=12 --n_head=12 --n_embd=768 --block_size=1024 --batch_size=16 --vocab_size=50304 --compile=True`
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from configurator import at_least, check_values, configure
from memory import autocast_context, peak_memory_bytes, pick_device, pick_dtype
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
batch_size = 16
block_size = 128
vocab_size = 4096
n_layer = 4
n_head = 4
n_embd = 128
mlp = 'gelu'                 # 'gelu' | 'swiglu' | 'relu2'
activation_checkpointing = False
device = 'auto'
dtype = 'auto'
compile = False
warmup_steps = 3             # untimed steps (compilation, allocator warm-up)
steps = 10                   # timed steps
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd'))])

device = pick_device(device)
device_type = device.split(':')[0]
ptdtype = pick_dtype(device, dtype)
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, mlp=mlp))
model.activation_checkpointing = activation_checkpointing
model.to(device)
optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
step_model = torch.compile(model) if compile else model
x = torch.randint(vocab_size, (batch_size, block_size), device=device)
y = torch.randint(vocab_size, (batch_size, block_size), device=device)


def sync():
    if device_type == 'cuda':
        torch.cuda.synchronize()


times = []
for i in range(warmup_steps + steps):
    sync()
    t0 = time.perf_counter()
    with autocast_context(device, ptdtype):
        _, loss = step_model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    if i >= warmup_steps:
        times.append(time.perf_counter() - t0)

step_time = statistics.median(times)
tokens_per_sec = batch_size * block_size / step_time
device_name = torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type
mfu = model.estimate_mfu(tokens_per_sec, device_name)
peak = peak_memory_bytes(device)
print(f"{device_name}, {ptdtype}, compile={compile}, {model.get_num_params() / 1e6:.2f}M params, "
      f"batch {batch_size} x {block_size}: median step {step_time * 1000:.1f} ms, {tokens_per_sec:,.0f} tokens/s, "
      + (f"MFU {mfu * 100:.1f}%" if mfu is not None else "MFU unknown (no peak-FLOPs figure for this device)")
      + (f", peak memory {peak / 2**20:.0f} MiB" if peak else ""))
