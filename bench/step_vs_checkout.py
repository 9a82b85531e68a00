"""
One training step of this checkout's GPT against another checkout's (e.g. main before a change to model.py), the
same weights, in one process: alternating blocks of 2 steps, so machine noise hits both alike, compiled or eager;
then what a step adds to the peak resident memory (VmHWM, Linux), each side in a fresh process. The step is
bench_gpt.py's: forward with targets, backward, fused AdamW, at its default shape (4 x 128, block 128), float32.

    git worktree add /tmp/main main          # or: mkdir /tmp/main && git archive main | tar -x -C /tmp/main
    OMP_NUM_THREADS=1 python bench/step_vs_checkout.py --baseline=/tmp/main --vocab_size=50304 --batch_size=8
    OMP_NUM_THREADS=1 python bench/step_vs_checkout.py --baseline=/tmp/main --compile=True
"""

import importlib.util
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch

from configurator import UserError, at_least, check_values, configure

# -----------------------------------------------------------------------------
baseline = ''                # the other checkout (its model.py is imported); required
vocab_size = 4096
batch_size = 16
compile = False
rounds = 12                  # alternating blocks of 2 steps per side
peak = True                  # also each side's peak memory of a step, in fresh processes
side = ''                    # internal: 'baseline' or 'this' measures that side's peak memory and prints it
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('vocab_size', 'batch_size', 'rounds'))])
if not os.path.exists(os.path.join(baseline, 'model.py')):
    raise UserError(f"baseline={baseline!r} has no model.py; pass another checkout of nanotrain, e.g. "
                    f"`git worktree add /tmp/main main` and --baseline=/tmp/main.")


def gpt_module(folder):
    """model.py of folder, imported under its own name (its imports resolve to this checkout's other modules)."""
    spec = importlib.util.spec_from_file_location(f'model_{len(folder)}_{abs(hash(folder))}',
                                                  os.path.join(folder, 'model.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(module):
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig(vocab_size=vocab_size, n_layer=4, n_head=4, n_embd=128, block_size=128))
    return model, model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), 'cpu')


x, y = (torch.randint(vocab_size, (batch_size, 128), generator=torch.Generator().manual_seed(s)) for s in (1, 2))


def step(model, optimizer, call):
    _, loss = call(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def status(key):
    with open('/proc/self/status') as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


if side:  # one side's peak: VmHWM reset after two warm-up steps, then one step
    model, optimizer = build(gpt_module(baseline if side == 'baseline' else ROOT))
    step(model, optimizer, model)
    step(model, optimizer, model)
    before = status('VmRSS')
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    step(model, optimizer, model)
    print((status('VmHWM') - before) / 2**20)
    sys.exit(0)

sides = {'baseline': build(gpt_module(baseline)), 'this': build(gpt_module(ROOT))}
sides['this'][0].load_state_dict(sides['baseline'][0].state_dict())  # the same weights
calls = {name: torch.compile(model) if compile else model for name, (model, _) in sides.items()}
t0 = time.time()
first = {name: step(*sides[name], calls[name]) for name in sides}
print(f"first step (compiling: {compile}) {time.time() - t0:.0f} s; its loss: baseline {first['baseline']:.6f}, "
      f"this {first['this']:.6f}")
for name in sides:
    step(*sides[name], calls[name])
times = {name: [] for name in sides}
for r in range(rounds):
    for name in (('baseline', 'this') if r % 2 == 0 else ('this', 'baseline')):
        t = time.perf_counter()
        step(*sides[name], calls[name])
        step(*sides[name], calls[name])
        times[name].append((time.perf_counter() - t) / 2)
a, b = (statistics.median(times[name]) for name in ('baseline', 'this'))
print(f"vocab {vocab_size}, batch {batch_size} x 128, compile={compile}, {torch.get_num_threads()} thread(s): baseline "
      f"{a * 1000:.1f} ms, this checkout {b * 1000:.1f} ms a step (medians of {rounds} blocks of 2): {a / b:.3f}x")
if peak:
    args = [sys.executable, __file__, f'--baseline={baseline}', f'--vocab_size={vocab_size}',
            f'--batch_size={batch_size}']
    mib = {name: float(subprocess.run(args + [f'--side={name}'], capture_output=True, text=True, check=True)
                       .stdout.split()[-1]) for name in sides}
    print(f"a step adds to the peak resident memory (eager): baseline {mib['baseline']:.0f} MiB, "
          f"this checkout {mib['this']:.0f} MiB")
