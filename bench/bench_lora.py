"""
LoRA vs full fine-tuning of the same model: trainable parameters, optimizer-state bytes, activation
memory kept for backward, peak memory and step time. Each mode runs in a fresh process, so peak
memory (CUDA: max allocated; CPU: max resident set size, which includes PyTorch itself) is its own.
`python bench/bench_lora.py` (the default train.py shape), or e.g.
`python bench/bench_lora.py --n_layer=12 --n_head=12 --n_embd=768 --block_size=1024 --vocab_size=50304 --lora_target_modules=all-linear`
"""

import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from configurator import POSITIVE, at_least, check_values, configure
from lm.lora import apply_lora, lora_optimizer
from memory import peak_memory_bytes, synchronize
from model import GPT, GPTConfig
from run.device import autocast_context, pick_device, pick_dtype

# -----------------------------------------------------------------------------
mode = 'all'                 # 'all' (each mode below in its own process, then a table) | 'full' | 'lora'
batch_size = 16
block_size = 128
vocab_size = 4100            # the default tokenizer's 4096 plus the 4 chat tokens
n_layer = 4
n_head = 4
n_embd = 128
lora_r = 8
lora_alpha = 16.0
lora_target_modules = 'attn.q,attn.k,attn.v,attn.proj'  # as train.py's default, or 'all-linear'
activation_checkpointing = False
device = 'auto'
dtype = 'auto'
warmup_steps = 3             # untimed steps
steps = 10                   # timed steps
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'lora_r')),
                      (POSITIVE, ('lora_alpha',))])

if mode == 'all':
    rows = []
    for m in ('full', 'lora'):
        args = [f'--{k}={v}' for k, v in config.items() if k != 'mode'] + [f'--mode={m}']
        out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    full = rows[0]
    print(f"{full['device']}, {full['dtype']}, batch {batch_size} x {block_size}, "
          f"LoRA r={lora_r} on {lora_target_modules}")
    print("| | trainable params | optimizer state | activations saved for backward | peak memory | step time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['trainable']:,} ({100 * r['trainable'] / r['params']:.2f}%) "
              f"| {r['optimizer_bytes'] / 2**20:.2f} MiB | {r['activation_bytes'] / 2**20:.1f} MiB "
              f"| {r['peak_bytes'] / 2**20:.0f} MiB | {r['step_ms']:.1f} ms |")
    sys.exit(0)

device = pick_device(device)
device_type = device.split(':')[0]
ptdtype = pick_dtype(device, dtype)
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
if mode == 'lora':
    apply_lora(model, lora_r, lora_alpha, target_modules=lora_target_modules)
model.activation_checkpointing = activation_checkpointing
model.to(device)
optimizer = (lora_optimizer(model, 0.1, 1e-4, (0.9, 0.95), device_type) if mode == 'lora'
             else model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type))  # trainable parameters only
x = torch.randint(vocab_size, (batch_size, block_size), device=device)
y = torch.randint(vocab_size, (batch_size, block_size), device=device)

# bytes of the activations autograd keeps for backward in the last forward (parameters it keeps don't count)
saved, param_storage = [], {p.data_ptr() for p in model.parameters()}


def pack(t):
    if t.data_ptr() not in param_storage:
        saved.append(t.numel() * t.element_size())
    return t


times = []
for i in range(warmup_steps + steps):
    synchronize(device)
    t0 = time.perf_counter()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context(device, ptdtype):
        _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    if i >= warmup_steps:
        times.append(time.perf_counter() - t0)

optimizer_bytes = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                      for t in state.values() if torch.is_tensor(t))
print(json.dumps(dict(mode=mode, device=torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type,
                      dtype=str(ptdtype), params=sum(p.numel() for p in model.parameters()),
                      trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                      optimizer_bytes=optimizer_bytes, activation_bytes=sum(saved),
                      peak_bytes=peak_memory_bytes(device), step_ms=1000 * statistics.median(times))))
