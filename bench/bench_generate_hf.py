"""
Generation on a published model, nanotrain against transformers' `generate`: SmolLM2-135M-Instruct
(float32, CPU), the same chat prompts, greedy and sampled, one prompt at a time and in batches.

    python bench/bench_generate_hf.py   # the defaults: 32 prompts, 64 new tokens
    # the committed results (bench/results/generate_hf.json), 20 min on the shared 2-core CPU:
    python bench/bench_generate_hf.py --threads=1 --num_prompts=16 \
        --batch_sizes="(1, 8, 16)" --max_new_tokens=32 --sample_prompts=4 --sample_batch=4

transformers is never a dependency of nanotrain: each side runs in its own Python as a worker
(--side=nanotrain here, --side=transformers in hf_python, which has transformers 5.24) and writes its
token ids, completions and timings to a JSON file that this process reads. With --control=True a
third worker runs nanotrain in hf_python, on transformers' torch build, to tell the code from the build.

Each side:
1. Encodes PROMPTS (num_prompts chat conversations of 30-300 tokens) with the model's own chat
   template and the generation prompt: nanotrain through hf.tokenizer's encode_prompt (sample.py's
   way), transformers through apply_chat_template(add_generation_prompt=True). The ids must match.
2. Greedy, max_new_tokens, stopping at the end-of-turn token (tokenizer.eos_id, <|im_end|>) at batch 1
   (one prompt at a time: nanotrain's GPT.generate, sample.py's path; transformers' generate with no
   padding) and at each batch size in batch_sizes (the prompts in order, in chunks: nanotrain's
   lm/generate.py generate_batch; transformers' generate on left-padded ids with their attention mask).
3. Sampled: temperature, top_k, num_samples completions per prompt (nanotrain's num_samples,
   transformers' num_return_sequences) of the first sample_prompts prompts, sample_batch at a time.
Each worker runs every configuration on 2 prompts to warm up, then once over all prompts; tokens/s =
the completions' tokens (through the stop token, without transformers' padding after it) / the wall
time. The benchmark runs `repeats` rounds of a worker per side, alternating the sides (reversed in odd
rounds: the machine's other load falls on both) and reports the median over the rounds.
torch.set_num_threads(threads) and OMP_NUM_THREADS on both.

Then this process compares the greedy completions with transformers' one at a time: how many match
token for token, and for each that does not, the first token that differs and the logit gap there
(nanotrain's unpadded forward over the prompt and the common prefix: the top logit minus the logit of
the other side's token; a gap of a few 1e-5 is a near tie float32 rounding can flip).
Output: a table on stdout, everything in bench/results/generate_hf.json.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch

from configurator import at_least, check_values, configure, one_of
from run.device import cpu_name

# -----------------------------------------------------------------------------
side = 'all'                 # 'all' (the benchmark) | workers: 'nanotrain' | 'transformers'
model = '/work/models/smollm2-135m-instruct'  # the Hugging Face folder (make_smollm2_hf.py builds it)
hf_python = '/work/tfenv29/bin/python'  # Python of the environment with transformers
control = False              # also nanotrain in hf_python (transformers' torch build)
num_prompts = 32             # the first num_prompts of PROMPTS
batch_sizes = (1, 8, 32)     # greedy runs; 1 = one prompt at a time
max_new_tokens = 64
repeats = 3                  # rounds: timed runs per configuration and side (a worker: runs in a row)
threads = 2                  # torch.set_num_threads and OMP_NUM_THREADS, both sides
temperature = 0.8            # the sampled runs
top_k = 50
num_samples = 4
sample_batch = 8             # prompts per sampled batch (x num_samples rows)
sample_prompts = 8           # the sampled runs' prompts: the first sample_prompts (each gives num_samples completions)
seed = 1337
out = os.path.join(ROOT, 'bench', 'results', 'generate_hf.json')
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('num_prompts', 'max_new_tokens', 'repeats', 'threads', 'num_samples',
                                     'sample_batch', 'sample_prompts')),
                      (one_of(('all', 'nanotrain', 'transformers')), ('side',))])

PARAGRAPH = (
    "The Industrial Revolution, which began in Britain in the late eighteenth century, transformed the way "
    "goods were produced. Before it, most people worked on farms or in small workshops, making things by hand. "
    "The invention of the steam engine, the spinning jenny and the power loom allowed factories to produce "
    "textiles and other goods far faster and more cheaply than before. Cities grew rapidly as people moved "
    "from the countryside to find work, and new railways carried raw materials and finished products across "
    "the country. Working conditions in early factories were often harsh, with long hours, low pay and child "
    "labour, which eventually led to reforms and the rise of trade unions.")
SENTENCES = PARAGRAPH.split('. ')
QUESTIONS = [
    'What is the capital of France?', 'What is 48+26?', 'Why is the sky blue?', 'Name three primary colors.',
    'How many legs does a spider have?', 'Write a haiku about autumn.', 'What does a CPU do?',
    'Give me a synonym for happy.', 'Explain photosynthesis to a ten-year-old.',
    'What is the difference between weather and climate?', 'Translate "good morning" into Spanish.',
    'Suggest a name for a pet goldfish.', 'Why do we have leap years?', 'How do vaccines work?',
    'List four planets of the solar system.', 'What is a prime number? Give two examples.',
    'Write one sentence about the ocean.', 'How can I make my tea less bitter?',
    'Who wrote Romeo and Juliet?', 'What is the boiling point of water at sea level?',
]
PROMPTS = ([[{'role': 'user', 'content': q}] for q in QUESTIONS]
           + [[{'role': 'system', 'content': 'You are a concise assistant. Answer in one sentence.'},
               {'role': 'user', 'content': q}] for q in QUESTIONS[:4]]
           + [[{'role': 'user', 'content': 'Hi! Can you recommend a good book?'},
               {'role': 'assistant', 'content': "Sure! 'To Kill a Mockingbird' by Harper Lee is a classic."},
               {'role': 'user', 'content': 'What is it about?'}]]
           + [[{'role': 'user', 'content': 'Summarize this text in one sentence.\n\n' + '. '.join(SENTENCES[:n])}]
              for n in range(1, 8)])
PROMPTS = PROMPTS[::max(len(PROMPTS) // num_prompts, 1)][:num_prompts]  # fewer: spread over the lengths


def chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def trimmed(ids, stop):
    """ids up to and including the first stop token (transformers pads finished rows after it)."""
    return ids[:ids.index(stop) + 1] if stop in ids else ids


# -----------------------------------------------------------------------------
# the sides: (prompt ids, stop id, greedy(prompts, batch) and sampled(prompts, generator)), each returning
# a list of completions

def nanotrain_side():
    from hf.checkpoint import load_hf_checkpoint
    from hf.tokenizer import load_hf_tokenizer
    from lm.generate import generate_batch
    from model import GPT, GPTConfig
    ckpt = load_hf_checkpoint(model)
    gpt = GPT.from_state_dict(GPTConfig(**ckpt['model_args']), ckpt['model']).eval()
    tokenizer = load_hf_tokenizer(model)
    stop = tokenizer.eos_id

    def greedy(prompts, batch):
        if batch == 1:  # sample.py's path
            return [gpt.generate(torch.tensor([p]), max_new_tokens, temperature=0.0, eos_id=stop)[0, len(p):].tolist()
                    for p in prompts]
        return [c for chunk in chunks(prompts, batch)
                for c in generate_batch(gpt, chunk, max_new_tokens, stop_ids=[stop])]

    def sampled(prompts, generator):
        return [c for chunk in chunks(prompts, sample_batch)
                for c in generate_batch(gpt, chunk, max_new_tokens, temperature, top_k, stop_ids=[stop],
                                        num_samples=num_samples, generator=generator)]

    return [tokenizer.encode_prompt(m) for m in PROMPTS], stop, greedy, sampled


def transformers_side():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    stop, pad = hf.generation_config.eos_token_id, tokenizer.pad_token_id
    assert isinstance(stop, int), f"expected one end-of-turn id, got {stop}"

    def generate(prompts, **kw):
        width = max(map(len, prompts))  # left padding, masked
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=stop,
                          pad_token_id=pad, **kw)
        return [trimmed(row[width:].tolist(), stop) for row in out]

    def greedy(prompts, batch):
        return [c for chunk in chunks(prompts, batch) for c in generate(chunk, do_sample=False)]

    def sampled(prompts, generator):
        torch.manual_seed(generator.initial_seed())  # transformers samples from the global generator
        return [c for chunk in chunks(prompts, sample_batch)
                for c in generate(chunk, do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0,
                                  num_return_sequences=num_samples)]

    ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in PROMPTS]
    ids = [list(i['input_ids'] if hasattr(i, 'keys') else i) for i in ids]
    return ids, stop, greedy, sampled


def run_side(which, path):
    """One side's worker: every configuration, timed, into path (JSON)."""
    torch.set_num_threads(threads)
    prompts, stop, greedy, sampled = (nanotrain_side if which == 'nanotrain' else transformers_side)()
    runs = {f'greedy, batch {b}': lambda ps, b=b: greedy(ps, b) for b in batch_sizes}
    runs[f'sampled, batch {sample_batch} x {num_samples}'] = (
        lambda ps: sampled(ps[:sample_prompts], torch.Generator().manual_seed(seed)))
    result = dict(side=which, torch=torch.__version__, threads=torch.get_num_threads(), prompt_ids=prompts,
                  stop_id=stop, runs={})
    if which == 'transformers':
        import transformers
        result['transformers'] = transformers.__version__
    with torch.no_grad():
        for name, fn in runs.items():
            fn(prompts[:2])  # warm-up
            seconds, tokens = [], []
            for _ in range(repeats):
                completions, t = timed(lambda: fn(prompts))
                seconds.append(t)
                tokens.append(sum(map(len, completions)))
            rate = statistics.median(n / t for n, t in zip(tokens, seconds))
            result['runs'][name] = dict(seconds=seconds, tokens=tokens, tokens_per_s=rate, completions=completions)
            print(f"{which:>12} {name:>28}: {rate:7.1f} tokens/s (runs: "
                  f"{', '.join(f'{n} in {t:.1f}s' for n, t in zip(tokens, seconds))})", flush=True)
    with open(path, 'w') as f:
        json.dump(result, f)


if side != 'all':
    run_side(side, out)
    sys.exit(0)


# -----------------------------------------------------------------------------
# the benchmark: the workers, then the comparison

@torch.no_grad()
def divergence(gpt, prompt, reference, other):
    """Where other first differs from reference, and the logit gap there in nanotrain's unpadded forward:
    (position, reference token's logit - other token's, top logit - second logit); None if equal."""
    j = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if j is None:
        return None if len(reference) == len(other) else dict(position=min(len(reference), len(other)),
                                                                note='one is a prefix of the other')
    logits = gpt(torch.tensor([prompt + reference[:j]]))[0][0, -1]
    top2 = logits.topk(2).values
    return dict(position=j, reference_token=reference[j], other_token=other[j],
                gap=(logits[reference[j]] - logits[other[j]]).item(), top2_gap=(top2[0] - top2[1]).item())


SIDES = {'nanotrain': sys.executable, 'transformers': hf_python}
if control:
    SIDES['nanotrain_same_torch'] = hf_python
env = dict(os.environ, OMP_NUM_THREADS=str(threads))
args = [f'--{k}={v}' for k, v in config.items() if k not in ('side', 'out', 'control', 'hf_python', 'repeats')]
rounds, load = {name: [] for name in SIDES}, [os.getloadavg()]
with tempfile.TemporaryDirectory() as tmp:
    # one timed run of every configuration per worker; the sides alternate, in reverse order in odd
    # rounds, so a change in the machine's other load falls on both
    for i in range(repeats):
        for name, python in (list(SIDES.items()) if i % 2 == 0 else reversed(SIDES.items())):
            path = os.path.join(tmp, f'{name}.json')
            which = 'transformers' if name == 'transformers' else 'nanotrain'
            subprocess.run([python, os.path.abspath(__file__), f'--side={which}', f'--out={path}', '--repeats=1',
                            *args], env=env, check=True)
            with open(path) as f:
                rounds[name].append(json.load(f))
            load.append(os.getloadavg())
results = {}
for name, runs in rounds.items():  # the rounds' runs as one side's: every run's time, the median rate
    results[name] = dict(runs[0], runs={run: dict(
        seconds=[r['runs'][run]['seconds'][0] for r in runs], tokens=[r['runs'][run]['tokens'][0] for r in runs],
        tokens_per_s=statistics.median(r['runs'][run]['tokens_per_s'] for r in runs),
        completions=first['completions'],
        same_every_round=all(r['runs'][run]['completions'] == first['completions'] for r in runs))
        for run, first in runs[0]['runs'].items()})

nano, hf = results['nanotrain'], results['transformers']
ids_equal = nano['prompt_ids'] == hf['prompt_ids']
assert nano['stop_id'] == hf['stop_id']
from hf.checkpoint import load_hf_checkpoint  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
ckpt = load_hf_checkpoint(model)
gpt = GPT.from_state_dict(GPTConfig(**ckpt['model_args']), ckpt['model']).eval()
# transformers one prompt at a time; where batch_sizes leaves 1 out, its smallest batch
reference_run = f'greedy, batch {min(batch_sizes)}'
reference = hf['runs'][reference_run]['completions']
greedy = {}
for name, r in results.items():
    for run, v in r['runs'].items():
        if run.startswith('greedy'):
            found = [divergence(gpt, p, ref, c) for p, ref, c in zip(nano['prompt_ids'], reference, v['completions'])]
            greedy[f'{name}, {run}'] = dict(identical=found.count(None), of=len(found),
                                            divergences={i: d for i, d in enumerate(found) if d})

lengths = [len(p) for p in nano['prompt_ids']]
summary = dict(
    command='python bench/bench_generate_hf.py' + ''.join(f' {a}' for a in sys.argv[1:]),
    date=time.strftime('%Y-%m-%d %H:%M'), cpu=cpu_name(), threads=threads, loadavg=load,
    versions=dict(transformers=hf['transformers'], **{f'torch ({name})': r['torch'] for name, r in results.items()}),
    config=config, prompt_lengths=lengths,
    chat_template_ids_identical=ids_equal, greedy_vs_transformers_one_at_a_time=greedy,
    tokens_per_s={name: {run: v['tokens_per_s'] for run, v in r['runs'].items()} for name, r in results.items()},
    sides=results)
with open(out, 'w') as f:
    json.dump(summary, f, indent=1)

print(f"\n{num_prompts} chat prompts of {min(lengths)}-{max(lengths)} tokens, up to {max_new_tokens} new tokens, "
      f"{cpu_name()}, {threads} threads; chat-template ids identical: {ids_equal}")
names = list(results)
print('| run | ' + ' | '.join(f'{n} tokens/s' for n in names) + ' | nanotrain / transformers |')
print('|---' * (len(names) + 2) + '|')
for run in nano['runs']:
    rates = [results[n]['runs'][run]['tokens_per_s'] for n in names]
    print(f'| {run} | ' + ' | '.join(f'{r:.1f}' for r in rates) + f' | {rates[0] / rates[1]:.2f}x |')
print(f"\ngreedy completions identical to transformers' {reference_run}:")
for name, g in greedy.items():
    print(f"  {name}: {g['identical']}/{g['of']}" + ''.join(
        f"\n    prompt {i}: {d}" for i, d in g['divergences'].items()))
print(f"load average before and after each side: {load}\nwrote {out}")
