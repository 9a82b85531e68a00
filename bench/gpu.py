"""
One command for a GPU: what nanotrain measures on one, part after part on the same card, each part a real script
in its own process under its own time limit. A part that fails or runs out of time is recorded as such and the
next one starts; the JSON is written after every part, so a run that is killed keeps what it measured, and a
rerun with --parts=... fills in the parts it names (the rest of the same day's JSON is kept). Run it first
whenever a GPU is at hand. Its budget is 8 minutes, which on the first H200 (2026-11-30) reached lora8b_nf4; a
second call with `--parts=` runs what was skipped (there: 207 s for rl1b, rl1b_compiled_decoding, lora8b_pack).

    cp -r ../shared/peers/nanogpt bench/results/nanogpt          # nanoGPT, unchanged, in an ignored folder
    mkdir -p models/smollm2-tokenizer && cp models/smollm2-135m-instruct/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} models/smollm2-tokenizer/
    python bench/gpu.py --nanogpt_dir=bench/results/nanogpt
    python bench/gpu.py --dry_run=True      # every part on the CPU with tiny shapes, compile off (CI runs it)
    python bench/gpu.py --table_only=bench/results/gpu_h100_2026-11-28.json  # README's and RESULTS.md's GPU rows

The parts, in the order they run (the most wanted first: the budget may end before the last):
- tests: the tests that need CUDA (`pytest -m cuda`);
- gpt_b16, nanogpt_b16, gpt_b32, nanogpt_b32: GPT-2 124M's shape (12 x 768, block 1024, vocab 50,304), bf16,
  compiled, random tokens: bench/bench_gpt.py (median step after 3) against nanoGPT's own bench.py run unchanged
  from nanogpt_dir (its "time per iteration": the mean of 20 steps after 10); gpt_b32 also writes a kernel profile;
- llama8b_folder: a Llama-3.1-8B-bodied Hugging Face folder (32 x 4096, MLP 14,336, 32 heads / 8 KV heads,
  untied) with SmolLM2's tokenizer and 49,152-token vocabulary: random bf16 weights drawn on the GPU, written once;
- lora8b_bfloat16, lora8b_nf4, then the two compiled: LoRA r=16 on every Linear through train.py on that folder,
  4 rows of 4,096 tokens a step, activation checkpointing, a bf16 or an NF4 base, eager or compiled: tokens/s, MFU
  and peak memory from train.py's log.jsonl (the median of the logged steps after the first);
- rl1b, rl1b_compiled_decoding: train_rl.py's rollouts on the Llama-3.2-1B shape (bench/bench_rl_1b.py's
  large_lora mode, a few steps), eager from the adapter model as before issue 54 (EAGER_DECODING), then each
  decode step a CUDA graph from a bf16 copy with the adapters merged (COMPILED_DECODING), with the ratio;
- lora8b_pack: the same LoRA on the number tasks, packed into rows of 4,096 tokens (PACKING).
Writes <out_dir>/gpu_<card>_<date>.json (the runs under <out_dir>/gpu/) and prints one table.
"""

import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'bench'))

from configurator import UserError, at_least, check_values, configure
from logged_run import kill_tree, run_until_logged

# -----------------------------------------------------------------------------
nanogpt_dir = ''             # an unchanged nanoGPT checkout (its bench.py); '' = its parts are skipped, with a note
tokenizer_folder = 'models/smollm2-tokenizer'  # SmolLM2's tokenizer files (the dry run: a test fixture's)
parts = 'all'                # 'all' or a comma-separated subset of PARTS' names
budget = 480                 # seconds for the whole command: a part gets what is left, at most its own limit
dry_run = False              # every part on the CPU with tiny shapes and compile off: checks the paths, measures nothing
table_only = ''              # a JSON this command wrote: print its table and rewrite README's and RESULTS.md's GPU rows
out_dir = os.path.join(ROOT, 'bench', 'results')  # the JSON; the runs go to out_dir/gpu (ignored by git)
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('budget',))])

# Flags the rest of issue 54 adds, each list going into its parts' commands as it is: filling one in is the
# one-line change that measures it. Packing that fills rows (item 4; pack=True may come to mean it):
PACKING = ['--pack=True']
# compiled static-cache decoding in train_rl.py's rollouts (item 5) from a copy with the adapters merged, against
# the rollouts before it (on CUDA both are train_rl.py's defaults now, so the eager part names its flags too)
COMPILED_DECODING = ['--compile_decode=True', '--merged_rollouts=True']
EAGER_DECODING = ['--compile_decode=False', '--merged_rollouts=False']
# NF4 under torch.compile (item 3) needs no flag: lora8b_nf4_compiled runs --lora_base_dtype=nf4 --compile=True

GPT2 = ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024', '--vocab_size=50304']
ROW = 4096                   # tokens a row (lora8b_*)
LORA_ROWS = 4                # rows a step
TIMED_STEPS = 2              # steps timed after the first (lora8b_*: logging windows of one step)
LLAMA_8B = dict(  # Llama-3.1-8B's config.json with SmolLM2's vocabulary; vocab_size: the tokenizer's
    architectures=['LlamaForCausalLM'], model_type='llama', hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act='silu',
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    torch_dtype='bfloat16', use_cache=True)
device = 'cpu' if dry_run else 'cuda'
if dry_run:  # the same parts at a size a CPU runs in seconds
    GPT2 = ['--n_layer=2', '--n_head=2', '--n_embd=64', '--block_size=64', '--vocab_size=512', '--steps=2',
            '--warmup_steps=1']
    ROW, LORA_ROWS, TIMED_STEPS = 128, 2, 1
    LLAMA_8B.update(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
runs = os.path.join(out_dir, 'gpu')
# the tokenizer's files go into the model folders; the dry run's: a test fixture's (no ignored folder needed)
tokenizer = os.path.join('tests', 'fixtures', 'hf', 'smollm2') if dry_run else tokenizer_folder


class PartFailed(Exception):
    """A part that ran but gave no figures: the status ('failed' or 'timed out') and what to say."""


def launch(args, limit, cwd=ROOT):
    """Run args in cwd until it ends or limit seconds pass, then SIGKILL it and what it started (compile workers
    hold the GPU too). -> (exit code, None if it was killed, and its output)."""
    with tempfile.TemporaryFile(mode='w+') as output:
        proc = subprocess.Popen(args, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_tree(proc.pid)
            proc.wait()
        output.seek(0)
        return code, output.read()


def checked(code, output, limit):
    """output, unless the process failed or ran out of time."""
    if code is None:
        raise PartFailed('timed out', f"still running after its {limit:.0f} s")
    if code:
        raise PartFailed('failed', f"exit {code}: {output.strip().splitlines()[-1] if output.strip() else ''}")
    return output


def tests(limit):
    """pytest on the tests marked cuda (skipped without CUDA: in the dry run all of them are)."""
    files = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, 'tests', 'test_*.py'))
                   if 'mark.cuda' in open(f).read())  # only these: collecting the whole suite takes a while
    # a worker a test on the GPU's machine (each compiles on its own; one after another took over 90 s on an H200),
    # the slowest named in the log
    workers = '0' if dry_run else '8'
    code, output = launch([sys.executable, '-m', 'pytest', '-m', 'cuda', '-n', workers, '--durations=5', '-q', '-p',
                           'no:cacheprovider', *files], limit)
    summary = output.strip().splitlines()[-1] if output.strip() else ''
    counts = {kind.rstrip('s'): int(n) for n, kind in re.findall(r'(\d+) (passed|failed|skipped|errors?)', summary)}
    if code is None:
        raise PartFailed('timed out', f"still running after its {limit:.0f} s")
    if not counts:  # pytest itself failed (a test file that does not import, say)
        raise PartFailed('failed', f"exit {code}: {output.strip()[-500:]}")
    slowest = [f'{s}s {name}' for s, name in re.findall(r'^([\d.]+)s call\s+(\S+)', output, re.M)]
    if code:
        return dict(counts, status='failed', note=summary, failures=output[-3000:], slowest=slowest)
    return dict(counts, summary=summary, slowest=slowest)


def gpt(batch_size, limit, profile=False):
    """bench/bench_gpt.py at GPT-2's shape, compiled, its figures (bench_gpt's JSON)."""
    figures = os.path.join(runs, f'gpt_b{batch_size}.json')
    args = [sys.executable, 'bench/bench_gpt.py', *GPT2, f'--batch_size={batch_size}', f'--device={device}',
            f'--compile={not dry_run}']
    command = ' '.join(['python', *args[1:]])
    args.append(f'--out={figures}')
    if profile:  # the kernel table of 3 steps after the timed ones, beside the JSON
        args.append(f"--profile={json_path.removesuffix('.json')}_gpt_b{batch_size}_profile.txt")
    if os.path.exists(figures):
        os.remove(figures)
    checked(*launch(args, limit), limit)
    with open(figures) as f:
        return dict(json.load(f), command=command)


# The dry run runs nanoGPT's bench.py unchanged, on a CPU: its torch.cuda.synchronize() calls made no-ops, and the
# GPT-2 124M model it builds shrunk to 2 x 64 (30 steps of the real one take minutes on a CPU)
NANOGPT_ON_CPU = """
import runpy, sys, torch
sys.path.insert(0, '')
import model
torch.cuda.synchronize = lambda *a, **k: None
shape = model.GPTConfig
model.GPTConfig = lambda **kw: shape(**dict(kw, n_layer=2, n_head=2, n_embd=64))
sys.argv = ['bench.py', *sys.argv[1:]]
runpy.run_path('bench.py', run_name='__main__')
"""


def nanogpt(batch_size, limit):
    """nanoGPT's bench.py on random tokens at batch_size x 1024, compiled; its time per iteration."""
    if not nanogpt_dir:
        raise PartFailed('skipped', "no nanogpt_dir: pass --nanogpt_dir=<an unchanged nanoGPT checkout> "
                                    "(cp -r ../shared/peers/nanogpt bench/results/nanogpt)")
    folder = os.path.abspath(os.path.join(ROOT, nanogpt_dir))
    block = 32 if dry_run else 1024
    batch_size = 2 if dry_run else batch_size
    flags = ['--real_data=False', f'--batch_size={batch_size}', f'--compile={not dry_run}']
    if dry_run:
        flags += ['--device=cpu', f'--block_size={block}', '--dtype=float32']
    args = [sys.executable, *(['-c', NANOGPT_ON_CPU] if dry_run else ['bench.py']), *flags]
    output = checked(*launch(args, limit, cwd=folder), limit)
    found = re.search(r'time per iteration: ([\d.]+)ms', output)
    if not found:
        raise PartFailed('failed', "bench.py printed no 'time per iteration'")
    step_ms = float(found.group(1))
    return dict(step_ms=step_ms, tokens_per_sec=batch_size * block / step_ms * 1000, batch_size=batch_size,
                block_size=block, command=f"cd {nanogpt_dir} && python bench.py {' '.join(flags)}")


def tokenizer_vocab():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(ROOT, tokenizer, 'tokenizer.json')).get_vocab_size(True)


WRITE_FOLDER = """
import json, sys
sys.path.insert(0, 'bench')
from hf_parity import write_random_llama
folder, hf_config, tokenizer_folder, device = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
write_random_llama(folder, hf_config, 2**30, tokenizer_folder, device)
"""


def llama8b_folder(limit):
    """The 8B-bodied folder under runs (random bf16 weights drawn on the device), unless it is there already."""
    hf_config = dict(LLAMA_8B, vocab_size=tokenizer_vocab())
    config_path = os.path.join(llama8b, 'config.json')
    if os.path.exists(config_path) and os.path.exists(os.path.join(llama8b, 'tokenizer.json')):
        with open(config_path) as f:
            if json.load(f) == hf_config:
                return dict(note='written before', vocab_size=hf_config['vocab_size'])
    shutil.rmtree(llama8b, ignore_errors=True)
    os.makedirs(llama8b)
    checked(*launch([sys.executable, '-c', WRITE_FOLDER, llama8b, json.dumps(hf_config), tokenizer, device],
                    limit), limit)
    size = sum(os.path.getsize(os.path.join(llama8b, f)) for f in os.listdir(llama8b))
    return dict(gigabytes=size / 1e9, vocab_size=hf_config['vocab_size'])


def write_rows(folder):
    """Chat examples longer than a row (truncated to it): random lowercase words, prompt a third of the row."""
    import random
    rng = random.Random(0)

    def words(n):
        return ' '.join(''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(3, 8)))
                        for _ in range(n))
    os.makedirs(folder, exist_ok=True)
    for split, n in (('train', 4 * LORA_ROWS), ('val', 2)):
        with open(os.path.join(folder, f'{split}.jsonl'), 'w') as f:
            f.writelines(json.dumps(dict(prompt=words(ROW // 12), response=words(ROW // 4))) + '\n' for _ in range(n))
    return folder


def lora8b(base, compiled, limit, pack=False):
    """train.py's LoRA (r=16, every Linear, activation checkpointing) on the 8B-bodied folder; the median tokens/s,
    MFU and the peak memory of the logged steps after the first (each step its own logging window)."""
    if not os.path.exists(os.path.join(llama8b, 'config.json')):
        raise PartFailed('skipped', 'no 8B-bodied folder (llama8b_folder did not finish)')
    if compiled and dry_run:  # compile is off in a dry run: it would run the eager part's command again
        raise PartFailed('skipped', f"dry run: compile off makes it lora8b_{base}'s command")
    name = f"lora8b_{base}{'_compiled' if compiled else ''}{'_pack' if pack else ''}"
    run_dir = os.path.join(runs, name)
    args = [sys.executable, 'train.py', '--training_type=lora', f'--init_from={llama8b}', f'--out_dir={run_dir}',
            '--resume=False', f'--device={device}', f'--lora_base_dtype={base}', f'--compile={compiled}',
            '--lora_r=16', '--lora_alpha=32', '--lora_target_modules=all-linear', '--activation_checkpointing=True',
            f'--block_size={ROW}', f'--max_length={ROW}', '--log_interval=1', '--max_iters=100000',
            '--eval_interval=100000', '--eval_iters=1', '--tensorboard=False', '--exact_match_examples=0',
            '--sample_tokens=0', '--warmup_iters=1', '--learning_rate=1e-5']
    args += [f'--batch_size={LORA_ROWS}', *(PACKING if pack else [f"--sft_data={write_rows(sft_rows)}"])]
    if dry_run and base == 'bfloat16':
        args.append('--dtype=bfloat16')  # a bf16 base computes in bf16: on a GPU that is the default
    t0 = time.time()
    logged, output = run_until_logged(args, os.path.join(run_dir, 'log.jsonl'), 'tokens_per_sec', 1 + TIMED_STEPS, limit)
    if len(logged) < 1 + TIMED_STEPS:
        late = time.time() - t0 >= limit
        raise PartFailed('timed out' if late else 'failed',
                         f"{len(logged)} of {1 + TIMED_STEPS} steps logged in {time.time() - t0:.0f} s"
                         + ('' if late else f": {output.strip().splitlines()[-1] if output.strip() else ''}"))
    timed = logged[1:1 + TIMED_STEPS]  # the log may hold more by the time it is read
    mfu = [e['mfu'] for e in timed if e.get('mfu') is not None]
    per_step = [e['tokens_per_step'] for e in timed if 'tokens_per_step' in e]  # packing fills rows, or not
    return dict(tokens_per_sec=statistics.median(e['tokens_per_sec'] for e in timed),
                tokens_per_step=statistics.median(per_step) if per_step else None,
                mfu=statistics.median(mfu) if mfu else None, peak_memory_mb=timed[-1]['peak_memory_mb'],
                steps=len(timed), command=' '.join(['python', *args[1:]]).replace(ROOT + os.sep, ''))


def rl1b(flags, limit):
    """bench/bench_rl_1b.py's large_lora mode (32 prompts x 8, 256 new tokens, LoRA, bf16 base), 1 + 2 steps."""
    rl_out = os.path.join(runs, 'rl1b')
    mode = 'recipe' if dry_run else 'large_lora'  # the dry run: 8 prompts x 8, 32 new tokens, float32 base
    args = [sys.executable, 'bench/bench_rl_1b.py', f'--tokenizer_folder={tokenizer}',
            f'--vocab_size={tokenizer_vocab()}', f'--modes={mode}', f'--device={device}', f'--out={rl_out}',
            f'--timeout={max(1, int(limit) - 30)}', f"--extra_flags={' '.join(flags)}"]
    args += ['--hidden_size=64', '--layers=2', '--warmup=0', '--steps=1'] if dry_run else ['--warmup=1', '--steps=2']
    results = os.path.join(rl_out, 'results.json')
    if os.path.exists(results):
        os.remove(results)
    output = checked(*launch(args, limit), limit)
    if not os.path.exists(results):
        raise PartFailed('failed', f"bench_rl_1b.py wrote no results: {output.strip()[-300:]}")
    with open(results) as f:
        result = json.load(f)['results'][mode]
    if 'failed' in result:
        raise PartFailed('timed out' if 'steps in' in result['failed'] else 'failed', result['failed'])
    return result


def compiled_decoding(limit):
    # compile is off in a dry run: the merged copy's rollouts, decoded eagerly
    return rl1b(COMPILED_DECODING + (['--compile_decode=False'] if dry_run else []), limit)


PARTS = {  # name: (what, its time limit in seconds, the function that runs it)
    'tests': ('the tests that need CUDA', 150, tests),
    'gpt_b16': ('GPT-2 124M shape, batch 16 x 1024, compiled: bench/bench_gpt.py', 100, lambda s: gpt(16, s)),
    'nanogpt_b16': ("the same in nanoGPT's bench.py", 100, lambda s: nanogpt(16, s)),
    'gpt_b32': ('GPT-2 124M shape, batch 32 x 1024, compiled: bench/bench_gpt.py', 100, lambda s: gpt(32, s, True)),
    'nanogpt_b32': ("the same in nanoGPT's bench.py", 100, lambda s: nanogpt(32, s)),
    'llama8b_folder': ('the Llama-3.1-8B-bodied folder, random bf16 weights drawn on the device', 90, llama8b_folder),
    'lora8b_bfloat16': ('LoRA r=16 on every Linear, 8B body, 4 x 4,096 tokens, bf16 base, eager', 120,
                        lambda s: lora8b('bfloat16', False, s)),
    'lora8b_nf4': ('the same, NF4 base, eager', 150, lambda s: lora8b('nf4', False, s)),
    'lora8b_bfloat16_compiled': ('the same, bf16 base, compiled', 240, lambda s: lora8b('bfloat16', True, s)),
    'lora8b_nf4_compiled': ('the same, NF4 base, compiled', 240, lambda s: lora8b('nf4', True, s)),
    'rl1b': ('train_rl.py, 1B shape, 32 prompts x 8, 256 new tokens, LoRA, bf16 base, eager rollouts', 120,
             lambda s: rl1b(EAGER_DECODING, s)),
    'rl1b_compiled_decoding': ('the same, rollouts compiled (CUDA graphs) from a merged bf16 copy', 180,
                               compiled_decoding),
    'lora8b_pack': ('LoRA on the 8B body, the number tasks packed into 4,096-token rows, bf16 base, eager', 90,
                    lambda s: lora8b('bfloat16', False, s, pack=True)),
}
MIN_START = 20  # seconds: a part that would get fewer is skipped


# -----------------------------------------------------------------------------
# the table (printed, and written into README.md and runs/RESULTS.md by --table_only)

def gib(mb):
    return f"{mb / 1024:.1f} GiB" if mb else '-'


def result_text(name, part, saved):
    """One part's figures in words."""
    if part['status'] != 'ok':
        return f"{part['status']}: {part.get('note', '')}".rstrip(': ')
    if name == 'tests':
        return part['summary']
    if name.startswith('gpt_'):
        text = (f"{part['tokens_per_sec']:,.0f} tokens/s ({part['step_ms']:.1f} ms a step)"
                + (f", MFU {part['mfu'] * 100:.1f}%" if part.get('mfu') else '') + f", {gib(part['peak_memory_mb'])}")
        peer = saved.get('nano' + name)
        if peer and peer['status'] == 'ok':
            text += (f"; nanoGPT {peer['tokens_per_sec']:,.0f} ({peer['step_ms']:.1f} ms): "
                     f"**{part['tokens_per_sec'] / peer['tokens_per_sec']:.3f}x**")
        return text
    if name.startswith('nanogpt_'):
        return f"{part['tokens_per_sec']:,.0f} tokens/s ({part['step_ms']:.1f} ms a step)"
    if name.startswith('lora8b_'):
        return (f"{part['tokens_per_sec']:,.0f} tokens/s" + (f", MFU {part['mfu'] * 100:.1f}%" if part['mfu'] else '')
                + f", peak {gib(part['peak_memory_mb'])}"
                + (f", {part['tokens_per_step']:,.0f} tokens a step" if part.get('tokens_per_step') else ''))
    if name.startswith('rl1b'):
        text = (f"{part['generation_tokens_per_sec']:,.0f} generated tokens/s, {part['steps_per_sec']:.2f} steps/s, "
                f"rollouts {part['generation_s'] / (part['generation_s'] + part['training_s']):.0%} of a step, "
                f"peak {gib(part['peak_memory_mb'])}")
        eager = saved.get('rl1b') if name == 'rl1b_compiled_decoding' else None
        if eager and eager['status'] == 'ok':
            text += (f"; eager rollouts' tokens/s: "
                     f"**{part['generation_tokens_per_sec'] / eager['generation_tokens_per_sec']:.2f}x**")
        return text
    if name == 'llama8b_folder':
        return part.get('note') or f"{part['gigabytes']:.1f} GB, vocabulary {part['vocab_size']:,}"
    return part.get('note', 'ok')


def gpu_table(saved):
    """The Markdown table of a JSON this command wrote."""
    lines = ['| part | what | result |', '|---|---|---|']
    for name, part in saved['parts'].items():
        lines.append(f"| {name} | {part['what']} | {result_text(name, part, saved['parts'])} |")
    return '\n'.join(lines)


def heading(saved, path):
    env = saved['environment']
    commits = ', '.join(dict.fromkeys(p.get('commit', saved['commit']) for p in saved['parts'].values()))
    if saved['dry_run']:
        return (f"`python bench/gpu.py --dry_run=True` ({saved['date']}, commit {commits}): every part on the CPU "
                f"with tiny shapes and compile off; it checks the paths and measures nothing:")
    return (f"`python bench/gpu.py` on one {env['card']} ({saved['date']}, commit {commits}, torch "
            f"{env['torch']}, CUDA {env['cuda']}; raw figures: `{os.path.relpath(path, ROOT)}`); bf16, each part "
            f"in its own process, one after the other:")


GPU_BEGIN, GPU_END = '<!-- gpu: generated by bench/gpu.py --table_only, do not edit -->', '<!-- gpu end -->'


def rewrite_block(path, text):
    """Replace what is between the GPU markers in path by text."""
    with open(path) as f:
        doc = f.read()
    if GPU_BEGIN not in doc or GPU_END not in doc:
        raise UserError(f"{path} has no {GPU_BEGIN} ... {GPU_END} block to rewrite; add the two markers where "
                        f"the GPU table belongs.")
    start, end = doc.index(GPU_BEGIN) + len(GPU_BEGIN), doc.index(GPU_END)
    with open(path, 'w') as f:
        f.write(doc[:start] + '\n' + text + '\n' + doc[end:])


if table_only:
    with open(table_only) as f:
        saved = json.load(f)
    if saved.get('dry_run'):
        raise UserError(f"{table_only} is a dry run's (CPU, tiny shapes, compile off): its figures are not a GPU's; "
                        f"pass the JSON of a run on a GPU.")
    block = heading(saved, os.path.abspath(table_only)) + '\n\n' + gpu_table(saved)
    for doc in ('README.md', os.path.join('runs', 'RESULTS.md')):
        rewrite_block(os.path.join(ROOT, doc), block)
    print(block)
    sys.exit(0)

# -----------------------------------------------------------------------------
# the run

chosen = list(PARTS) if parts == 'all' else [p.strip() for p in parts.split(',') if p.strip()]
unknown = [p for p in chosen if p not in PARTS]
if unknown:
    raise UserError(f"parts={parts!r}: {', '.join(unknown)} is not a part; choose from {', '.join(PARTS)}.")
if nanogpt_dir and not os.path.exists(os.path.join(ROOT, nanogpt_dir, 'bench.py')):
    raise UserError(f"nanogpt_dir={nanogpt_dir!r} has no bench.py; pass an unchanged nanoGPT checkout "
                    f"(cp -r ../shared/peers/nanogpt bench/results/nanogpt).")
if not os.path.exists(os.path.join(ROOT, tokenizer, 'tokenizer.json')):
    raise UserError(f"tokenizer_folder={tokenizer_folder!r} has no tokenizer.json; copy SmolLM2's tokenizer files "
                    f"there (this file's docstring), or pass another Hugging Face tokenizer folder.")
ENVIRONMENT = ("import json, torch; print(json.dumps(dict(card=torch.cuda.get_device_name() if torch.cuda.is_available() "
               "else 'cpu', torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())))")
environment = json.loads(subprocess.run([sys.executable, '-c', ENVIRONMENT], capture_output=True, text=True,
                                        check=True).stdout)
if not dry_run and environment['card'] == 'cpu':
    raise UserError("bench/gpu.py measures a CUDA GPU and this machine has none; --dry_run=True checks every part "
                    "on the CPU.")
card = 'cpu' if dry_run else next((w for w in environment['card'].lower().split() if any(c.isdigit() for c in w)),
                                  'gpu')
date = time.strftime('%Y-%m-%d')
# a dry run's JSON stays with its runs, which git ignores
json_path = os.path.join(runs if dry_run else out_dir, f"gpu_{re.sub(r'[^a-z0-9]+', '-', card)}_{date}.json")
llama8b, sft_rows = os.path.join(runs, 'llama8b'), os.path.join(runs, 'rows')
commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()
saved = dict(date=date, commit=commit, dry_run=dry_run, budget_s=budget, environment=environment, parts={})
if os.path.exists(json_path):  # a rerun of some parts keeps the others
    with open(json_path) as f:
        saved['parts'] = json.load(f)['parts']
os.makedirs(runs, exist_ok=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit('stopped (SIGTERM)'))  # launch's finally kills the running part
start = time.time()
for name in chosen:
    what, own_limit, run = PARTS[name]
    limit = min(own_limit, budget - (time.time() - start))
    t0 = time.time()
    if limit < MIN_START:
        part = dict(status='skipped', note=f"the budget ({budget} s) ran out")
    else:
        print(f"{name}: {what} (at most {limit:.0f} s)", flush=True)
        try:
            part = dict(status='ok')
            part.update(run(limit))  # a part may set its own status (tests that failed) beside its figures
        except PartFailed as e:
            part = dict(status=e.args[0], note=e.args[1])
    saved['parts'][name] = dict(what=what, **part)
    saved['parts'][name].update(wall_s=round(time.time() - t0, 1), limit_s=round(limit), commit=commit)
    saved['parts'] = {p: saved['parts'][p] for p in PARTS if p in saved['parts']}  # PARTS' order
    with open(json_path, 'w') as f:  # after every part: a killed run keeps what it measured
        json.dump(saved, f, indent=1)
    print(f"  {time.time() - t0:.0f} s, {result_text(name, saved['parts'][name], saved['parts'])}", flush=True)
print(f"\n{heading(saved, json_path)}\n\n{gpu_table(saved)}")
if not dry_run:
    print(f"\nREADME.md and runs/RESULTS.md take these rows: python bench/gpu.py --table_only={os.path.relpath(json_path, ROOT)}")
