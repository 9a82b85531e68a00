"""
A GPT language model in plain PyTorch, nanoGPT style, with the common modern options: RoPE (with Llama 3's
frequency scaling) or learned positions, RMSNorm or LayerNorm, GELU / SwiGLU / ReLU^2 MLP, grouped-query and
sliding-window attention, QK-norm, logit soft-capping, tied embeddings, activation checkpointing and KV-cache
generation. It holds the published Llama / Qwen2 / Qwen3 / Mistral / Arcee / GPT-2 models too (hf/checkpoint.py).
"""
import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from configurator import UserError
from run.device import peak_flops

CHOICES = dict(pos_emb=('rope', 'learned'), norm=('rmsnorm', 'layernorm'), mlp=('gelu', 'gelu_tanh', 'swiglu', 'relu2'))
ROPE_SCALING_KEYS = ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings')


def weight_flops(weight):
    """Training FLOPs per token of a weight's matmul: 2 per element forward, 2 for the gradient of its input and
    2 for its own gradient; a frozen weight (a LoRA run's base) has no gradient of its own, so 4."""
    return (6 if weight.requires_grad else 4) * weight.numel()


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 4096
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0
    bias: bool = False             # biases in Linear layers and LayerNorm
    pos_emb: str = 'rope'          # 'rope' | 'learned'
    norm: str = 'rmsnorm'          # 'rmsnorm' | 'layernorm'
    mlp: str = 'gelu'              # 'gelu' | 'gelu_tanh' (GPT-2's) | 'swiglu' | 'relu2' (ReLU^2)
    tie_embeddings: bool = True    # lm_head shares the token embedding matrix
    qk_norm: bool = False          # normalize queries and keys per head before attention
    logit_softcap: float = 0.0     # logits = cap * tanh(logits / cap); 0 turns it off
    rope_theta: float = 10000.0
    zero_init_proj: bool = False   # residual output projections start at zero
    # the shapes published models need (0 = the usual value)
    n_kv_head: int = 0             # key/value heads (< n_head: grouped-query attention); 0 = n_head
    head_dim: int = 0              # size of each head; 0 = n_embd // n_head
    mlp_hidden: int = 0            # MLP width; 0 = mlp_hidden_size's rule
    qkv_bias: bool = False         # biases on the q/k/v projections only (Qwen2)
    norm_eps: float = 0.0          # 0 = 1e-6 for RMSNorm, 1e-5 for LayerNorm
    rope_scaling: dict = field(default_factory=dict)  # {} or Llama 3.1's: ROPE_SCALING_KEYS
    sliding_window: int = 0        # attend to self and sliding_window - 1 before (Mistral); 0 = all

    def __post_init__(self):
        for key, valid in CHOICES.items():
            if getattr(self, key) not in valid:
                raise UserError(f"model config: {key}={getattr(self, key)!r} is not supported; "
                                 f"set {key} to one of {', '.join(map(repr, valid))}.")
        if self.n_embd % self.n_head and not self.head_dim:
            raise UserError(f"model config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             f"choose n_embd as a multiple of n_head.")
        if self.n_head % self.kv_heads:
            raise UserError(f"model config: n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}; "
                             f"each key/value head serves the same number of query heads.")
        if self.pos_emb == 'rope' and self.head_size % 2:
            raise UserError(f"model config: RoPE needs an even head size but it is {self.head_size}; "
                             f"change n_embd or n_head, or use pos_emb='learned'.")
        if self.rope_scaling and sorted(self.rope_scaling) != sorted(ROPE_SCALING_KEYS):
            raise UserError(f"model config: rope_scaling={self.rope_scaling} must have exactly the keys "
                             f"{', '.join(ROPE_SCALING_KEYS)} (Llama 3.1's), or be {{}}.")
        for key in ('logit_softcap', 'sliding_window'):
            if getattr(self, key) < 0:
                raise UserError(f"model config: {key}={getattr(self, key)} must be >= 0 (0 turns it off).")

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def head_size(self):
        return self.head_dim or self.n_embd // self.n_head


def new_seed():
    """A seed for a model's weights, drawn from torch's global stream (GPT's init_seed)."""
    return torch.randint(2**62, (), device='cpu').item()


def make_norm(config, dim):
    if config.norm == 'rmsnorm':
        return nn.RMSNorm(dim, eps=config.norm_eps or 1e-6)
    return nn.LayerNorm(dim, eps=config.norm_eps or 1e-5, bias=config.bias)


def llama3_frequencies(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3.1's RoPE scaling: frequencies whose wavelength is longer than the original context / low_freq_factor
    slow down by factor, those shorter than original context / high_freq_factor stay, and the ones between
    blend the two smoothly."""
    wavelen = 2 * math.pi / inv_freq
    slow = wavelen > original_max_position_embeddings / low_freq_factor
    fast = wavelen < original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))


def rope_cos_sin(block_size, head_dim, theta, scaling=None):
    """cos/sin of the rotation angles, (block_size, head_dim // 2); frequency i is theta**(-2i/head_dim),
    then rescaled by llama3_frequencies when scaling (its keyword arguments) is given."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling:
        inv_freq = llama3_frequencies(inv_freq, **scaling)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate (x[..., i], x[..., i + D/2]) pairs of x (B, H, T, D) by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def attend(q, k, v, dropout_p=0.0, causal=True, mask=None):
    """(B, H, Tq, D) queries over (B, Hkv, Tk, D) keys/values, each key/value head shared by H / Hkv query
    heads. The one place attention is computed. mask (B, 1, Tq, Tk), True where attention is allowed,
    replaces the causal mask (packed rows, sliding windows)."""
    if mask is not None and q.size(1) != k.size(1) and q.size(2) > 1:
        # only cuDNN's fused kernel takes GQA with a mask (flash takes no mask, memory-efficient no
        # GQA); elsewhere math would build (B, H, Tq, Tk) scores. Repeated keys/values cost (B, H,
        # Tk, D), as in transformers. One query (decoding) has (B, H, 1, Tk) scores: no copy of the
        # whole cache for that
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=causal and mask is None, enable_gqa=q.size(1) != k.size(1))


def document_mask(doc_ids):
    """Attention mask (B, 1, T, T) for rows packed with several documents: causal, and each token
    sees only earlier tokens of its own document. doc_ids (B, T) numbers the documents of a row."""
    T = doc_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def window_mask(q_pos, k_pos, window):
    """True where a query at position q_pos may attend to a key at k_pos, (..., Tq, Tk): causal, and the key at most
    window - 1 positions back, so a query sees window keys counting itself (transformers' sliding_window)."""
    back = q_pos[..., :, None] - k_pos[..., None, :]
    return (back >= 0) & (back < window)


def document_positions(doc_ids):
    """Position of every token within its own document, (B, T); documents are contiguous runs of
    equal doc ids, so each starts again at position 0 as it would alone."""
    idx = torch.arange(doc_ids.size(1), device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


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


class KVCache:
    """One layer's keys and values of the tokens seen so far, preallocated to max_len positions."""

    def __init__(self, max_len):
        self.max_len = max_len
        self.k = self.v = None
        self.len = 0

    def update(self, k, v):
        """Append (B, H, T, D) keys/values; return all cached ones (views, no copy)."""
        if self.k is None:
            B, H, _, D = k.shape
            self.k = k.new_empty(B, H, self.max_len, D)
            self.v = v.new_empty(B, H, self.max_len, D)
        T = k.size(2)
        self.k[:, :, self.len:self.len + T] = k
        self.v[:, :, self.len:self.len + T] = v
        self.len += T
        return self.k[:, :, :self.len], self.v[:, :, :self.len]

    def keep(self, rows):
        """Keep only these rows (indices; a repeated one is copied), as the batch drops finished rows."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)


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


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_size
        self.dropout, self.window = config.dropout, config.sliding_window
        # separate q/k/v projections so each can be targeted (e.g. by LoRA) by name
        q_size, kv_size, qkv_bias = self.n_head * self.head_dim, self.n_kv_head * self.head_dim, config.bias or config.qkv_bias
        self.q = nn.Linear(config.n_embd, q_size, bias=qkv_bias)
        self.k = nn.Linear(config.n_embd, kv_size, bias=qkv_bias)
        self.v = nn.Linear(config.n_embd, kv_size, bias=qkv_bias)
        self.proj = nn.Linear(q_size, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x, rope=None, cache=None, mask=None):
        B, T, C = x.shape
        layers = (self.q, self.k, self.v)
        if cache is not None and T == 1:  # a decode step: stacking the weights would copy them per token
            q, k, v = (m(x) for m in layers)
        else:
            # one matmul over the three layers' stacked weights instead of three (4% of a step at
            # nanoGPT's CPU shape); layers with an adapter (lora.LoRALinear) then add its term
            bias = None if self.q.bias is None else torch.cat([m.bias for m in layers])
            qkv = F.linear(x, torch.cat([m.weight for m in layers]), bias).split([m.out_features for m in layers], -1)
            q, k, v = (m.add_adapter(x, y) if hasattr(m, 'add_adapter') else y for m, y in zip(layers, qkv))
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = (y.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2) for y in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        dropout = self.dropout if self.training else 0.0
        if isinstance(mask, SharedPrompts):  # completions and their prompts in one flat row (lm/rl.py)
            y = mask.attend(q, k, v, dropout, self.window)
        elif isinstance(cache, SharedPromptCache):  # a decode step of rows sharing prompts
            y = cache.attend(q, k, v, mask)
        else:
            causal = True
            if cache is not None:
                # generate() only prefills an empty cache or appends a single token; that token
                # attends to every cached key (is_causal aligns the mask top-left, hiding all but
                # the first)
                causal = cache.len == 0
                k, v = cache.update(k, v)
            y = attend(q, k, v, dropout, causal, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.resid_drop(self.proj(y))


def mlp_hidden_size(config):
    if config.mlp_hidden:
        return config.mlp_hidden
    if config.mlp == 'swiglu':
        # 2/3 of 4*n_embd keeps the parameter count of a 4x MLP with its extra gate; round up to 64
        return 64 * math.ceil(8 * config.n_embd / 3 / 64)
    return 4 * config.n_embd


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.kind = config.mlp
        hidden = mlp_hidden_size(config)
        self.fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gate = nn.Linear(config.n_embd, hidden, bias=config.bias) if config.mlp == 'swiglu' else None
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        h = self.fc(x)
        if self.kind == 'swiglu':
            h = F.silu(self.gate(x)) * h
        elif self.kind == 'relu2':
            h = F.relu(h).square()
        elif self.kind == 'gelu_tanh':
            h = F.gelu(h, approximate='tanh')
        else:
            h = F.gelu(h)
        return self.drop(self.proj(h))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, rope=None, cache=None, mask=None):
        x = x + self.attn(self.ln_1(x), rope, cache, mask)
        return x + self.mlp(self.ln_2(x))


def sampling_dtype(device):
    """The dtype of sampling's CDF and uniform numbers: float64, except on a device without it (Apple's MPS)."""
    return torch.float32 if torch.device(device).type == 'mps' else torch.float64


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None, uniform=None):
    """Pick the next token (B, 1) from last-position logits (B, V). temperature 0 is greedy;
    top_k keeps the k most likely tokens, top_p the smallest set whose probability reaches top_p.
    Sampling inverts each row's CDF at one uniform number (B,), drawn from generator unless given: a row's
    token depends on its own logits and number only, so rows sample alike in any batch (lm/generate.py)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float('-inf'))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # the mass before this token already reaches top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float('-inf')))
    if uniform is None:
        uniform = torch.rand(logits.size(0), generator=generator, device=logits.device,
                             dtype=sampling_dtype(logits.device))
    cdf = F.softmax(logits, dim=-1).to(sampling_dtype(logits.device)).cumsum(dim=-1)
    # the first token whose cumulative probability passes the number: never one of probability 0
    token = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None].to(cdf.device), right=True)
    return token.clamp_(max=logits.size(-1) - 1)


class GPT(nn.Module):

    def __init__(self, config, init_seed=None):
        """init_seed: the seed its weights are drawn from (init_weights); None: one draw of torch's global stream
        (torch.manual_seed decides it). Built under torch.device('meta'), nothing is drawn: the weights are loaded
        (from_state_dict), or each FSDP rank draws its shards from init_seed after sharding (run/fsdp.py)."""
        super().__init__()
        self.config = config
        self.activation_checkpointing = False  # runtime switch, not part of the config
        device = torch.empty(0).device  # the caller's default device
        # built on the meta device, then drawn once: no layer's default init drawn and overwritten
        with torch.device('meta'):
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=make_norm(config, config.n_embd),
            ))
            if config.pos_emb == 'learned':
                self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if device.type != 'meta':
            self.to_empty(device=device)
        if config.tie_embeddings:  # after to_empty, which gives each module a Parameter of its own
            self.transformer.wte.weight = self.lm_head.weight
        self.init_seed = init_seed
        if device.type != 'meta':
            self.init_weights(init_seed)
        if config.pos_emb == 'rope':
            self.set_rope_tables(device)

    @torch.no_grad()
    def init_weights(self, seed=None):
        """Draw every weight (initial_value), each parameter whole; seed: as GPT's init_seed."""
        self.init_seed = new_seed() if seed is None else seed
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, self.init_seed))

    def initial_value(self, name, seed):
        """Parameter name's initial value, whole, float32 on the CPU (GPT-2's init): a norm's weight 1, a bias 0,
        every other weight normal with std 0.02, the two residual projections of each layer scaled by
        1/sqrt(2*n_layer) (or 0: zero_init_proj). Each parameter is drawn from its own stream, seeded by seed
        and its name, so its values do not depend on which parameters are drawn before it: FSDP draws them one
        at a time on every rank and keeps its shard (run/fsdp.py init_shards), the same model as one process."""
        shape = self.get_parameter(name).shape
        if name.endswith('.bias'):
            return torch.zeros(shape)
        if len(shape) == 1:  # a norm's weight
            return torch.ones(shape)
        std = 0.02
        if name.endswith('.proj.weight'):  # each layer adds two residual projections into the stream
            if self.config.zero_init_proj:
                return torch.zeros(shape)
            std /= math.sqrt(2 * self.config.n_layer)
        # sha256: a stable seed per name in every process (Python's hash() of a str is not)
        name_seed = int.from_bytes(hashlib.sha256(f'{seed}:{name}'.encode()).digest()[:8], 'little') >> 1
        return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(name_seed))

    def set_rope_tables(self, device=None):
        """RoPE's cos/sin tables; derived from the config, so not saved: the state dict holds only trained
        weights. (A model built on the meta device, hf/checkpoint.py, computes them after loading.)"""
        c = self.config
        cos, sin = rope_cos_sin(c.block_size, c.head_size, c.rope_theta, c.rope_scaling)
        self.register_buffer('rope_cos', cos.to(device), persistent=False)
        self.register_buffer('rope_sin', sin.to(device), persistent=False)

    @classmethod
    def from_state_dict(cls, config, state):
        """A GPT whose weights are state's tensors themselves, built on the meta device, so no other
        weights are ever allocated: host memory holds one copy of the model (hf/checkpoint.py)."""
        with torch.device('meta'):
            model = cls(config)
        model.load_state_dict(state, assign=True)
        # assign gave lm_head its own Parameter: share the embedding's again
        if config.tie_embeddings:
            model.lm_head.weight = model.transformer.wte.weight
        if config.pos_emb == 'rope':
            model.set_rope_tables()
        return model

    def model_args(self):
        return dataclasses.asdict(self.config)

    @torch.no_grad()
    def resize_vocab(self, vocab_size):
        """Grow the token embedding (and an untied lm_head) to vocab_size rows, for added special
        tokens. A new row is the mean of the old rows plus noise with their per-dimension spread:
        a typical token, so its logit starts ordinary, yet each new token is distinct. The noise has a
        fixed seed: the same base model always grows the same rows (a resumed LoRA run rebuilds their start;
        lora.apply_lora's added_tokens trains them, and its checkpoint holds them)."""
        def grown(old):
            noise = torch.randn(vocab_size - len(old), old.size(1), generator=torch.Generator().manual_seed(0))
            return nn.Parameter(torch.cat([old, old.mean(0) + noise.to(old) * old.std(0)]))
        self.transformer.wte.weight = grown(self.transformer.wte.weight)
        self.transformer.wte.num_embeddings = vocab_size
        self.lm_head.weight = self.transformer.wte.weight if self.config.tie_embeddings else grown(self.lm_head.weight)
        self.lm_head.out_features = vocab_size
        self.config = dataclasses.replace(self.config, vocab_size=vocab_size)

    def get_num_params(self, non_embedding=True):
        """Parameter count. non_embedding=True leaves out pure lookup tables (position embeddings,
        and the token embeddings unless they are tied to lm_head, whose matmul is real work)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.config.pos_emb == 'learned':
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.transformer.wte.weight.numel()
        return n

    def hidden_states(self, idx, caches=None, doc_ids=None, positions=None, mask=None):
        """Final normalized hidden states (B, T, n_embd). With caches (one KVCache per layer) the
        tokens continue the cached sequence and their keys/values are appended. doc_ids (B, T) marks
        rows packed with several documents: each is attended to and positioned as if it were alone
        (shorthand for positions=document_positions(doc_ids), mask=document_mask(doc_ids)).
        positions (B, T) and mask (B, 1, T, T), True where attention is allowed, lay out any other
        packing (DPO shares a prompt between two completions); a row may then be longer than
        block_size, as long as every position is below it. With a sliding_window, a row (or cache) longer
        than the window, and every mask, are narrowed to the window (window_mask, over positions), except
        that positions continuing a filled cache leave the window to the mask, which must then be given."""
        B, T = idx.shape
        start = caches[0].len if caches else 0
        if doc_ids is not None:
            positions, mask = document_positions(doc_ids), document_mask(doc_ids)
        if positions is None and start + T > self.config.block_size:
            raise ValueError(f"model.py: got {start + T} tokens but block_size is {self.config.block_size}; "
                             f"crop the input to its last {self.config.block_size} tokens.")
        x = self.transformer.wte(idx)
        pos = torch.arange(start, start + T, device=idx.device) if positions is None else positions
        rope = None
        if self.config.pos_emb == 'learned':
            x = x + self.transformer.wpe(pos)
        else:  # (1 or B, 1, T, D/2): per-row positions broadcast over heads
            rope = (self.rope_cos[pos].unsqueeze(-3), self.rope_sin[pos].unsqueeze(-3))
        window = self.config.sliding_window
        # else is_causal, the fast kernel, is exact
        if window and not isinstance(mask, SharedPrompts) and (mask is not None or start + T > window):
            # the cached keys' positions are the caller's (lm/generate.py)
            if positions is not None and start:
                if mask is None:
                    raise ValueError("model.py: positions that continue a KV cache under a sliding window need a "
                                     "mask holding the window over the cached keys (lm/generate.py's padded_mask).")
            else:
                # cached too
                keys = pos if positions is not None else torch.arange(start + T, device=idx.device)
                # (1 or B, 1, T, keys), broadcast over heads
                band = window_mask(pos, keys, window).unsqueeze(-3)
                mask = band if mask is None else mask & band
        x = self.transformer.drop(x)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.transformer.h):
            if recompute:
                # keep only block inputs; rerun the block in
                # backward (RNG state is replayed for dropout)
                x = checkpoint(block, x, rope, None, mask, use_reentrant=False)
            else:
                x = block(x, rope, caches[i] if caches else None, mask)
        return self.transformer.ln_f(x)

    def logits(self, h):
        logits = self.lm_head(h)
        cap = self.config.logit_softcap
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def forward(self, idx, targets=None, doc_ids=None, logits_at=None, positions=None, mask=None):
        """idx (B, T) with T <= block_size -> (logits (B, T, V), mean cross-entropy over targets != -100
        or None). Logits are returned for every position either way. doc_ids, positions, mask: see
        hidden_states. logits_at, a (B, T) bool mask or a (rows, cols) pair of index tensors: logits (and
        loss) only at those positions, (N, V); fine-tuning computes them at the labelled ones and spares
        the output layer the work on prompts and padding."""
        h = self.hidden_states(idx, doc_ids=doc_ids, positions=positions, mask=mask)
        logits = self.logits(h if logits_at is None else h[logits_at])
        loss = None
        if targets is not None:
            targets = targets if logits_at is None else targets[logits_at]
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on the matmul weights only: norms, biases and embeddings
        (including a tied lm_head, which is the token embedding) are not decayed. Frozen parameters
        are left out (a LoRA run's optimizer is lora.lora_optimizer)."""
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
        no_decay = [p for p in params if p.dim() < 2 or id(p) in embeddings]
        print(f"num decayed parameter tensors: {len(decay)}, with {sum(p.numel() for p in decay):,} parameters")
        print(f"num non-decayed parameter tensors: {len(no_decay)}, with {sum(p.numel() for p in no_decay):,} parameters")
        # one kernel for all parameters instead of ~10 small
        # ops per tensor; on CPU too (bench/README.md)
        fused = device_type in ('cuda', 'cpu')
        print(f"using fused AdamW: {fused}")
        groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def flops_per_token(self, output_fraction=1.0, context=None):
        """Training FLOPs per token (forward + backward): the matmuls' (weight_flops over the weights that do
        matmul work, get_num_params' set) plus attention over context tokens (None: block_size; a published
        model's block_size is its longest context, not the run's), or sliding_window ones if fewer. The output
        layer's share counts only for output_fraction of the tokens, those whose logits are computed (fine-tuning:
        the labelled ones, see forward's logits_at)."""
        c = self.config
        matmuls = sum(weight_flops(p) for p in self.parameters())
        if c.pos_emb == 'learned':
            matmuls -= weight_flops(self.transformer.wpe.weight)
        if not c.tie_embeddings:
            matmuls -= weight_flops(self.transformer.wte.weight)
        head = weight_flops(self.lm_head.weight)
        attended = min(context or c.block_size, c.sliding_window or math.inf)
        return matmuls - head + head * output_fraction + 12 * c.n_layer * c.n_head * c.head_size * attended

    def estimate_mfu(self, tokens_per_sec, device_name=None, output_fraction=1.0, context=None):
        """Model FLOPs utilization: achieved FLOP/s per device over the device's peak bf16 FLOP/s.
        tokens_per_sec is per device. device_name is torch.cuda.get_device_name() of the training GPU
        or 'cpu'/'mps' (None: the current CUDA device, if any). output_fraction: the share of the tokens
        that go through the output layer, context: the run's context length (flops_per_token). Returns
        None for unknown devices."""
        if device_name is None:
            device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'
        peak = peak_flops(device_name)
        if peak is None:
            return None
        return self.flops_per_token(output_fraction, context) * tokens_per_sec / peak

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_kv_cache=True,
                 eos_id=None, generator=None):
        """Extend idx (B, T) by up to max_new_tokens tokens; call model.eval() first. Each step sees at most
        the last block_size tokens. With eos_id, finished rows are padded with eos_id and generation
        stops once every row has produced it. The KV cache gives the same tokens as use_kv_cache=False."""
        block_size = self.config.block_size
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        caches = None
        for _ in range(max_new_tokens):
            if not use_kv_cache:
                h = self.hidden_states(idx[:, -block_size:])
            elif caches is None or idx.size(1) > block_size:
                # (re)prefill: at the start, and at every step once block_size is passed (every
                # cached position then shifts by one); no longer than this call fills: a published
                # block_size may be 128k positions
                caches = [KVCache(min(block_size, idx.size(1) + max_new_tokens)) for _ in self.transformer.h]
                h = self.hidden_states(idx[:, -block_size:], caches)
            else:
                h = self.hidden_states(idx[:, -1:], caches)
            next_token = sample_next(self.logits(h[:, -1]), temperature, top_k, top_p, generator)
            if eos_id is not None:
                next_token = next_token.masked_fill(done[:, None], eos_id)
                done |= next_token[:, 0] == eos_id
            idx = torch.cat([idx, next_token], dim=1)
            if eos_id is not None and done.all():
                break
        return idx
