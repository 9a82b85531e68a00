"""
Batched generation with the KV cache, for evaluation and online RL: prompts of different lengths at
once, greedy or sampled (model.sample_next), each row stopping at its own first stop token.

Prompts are left-padded to the longest, so every row's last prompt token sits in the same slot and
the batch decodes one slot per step. Slot j of row b holds the token at position j - starts[b]
(starts[b]: row b's padding); RoPE or learned positions see each prompt from position 0, and a mask
hides the padding. The prompts are prefilled in groups of similar length, each padded only to its own
longest (prefill), into a cache preallocated for the whole generation (DecodeCache), which each decode step
writes in place (decode_step). With num_samples = G the prompts are prefilled once, and their G rows read the
prompt's keys from that one copy (SharedPromptCache) or from G copies of it. Rows that finish
leave the batch (and their own cache rows with them), so a long completion does not keep finished rows
computing; as leaving copies the caches, they leave together, once computing them in the steps left
would cost more than a decode step of the whole batch.

CompiledDecoding runs the decode step through torch.compile over caches of fixed shapes (CUDA graphs on a GPU:
one launch a step instead of one a kernel, gpt-fast's recipe); there the batch keeps its rows to the end.
"""
import math

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


def length_groups(lengths, waste=0.25):
    """The prompts' indices in groups of similar length, shortest first, each padded to its longest costing at
    most waste more than its tokens: prompts of 35 and 168 tokens pad 35 to 168 (4.8x) in one batch."""
    groups = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        group = groups[-1] if groups else []
        if not group or (len(group) + 1) * lengths[i] > (1 + waste) * (sum(lengths[j] for j in group) + lengths[i]):
            groups.append(group := [])
        group.append(i)
    return groups


def prefill(model, prompts, groups, width):
    """Each prompt's next-token logits (P, V) and the keys and values of all of them, left-padded to the longest:
    per layer (k, v), each (P, Hkv, width, D), width >= the longest prompt, slots after the prompts (and the
    padding) zero. Rows in the order of groups (length_groups), each group computed padded to its own longest."""
    device, longest = model.lm_head.weight.device, max(map(len, prompts))
    logits, layers, row = None, None, 0
    for group in groups:
        idx, starts = left_pad([prompts[i] for i in group], device)
        caches = [KVCache(idx.size(1)) for _ in model.transformer.h]
        out = next_logits(model, idx, starts, caches)
        if layers is None:
            logits = out.new_empty(len(prompts), out.size(1))
            layers = [tuple(x.new_zeros(len(prompts), x.size(1), width, x.size(3)) for x in (c.k, c.v)) for c in caches]
        rows = slice(row, row + len(group))
        logits[rows] = out
        for (k, v), cache in zip(layers, caches):  # the group's slots end where the longest prompt's do
            k[rows, :, longest - idx.size(1):longest] = cache.k
            v[rows, :, longest - idx.size(1):longest] = cache.v
        row += len(group)
    return logits, layers


def key_chunks(groups, starts):
    """(first row, end row, first slot) of each run of rows of one length group (groups: each row's, rows in group
    order) and the first slot any of them reads (starts: each row's padding): eager attention reads no slot that
    is padding for every row of a run."""
    chunks, first = [], 0
    for row in range(1, len(groups) + 1):
        if row == len(groups) or groups[row] != groups[first]:
            chunks.append((first, row, min(starts[first:row])))
            first = row
    return chunks


def attend_one(q, k, v, mask):
    """Attention of one query a row, q (B, H, 1, D), over k, v (B, Hkv, L, D), each key/value head serving H / Hkv
    query heads; mask (B, 1, 1, L), True where allowed. Grouped matmuls, as transformers' eager attention (scores in
    the inputs' dtype, softmax in at least float32): on a CPU twice SDPA's speed for one query (its flash kernel
    tiles for many), and what torch.compile fuses on a GPU. model.attend computes the same."""
    B, H, _, D = q.shape
    scores = (q.view(B, k.size(1), H // k.size(1), D) / math.sqrt(D)) @ k.transpose(-1, -2)  # (B, Hkv, r, L)
    scores = scores.masked_fill(~mask, float('-inf'))
    weights = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(-1).to(v.dtype)
    return (weights @ v).view(B, H, 1, D)


class DecodeCache:
    """One layer's keys and values of a batch decoding a token a row a step (decode_step), preallocated: k, v (B, Hkv,
    width, D) hold the prompts left-padded (prefill) and slots for the tokens to come; a step writes its token's at
    slot, a (1,) tensor every layer shares, in place (index_copy_), and attends over the first slots its mask covers;
    eagerly, each run of rows of similar length (chunks: key_chunks) from its own first slot, skipping padding. Its
    shapes never change, so a compiled step (CompiledDecoding, chunks None) is captured once."""

    def __init__(self, k, v, slot, chunks=None):
        self.k, self.v, self.slot, self.chunks = k, v, slot, chunks
        self.len = k.size(2)  # what hidden_states reads as the cached length; decode_step gives positions and mask

    def keep(self, rows):
        self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)

    def attend(self, q, k, v, mask):
        self.k.index_copy_(2, self.slot, k)
        self.v.index_copy_(2, self.slot, v)
        n = mask.size(-1)
        if self.chunks is None:
            return attend_one(q, self.k[:, :, :n], self.v[:, :, :n], mask)
        return torch.cat([attend_one(q[a:b], self.k[a:b, :, first:n], self.v[a:b, :, first:n], mask[a:b, ..., first:n])
                          for a, b, first in self.chunks])


def decode_step(model, token, slot, starts, caches, n_keys=None):
    """Logits (B, V) after token (B, 1), each row's next, at slot (a (1,) tensor; the same for every row, as prompts
    are left-padded) of caches (DecodeCache or SharedPromptCache, one a layer), whose padding starts (B,) hide. The
    token attends over the first n_keys slots (None: the caches' width, a fixed shape for torch.compile)."""
    n_keys = caches[0].len if n_keys is None else n_keys
    mask = padded_mask(slot, n_keys, starts, model.config.sliding_window)
    h = model.hidden_states(token, caches, positions=(slot - starts)[:, None], mask=mask)
    return model.logits(h[:, -1])


class CompiledDecoding:
    """decode_step compiled (fullgraph; mode='reduce-overhead' on a GPU: each step one CUDA graph replay instead of
    a launch a kernel, as gpt-fast decodes) and the caches it writes in place, kept for later calls of the same shape
    (a graph reads and writes fixed addresses; torch._dynamo.mark_static_address). Widths are rounded up to a multiple
    of WIDTH_STEP, so prompts of about the same length reuse one graph. One per model and script: generate_batch's
    decoding=. Cost: a compilation at the first call (minutes on a CPU), a graph recorded at the first call of each
    shape, and the caches of the last MAX_SHAPES shapes. backend: torch.compile's ('aot_eager' traces and
    functionalizes the step as inductor does, without generating kernels: the CPU tests' cheap check)."""
    WIDTH_STEP, MAX_SHAPES = 64, 4

    def __init__(self, backend='inductor'):
        self.step, self.caches, self.backend = None, {}, backend

    def static_caches(self, layers):
        """DecodeCaches of these (k, v) tensors' shape whose tensors stay the same between calls: the values copied in."""
        k0 = layers[0][0]
        key = (tuple(k0.shape), k0.dtype, k0.device)
        if key not in self.caches:
            while len(self.caches) >= self.MAX_SHAPES:
                self.caches.pop(next(iter(self.caches)))
            slot = torch.zeros(1, dtype=torch.long, device=k0.device)
            caches = [DecodeCache(torch.empty_like(k), torch.empty_like(v), slot) for k, v in layers]
            for t in [slot] + [x for c in caches for x in (c.k, c.v)]:
                torch._dynamo.mark_static_address(t)
            self.caches[key] = caches
        caches = self.caches[key]
        for cache, (k, v) in zip(caches, layers):
            cache.k.copy_(k)
            cache.v.copy_(v)
        return caches

    def __call__(self, model, token, slot, starts, caches):
        if self.step is None:
            # CUDA graphs exist on CUDA only, and come from inductor
            mode = 'reduce-overhead' if token.device.type == 'cuda' and self.backend == 'inductor' else None
            # the first shape compiled static (a tenth of a dynamic compilation's time on a CPU, and kernels of
            # fixed sizes); a second shape (RL's evals) recompiles once with the changed sizes dynamic, after which
            # each new shape only records its CUDA graph
            self.step = torch.compile(decode_step, backend=self.backend, mode=mode, fullgraph=True)
        if token.device.type == 'cuda':
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are consumed: its buffers are free
        return self.step(model, token, slot, starts, caches)


def generate_batch(model, prompts, max_new_tokens, temperature=0.0, top_k=None, top_p=None, stop_ids=(),
                   num_samples=1, generator=None, rows_of=None, share_prompts=None, decoding=None):
    """Completions of prompts (lists of token ids), num_samples per prompt in prompt order:
    prompt i's are entries i * num_samples ... (i + 1) * num_samples - 1. Each is at most
    max_new_tokens ids, without the prompt, ending with the first of stop_ids it produced (shared
    by all rows). temperature 0 is greedy; sampling draws from generator one number per completion a
    step (model.sample_next). rows_of=(first, total): these completions are rows first... of a batch of
    total that processes split; each draws all total numbers and uses its own, so the split does not change
    the samples (train_rl.py's ranks). share_prompts: the num_samples rows of a prompt read its cached keys
    from one copy (SharedPromptCache) instead of num_samples; None = on a CPU, where decoding waits
    on reading the cache (on a GPU it waits on kernel launches, which that adds). decoding: a CompiledDecoding
    to decode with (then every row stays in the batch to the end, its tokens after its stop thrown away, and no
    prompt is shared), None = eager. Call model.eval() first."""
    completions = [[] for _ in range(len(prompts) * num_samples)]
    for drawn in drawn_tokens(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, num_samples,
                              generator, rows_of, share_prompts, decoding):
        for row, token in drawn.items():
            completions[row].append(token)
    return completions


def stream_tokens(model, ids, max_new_tokens, temperature=0.0, top_k=None, top_p=None, generator=None,
                  use_kv_cache=True, decoding=None):
    """The tokens (ints) that follow one prompt's ids, each as soon as it is drawn, as GPT.generate draws them:
    through decoding (a CompiledDecoding: CUDA graphs on a GPU) where prompt and answer fit its static cache, else
    GPT.generate_tokens (its context slides past block_size). No stop token: the caller stops reading at its own."""
    if decoding is not None and use_kv_cache and len(ids) + max_new_tokens - 1 <= model.config.block_size:
        return (drawn[0] for drawn in drawn_tokens(model, [ids], max_new_tokens, temperature, top_k, top_p,
                                                   generator=generator, decoding=decoding))
    prompt = torch.tensor([ids], dtype=torch.long, device=model.lm_head.weight.device)
    return (t.item() for t in model.generate_tokens(prompt, max_new_tokens, temperature, top_k, top_p, use_kv_cache,
                                                     generator=generator))


@torch.inference_mode()
def drawn_tokens(model, prompts, max_new_tokens, temperature=0.0, top_k=None, top_p=None, stop_ids=(),
                 num_samples=1, generator=None, rows_of=None, share_prompts=None, decoding=None):
    """generate_batch's tokens a step at a time, as they are drawn: {completion: its new token} of the completions
    still running (serve.py draws a request's answers with it; stream_tokens one prompt's, compiled)."""
    check_prompts(prompts, max_new_tokens, model.config.block_size)
    if not prompts or max_new_tokens == 0:
        return
    device = model.lm_head.weight.device
    longest = max(map(len, prompts))
    # the batch's rows: each prompt's num_samples, prompts in groups of similar length (prefill, key_chunks)
    groups = length_groups([len(p) for p in prompts])
    order = [i for group in groups for i in group]
    rows = [i * num_samples + s for i in order for s in range(num_samples)]  # the completion each row writes to
    starts_list = [longest - len(prompts[r // num_samples]) for r in rows]
    group_of = [g for g, group in enumerate(groups) for _ in range(len(group) * num_samples)]
    starts = torch.tensor(starts_list, device=device)
    share = num_samples > 1 and decoding is None and (device.type == 'cpu' if share_prompts is None else share_prompts)
    width = longest + (0 if share else max_new_tokens - 1)
    if decoding is not None:
        width = -(-width // decoding.WIDTH_STEP) * decoding.WIDTH_STEP
    logits, layers = prefill(model, prompts, groups, width)
    logits = logits.repeat_interleave(num_samples, dim=0)
    slot = torch.full((1,), longest, device=device)  # where the first new token goes
    if share:
        caches = []
        for k, v in layers:
            cache = KVCache(longest)
            cache.k, cache.v, cache.len = k, v, longest
            caches.append(SharedPromptCache(cache, num_samples, max_new_tokens - 1))
    else:
        layers = [(k.repeat_interleave(num_samples, 0), v.repeat_interleave(num_samples, 0)) for k, v in layers] \
            if num_samples > 1 else layers
        if decoding is None:
            chunks = key_chunks(group_of, starts_list)
            caches = [DecodeCache(k, v, slot, chunks) for k, v in layers]
        else:
            caches = decoding.static_caches(layers)
            slot = caches[0].slot
            slot.fill_(longest)
    stop_ids = set(stop_ids)
    first, total = rows_of or (0, len(prompts) * num_samples)
    owners = torch.tensor(rows, device=device) + first  # each batch row's number in the draw
    for step in range(max_new_tokens):
        uniform = None if temperature == 0 else torch.rand(total, generator=generator, device=device,
                                                            dtype=sampling_dtype(device))[owners]
        token = sample_next(logits, temperature, top_k, top_p, generator, uniform)
        drawn = {}
        for i, (row, t) in enumerate(zip(rows, token[:, 0].tolist())):
            if row is not None:
                drawn[row] = t
                rows[i] = None if t in stop_ids else row
        yield drawn
        running = [row is not None for row in rows]
        if step == max_new_tokens - 1 or not any(running):
            break
        # finished rows leave together (each leaving copies the caches), once computing them in the
        # steps left would cost more than a decode step of the batch; until then, tokens thrown away
        if decoding is None and running.count(False) * (max_new_tokens - 1 - step) >= len(rows):
            kept = [i for i, r in enumerate(running) if r]
            keep = torch.tensor(kept, device=device)
            rows, group_of, starts_list = ([x[i] for i in kept] for x in (rows, group_of, starts_list))
            chunks = key_chunks(group_of, starts_list)
            for cache in caches:
                cache.keep(keep)
                if isinstance(cache, DecodeCache):
                    cache.chunks = chunks
            token, starts, owners = token[keep], starts[keep], owners[keep]
        if decoding is None:
            logits = decode_step(model, token, slot, starts, caches, longest + step + 1)
        else:
            logits = decoding(model, token, slot, starts, caches)
        slot += 1
