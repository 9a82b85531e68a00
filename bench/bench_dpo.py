"""
DPO throughput and memory: train_dpo.py's steps/s and peak memory with each kind of reference (a
frozen copy, precomputed log-probs, the LoRA model with adapters disabled) and with padded vs
padding-free (packed) batches. Every mode runs train_dpo.py itself in a fresh process, on the same
model and data, rounds alternating the modes; the table gives medians over rounds.

    python bench/bench_dpo.py                          # CPU, a 4x256 model, the embedded number-task pairs
    python bench/bench_dpo.py --n_layer=12 --n_head=12 --n_embd=768 --device=cuda

The policy starts from a random chat model of the given shape (speed and memory do not depend on
the weights), saved as an SFT checkpoint under bench/results/. steps/s is the median over the
logging windows after the first; peak memory is the process's maximum resident set size (it
includes PyTorch itself, ~0.3-0.5 GiB on CPU) and, on CUDA, torch's peak allocated memory. The
precomputed mode's one-off pass over the data is reported separately.
"""

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configurator import at_least, check_values, configure
from data import prepare_default
from lm.tokenizer import ChatTokenizer, load_tokenizer
from model import GPT, GPTConfig
from run.checkpoint import save_checkpoint

# -----------------------------------------------------------------------------
n_layer = 4
n_head = 4
n_embd = 256
block_size = 64
batch_size = 32              # pairs per step
steps = 60                   # optimizer steps per run (the first logging window is not timed)
log_interval = 10
rounds = 3                   # each mode once per round, modes alternating
device = 'cpu'
dtype = 'auto'
num_threads = 0              # 0 = torch's default
out = os.path.join(ROOT, 'bench', 'results', 'dpo')
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('batch_size', 'log_interval', 'block_size', 'n_layer', 'n_head', 'n_embd')),
                      (at_least(0), ('num_threads',))])

MODES = {
    'frozen copy, padded': ['--pack=False'],
    'frozen copy, padding-free': ['--pack=True'],
    'precomputed, padded': ['--precompute_ref_logps=True', '--pack=False'],
    'precomputed, padding-free': ['--precompute_ref_logps=True', '--pack=True'],
    'LoRA, adapters off, padded': ['--use_lora=True', '--pack=False'],
    'LoRA, adapters off, padding-free': ['--use_lora=True', '--pack=True'],
}

os.makedirs(out, exist_ok=True)
os.chdir(ROOT)
tokenizer = ChatTokenizer(load_tokenizer(prepare_default()))
model_args = dict(block_size=block_size, vocab_size=tokenizer.vocab_size, n_layer=n_layer, n_head=n_head,
                  n_embd=n_embd, dropout=0.0, bias=False)
model = GPT(GPTConfig(**model_args))
init = os.path.join(out, 'init.pt')
save_checkpoint(init, dict(kind='gpt', model=model.state_dict(), model_args=model.model_args(),
                           config={'training_type': 'sft'}, tokenizer=tokenizer.identity(),
                           data_dir=os.path.abspath(os.path.join('data', 'stdlib'))))


def run(name, flags, round_):
    run_dir = os.path.join(out, f'run_{list(MODES).index(name)}')
    args = [sys.executable, 'train_dpo.py', f'--init_from={init}', f'--out_dir={run_dir}', '--resume=False',
            f'--batch_size={batch_size}', f'--max_iters={steps}', f'--log_interval={log_interval}',
            f'--eval_interval={10 * steps}', '--eval_pairs=32', '--exact_match_examples=0', '--tensorboard=False',
            f'--device={device}', f'--dtype={dtype}', f'--num_threads={num_threads}', *flags]
    if os.path.exists(run_dir):  # a fresh run, and a fresh reference cache for the precomputed modes
        for f in os.listdir(run_dir):
            if f.endswith('.pt') or f == 'log.jsonl':
                os.remove(os.path.join(run_dir, f))
    t0 = time.time()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"{name} failed:\n{output[-3000:]}")
    with open(os.path.join(run_dir, 'log.jsonl')) as f:
        events = [json.loads(line) for line in f if line.strip()]
    windows = [e for e in events if 'steps_per_sec' in e][1:]
    precompute = next((float(line.split(' computed in ')[1].split(' s')[0]) for line in output.splitlines()
                       if 'reference log-probs of' in line), None)
    return dict(steps_per_sec=statistics.median(e['steps_per_sec'] for e in windows),
                tokens_per_sec=statistics.median(e['tokens_per_sec'] for e in windows),
                peak_rss_mb=usage.ru_maxrss / 1024, peak_allocated_mb=windows[-1]['peak_memory_mb'],
                precompute_s=precompute, wall_s=time.time() - t0, loss=windows[-1]['loss'])


results = {name: [] for name in MODES}
for round_ in range(rounds):
    names = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
    for name in names:
        results[name].append(run(name, MODES[name], round_))
        print(f"round {round_ + 1}: {name}: {results[name][-1]}", flush=True)

median = lambda name, key: statistics.median(r[key] for r in results[name])
base = median('frozen copy, padded', 'steps_per_sec')
print(f"\n{device}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params ({n_layer}x{n_embd}), "
      f"{batch_size} pairs per step, {steps} steps, medians of {rounds} rounds")
print("| reference, batches | steps/s | vs frozen copy, padded | tokens/s | peak RSS | peak allocated (CUDA) "
      "| one-off precompute |")
print("|---|---|---|---|---|---|---|")
for name in MODES:
    pre = median(name, 'precompute_s') if results[name][0]['precompute_s'] is not None else None
    print(f"| {name} | {median(name, 'steps_per_sec'):.2f} | {median(name, 'steps_per_sec') / base:.2f}x "
          f"| {median(name, 'tokens_per_sec'):,.0f} | {median(name, 'peak_rss_mb'):,.0f} MiB "
          + (f"| {median(name, 'peak_allocated_mb'):,.0f} MiB | " if device.startswith('cuda') else "| - | ")
          + (f"{pre:.1f} s |" if pre is not None else "- |"))
with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(dict(config=config, results=results), f, indent=1)
