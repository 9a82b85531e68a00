"""
Measure a model on a task file: `python eval.py --init_from=out-sft/ckpt.pt --eval_data=data/my_task/test.jsonl`;
without --eval_data, on the embedded number tasks' held-out split (data/number_tasks/test.jsonl).
The model is a train.py / train_dpo.py checkpoint (full, a LoRA run's adapters or its merged.pt), a run's
folder or a Hugging Face model folder, loaded as sample.py loads it (loading.py). The task file is JSONL
(lm/eval_tasks.py; docs/eval.md), every row one kind:
- generation ({"prompt"} or chat {"messages"}, with {"reference"} or {"references"}): the model answers each
  prompt (a chat model in its chat template, stopping at its end of turn; a base model continues the text,
  stopping at EOS), in batches (lm/generate.py); scored by lm/metrics.py's corpus metrics, and with
  num_samples > 1 by pass@k (a sample is correct when it is an exact match).
- multiple choice ({"context", "choices", "label"}): each choice scored by its summed log-likelihood after
  the context, acc, acc_norm and acc_bytes exactly as lm-evaluation-harness computes them.
- perplexity ({"text"} rows, or a .txt file): each text's log-likelihood over lm-eval's rolling windows;
  word and byte perplexity and bits per byte as lm-eval's loglikelihood_rolling aggregates them.
Prints a table (each score with its standard error, as lm-eval) and writes a JSON file with every
example's prediction and scores, so that two models can be compared example by example.
"""

import json
import os
import tempfile

import torch
from tqdm import tqdm

from configurator import (FOLDER, SEED, UserError, at_least, check_output_file, check_values, configure, interval,
                          same_file)
from lm.eval_tasks import (GENERATION, ROLLING, call_reference, choice_logliks, choice_predictions, choice_requests,
                           generation_prompt, read_task, rolling_requests, rolling_scores, with_fewshot)
from lm.generate import CompiledDecoding, generate_batch, stop_tokens
from lm.metrics import (corpus_scores, corpus_stderrs, exact_match, example_scores, mean_pass_at_k, mean_stderr,
                        parse_metric_names, pass_at_k)
from loading import load_for_generation, model_path
from memory import in_parts
from run.device import autocast_context, pick_device, pick_dtype
from tasks.number_tasks import prepare_number_tasks

# -----------------------------------------------------------------------------
init_from = ''               # a checkpoint file, a run folder or a Hugging Face folder; '' = out_dir's ckpt_name
out_dir = 'out'              # with init_from '': the run folder to evaluate (sample.py's spelling)
ckpt_name = 'ckpt.pt'        # with init_from '': 'ckpt.pt', 'best.pt' or a LoRA run's 'merged.pt'
eval_data = ''               # the task file: JSONL rows (docs/eval.md); '' = the number tasks' held-out split
data_dir = ''                # tokenizer folder; '' = the one recorded in the checkpoint
chat_template_variables = {}  # published model's chat-template variables; {} = as it was fine-tuned
metrics = 'exact_match,bleu,chrf,rouge1,rouge2,rouge_l'  # generation: names in lm/metrics.METRICS ('' = none)
max_new_tokens = 0           # generation: tokens per answer at most; 0 = up to 256, as many as fit block_size
temperature = 0.0            # generation: 0 = greedy
top_k = 0                    # generation: 0 = off
top_p = 0.0                  # generation: nucleus sampling; 0 = off
num_samples = 1              # generation: answers per prompt (n of pass@k)
pass_k = '1'                 # generation with num_samples > 1: comma-separated k of pass@k, each <= num_samples
target_delimiter = ' '       # multiple choice: put between the context and each choice (lm-eval's); few-shot answers
num_fewshot = 0              # solved examples (other rows of the file) before each question, as lm-eval's
description = ''             # text before the few-shot examples (lm-eval's description); a chat model's system turn
batch_size = 16              # prompts per generation batch; multiple choice: sequences per forward pass
compile_decode = None        # generation: decode through torch.compile over a static KV cache (CUDA graphs); None = on CUDA
max_examples = 0             # evaluate the first this many examples; 0 = all
out = ''                     # the JSON file written; '' = next to eval_data: <name>.eval.<model>.json
seed = 1337                  # random seed of sampling
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16; fp32 on CPU
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('num_samples', 'batch_size')),
    (at_least(0), ('max_new_tokens', 'temperature', 'top_k', 'max_examples', 'num_fewshot')),
    (interval('[0, 1]'), ('top_p',)),
    (FOLDER, ('out_dir',)),
])
try:
    metric_names = parse_metric_names(metrics)
except ValueError as e:
    raise UserError(f"metrics={metrics!r}: {e}.") from None
try:
    ks = [int(k) for k in pass_k.split(',') if k.strip()]
except ValueError:
    raise UserError(f"pass_k={pass_k!r} must be comma-separated whole numbers, e.g. '1,5'.") from None
if any(not 1 <= k <= num_samples for k in ks):
    raise UserError(f"pass_k={pass_k!r}: each k must be from 1 to num_samples={num_samples} (pass@k draws k of the "
                    f"num_samples answers); raise num_samples or lower k.")
if compile_decode not in (None, True, False):
    raise UserError(f"compile_decode={compile_decode!r} must be True, False or None (None: on a GPU, not on a CPU).")
if num_samples > 1 and temperature == 0:
    raise UserError(f"num_samples={num_samples} with temperature=0: greedy decoding gives one answer "
                    f"{num_samples} times; set temperature > 0 (e.g. 0.8) to sample.")

# no task file: the embedded number tasks' held-out split, which train.py's evals answer
task_path = eval_data or os.path.join(prepare_number_tasks(), 'test.jsonl')
kind, rows = read_task(task_path, max_examples)
generation = kind == GENERATION
# without references (and metrics='') eval.py only generates: no scores, no pass@k
unreferenced = [row['line'] for row in rows if generation and row['references'] is None and not row['call']]
if metric_names and unreferenced:
    raise UserError(f"{task_path}:{unreferenced[0]} has no reference, which metrics={metrics!r} need: give it "
                    f"\"reference\": str or \"references\": [str, ...], or pass --metrics='' to only generate.")
local_device = pick_device(device)  # 'auto' resolved
autocast = autocast_context(local_device, pick_dtype(local_device, dtype))
torch.manual_seed(seed)
model, tokenizer, chat, ckpt_path = load_for_generation(model_path(init_from, out_dir, ckpt_name), data_dir,
                                                        chat_template_variables, local_device)
block_size = model.config.block_size
try:
    rows = with_fewshot(kind, rows, num_fewshot, description, target_delimiter, chat,
                        rows_cut=len(rows) == max_examples)  # the file may hold more rows than were read
except UserError as e:
    raise UserError(f"{task_path}, {e}") from None


def earlier_result(path):
    """Whether path holds eval.py's results for this model on this task file: the one file eval.py replaces."""
    try:
        with open(path, encoding='utf-8') as f:
            old = json.load(f)
        return same_file(old['init_from'], ckpt_path) and same_file(old['eval_data'], task_path)
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return False


results_path = out
if not out:  # the model named by its folder (and its checkpoint unless ckpt.pt), so two models do not collide
    folder, name = os.path.split(os.path.abspath(ckpt_path))
    model_name = os.path.basename(ckpt_path.rstrip('/')) if os.path.isdir(ckpt_path) else (
        os.path.basename(folder) + ('' if name == 'ckpt.pt' else '-' + os.path.splitext(name)[0]))
    stem = os.path.join(os.path.dirname(task_path), f"{os.path.splitext(os.path.basename(task_path))[0]}.eval."
                                                    f"{model_name}")
    # another model of the same folder name (r1/out-sft, r2/out-sft) gets the next free name
    results_path, n = stem + '.json', 1
    while os.path.lexists(results_path) and not earlier_result(results_path):
        n += 1
        results_path = f"{stem}-{n}.json"
check_output_file(results_path, 'out', 'the results JSON', earlier_result,
                  reads=[task_path, ckpt_path])
examples, scores, stderrs = [], {}, {}


def on_line(where, encode, *args):
    """encode(*args), a row's tokens; the tokenizer's own errors (a character a char tokenizer lacks) name the
    row's file and line."""
    try:
        return encode(*args)
    except UserError as e:
        raise UserError(e.args[0] if str(e).startswith(where) else f"{where}: {e}") from None


def in_batches(items, work):
    """work(batch) over items, batch_size at a time, halved where they run out of memory (memory.in_parts): a
    batch's results do not depend on its size (lm-eval's batch_size='auto' searches for the size up front)."""
    in_parts(len(items), batch_size, lambda start, stop: work(items[start:stop]), local_device,
             f"out of memory evaluating one sequence at a time on {local_device}: use a smaller model or "
             f"max_new_tokens, or a device with more memory.",
             lambda size: tqdm.write(f"out of memory: {size} at a time from here on"))


if generation:
    # an example that ends with tool calls is answered by the calls as the template writes them
    rows = [on_line(f"{task_path}:{row['line']}", call_reference, tokenizer, chat, row) for row in rows]
    # a chat answer ends at its end of turn, a continuation at EOS (or a published model's stops)
    stop_ids = stop_tokens(tokenizer)
    prompts = [on_line(f"{task_path}:{row['line']}", generation_prompt, tokenizer, chat, row,
                       f"{task_path}:{row['line']}") for row in rows]
    longest = max(range(len(rows)), key=lambda i: len(prompts[i]))
    # the default: up to 256 new tokens, fewer where the longest prompt leaves fewer of the block
    new_tokens = max_new_tokens or max(1, min(256, block_size + 1 - len(prompts[longest])))
    for row, ids in zip(rows, prompts):
        if len(ids) + new_tokens - 1 > block_size:
            raise UserError(f"{task_path}:{row['line']}: the prompt is {len(ids)} tokens; with max_new_tokens="
                            f"{new_tokens} the model would see {len(ids) + new_tokens - 1} positions, "
                            f"over its block_size of {block_size}. Shorten the prompt, lower max_new_tokens, or leave "
                            f"the example out.")
    if not max_new_tokens and new_tokens < 256:
        print(f"answers of up to {new_tokens} tokens: the longest prompt ({task_path}:{rows[longest]['line']}, "
              f"{len(prompts[longest])} tokens) leaves that many of the model's block_size of {block_size}")
    generator = torch.Generator(device=local_device).manual_seed(seed)
    # a compiled step pays for itself over many steps on a GPU; on a CPU compiling takes minutes (docs/eval.md)
    compiled = local_device.startswith('cuda') if compile_decode is None else compile_decode
    decoding = CompiledDecoding() if compiled else None
    progress = tqdm(total=len(rows), desc=f"generation {os.path.basename(task_path)}", unit='example')
    # shortest prompts first: a batch pads its prompts to its longest
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
    examples = [None] * len(rows)

    def answer(batch):
        with autocast:
            completions = generate_batch(model, [prompts[i] for i in batch], new_tokens, temperature,
                                         top_k or None, top_p or None, stop_ids, num_samples, generator,
                                         decoding=decoding)
        for b, i in enumerate(batch):
            row, samples = rows[i], []
            for ids in completions[b * num_samples:(b + 1) * num_samples]:
                text = tokenizer.decode(ids[:-1] if ids and ids[-1] in stop_ids else ids)
                # cut before the first stop string
                samples.append(min((text[:text.index(s)] for s in row['stop'] if s in text), key=len, default=text))
            references = row['references'] or []
            example = dict(index=i, prompt=row['prompt'] if row['prompt'] is not None else tokenizer.decode(prompts[i]),
                           references=references, prediction=samples[0])
            if num_samples > 1:
                example['samples'] = samples
            example['scores'] = example_scores(metric_names, samples[0], references) if row['references'] else {}
            if row['references']:
                example['correct'] = sum(exact_match([s], [references]) == 1.0 for s in samples)
            examples[i] = example
        progress.update(len(batch))
    in_batches(order, answer)
    progress.close()
    if metric_names:
        predictions, references = [e['prediction'] for e in examples], [e['references'] for e in examples]
        scores = corpus_scores(metric_names, predictions, references)
        stderrs = corpus_stderrs(metric_names, predictions, references)
    if num_samples > 1 and not unreferenced:  # a sample is correct when it is an exact match
        for k in ks:
            scores[f'pass@{k}'] = mean_pass_at_k([(num_samples, e['correct']) for e in examples], k)
            stderrs[f'pass@{k}'] = mean_stderr([pass_at_k(num_samples, e['correct'], k) for e in examples])
elif kind == ROLLING:
    # every text's windows, batch_size to a forward pass; a text's loglik is their sum
    requests = [(i, request) for i, row in enumerate(rows) for request in on_line(
        f"{task_path}:{row['line']}", rolling_requests, tokenizer, row['text'], block_size,
        f"{task_path}:{row['line']}")]
    logliks = [0.0] * len(rows)
    progress = tqdm(total=len(requests), desc=f"perplexity {os.path.basename(task_path)}", unit='window')

    def add_windows(batch):
        for (i, _), loglik in zip(batch, choice_logliks(model, [r for _, r in batch], autocast)):
            logliks[i] += loglik
        progress.update(len(batch))
    in_batches(requests, add_windows)
    progress.close()
    for i, row in enumerate(rows):
        examples.append(dict(index=i, line=row['line'], loglik=logliks[i],
                             **rolling_scores([logliks[i]], [row['text']])))
    scores = rolling_scores(logliks, [row['text'] for row in rows])  # lm-eval gives these no standard error
else:
    # every choice of every example, batched batch_size sequences to a forward pass
    requests = [(i, request) for i, row in enumerate(rows) for request in on_line(
        f"{task_path}:{row['line']}", choice_requests, tokenizer, row, target_delimiter, block_size,
        f"{task_path}:{row['line']}")]
    logliks = [[] for _ in rows]
    progress = tqdm(total=len(rows), desc=f"multiple choice {os.path.basename(task_path)}", unit='example')

    def add_choices(batch):
        for (i, _), loglik in zip(batch, choice_logliks(model, [r for _, r in batch], autocast)):
            logliks[i].append(loglik)
        done = batch[-1][0] + (len(logliks[batch[-1][0]]) == len(rows[batch[-1][0]]['choices']))
        progress.update(done - progress.n)
    in_batches(requests, add_choices)
    progress.close()
    for i, row in enumerate(rows):
        pred, pred_norm, pred_bytes = choice_predictions(logliks[i], row['choices'])
        examples.append(dict(index=i, context=row['context'], choices=row['choices'], label=row['label'],
                             logliks=logliks[i], pred=pred, pred_norm=pred_norm, pred_bytes=pred_bytes,
                             acc=int(pred == row['label']), acc_norm=int(pred_norm == row['label']),
                             acc_bytes=int(pred_bytes == row['label'])))
    for name in ('acc', 'acc_norm', 'acc_bytes'):
        scores[name] = sum(e[name] for e in examples) / len(examples)
        stderrs[name] = mean_stderr([e[name] for e in examples])

# the table, as lm-eval prints it: each score with its standard error; BLEU and chrF on
# sacreBLEU's 0-100 scale, perplexities >= 1, bits per byte in bits, the rest 0-1 fractions
print(f"\n{ckpt_path} on {task_path}")
print(f"{'metric':<16}{'value':>10}{'stderr':>10}{'n':>8}  scale")
for name, value in scores.items():
    scale = '0-100' if name in ('bleu', 'chrf') else 'bits' if name == 'bits_per_byte' else (
        '>= 1' if name.endswith('perplexity') else '0-1')
    stderr = 'N/A' if stderrs.get(name) is None else f"{stderrs[name]:.4f}"
    print(f"{name:<16}{value:>10.4f}{stderr:>10}{len(examples):>8}  {scale}")
result = dict(init_from=ckpt_path, eval_data=task_path, task=kind, n=len(examples), config=config, scores=scores,
              stderr=stderrs, examples=examples)
# whole or not at all, through a temporary of its own name (a file <out>.tmp of the user's stays)
fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(results_path)), suffix='.tmp')
with os.fdopen(fd, 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=1, ensure_ascii=False)
os.chmod(temporary, 0o644)  # mkstemp makes it 0600
os.replace(temporary, results_path)
print(f"wrote {results_path}")
