"""
Batched generation (lm/generate.py's generate_batch) against one prompt at a time through
GPT.generate: tokens/s on num_prompts prompts of mixed lengths, both with the KV cache, alternating
in one process. `python bench/bench_generate.py` (model.py's default shape, random weights, CPU), or
e.g. `--num_prompts=64 --max_new_tokens=128 --device=cuda`. Every prompt gets max_new_tokens new
tokens (no stop ids), so both produce the same count; the median of `repeats` runs is reported.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from configurator import at_least, check_values, configure
from lm.generate import generate_batch
from model import GPT, GPTConfig
from run.device import pick_device

# -----------------------------------------------------------------------------
num_prompts = 16
min_prompt_len = 16
max_prompt_len = 128
max_new_tokens = 64
temperature = 0.0            # 0: greedy
repeats = 3
device = 'cpu'               # 'auto' picks a GPU when there is one
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('num_prompts', 'min_prompt_len', 'max_new_tokens', 'repeats'))])
device = pick_device(device)


def sync():
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


torch.manual_seed(0)
model = GPT(GPTConfig()).to(device).eval()
g = torch.Generator().manual_seed(0)
lengths = torch.randint(min_prompt_len, max_prompt_len + 1, (num_prompts,), generator=g).tolist()
prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
sampling = dict(temperature=temperature)


def batched():
    return generate_batch(model, prompts, max_new_tokens, **sampling)


def one_at_a_time():
    return [model.generate(torch.tensor([p], device=device), max_new_tokens, **sampling)[0, len(p):].tolist()
            for p in prompts]


print(f"{num_prompts} prompts of {min(lengths)}-{max(lengths)} tokens, {max_new_tokens} new tokens each, "
      f"{model.get_num_params() / 1e6:.1f}M parameters, {device}, {torch.get_num_threads()} threads")
batched(), one_at_a_time()  # warm-up
seconds = {'batched': [], 'one at a time': []}
for _ in range(repeats):
    out_batch, t = timed(batched)
    seconds['batched'].append(t)
    out_single, t = timed(one_at_a_time)
    seconds['one at a time'].append(t)
tokens = num_prompts * max_new_tokens
rates = {name: tokens / statistics.median(ts) for name, ts in seconds.items()}
for name, rate in rates.items():
    print(f"{name:>14}: {rate:9,.0f} tokens/s  (runs: {', '.join(f'{t:.2f}s' for t in seconds[name])})")
print(f"batched / one at a time: {rates['batched'] / rates['one at a time']:.2f}x")
same = sum(a == b for a, b in zip(out_batch, out_single))
print(f"completions equal token for token: {same}/{num_prompts} (float32: a near tie may flip a greedy choice)")
