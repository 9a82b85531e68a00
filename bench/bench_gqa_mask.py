"""
Grouped-query attention with a mask (packed SFT/DPO rows, sliding windows): tokens/s and peak memory of a training
step with model.attend as it is (keys/values repeated to the query heads, so a fused kernel takes the mask) against
the path before the fix (SDPA's enable_gqa with the mask: on CUDA only the math kernel takes that pair, and it
builds (B, H, T, T) scores), and the same rows without a mask (is_causal, flash) as the ceiling.
    python bench/bench_gqa_mask.py                      # SmolLM2-135M's shape, 8 rows of 2,048 tokens
    python bench/bench_gqa_mask.py --shape=llama1b --batch_size=2
Each row packs documents of 128-1,024 tokens (doc_ids). Median of `steps` timed steps after `warmup_steps`.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn.functional as F

import model as model_module
from configurator import configure, one_of, check_values
from model import GPT, GPTConfig
from run.device import autocast_context, pick_device, pick_dtype

# -----------------------------------------------------------------------------
shape = 'smollm2'            # 'smollm2' (SmolLM2-135M: 30 x 576, 9 / 3 heads) | 'llama1b' (16 x 2048, 32 / 8 heads)
batch_size = 8
block_size = 2048
paths = 'repeat,enable_gqa,no_mask'  # which attention paths to time
device = 'auto'
dtype = 'auto'
warmup_steps = 2
steps = 8
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(one_of(('smollm2', 'llama1b')), ('shape',))])
SHAPES = dict(
    smollm2=dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp='swiglu', mlp_hidden=1536, vocab_size=49152),
    llama1b=dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, mlp='swiglu', mlp_hidden=8192, vocab_size=128256),
)
device = pick_device(device)
ptdtype = pick_dtype(device, dtype)
fixed_attend = model_module.attend


def enable_gqa_attend(q, k, v, dropout_p=0.0, causal=True, mask=None):
    """model.attend before the fix."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=causal and mask is None, enable_gqa=q.size(1) != k.size(1))


def sync():
    if device.startswith('cuda'):
        torch.cuda.synchronize()


torch.manual_seed(0)
model = GPT(GPTConfig(block_size=block_size, **SHAPES[shape])).to(device)
optimizer = model.configure_optimizers(0.1, 1e-5, (0.9, 0.95), device.split(':')[0])
g = torch.Generator().manual_seed(0)
x = torch.randint(model.config.vocab_size, (batch_size, block_size), generator=g).to(device)
lengths = torch.randint(128, 1025, (batch_size, block_size // 128), generator=g)
doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), row)[:block_size] for row in lengths]).to(device)
results = {}
for path in paths.split(','):
    model_module.attend = enable_gqa_attend if path == 'enable_gqa' else fixed_attend
    if device.startswith('cuda'):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for i in range(warmup_steps + steps):
            sync()
            t0 = time.perf_counter()
            with autocast_context(device, ptdtype):
                _, loss = model(x, x, doc_ids=None if path == 'no_mask' else doc_ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            if i >= warmup_steps:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        results[path] = None
        print(f"{path}: out of memory")
        continue
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith('cuda') else float('nan')
    results[path] = (batch_size * block_size / statistics.median(times), peak)
    print(f"{path}: {results[path][0]:,.0f} tokens/s, peak {peak:.1f} GiB", flush=True)
model_module.attend = fixed_attend
name = torch.cuda.get_device_name() if device.startswith('cuda') else device
print(f"\n{name}, {ptdtype}, {shape} shape, {batch_size} rows x {block_size} tokens packed with documents")
print("| attention path | tokens/s | peak memory |\n|---|---|---|")
for path, r in results.items():
    print(f"| {path} | " + (f"{r[0]:,.0f} | {r[1]:.1f} GiB |" if r else "out of memory | - |"))
