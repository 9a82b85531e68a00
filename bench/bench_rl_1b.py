"""
train_rl.py on a 1B published-model shape, on a GPU: generation tokens/s, steps/s and the split of a step
between rollouts and training. The model is Llama-3.2-1B's body (hidden 2048, 16 layers, 32 heads / 8 KV heads,
MLP 8192) with SmolLM2's tokenizer and its 49,152-token vocabulary (1.07B parameters), random bf16 weights:
speed and memory do not depend on the weights, and a random model never stops early, so every completion runs
to max_new_tokens (the slowest case). Prompts are the embedded number tasks in SmolLM2's chat template; the
reward is bench/digits_reward.py (a verifier would score every completion of a random model 0).

    python bench/bench_rl_1b.py --tokenizer_folder=models/smollm2-135m-instruct      # a GPU
    python bench/bench_rl_1b.py --tokenizer_folder=... --hidden_size=64 --layers=2 --device=cpu --steps=2

Decoding, today's and before (issue 54): the modes ending in _eager sample as train_rl.py did before, every
kernel launched, the adapters unmerged (`--compile_decode=False --merged_rollouts=False`); the others as it does
on a GPU by default, from a bf16 copy with the adapters merged, each decode step a CUDA graph over a static KV
cache (`--compile_decode=True --merged_rollouts=True`), so a pair (`--modes=large_lora_eager,large_lora`) is the
old and the new path side by side on one card. A compiled mode's first steps compile (`warmup` covers them).

Each mode runs `train_rl.py config/rl_hf.py` (the SmolLM2 recipe: LoRA r=16 on every linear layer, dapo) in a
fresh process with the mode's flags; the process is killed (SIGKILL, no checkpoint) once its log holds
`warmup` + `steps` steps, and the table gives the medians of the steps after the warm-up. Writes out/results.json.
"""

import json
import os
import signal
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'bench'))

from configurator import at_least, check_values, configure
from hf_parity import random_llama_folder
from logged_run import run_until_logged

# -----------------------------------------------------------------------------
tokenizer_folder = 'models/smollm2-135m-instruct'  # a Hugging Face folder whose tokenizer files are copied
hidden_size = 2048           # the shape (Llama-3.2-1B's); smaller for a CPU check of the machinery
layers = 16
vocab_size = 49152           # the tokenizer's: a random model samples every id, and each must decode
warmup = 2                   # steps at the start that are not timed (allocator, kernels, compilation)
steps = 4                    # timed steps per mode
modes = 'all'                # 'all' or a comma-separated subset of MODES' names
extra_flags = ''             # train_rl.py flags after every mode's own, space-separated (they win)
device = 'cuda'
timeout = 300                # seconds a mode may take (a compiled one compiles first)
out = os.path.join(ROOT, 'bench', 'results', 'rl_1b')
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('hidden_size', 'layers', 'vocab_size', 'steps', 'timeout')),
                      (at_least(0), ('warmup',))])

LARGE = ['--prompts_per_step=32', '--max_new_tokens=256', '--gradient_accumulation_steps=2']
EAGER = ['--compile_decode=False', '--merged_rollouts=False']  # rollouts as before issue 54
FAST = ['--compile_decode=True', '--merged_rollouts=True']  # the GPU defaults since
MODES = {  # name: (what the table calls it, flags on top of config/rl_hf.py)
    'recipe_eager': ('config/rl_hf.py as is: 8 prompts x 8, 32 new tokens, LoRA, float32 base; eager rollouts', EAGER),
    'recipe': ('the same, rollouts compiled from a merged bf16 copy', FAST),
    'recipe_bf16': ('the same, bf16 base', ['--lora_base_dtype=bfloat16'] + FAST),
    'large_lora_eager': ('32 prompts x 8, 256 new tokens, LoRA, bf16 base; eager rollouts, adapters unmerged',
                         LARGE + ['--lora_base_dtype=bfloat16'] + EAGER),
    'large_lora_merged': ('the same, eager rollouts from a merged bf16 copy',
                          LARGE + ['--lora_base_dtype=bfloat16', '--compile_decode=False', '--merged_rollouts=True']),
    'large_lora': ('the same, compiled rollouts (CUDA graphs) from a merged bf16 copy',
                   LARGE + ['--lora_base_dtype=bfloat16'] + FAST),
    'large_qlora': ('the same, NF4 base (the copy dequantized and merged)', LARGE + ['--lora_base_dtype=nf4'] + FAST),
    'large_full_eager': ('32 prompts x 8, 256 new tokens, all weights; eager rollouts', LARGE + ['--use_lora=False',
                                                                                              '--compile_decode=False']),
    'large_full': ('the same, compiled rollouts', LARGE + ['--use_lora=False', '--compile_decode=True']),
    'large_lora_compile': ('32 prompts x 8, 256 new tokens, LoRA, bf16 base, compiled training forward and rollouts',
                           LARGE + ['--lora_base_dtype=bfloat16', '--compile=True'] + FAST),
}
chosen = list(MODES) if modes == 'all' else [m.strip() for m in modes.split(',')]
unknown = [m for m in chosen if m not in MODES]
if unknown:
    sys.exit(f"unknown modes {unknown}; choose from: {', '.join(MODES)}")


def run(name, flags, model_folder):
    run_dir = os.path.join(out, name)
    args = [sys.executable, 'train_rl.py', 'config/rl_hf.py', f'--init_from={model_folder}', f'--out_dir={run_dir}',
            '--resume=False', f'--device={device}', '--log_interval=1', '--max_iters=100000',
            '--eval_interval=100000', '--tensorboard=False', '--exact_match_examples=0', '--eval_prompts=8',
            '--pass_k=2', '--reward=bench/digits_reward.py:digits', *flags, *extra_flags.split()]
    t0 = time.time()
    logged, output = run_until_logged(args, os.path.join(run_dir, 'log.jsonl'), 'time/generation_s', warmup + steps,
                                      timeout)
    if len(logged) < warmup + steps:
        return dict(failed=f"{len(logged)} steps in {time.time() - t0:.0f} s", output=output[-1500:],
                    command=' '.join(args[1:]))
    timed = logged[warmup:warmup + steps]
    generation = statistics.median(e['time/generation_s'] for e in timed)
    training = statistics.median(e['time/training_s'] for e in timed)
    return dict(steps_per_sec=statistics.median(1 / (e['time/generation_s'] + e['time/training_s']) for e in timed),
                generation_s=generation, training_s=training,
                generation_tokens_per_sec=statistics.median(e['generation/tokens_per_sec'] for e in timed),
                merge_s=statistics.median(e.get('time/merge_s', 0.0) for e in timed),
                completion_length=statistics.median(e['completions/mean_length'] for e in timed),
                peak_memory_mb=timed[-1]['peak_memory_mb'], wall_s=time.time() - t0,
                command=' '.join(['python', *args[1:]]))


signal.signal(signal.SIGTERM, lambda *_: sys.exit('stopped (SIGTERM)'))  # kill the running mode too
os.makedirs(out, exist_ok=True)
model_folder, hf_config = random_llama_folder(out, hidden_size, layers, vocab_size, tokenizer_folder)
results = {}
for name in chosen:
    results[name] = dict(mode=MODES[name][0], **run(name, MODES[name][1], model_folder))
    print(f"{name}: {json.dumps(results[name])}", flush=True)
    with open(os.path.join(out, 'results.json'), 'w') as f:  # after every mode: a later one may time out
        json.dump(dict(config=config, hf_config=hf_config, results=results), f, indent=1)
print(f"\n{device}, Llama-shaped {layers} x {hidden_size}, vocab {vocab_size}, random weights; medians of "
      f"{steps} steps after {warmup}")
print("| mode | steps/s | rollouts s | training s (merge s) | generated tokens/s | peak memory |\n"
      "|---|---|---|---|---|---|")
for r in results.values():
    if 'failed' in r:
        print(f"| {r['mode']} | failed: {r['failed']} | | | | |")
        continue
    print(f"| {r['mode']} | {r['steps_per_sec']:.2f} | {r['generation_s']:.2f} | {r['training_s']:.2f} "
          f"({r['merge_s']:.3f}) | {r['generation_tokens_per_sec']:,.0f} | {r['peak_memory_mb'] / 1024:.1f} GiB |")
for new, old in (('large_lora', 'large_lora_eager'), ('large_full', 'large_full_eager'), ('recipe', 'recipe_eager')):
    if 'steps_per_sec' in results.get(new, {}) and 'steps_per_sec' in results.get(old, {}):
        ratio = results[new]['generation_tokens_per_sec'] / results[old]['generation_tokens_per_sec']
        print(f"{new} / {old}: generated tokens/s {ratio:.2f}x")
