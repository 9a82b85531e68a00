"""
Batched generation with the KV cache, for evaluation and online RL: prompts of different lengths at
once, greedy or sampled (model.sample_next), each row stopping at its own first stop token.

Prompts are left-padded to the longest, so every row's last prompt token sits in the same slot and
the batch decodes one slot per step. Slot j of row b holds the token at position j - starts[b]
(starts[b]: row b's padding); RoPE or learned positions see each prompt from position 0, and a mask
hides the padding. With num_samples = G the prompts are prefilled once, and their G rows read the
prompt's keys from that one copy (SharedPromptCache) or from G copies of it. Rows that finish
leave the batch (and their own cache rows with them), so a long completion does not keep finished rows
computing; as leaving copies the caches, they leave together, once computing them in the steps left
would cost more than a decode step of the whole batch.
"""
import torch

from lm.shared_prompts import SharedPromptCache
from model import KVCache, sample_next, sampling_dtype, window_mask


def stop_tokens(tokenizer):
    """The ids that end an answer, sorted: the tokenizer's eos_id (a chat model's end of turn) and a published
    model's other stop tokens (hf/tokenizer.py's stop_ids, from generation_config.json)."""
    return sorted({tokenizer.eos_id, *getattr(tokenizer, 'stop_ids', [])} - {None})


def check_prompts(prompts, max_new_tokens, block_size):
    """Every position generation needs must be below block_size: batched rows cannot slide
    their context as GPT.generate crops equal rows, so a prompt that would need it is an error."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"generate_batch: prompt {i} is empty; each prompt needs at least one token "
                             f"(e.g. BOS) to predict the next from.")
        fed = len(prompt) + max(max_new_tokens - 1, 0)  # the last new token is never fed back
        if fed > block_size:
            raise ValueError(f"generate_batch: prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                             f"{max_new_tokens} the model would see {fed} positions but block_size is "
                             f"{block_size}; shorten the prompt or lower max_new_tokens.")


def left_pad(prompts, device):
    """(B, P) tokens, each prompt at the right end of its row (padding is token 0, masked), and
    starts (B,): how many padding slots open each row."""
    width = max(map(len, prompts))
    idx = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in zip(idx, prompts):
        row[width - len(prompt):] = torch.tensor(prompt)
    starts = torch.tensor([width - len(p) for p in prompts])
    return idx.to(device), starts.to(device)


def padded_mask(q_slots, n_keys, starts, window):
    """(B, 1, Tq, n_keys), True where a query may attend: causal and within the window over slots (a
    row's positions are its slots shifted, so the distances are the same), never to padding keys."""
    k_slots = torch.arange(n_keys, device=starts.device)
    allowed = window_mask(q_slots, k_slots, window or n_keys) & (k_slots >= starts[:, None, None])
    # a padding query sees itself: with no key at all some kernels give NaN (CPU's math one 0),
    # which its cached values would carry into the real rows' attention (a masked NaN: 0 * NaN)
    return (allowed | (q_slots[:, None] == k_slots))[:, None]


def next_logits(model, idx, starts, caches):
    """Logits (B, V) after the last token of idx (B, T), which continues the caches' rows."""
    first = caches[0].len
    if not starts.any():  # no padding: plain causal attention, GPT.generate's path, fused kernels
        h = model.hidden_states(idx, caches)
    else:
        q_slots = torch.arange(first, first + idx.size(1), device=idx.device)
        positions = (q_slots - starts[:, None]).clamp(min=0)  # padding at 0: never attended to
        mask = padded_mask(q_slots, first + idx.size(1), starts, model.config.sliding_window)
        h = model.hidden_states(idx, caches, positions=positions, mask=mask)
    return model.logits(h[:, -1])


@torch.inference_mode()
def generate_batch(model, prompts, max_new_tokens, temperature=0.0, top_k=None, top_p=None, stop_ids=(),
                   num_samples=1, generator=None, rows_of=None, share_prompts=None):
    """Completions of prompts (lists of token ids), num_samples per prompt in prompt order:
    prompt i's are entries i * num_samples ... (i + 1) * num_samples - 1. Each is at most
    max_new_tokens ids, without the prompt, ending with the first of stop_ids it produced (shared
    by all rows). temperature 0 is greedy; sampling draws from generator one number per completion a
    step (model.sample_next). rows_of=(first, total): these completions are rows first... of a batch of
    total that processes split; each draws all total numbers and uses its own, so the split does not change
    the samples (train_rl.py's ranks). share_prompts: the num_samples rows of a prompt read its cached keys
    from one copy (SharedPromptCache) instead of num_samples; None = on a CPU, where decoding waits
    on reading the cache (on a GPU it waits on kernel launches, which that adds). Call model.eval() first."""
    check_prompts(prompts, max_new_tokens, model.config.block_size)
    completions = [[] for _ in range(len(prompts) * num_samples)]
    if not prompts or max_new_tokens == 0:
        return completions
    idx, starts = left_pad(prompts, model.lm_head.weight.device)
    share = num_samples > 1 and (idx.device.type == 'cpu' if share_prompts is None else share_prompts)
    width = idx.size(1) + (0 if share else max_new_tokens - 1)
    caches = [KVCache(width) for _ in model.transformer.h]
    logits = next_logits(model, idx, starts, caches).repeat_interleave(num_samples, dim=0)
    starts = starts.repeat_interleave(num_samples)
    if share:
        caches = [SharedPromptCache(cache, num_samples, max_new_tokens - 1) for cache in caches]
    else:
        copies = torch.arange(len(prompts), device=idx.device).repeat_interleave(num_samples)
        for cache in caches:
            cache.keep(copies)
    stop_ids = set(stop_ids)
    rows = list(range(len(completions)))  # the completion each batch row writes to; None once it stopped
    first, total = rows_of or (0, len(completions))
    owners = torch.arange(len(completions), device=idx.device) + first  # each batch row's number in the draw
    for step in range(max_new_tokens):
        uniform = None if temperature == 0 else torch.rand(total, generator=generator, device=idx.device,
                                                            dtype=sampling_dtype(idx.device))[owners]
        token = sample_next(logits, temperature, top_k, top_p, generator, uniform)
        for i, (row, t) in enumerate(zip(rows, token[:, 0].tolist())):
            if row is not None:
                completions[row].append(t)
                rows[i] = None if t in stop_ids else row
        running = [row is not None for row in rows]
        if step == max_new_tokens - 1 or not any(running):
            break
        # finished rows leave together (each leaving copies the caches), once computing them in the
        # steps left would cost more than a decode step of the batch; until then, tokens thrown away
        if running.count(False) * (max_new_tokens - 1 - step) >= len(rows):
            keep = torch.tensor([i for i, r in enumerate(running) if r], device=idx.device)
            for cache in caches:
                cache.keep(keep)
            rows = [row for row in rows if row is not None]
            token, starts, owners = token[keep], starts[keep], owners[keep]
        logits = next_logits(model, token, starts, caches)
    return completions
