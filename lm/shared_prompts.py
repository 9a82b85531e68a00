"""
Prompts each continued by several sampled completions (online RL's G samples of a prompt), every prompt
computed or read once: SharedPrompts, the training layout of prompts and their completions in one flat row
(lm/rl.py's micro-batches), and SharedPromptCache, the decoding cache whose G rows read their prompt's keys
from one copy (lm/generate.py). Each computes its own attention from the q, k, v model.py's attention hands
it: a layout passed to GPT.forward as its mask, a cache as a layer's cache (see GPT.hidden_states).
"""
import math

import torch

from model import KVCache, attend, window_mask


class SharedPrompts:
    """Prompts each continued by several completions (RL's G samples), all in one flat row of N tokens
    without padding, passed to GPT.forward as its mask: a prompt's tokens attend causally within it, a
    completion's to its prompt and causally to itself, as each sequence would alone, while every prompt
    is computed once. prompts, completions: lists of the row's columns of each one's tokens, in order (a
    completion's positions continue its prompt's); prompt_of: each completion's prompt. Attention gathers
    the tokens into a (P, Lp) and a (C, Lc) grid, one kernel call each, and brings the outputs back;
    attention over the whole row would cost N^2 where this costs about C x Lc x (Lp + Lc)."""

    def __init__(self, prompts, completions, prompt_of, device='cpu'):
        def grid(spans):  # (n, longest) columns, padded with each span's first; and the lengths (n,)
            longest = max(map(len, spans), default=0)
            return (torch.tensor([list(s) + [s[0]] * (longest - len(s)) for s in spans], dtype=torch.long,
                                 device=device).view(len(spans), longest),
                    torch.tensor([len(s) for s in spans], dtype=torch.long, device=device))
        (self.prompts, prompt_lengths), (self.completions, lengths) = grid(prompts), grid(completions)
        self.prompt_of = torch.tensor(prompt_of, dtype=torch.long, device=device)
        Lp, Lc = self.prompts.size(1), self.completions.size(1)
        self.steps = torch.arange(max(Lp, Lc), device=device)
        own_lengths = prompt_lengths[self.prompt_of, None]  # a completion's positions start there
        # a completion's token sees its prompt's tokens, then its own up to itself; never padding,
        # which comes after the real ones (and padded queries are dropped)
        sees_prompt = (self.steps[:Lp] < own_lengths)[:, None].expand(-1, Lc, -1)
        sees_own = torch.ones(Lc, Lc, dtype=torch.bool, device=device).tril().expand(len(completions), -1, -1)
        self.mask = torch.cat([sees_prompt, sees_own], -1)[:, None]
        self.keys = torch.cat([self.prompts[self.prompt_of], self.completions], 1)  # a completion's keys' columns
        self.completion_pos = own_lengths + self.steps[:Lc]
        # each token's slot among the grids' (prompts' first): the outputs back in row order
        real = torch.cat([(self.steps[:Lp] < prompt_lengths[:, None]).flatten(),
                          (self.steps[:Lc] < lengths[:, None]).flatten()])
        columns = torch.cat([self.prompts.flatten(), self.completions.flatten()])[real]
        self.back = torch.empty_like(columns)
        self.back[columns] = real.nonzero()[:, 0]

    def attend(self, q, k, v, dropout_p=0.0, window=0):
        """q (1, H, N, D), k and v (1, Hkv, N, D) of the row's tokens: attention's output (1, H, N, D);
        window: each token sees window keys at most, counting itself (GPTConfig.sliding_window)."""
        def gather(x, columns):  # (1, h, N, D) -> (n, L, h, D): a token a row, as backward adds fastest
            return x[0].transpose(0, 1).index_select(0, columns.flatten()).unflatten(0, columns.shape)

        def heads_first(*xs):  # (n, L, h, D) -> (n, h, L, D)
            return (x.transpose(1, 2) for x in xs)
        Lp = self.prompts.size(1)
        band = window_mask(self.steps[:Lp], self.steps[:Lp], window)[None, None] if window else None
        out = [attend(*heads_first(*(gather(x, self.prompts) for x in (q, k, v))), dropout_p, True, band)]
        if self.completions.numel():
            mask = self.mask
            if window:
                key_pos = torch.cat([self.steps[:Lp].expand(len(self.prompt_of), -1), self.completion_pos], 1)
                mask = mask & window_mask(self.completion_pos, key_pos, window)[:, None]
            out.append(attend(*heads_first(gather(q, self.completions), gather(k, self.keys), gather(v, self.keys)),
                              dropout_p, False, mask))
        y = torch.cat([o.transpose(1, 2).flatten(0, 1) for o in out]).index_select(0, self.back)  # (N, H, D)
        return y.transpose(0, 1)[None]


class SharedPromptCache:
    """One layer's cache for rows that continue shared prompts, G rows each (lm/generate.py's samples):
    the prompts' keys/values once (prompts, a filled KVCache of P rows), then each row's own tokens. A
    decode step (attend) reads a prompt's keys once for its G rows, not from G copies: on a CPU decoding
    waits on reading the cache, most of which is prompt when completions are short."""

    def __init__(self, prompts, group_size, max_len):
        self.prompts, self.group_size, self.own = prompts, group_size, KVCache(max_len)
        # each row's prompt and place among its prompt's G rows
        rows = torch.arange(prompts.k.size(0) * group_size, device=prompts.k.device)
        self.prompt_of, self.member = rows // group_size, rows % group_size

    @property
    def len(self):
        return self.prompts.len + self.own.len

    def keep(self, rows):
        self.prompt_of, self.member = self.prompt_of[rows], self.member[rows]
        self.own.keep(rows)

    def attend(self, q, k, v, mask):
        """Attention of one new token a row, q (B, H, 1, D), k and v (B, Hkv, 1, D), over its prompt's keys
        and its own so far (these appended); mask (B, 1, 1, prompt + own), True where allowed, None for all.
        A prompt's keys meet its rows' queries in one matmul, the queries placed in a (P, Hkv, G, r) grid
        (r query heads a key head, rows that left 0); softmax over both parts in at least float32."""
        own_k, own_v = self.own.update(k, v)
        dtype = torch.promote_types(q.dtype, torch.float32)
        prompt_k, prompt_v = self.prompts.k.to(dtype), self.prompts.v.to(dtype)
        P, Hkv, Lp, D = prompt_k.shape
        B, H = q.shape[:2]
        grid = (P, Hkv, self.group_size * (H // Hkv), -1)
        where = (self.prompt_of, slice(None), self.member)

        def to_grid(rows):  # (B, Hkv, r, X) -> (P, Hkv, G * r, X)
            x = rows.new_zeros(P, Hkv, self.group_size, *rows.shape[2:])
            x[where] = rows
            return x.view(grid)

        def from_grid(x):  # the inverse
            return x.view(P, Hkv, self.group_size, H // Hkv, -1)[where]

        q = q.view(B, Hkv, H // Hkv, D).to(dtype) / math.sqrt(D)
        scores = torch.cat([from_grid(to_grid(q) @ prompt_k.transpose(-1, -2)),
                            q @ own_k.to(dtype).transpose(-1, -2)], -1)  # (B, Hkv, r, Lp + own)
        if mask is not None:
            scores = scores.masked_fill(~mask, float('-inf'))
        weights = scores.softmax(-1)
        y = from_grid(to_grid(weights[..., :Lp]) @ prompt_v) + weights[..., Lp:] @ own_v.to(dtype)
        return y.view(B, H, 1, D).to(v.dtype)
