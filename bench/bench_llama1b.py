"""
Fine-tuning a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, vocab 128,256,
tied: 1.24B parameters) of random bf16 weights at 2,048 tokens per sequence, in the style of torchtune's table:
tokens/s and peak memory of train.py (full SFT, LoRA, each with activation checkpointing off and on; FSDP with and
without CPU offload under torchrun) and of train_dpo.py (frozen-copy reference padded and padding-free, the
precomputed reference, LoRA with adapters off as the reference). Speed and memory do not depend on the weights.

    python bench/bench_llama1b.py --tokenizer_folder=models/smollm2-135m-instruct       # a GPU
    python bench/bench_llama1b.py --tokenizer_folder=... --hidden_size=64 --layers=2 --vocab_size=49152 --device=cpu

Each mode runs the real script in a fresh process on the same model folder (written once under out, with the
tokenizer files of tokenizer_folder) and the same data: synthetic chat examples that fill 2,048 tokens after
truncation, and preference pairs of a 1,536-token prompt with two 512-token completions. The process is killed
(SIGKILL, so it writes no checkpoint) once its log holds `windows` + 1 logging windows; the first window (warm-up)
is dropped and the table gives the median tokens/s of the rest and the last window's peak memory (CUDA: torch's
max allocated). Writes out/results.json and prints a Markdown table.
"""

import json
import os
import random
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
hidden_size = 2048           # the shape (defaults: Llama-3.2-1B's); smaller for a CPU check of the machinery
layers = 16
vocab_size = 128256
seq_len = 2048               # tokens per sequence (SFT rows; DPO prompt + completion)
sft_batch_size = 4           # sequences per micro-batch
dpo_batch_size = 2           # preference pairs per micro-batch
log_interval = 3             # steps per logging window
windows = 3                  # timed windows after the first
extra_flags = ''            # more flags for every mode's script, e.g. '--compile=True --lora_base_dtype=bfloat16'
modes = 'all'                # 'all' or a comma-separated subset of MODES' names (sft,lora,dpo_packed,...)
device = 'cuda'
timeout = 600                # seconds a mode may take
out = os.path.join(ROOT, 'bench', 'results', 'llama1b')
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('hidden_size', 'layers', 'vocab_size', 'seq_len', 'sft_batch_size',
                                     'dpo_batch_size', 'log_interval', 'windows', 'timeout'))])

TORCHRUN = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1']
SFT = ['train.py', '--training_type=sft', f'--batch_size={sft_batch_size}']
LORA = ['train.py', '--training_type=lora', f'--batch_size={sft_batch_size}', '--lora_r=16', '--lora_alpha=32',
        '--lora_target_modules=q_proj,k_proj,v_proj,o_proj']
DPO = ['train_dpo.py', f'--batch_size={dpo_batch_size}']
MODES = {  # name: (what the table calls it, the command)
    'sft': ('SFT, full', SFT),
    'sft_ac': ('SFT, full, activation checkpointing', SFT + ['--activation_checkpointing=True']),
    'lora': ('SFT, LoRA r=16 on q,k,v,o', LORA),
    'lora_ac': ('SFT, LoRA, activation checkpointing', LORA + ['--activation_checkpointing=True']),
    'fsdp': ('SFT, full, FSDP (torchrun, 1 GPU)', ['torchrun'] + SFT + ['--parallel=fsdp']),
    'fsdp_offload': ('SFT, full, FSDP + CPU offload (torchrun, 1 GPU)',
                     ['torchrun'] + SFT + ['--parallel=fsdp', '--fsdp_cpu_offload=True']),
    'dpo_padded': ('DPO, frozen copy, padded', DPO + ['--pack=False']),
    'dpo_packed': ('DPO, frozen copy, padding-free', DPO + ['--pack=True']),
    'dpo_precomputed': ('DPO, precomputed reference, padding-free',
                        DPO + ['--pack=True', '--precompute_ref_logps=True']),
    'dpo_lora': ('DPO, LoRA r=16 (adapters off = reference), padding-free',
                 DPO + ['--pack=True', '--use_lora=True', '--lora_r=16', '--lora_alpha=32']),
}
chosen = list(MODES) if modes == 'all' else [m.strip() for m in modes.split(',')]
unknown = [m for m in chosen if m not in MODES]
if unknown:
    sys.exit(f"unknown modes {unknown}; choose from: {', '.join(MODES)}")


def words(rng, n):
    return ' '.join(''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(3, 8)))
                    for _ in range(n))


def write_jsonl(path, rows):
    with open(path, 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in rows)


def write_data(folder):
    """Chat examples longer than seq_len (truncated to it), preference pairs of a long prompt and two
    completions (random lowercase words: about 3.6 tokens each in SmolLM2's tokenizer)."""
    rng = random.Random(0)
    sft, dpo = os.path.join(folder, 'sft'), os.path.join(folder, 'dpo')
    os.makedirs(sft, exist_ok=True)
    os.makedirs(dpo, exist_ok=True)
    for split, n in (('train', 64), ('val', 8)):
        write_jsonl(os.path.join(sft, f'{split}.jsonl'),
                    [dict(prompt=words(rng, seq_len // 8), response=words(rng, seq_len // 4)) for _ in range(n)])
        write_jsonl(os.path.join(dpo, f'{split}.jsonl'),
                    [dict(prompt=words(rng, seq_len // 4), chosen=words(rng, seq_len // 14),
                          rejected=words(rng, seq_len // 14)) for _ in range(n)])
    return sft, dpo


def run(name, flags, model_folder, sft_data, dpo_data):
    run_dir = os.path.join(out, name)
    launcher, script = (TORCHRUN, flags[1:]) if flags[0] == 'torchrun' else ([sys.executable], flags)
    dpo = script[0] == 'train_dpo.py'
    args = [*launcher, *script, f'--init_from={model_folder}', f'--out_dir={run_dir}', '--resume=False',
            f'--device={device}', f'--log_interval={log_interval}', '--max_iters=100000', '--eval_interval=100000',
            '--tensorboard=False', '--exact_match_examples=0', '--warmup_iters=1', '--learning_rate=1e-5']
    args += extra_flags.split()
    args += ([f'--dpo_data={dpo_data}', f'--max_length={seq_len}', f'--max_prompt_length={seq_len * 3 // 4}',
              '--eval_pairs=2'] if dpo else
             [f'--sft_data={sft_data}', f'--block_size={seq_len}', f'--max_length={seq_len}', '--eval_iters=1',
              '--sample_tokens=0'])
    t0 = time.time()
    timed, output = run_until_logged(args, os.path.join(run_dir, 'log.jsonl'), 'tokens_per_sec', windows + 1, timeout)
    if len(timed) < windows + 1:
        sys.exit(f"{name}: {len(timed)} logging windows in {time.time() - t0:.0f} s\n{' '.join(args)}\n"
                 f"{output[-4000:]}")
    timed = timed[1:]
    return dict(tokens_per_sec=statistics.median(e['tokens_per_sec'] for e in timed),
                steps_per_sec=statistics.median(e.get('steps_per_sec', 0) for e in timed),
                mfu=statistics.median(e['mfu'] for e in timed) if timed[0].get('mfu') is not None else None,
                peak_memory_mb=timed[-1]['peak_memory_mb'], steps=log_interval * windows,
                wall_s=time.time() - t0,
                command=' '.join(['torchrun --nproc_per_node=1' if launcher == TORCHRUN else 'python', *script,
                                  *extra_flags.split()]))


signal.signal(signal.SIGTERM, lambda *_: sys.exit('stopped (SIGTERM)'))  # kill the running mode too
os.makedirs(out, exist_ok=True)
model_folder, hf_config = random_llama_folder(out, hidden_size, layers, vocab_size, tokenizer_folder)
sft_data, dpo_data = write_data(out)
results = {}
for name in chosen:
    results[name] = dict(mode=MODES[name][0], **run(name, MODES[name][1], model_folder, sft_data, dpo_data))
    print(f"{name}: {results[name]}", flush=True)
with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(dict(config=config, hf_config=hf_config, results=results), f, indent=1)
print(f"\n{device}, Llama-shaped {layers} x {hidden_size}, vocab {vocab_size}, {seq_len} tokens per sequence; "
      f"SFT micro-batch {sft_batch_size} sequences, DPO {dpo_batch_size} pairs; median of {windows} windows "
      f"of {log_interval} steps after one")
print("| mode | tokens/s | MFU | peak memory |\n|---|---|---|---|")
for r in results.values():
    print(f"| {r['mode']} | {r['tokens_per_sec']:,.0f} | " + (f"{r['mfu'] * 100:.1f}%" if r['mfu'] else '-')
          + f" | {r['peak_memory_mb'] / 1024:.1f} GiB |")
