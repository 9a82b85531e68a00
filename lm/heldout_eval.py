"""
Held-out evaluation of a chat model while it fine-tunes (train.py, train_dpo.py): its greedy answers to
held-out prompts, generated batch_size prompts at a time with the KV cache (lm/generate.generate_batch),
scored by the metrics the run's eval_metrics names (lm/metrics.METRICS). Also the sample a GPT run
prints at its end.

What an answer is, per metric:
- exact_match, strict: the reference (both sides normalize_answer'd) and then at once the end-of-turn
  token, within the reference's token count + 1 new tokens; an answer that runs on is wrong.
- the others (bleu, chrf, rouge*): the answer's text before the end-of-turn token; the model answers until
  it stops or prompt and answer fill max_length tokens (the longest a training example may be).
Greedy answers are prefixes of one another, so one generation, as long as the longer budget, serves both.

Under DDP the prompts are cut into the same batches on every rank and rank r answers batches r,
r + world_size, ...; the answers are gathered so that every rank scores the whole list in order, as one
process does (a corpus BLEU is no mean of per-rank BLEUs). Under FSDP every forward pass is a
collective: every rank answers every batch.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist

from configurator import UserError
from lm.generate import generate_batch, stop_tokens
from lm.metrics import METRICS, corpus_scores, exact_match, parse_metric_names
from memory import in_parts
from run.fsdp import is_sharded, whole_root
from run.runtime import log


class HeldOut(NamedTuple):
    """What a run's held-out evaluation answers and how it scores it."""
    tokenizer: object  # the chat tokenizer: its eos_id (end of turn) and stop_ids end an answer
    prompts: list  # (prompt ids, reference text) pairs; [] = no held-out evaluation
    metrics: list  # names in lm.metrics.METRICS
    batch_size: int  # prompts answered at once
    max_length: int  # prompt + answer tokens an answer may fill (all metrics but exact_match)
    sources: tuple = ()  # each prompt's data source (a name), scored apart as well; () = one unnamed source


def metric_names(value, key='eval_metrics'):
    """The metric names of a comma-separated config value (duplicates dropped), each a key of
    lm.metrics.METRICS; else a UserError naming the key and the choices."""
    try:
        names = parse_metric_names(value)
        if not names:
            raise ValueError(f"no metric named; choose from {', '.join(METRICS)}")
    except ValueError as e:
        raise UserError(f"{key}={value!r}: {e}, comma-separated (e.g. --{key}=exact_match,bleu); "
                        f"exact_match_examples=0 scores none.") from None
    return names


def answer_budget(held_out, prompt, reference, block_size):
    """(prompt, new tokens to generate) for one held-out pair: the exact-match budget (the reference's
    tokens + 1), or up to max_length when a free-form metric is scored too; within block_size, as
    generate_batch needs (an overlong prompt keeps its last tokens, as GPT.generate would see them)."""
    budget = len(held_out.tokenizer.encode(reference)) + 1
    if held_out.metrics != ['exact_match']:
        budget = max(budget, held_out.max_length - len(prompt))
    budget = min(budget, block_size)
    return prompt[-(block_size + 1 - budget):], budget


def answer_batches(rows, batch_size, block_size):
    """rows' indices ((prompt, budget) each) in batches of at most batch_size, shortest prompts first
    (little padding), each within generate_batch's limit: longest prompt + largest budget - 1 <= block_size.
    Answers that may run to max_length = block_size thus share a batch only with prompts of about their
    length: smaller batches, each row still answered as alone."""
    batches, batch = [], []
    for i in sorted(range(len(rows)), key=lambda i: len(rows[i][0])):
        grown = batch + [i]
        fed = max(len(rows[j][0]) for j in grown) + max(rows[j][1] for j in grown) - 1
        if len(grown) > batch_size or fed > block_size:
            batches.append(batch)
            grown = [i]
        batch = grown
    return batches + [batch] if batch else batches


def score_answers(names, answers, references, tokenizer):
    """{name: score} of answers (token ids, as generated: ending at a stop token if produced, the end of turn
    or a published model's others) against their reference texts; exact_match strict (see the top of this file)."""
    texts, hits, stops = [], [], stop_tokens(tokenizer)
    for answer, reference in zip(answers, references):
        end = next((i for i, token in enumerate(answer) if token in stops), len(answer))
        texts.append(tokenizer.decode(answer[:end]))
        stopped = end < len(tokenizer.encode(reference)) + 1
        hits.append(stopped and exact_match([texts[-1]], [reference]) == 1.0)
    scores = corpus_scores([name for name in names if name != 'exact_match'], texts, references)
    scores['exact_match'] = sum(hits) / len(hits)
    return {name: scores[name] for name in names}


def answered(model, rows, batches, stop_ids, retry):
    """{row: answer} of answer_batches' batches of rows, each row as alone. With retry (this rank may redo a
    batch alone) a batch that runs out of memory is answered in halves, and so are those after it
    (memory.in_parts)."""
    answers, most = {}, max(map(len, batches), default=1)
    for batch in batches:
        def answer(start, stop):
            part = batch[start:stop]
            completions = generate_batch(model, [rows[i][0] for i in part], max(rows[i][1] for i in part),
                                         stop_ids=stop_ids)
            # a row may run past its own budget while others in the batch go on
            answers.update((i, completion[:rows[i][1]]) for i, completion in zip(part, completions))
        if not retry:
            answer(0, len(batch))
            continue
        most = in_parts(len(batch), most, answer, str(model.lm_head.weight.device),
                        "out of memory answering one held-out prompt: skip the held-out answers with "
                        "exact_match_examples=0 (or lower max_length, where the script has it).")
    return answers


@torch.no_grad()
def heldout_answers(model, held_out, autocast):
    """Every held-out prompt's greedy answer (token ids), in order, on every rank. model: the raw model
    (in any mode; left as it was), computing under autocast. Every rank must call it."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    block_size = model.config.block_size
    rows = [answer_budget(held_out, prompt, reference, block_size) for prompt, reference in held_out.prompts]
    batches = answer_batches(rows, held_out.batch_size, block_size)
    split = dist.is_initialized() and not is_sharded(model)
    training = model.training
    model.eval()
    stop_ids, retry = stop_tokens(held_out.tokenizer), not is_sharded(model)  # FSDP's ranks generate in lockstep
    try:
        with autocast, whole_root(model):
            answers = answered(model, rows, batches[rank::world_size] if split else batches, stop_ids, retry)
    finally:  # an out-of-memory error must not leave a training model in eval mode
        model.train(training)
    if split:
        shares = [None] * world_size
        dist.all_gather_object(shares, answers)
        answers = {i: answer for share in shares for i, answer in share.items()}
    return [answers[i] for i in range(len(rows))]


def shown_score(name, score):
    return f"{score:.1%}" if name in ('exact_match', 'tool_calls') else f"{score:.4g}"  # shares as percentages


def report_heldout(model, held_out, autocast, step, record):
    """Answer and score the held-out prompts (nothing when there are none), log the scores on one line
    and record them as eval/<metric> (run_log's record: log.jsonl and TensorBoard) at step; with named
    sources, each source's prompts are scored apart too, eval/<metric>/<source>. Every rank must call it."""
    if not held_out.prompts:
        return
    answers = heldout_answers(model, held_out, autocast)
    references = [ref for _, ref in held_out.prompts]
    scores = score_answers(held_out.metrics, answers, references, held_out.tokenizer)
    by_source = {}
    for source in dict.fromkeys(held_out.sources):  # each once, in order
        mine = [i for i, s in enumerate(held_out.sources) if s == source]
        by_source[source] = score_answers(held_out.metrics, [answers[i] for i in mine], [references[i] for i in mine],
                                          held_out.tokenizer)
    shown = []
    for name, score in scores.items():
        each = ', '.join(f"{source} {shown_score(name, s[name])}" for source, s in by_source.items())
        shown.append(f"{name} {shown_score(name, score)}" + (f" ({each})" if each else ''))
    log(f"step {step}: {', '.join(shown)} on {len(answers)} held-out prompts")
    record(dict(step=step, **{f'eval/{name}': score for name, score in scores.items()},
                **{f'eval/{name}/{source}': score for source, s in by_source.items() for name, score in s.items()}))
