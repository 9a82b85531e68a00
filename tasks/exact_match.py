"""
Scoring a chat model on held-out prompts: the share it answers greedily with exactly the reference
answer and then stops (the end-of-turn token). Every rank of a DDP run scores its share; under FSDP,
where every forward pass is a collective, every rank answers every prompt. Also the sample a GPT run
prints at its end (a chat model answering the first held-out prompt).
"""
import os

import torch
import torch.distributed as dist

from lm.metrics import normalize_answer
from run.fsdp import is_sharded, whole_root
from run.runtime import log


@torch.no_grad()
def exact_match_accuracy(model, tokenizer, prompts, autocast):
    """Fraction of prompts, (prompt ids, reference text) pairs, that the model (in eval mode, under the
    autocast context) answers greedily with exactly the reference, then tokenizer.eos_id; both sides
    normalised as lm.metrics.exact_match does (normalize_answer: ends stripped, inner whitespace one
    space). It may generate one token more than the reference: a right answer must stop there. Under
    DDP each rank answers its share and the counts are summed: every rank must call it."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = prompts if is_sharded(model) else prompts[rank::world_size]  # all: the sum below keeps the ratio
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    hits = 0
    with autocast, whole_root(model):
        for prompt, reference in mine:
            out = model.generate(torch.tensor([prompt], device=device), len(tokenizer.encode(reference)) + 1,
                                 temperature=0, eos_id=tokenizer.eos_id)[0, len(prompt):].tolist()
            end = tokenizer.eos_id
            hits += end in out and (normalize_answer(tokenizer.decode(out[:out.index(end)]))
                                    == normalize_answer(reference))
    model.train(training)
    total = torch.tensor([hits, len(mine)], device=device, dtype=torch.float)
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def report_exact_match(model, tokenizer, prompts, autocast, step, record):
    """Score prompts (exact_match_accuracy), log the score and record it (checkpoint.run_log's record) at
    step; nothing when there are no prompts. Every rank must call it."""
    if prompts:
        accuracy = exact_match_accuracy(model, tokenizer, prompts, autocast)
        log(f"step {step}: exact match {accuracy:.1%} on {len(prompts)} held-out prompts")
        record(dict(step=step, exact_match=accuracy))


def print_sample(model, tokenizer, prompt, max_new_tokens, eos_id, seed, device, heading):
    """Print heading and what model generates after prompt (token ids) on device: temperature 0.8, top-k 50, a
    generator seeded with seed, stopping at eos_id (None: never). Under FSDP every rank must call it (each
    token is computed by all of them); rank 0 prints."""
    model.eval()
    with whole_root(model):
        sample = model.generate(torch.tensor([prompt], device=device), max_new_tokens, temperature=0.8, top_k=50,
                                eos_id=eos_id, generator=torch.Generator(device=device).manual_seed(seed))
    if int(os.environ.get('RANK', 0)) == 0:
        print(heading)
        print(tokenizer.decode(sample[0].tolist()))
