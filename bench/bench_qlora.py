"""
LoRA on a published model with its frozen base in float32, bfloat16 and NF4 (QLoRA, lm/nf4.py), side by side:
the host memory of loading the model as train.py does (peak resident memory of a process that only builds it
and reads each of its tensors once),
and the README's LoRA recipe (config/lora_hf.py) run to its end with each base: its peak resident memory, its
steps/s and the held-out exact match of its merged model through eval.py (the first 200 test prompts, as the
report's table). A bf16 base computes under bf16 autocast (it must: train.py refuses otherwise); the float32 and
NF4 bases compute in float32 (the CPU default; on a GPU QLoRA computes in bf16).

    python bench/bench_qlora.py                       # models/smollm2-135m-instruct (docs/huggingface.md)
    python bench/bench_qlora.py --bases=nf4 --max_iters=20 --heldout=0   # a quick look
    python bench/bench_qlora.py --bases=bfloat16,nf4 --extra="--dtype=bfloat16 --seed=2" \
        --out=bench/results/qlora_bf16_seed2      # both computing in bf16, another seed
    # the recipe's training step alone (all-linear adapters, bf16 compute), the bases alternating in one process,
    # CPU time of one thread: what the 4-bit base costs, steady on a shared machine
    OMP_NUM_THREADS=1 python bench/bench_qlora.py --step_bench=True --bases=bfloat16,nf4 --out=bench/results/qlora_step
    # on a GPU, compiled, rows of 4,096 tokens (a bigger folder: --model=...), peak memory per base
    python bench/bench_qlora.py --step_bench=True --step_device=cuda --compile=True --bases=bfloat16,nf4 \
        --rows=4 --row_tokens=4096 --activation_checkpointing=True --out=bench/results/qlora_step_gpu
    # a Llama-3.2-1B-shaped folder of random bf16 weights, a few steps
    python bench/bench_qlora.py --llama_1b=True --max_iters=4 --heldout=0 --out=bench/results/qlora_1b \
        --extra="--batch_size=1 --gradient_accumulation_steps=1 --eval_iters=1 --exact_match_examples=0"

Writes <out>.json (bench/results/qlora.json) and prints the table (README's GPU-free memory table comes from it).
"""
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configurator import at_least, check_values, configure, one_of  # noqa: E402
from run.device import cpu_name  # noqa: E402

# -----------------------------------------------------------------------------
model = 'models/smollm2-135m-instruct'  # a Hugging Face folder
bases = 'float32,bfloat16,nf4'  # the lora_base_dtype values to compare
max_iters = 0                # 0 = the recipe's own (config/lora_hf.py: 150 steps)
heldout = 200                # test prompts eval.py answers with each merged model; 0 = skip
llama_1b = False             # instead of model: a Llama-3.2-1B-shaped folder of random bf16 weights (its tokenizer)
extra = ''                   # more flags for train.py, e.g. a smaller batch for the 1B shape on a CPU
step_bench = False           # instead of the recipe: its training step only, the bases alternating in this process
repeats = 7                  # step_bench: steps of each base (after one to warm up); medians
rows = 0                     # step_bench: rows a micro-batch; 0 = the recipe's batch_size
row_tokens = 52              # step_bench: tokens a row (the number tasks' prompt and answer), the last quarter labelled
step_device = 'cpu'          # step_bench: 'cpu' | 'cuda'
activation_checkpointing = False  # step_bench: recompute each block in the backward (long rows on a GPU)
step_dtype = 'bfloat16'      # step_bench: the compute dtype (float32: the bases float32 and nf4)
compile = False              # step_bench: torch.compile the model (as train.py --compile=True)
out = os.path.join(ROOT, 'bench', 'results', 'qlora')
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(0), ('max_iters', 'heldout', 'rows')), (at_least(1), ('repeats', 'row_tokens')),
                      (one_of(('bfloat16', 'float32')), ('step_dtype',)), (one_of(('cpu', 'cuda')), ('step_device',))])

LOAD = """
import resource, sys, torch
from lm.lora import check_lora_base_dtype
from lm.tokenizer import chat_tokenizer
from starting_model import full_model_checkpoint, run_model_args, run_tokenizer, starting_gpt
base, folder = sys.argv[1], sys.argv[2]
check_lora_base_dtype(base, torch.bfloat16 if base == 'bfloat16' else torch.float32, 'ddp')
ckpt, path = full_model_checkpoint(None, None, folder, '', 'lora')
_, base_tokenizer = run_tokenizer('', ckpt, path, None, folder)
tokenizer = chat_tokenizer(base_tokenizer)
args = run_model_args(dict(dropout=0.0, block_size=512), ckpt, path, tokenizer)
model, _ = starting_gpt(args, ckpt, path, tokenizer, base_tokenizer, False, base)
# read every tensor once, as the first step does (memory-mapped ones count once they are read)
sum(t.float().sum().item() for t in model.state_dict().values())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def load_peak(base):
    """Peak resident bytes of a process that builds the LoRA run's starting model as train.py does."""
    done = subprocess.run([sys.executable, '-c', LOAD, base, model], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"loading with lora_base_dtype={base} failed:\n{done.stderr[-3000:]}")
    return int(done.stdout.split()[-1])


def recipe(base):
    """config/lora_hf.py with this base, to its end: (its log's training events, the exact match of merged.pt)."""
    run_dir = os.path.join(out, base)
    args = ['train.py', 'config/lora_hf.py', f'--init_from={model}', f'--out_dir={run_dir}', '--resume=False',
            f'--lora_base_dtype={base}', '--tensorboard=False', '--sample_tokens=0', '--device=cpu',
            *(['--dtype=bfloat16'] if base == 'bfloat16' else []),
            *([f'--max_iters={max_iters}', f'--lr_decay_iters={max_iters}'] if max_iters else []), *extra.split()]
    t0 = time.time()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    wall = time.time() - t0
    with open(os.path.join(run_dir, 'log.jsonl')) as f:
        events = [json.loads(line) for line in f if line.strip()]
    steps = [e for e in events if 'tokens_per_sec' in e]
    result = dict(command='python ' + ' '.join(args), wall_s=wall, peak_rss_mb=steps[-1]['peak_memory_mb'],
                  tokens_per_sec=statistics.median(e['tokens_per_sec'] for e in steps[1:] or steps),
                  exact_match_100=([e['eval/exact_match'] for e in events if 'eval/exact_match' in e] or [None])[-1])
    if heldout:
        scores = os.path.join(run_dir, 'heldout.json')
        done = subprocess.run([sys.executable, 'eval.py', f"--init_from={os.path.join(run_dir, 'merged.pt')}",
                               f'--max_examples={heldout}', f'--out={scores}', '--device=cpu'],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"eval.py on {run_dir}/merged.pt failed:\n{done.stderr[-3000:]}")
        with open(scores) as f:
            result[f'exact_match_{heldout}'] = json.load(f)['scores']['exact_match']
    return result


def step_bench_results():
    """The recipe's optimizer step (config/lora_hf.py: its adapters on every Linear, its micro-batches and
    accumulation; in step_dtype, under autocast for bf16 as the all-linear rows of the README's table) on random
    token rows, for each base in turn, repeats times: medians of the seconds a step and of the step's tokens per
    second, by the clock and on a CPU by this thread's CPU time (a shared machine's other work does not count);
    on a GPU each base's peak memory."""
    import torch
    from lm.lora import apply_lora, check_lora_base_dtype, lora_optimizer
    from lm.tokenizer import chat_tokenizer
    from run.device import DTYPES, autocast_context
    from starting_model import full_model_checkpoint, run_model_args, run_tokenizer, starting_gpt
    recipe_config = {}
    with open(os.path.join(ROOT, 'config', 'lora_hf.py')) as f:
        exec(f.read(), recipe_config)
    steps, cuda = recipe_config['gradient_accumulation_steps'], step_device == 'cuda'
    built, times, peaks = {}, {base: [] for base in bases.split(',')}, {}
    autocast = autocast_context(step_device, DTYPES[step_dtype])
    for base in times:
        check_lora_base_dtype(base, DTYPES[step_dtype], 'ddp')
        folder = os.path.join(ROOT, model)
        ckpt, path = full_model_checkpoint(None, None, folder, '', 'lora')
        _, base_tokenizer = run_tokenizer('', ckpt, path, None, folder)
        tokenizer = chat_tokenizer(base_tokenizer)
        args = run_model_args(dict(dropout=0.0, block_size=row_tokens), ckpt, path, tokenizer)
        gpt, vocab_size = starting_gpt(args, ckpt, path, tokenizer, base_tokenizer, False, base)
        apply_lora(gpt, recipe_config['lora_r'], recipe_config['lora_alpha'], recipe_config['lora_dropout'],
                   'all-linear', added_tokens=tokenizer.vocab_size - vocab_size)
        gpt.to(step_device).train().activation_checkpointing = activation_checkpointing
        optimizer = lora_optimizer(gpt, 0.0, recipe_config['learning_rate'], (0.9, 0.999), step_device)
        built[base] = (gpt, torch.compile(gpt) if compile else gpt, optimizer)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(gpt.config.vocab_size, (steps, rows or recipe_config['batch_size'], row_tokens), generator=g)
    y = torch.roll(x, -1, 2)
    y[..., :row_tokens * 3 // 4] = -100  # the prompt: no label
    x, y = x.to(step_device), y.to(step_device)

    def step(base):
        gpt, forward, optimizer = built[base]
        cpu, wall = time.thread_time(), time.perf_counter()
        for i in range(steps):
            with autocast:
                loss = forward(x[i], y[i], logits_at=y[i] != -100)[1] / steps
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.thread_time() - cpu, time.perf_counter() - wall

    for base in times:
        step(base)  # warm-up (and compiling)
    for _ in range(repeats):
        for base in times:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times[base].append(step(base))
            if cuda:
                peaks[base] = max(peaks.get(base, 0), torch.cuda.max_memory_allocated() / 2**30)
    tokens = x.numel()
    results = {}
    for base, measured in times.items():
        cpu, wall = (statistics.median(t[i] for t in measured) for i in (0, 1))
        results[base] = dict(step_wall_s=wall, tokens_per_sec=tokens / wall, wall_s=[t for _, t in measured],
                             **(dict(peak_gib=peaks[base]) if cuda else dict(
                                 step_cpu_s=cpu, tokens_per_cpu_s=tokens / cpu, cpu_s=[t for t, _ in measured])))
    return results


os.makedirs(out, exist_ok=True)
if llama_1b:  # bench/hf_parity.py's helper, written once
    sys.path.insert(0, os.path.join(ROOT, 'bench'))
    from hf_parity import random_llama_folder
    model = random_llama_folder(out, 2048, 16, 49152, model)[0]
if step_bench:
    import torch
    results = step_bench_results()
    # a CPU without native bf16 (AVX2 only) runs bf16 matmuls many times slower, which hides what NF4 costs
    device = torch.cuda.get_device_name() if step_device == 'cuda' else (
        f'{cpu_name()}, {torch.get_num_threads()} threads')
    with open(out.rstrip('/') + '.json', 'w') as f:
        json.dump(dict(model=model, step_bench=True, device=device, dtype=step_dtype, compile=compile,
                       repeats=repeats, rows=rows, row_tokens=row_tokens,
                       activation_checkpointing=activation_checkpointing, torch=torch.__version__,
                       date=time.strftime('%Y-%m-%d'), results=results), f, indent=1)
    first = next(iter(results.values()))
    print(f"\n{device}\n| base | s a step | tokens/s | ratio | " + (
        "peak GiB |" if step_device == 'cuda' else "s a step (CPU time) | tokens/CPU s | ratio |"))
    print("|---|---:|---:|---:|---:|" + ("" if step_device == 'cuda' else "---:|---:|"))
    for base, r in results.items():
        print(f"| {base} | {r['step_wall_s']:.2f} | {r['tokens_per_sec']:,.1f} | "
              f"{r['tokens_per_sec'] / first['tokens_per_sec']:.3f} | " + (
                  f"{r['peak_gib']:.1f} |" if step_device == 'cuda' else
                  f"{r['step_cpu_s']:.2f} | {r['tokens_per_cpu_s']:,.1f} | "
                  f"{r['tokens_per_cpu_s'] / first['tokens_per_cpu_s']:.3f} |"))
    sys.exit(0)
results = {}
for base in bases.split(','):
    results[base] = dict(load_peak_mb=load_peak(base) / 2**20, **recipe(base))
    print(base, json.dumps(results[base]), flush=True)
with open(out.rstrip('/') + '.json', 'w') as f:  # bench/results/qlora.json by default
    json.dump(dict(model='Llama-3.2-1B shape, random bf16 weights' if llama_1b else model,
                   max_iters=max_iters or 150, heldout=heldout, extra=extra, date=time.strftime('%Y-%m-%d'),
                   results=results), f, indent=1)
print(f"\n| base | load peak | training peak | tokens/s | exact match ({heldout} held-out) |")
print("|---|---:|---:|---:|---:|")
for base, r in results.items():
    print(f"| {base} | {r['load_peak_mb']:,.0f} MB | {r['peak_rss_mb']:,.0f} MB | {r['tokens_per_sec']:,.0f} | "
          + (f"{100 * r[f'exact_match_{heldout}']:.1f}%" if heldout else '-') + " |")
