"""
Training throughput of a GPT shape: tokens/s (median over timed steps) and, on known GPUs, MFU.
`python bench/bench_gpt.py` (the default train.py shape), or e.g.
`python bench/bench_gpt.py --n_layer=12 --n_head=12 --n_embd=768 --block_size=1024 --batch_size=16 --vocab_size=50304 --compile=True`
LoRA on the Llama-3.2-1B shape: `--n_layer=16 --n_head=32 --n_kv_head=8 --n_embd=2048 --mlp=swiglu --mlp_hidden=8192
--vocab_size=128256 --block_size=2048 --batch_size=4 --lora_r=16`. `--profile=FILE` writes torch.profiler's kernel
table of `profile_steps` steps after the timed ones; `--out=FILE` the figures as JSON (bench/gpu.py reads them).
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from configurator import at_least, check_values, configure
from lm.lora import apply_lora, cast_frozen_base
from memory import peak_memory_bytes
from model import GPT, GPTConfig
from run.device import autocast_context, pick_device, pick_dtype

# -----------------------------------------------------------------------------
batch_size = 16
block_size = 128
vocab_size = 4096
n_layer = 4
n_head = 4
n_embd = 128
mlp = 'gelu'                 # 'gelu' | 'swiglu' | 'relu2'
n_kv_head = 0                # key/value heads (grouped-query attention); 0 = n_head
mlp_hidden = 0               # MLP width; 0 = the model's rule
lora_r = 0                   # > 0: LoRA of this rank on q,k,v,proj (frozen base, as train.py's LoRA)
lora_dropout = 0.05          # train.py's default
lora_base_dtype = 'float32'  # the frozen base's Linear weights: 'float32' | 'bfloat16' (train.py's key)
sdpa_backend = 'auto'        # 'auto' | 'flash' | 'cudnn' | 'efficient': restrict SDPA to one kernel
activation_checkpointing = False
device = 'auto'
dtype = 'auto'
compile = False
compile_mode = 'default'     # torch.compile's mode, e.g. 'max-autotune-no-cudagraphs'
warmup_steps = 3             # untimed steps (compilation, allocator warm-up)
steps = 10                   # timed steps
profile = ''                 # a file for torch.profiler's table of the slowest ops, '' = none
profile_steps = 3
out = ''                     # a JSON file for the figures, '' = print only
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd'))])

device = pick_device(device)
device_type = device.split(':')[0]
ptdtype = pick_dtype(device, dtype)
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                      mlp=mlp, n_kv_head=n_kv_head, mlp_hidden=mlp_hidden))
model.activation_checkpointing = activation_checkpointing
if lora_r:
    apply_lora(model, lora_r, 2 * lora_r, lora_dropout)
    cast_frozen_base(model, getattr(torch, lora_base_dtype))
model.to(device)
optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
if sdpa_backend != 'auto':
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = dict(flash=SDPBackend.FLASH_ATTENTION, cudnn=SDPBackend.CUDNN_ATTENTION,
                   efficient=SDPBackend.EFFICIENT_ATTENTION)[sdpa_backend]
    sdpa_kernel(backend).__enter__()  # for the whole run
if compile:  # as train.py compiles: block by block, and the loss
    model.compile_blocks(compile_mode)
x = torch.randint(vocab_size, (batch_size, block_size), device=device)
y = torch.randint(vocab_size, (batch_size, block_size), device=device)


def sync():
    if device_type == 'cuda':
        torch.cuda.synchronize()


def train_step():
    with autocast_context(device, ptdtype):
        _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


times = []
for i in range(warmup_steps + steps):
    sync()
    t0 = time.perf_counter()
    train_step()
    sync()
    if i >= warmup_steps:
        times.append(time.perf_counter() - t0)
if profile:
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == 'cuda' else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(profile_steps):
            train_step()
        sync()
    sort = 'cuda_time_total' if device_type == 'cuda' else 'cpu_time_total'
    with open(profile, 'w') as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90))

step_time = statistics.median(times)
tokens_per_sec = batch_size * block_size / step_time
device_name = torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type
mfu = model.estimate_mfu(tokens_per_sec, device_name)
peak = peak_memory_bytes(device)
print(f"{device_name}, {ptdtype}, compile={compile and compile_mode}, sdpa={sdpa_backend}, lora_r={lora_r} ({lora_base_dtype} base), "
      f"{model.get_num_params() / 1e6:.2f}M params, "
      f"batch {batch_size} x {block_size}: median step {step_time * 1000:.1f} ms, {tokens_per_sec:,.0f} tokens/s, "
      + (f"MFU {mfu * 100:.1f}%" if mfu is not None else "MFU unknown (no peak-FLOPs figure for this device)")
      + (f", peak memory {peak / 2**20:.0f} MiB" if peak else ""))
if out:
    with open(out, 'w') as f:
        json.dump(dict(device=device_name, dtype=str(ptdtype), compile=compile and compile_mode, batch_size=batch_size,
                       block_size=block_size, params=model.get_num_params(), step_ms=step_time * 1000,
                       tokens_per_sec=tokens_per_sec, mfu=mfu, peak_memory_mb=peak / 2**20 if peak else None), f, indent=1)
