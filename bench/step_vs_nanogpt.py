"""
One training step of the same model, nanoGPT's code against ours, in one process: nanoGPT's GPT and
configure_optimizers (imported from an unmodified checkout) and model.GPT with nanoGPT's architecture
(learned positions, LayerNorm, GELU, no biases, tied head) and our configure_optimizers, at the CPU
quickstart's shape (4 x 128, block 64, batch 12, vocab 65). The two alternate in short blocks, so
machine noise hits both alike; speedrun.py's tokens/s comparison runs each whole training script in
its own process instead. Also times forward+backward alone and the `mm` calls' share of a step.

    python bench/step_vs_nanogpt.py --nanogpt_dir=/tmp/nanoGPT
"""

import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from configurator import UserError, configure
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
nanogpt_dir = '/tmp/nanoGPT'     # an unmodified nanoGPT checkout (its model.py is imported)
rounds = 30                      # alternating blocks per implementation
steps_per_round = 5
threads = 2
# -----------------------------------------------------------------------------
configure(globals())
if not os.path.exists(os.path.join(nanogpt_dir, 'model.py')):
    raise UserError(f"nanogpt_dir={nanogpt_dir!r} has no model.py; clone https://github.com/karpathy/nanoGPT there "
                    f"or pass --nanogpt_dir.")
spec = importlib.util.spec_from_file_location('nanogpt_model', os.path.join(nanogpt_dir, 'model.py'))
nanogpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nanogpt)
torch.set_num_threads(threads)

shape = dict(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False)
torch.manual_seed(0)
theirs = nanogpt.GPT(nanogpt.GPTConfig(**shape))
ours = GPT(GPTConfig(**shape, pos_emb='learned', norm='layernorm', mlp='gelu', tie_embeddings=True))
optimizers = {'nanoGPT': theirs.configure_optimizers(0.1, 1e-3, (0.9, 0.99), 'cpu'),  # its CPU path: no fused AdamW
              'nanotrain': ours.configure_optimizers(0.1, 1e-3, (0.9, 0.99), 'cpu')}
models = {'nanoGPT': theirs, 'nanotrain': ours}
x, y = torch.randint(65, (12, 64)), torch.randint(65, (12, 64))


def train_step(name):  # what both train.py loops do per step: forward, backward, clip, AdamW
    _, loss = models[name](x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(models[name].parameters(), 1.0)
    optimizers[name].step()
    optimizers[name].zero_grad(set_to_none=True)


def forward_backward(name):
    _, loss = models[name](x, y)
    loss.backward()
    models[name].zero_grad(set_to_none=True)


times = {(kind, name): [] for kind in ('step', 'forward+backward') for name in models}
for name in models:
    for _ in range(5):
        train_step(name)  # warm-up
for _ in range(rounds):
    for (kind, name), ms in times.items():
        fn = train_step if kind == 'step' else forward_backward
        t0 = time.perf_counter()
        for _ in range(steps_per_round):
            fn(name)
        ms.append((time.perf_counter() - t0) / steps_per_round * 1000)

with torch.profiler.profile() as prof:
    for _ in range(20):
        train_step('nanotrain')
events = prof.key_averages()
mm_share = sum(e.self_cpu_time_total for e in events if e.key == 'aten::mm') / sum(e.self_cpu_time_total for e in events)

print(f"{threads} threads, batch 12 x 64, {rounds} rounds of {steps_per_round} steps, medians (ms):")
for kind in ('step', 'forward+backward'):
    a, b = (statistics.median(times[kind, name]) for name in ('nanoGPT', 'nanotrain'))
    print(f"  {kind}: nanoGPT {a:.2f}, nanotrain {b:.2f}, nanotrain's speed {a / b:.3f}x")
print(f"  aten::mm is {mm_share:.0%} of nanotrain's step (profiler self time)")
