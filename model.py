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

import losses
from configurator import UserError

CHOICES = dict(pos_emb=('rope', 'learned'), norm=('rmsnorm', 'layernorm'), mlp=('gelu', 'gelu_tanh', 'swiglu', 'relu2'))
ROPE_SCALING_KEYS = ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings')


def weight_flops(weight):
    """Training FLOPs per token of a weight's matmul: 2 per element forward, 2 for the gradient of its input and
    2 for its own gradient; a frozen weight (a LoRA run's base) has no gradient of its own, so 4."""
    return (6 if weight.requires_grad else 4) * weight.numel()


def stored_elsewhere(model):
    """The Linear layers whose weight is no parameter of theirs (a 4-bit LoRA base keeps it packed: lm/nf4.py)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight is None]


# Dense (no sparsity) bf16/fp16 tensor-core peak FLOP/s per GPU, from NVIDIA datasheets. Matched
# case-insensitively as a substring of torch.cuda.get_device_name(); first match wins, so more
# specific names come before their prefixes (H100 NVL/PCIe before H100, A100/A10G before A10,
# L40S/L40 before L4). GeForce cards are listed at their fp32-accumulate rate, which PyTorch uses.
PEAK_FLOPS = [
    ('GH200', 989e12),
    ('H200', 989e12),
    ('H100 NVL', 835e12),
    ('H100 PCIe', 756e12),
    ('H100', 989e12),        # SXM, reported as e.g. "NVIDIA H100 80GB HBM3"
    ('A100', 312e12),
    ('A10G', 125e12),        # AWS publishes none; the A10 datasheet figure
    ('A10', 125e12),
    ('L40S', 362e12),
    ('L40', 181e12),
    ('L4', 121e12),
    ('A6000', 154.8e12),
    ('RTX 4090', 165.2e12),
    ('RTX 3090', 71e12),
    ('V100S', 130e12),
    ('V100-PCIE', 112e12),
    ('V100', 125e12),        # SXM2
    ('T4', 65e12),
]


def peak_flops(device_name):
    """Peak dense bf16/fp16 FLOP/s of the named GPU, or None when unknown (CPU, MPS, unlisted GPUs)."""
    name = device_name.lower()
    return next((flops for key, flops in PEAK_FLOPS if key.lower() in name), None)


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
    """Rotate (x[..., i], x[..., i + D/2]) pairs of x (..., D) by position-dependent angles cos, sin (..., D/2),
    broadcast against x (the model's: (B, T, H, D) by (1 or B, T, 1, D/2))."""
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


class DocumentRows:
    """Attention of rows packed with documents (doc_ids, B x T; -1: padding), one document at a time: each
    document's tokens placed in a row of its own (n documents x the longest, L), plain causal attention over
    those rows (the fused kernel, no mask: a row's padding comes after its tokens), and put back. Rows of short
    documents then cost their documents' attention, n * L^2, where document_mask's costs the whole T^2 square,
    which no masked kernel skips. A layout (GPT.hidden_states); packed_attention chooses it where it is cheaper."""

    def __init__(self, doc_ids, positions):
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        starts &= doc_ids >= 0
        document = starts.flatten().cumsum(0) - 1  # each token's document in the batch
        n, L = int(document[-1]) + 1, int(positions.masked_fill(doc_ids < 0, 0).max()) + 1
        # each token's slot of the (n, L) rows; padding's one slot past them, which nothing reads
        self.slot = torch.where(doc_ids.flatten() >= 0, document * L + positions.flatten(), n * L)
        self.rows = doc_ids.new_empty(n, L, 0)  # the rows' shape, as a tensor's (compiled: a dynamic size)

    def attend(self, q, k, v, dropout_p=0.0, window=0):
        """q (B, H, T, D), k and v (B, Hkv, T, D) -> (B, H, T, D); padding's output is 0."""
        B, H, T, D = q.shape
        n, L = self.rows.shape[:2]

        def to_rows(x):  # (B, h, T, D) -> (n, h, L, D), zeros after each document
            tokens = x.transpose(1, 2).reshape(B * T, x.size(1), D)
            rows = tokens.new_zeros(n * L + 1, x.size(1), D).index_copy(0, self.slot, tokens)
            return rows[:-1].view(n, L, x.size(1), D).transpose(1, 2)
        steps = torch.arange(L, device=q.device)
        band = window_mask(steps, steps, window) if window and L > window else None
        y = attend(to_rows(q), to_rows(k), to_rows(v), dropout_p, True, band).transpose(1, 2).reshape(n * L, H, D)
        y = torch.cat([y, y.new_zeros(1, H, D)]).index_select(0, self.slot)
        return y.view(B, T, H, D).transpose(1, 2)


PACKED_ROWS_SHARE = 1.0  # DocumentRows where its n * L^2 is at most this share of the masked B * T^2


def packed_attention(doc_ids, positions):
    """What attends within each document of packed rows: DocumentRows where its rows' n * L^2 is at most the
    masked square's B * T^2 (its causal kernel skips half of that, which pays for its copies: bench/README.md)
    and its n * L slots at most twice the B * T tokens (one long document among many short ones would pad them
    all to its length), else document_mask's (B, 1, T, T) mask."""
    rows = DocumentRows(doc_ids, positions)
    n, L = rows.rows.shape[:2]
    B, T = doc_ids.shape
    cheaper = n * L * L <= PACKED_ROWS_SHARE * B * T * T and n * L <= 2 * B * T
    return rows if cheaper else document_mask(doc_ids)


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

    def attend(self, q, k, v, mask=None):
        """Append k, v (B, Hkv, T, D) and attend q (B, H, T, D) over every cached key; mask as attend's. Generation
        only prefills an empty cache (causal) or appends one token, which sees every cached key (is_causal aligns
        the mask top-left, hiding all but the first). No dropout: a cache is for generation, in eval mode."""
        causal = self.len == 0
        return attend(q, *self.update(k, v), causal=causal, mask=mask)


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
        # a decode step (stacking the weights would copy them per token), or layers without a plain
        # weight (a 4-bit LoRA base, lm/nf4.py): each layer computes its own share
        if cache is not None and T == 1 or self.q.weight is None:
            q, k, v = (m(x) for m in layers)
        else:
            # one matmul over the three layers' stacked weights instead of three (4% of a step at
            # nanoGPT's CPU shape); a layer with add_adapter(x, y) adds its own term to its share y
            # (lm/lora.py), so that with the adapter off it computes this model's numbers bit for bit
            bias = None if self.q.bias is None else torch.cat([m.bias for m in layers])
            qkv = F.linear(x, torch.cat([m.weight for m in layers]), bias).split([m.out_features for m in layers], -1)
            q, k, v = (m.add_adapter(x, y) if hasattr(m, 'add_adapter') else y for m, y in zip(layers, qkv))
        q = q.view(B, T, self.n_head, self.head_dim)
        k, v = (y.view(B, T, self.n_kv_head, self.head_dim) for y in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # attention takes (B, H, T, D) views of these (B, T, H, D) tensors: a GPU's fused kernels return their
        # output and gradients in that layout too, so neither y below nor the backward's q/k gradients need a
        # transposing copy
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        # a cache, or a mask that is no tensor (a layout), computes its own attention (GPT.hidden_states)
        if cache is not None:
            y = cache.attend(q, k, v, mask)
        elif mask is None or torch.is_tensor(mask):
            y = attend(q, k, v, dropout, True, mask)
        else:
            y = mask.attend(q, k, v, dropout, self.window)
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
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or what float32 holds as 0
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float()
    # the largest first at 0: a tiny temperature (1e-40) then spreads the others to -inf, not all to inf (NaN)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
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
        self.compiled = None  # compile_blocks' (blocks, loss): training's forward through torch.compile
        device = torch.empty(0).device  # the caller's default device
        # built on the meta device, then drawn once: no layer's default init drawn and overwritten (an
        # Embedding's default init on the meta device would import torch._dynamo: 1.3 CPU-s a launch)
        with torch.device('meta'):
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd,
                                 _weight=torch.empty(config.vocab_size, config.n_embd)),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=make_norm(config, config.n_embd),
            ))
            if config.pos_emb == 'learned':
                self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd,
                                                    _weight=torch.empty(config.block_size, config.n_embd))
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
        n += sum(m.in_features * m.out_features for m in stored_elsewhere(self))
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
        that positions continuing a filled cache leave the window to the mask, which must then be given.
        Attention is computed by a layer's cache, if given: cache.attend(q, k, v, mask) (KVCache's; a cache
        also has len); else by a mask that is not a tensor but a layout: mask.attend(q, k, v, dropout_p,
        window), which applies the window itself. lm/shared_prompts.py has one of each."""
        B, T = idx.shape
        start = caches[0].len if caches else 0
        if doc_ids is not None:
            positions = document_positions(doc_ids)
            mask = packed_attention(doc_ids, positions)
        if positions is None and start + T > self.config.block_size:
            raise ValueError(f"model.py: got {start + T} tokens but block_size is {self.config.block_size}; "
                             f"crop the input to its last {self.config.block_size} tokens.")
        x = self.transformer.wte(idx)
        pos = torch.arange(start, start + T, device=idx.device) if positions is None else positions
        rope = None
        if self.config.pos_emb == 'learned':
            x = x + self.transformer.wpe(pos)
        else:  # (1 or B, T, 1, D/2): per-row positions broadcast over heads
            rope = (self.rope_cos[pos].unsqueeze(-2), self.rope_sin[pos].unsqueeze(-2))
        window = self.config.sliding_window
        # else is_causal, the fast kernel, is exact; a layout (no tensor) applies its own
        if window and (torch.is_tensor(mask) or mask is None and start + T > window):
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
        # decoding with caches runs eagerly (lm/generate.py compiles its own static-shape step)
        blocks = self.compiled[0] if self.compiled and not caches else self.transformer.h
        for i, block in enumerate(blocks):
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

    def head_weight(self):
        """lm_head's matrix as it computes (lm/lora.py's trained chat-token rows swapped in), or None where it is
        not one plain matrix (then the loss goes through lm_head itself)."""
        head = self.lm_head
        if hasattr(head, 'computed_weight'):
            return head.computed_weight()
        return head.weight if type(head) is nn.Linear and head.bias is None else None

    def forward(self, idx, targets=None, doc_ids=None, logits_at=None, positions=None, mask=None, weights=None):
        """idx (B, T) with T <= block_size. Without targets: (logits (B, T, V), None). With targets (B, T):
        (None, the mean cross-entropy over targets != -100), computed chunk by chunk of positions with its
        gradient (losses.head_loss_terms): no (B, T, V) logits are ever held, so a caller that needs logits
        calls model(idx). weights={term: per-position weights like targets}, terms of losses.LOSS_TERMS: the loss
        is then {term: (sum(weights * the term's values), the values at the positions, detached)}, train.py's
        token-weighted cross-entropy, z-loss and any other term with their normalizers folded in. doc_ids,
        positions, mask: see hidden_states. logits_at, a (B, T) bool mask or a (rows, cols) pair of index
        tensors: logits (and loss, and its values) only at those positions, (N, V); fine-tuning computes them at
        the labelled ones and spares the output layer the work on prompts and padding."""
        h = self.hidden_states(idx, doc_ids=doc_ids, positions=positions, mask=mask)
        if logits_at is not None:
            h = h[logits_at]
            if targets is not None:
                targets = targets[logits_at]
            if weights is not None:
                weights = {name: w[logits_at] for name, w in weights.items()}
        if targets is None:
            return self.logits(h), None
        h, targets = h.reshape(-1, h.size(-1)), targets.reshape(-1)
        if weights is None:
            keep = (targets != -100).float()
            terms = {'ce': keep / keep.sum()}
        else:
            terms = {name: w.reshape(-1) for name, w in weights.items()}
        head_loss_terms = self.compiled[1] if self.compiled else losses.head_loss_terms
        terms = head_loss_terms(h, targets, terms, self.logits, self.config.vocab_size, self.head_weight(),
                                self.config.logit_softcap)
        return None, (terms['ce'][0] if weights is None else terms)

    def compile_blocks(self, mode=None, backend='inductor'):
        """torch.compile each block on its own, and the output layer's loss; forward uses them (but not to decode
        with caches). The blocks are alike, so one compile serves them all: train.py's 3 steps of a 32-layer LoRA
        model took 49 s on a CPU, compiling included, against 366 s compiled whole; the step is as fast
        (bench/README.md)."""
        self.compiled = ([torch.compile(block, mode=mode, backend=backend) for block in self.transformer.h],
                         torch.compile(losses.head_loss_terms, mode=mode, backend=backend))

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
        matmuls = sum(weight_flops(p) for p in self.parameters()) \
            + sum(4 * m.in_features * m.out_features for m in stored_elsewhere(self))  # frozen
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
        new = self.generate_tokens(idx, max_new_tokens, temperature, top_k, top_p, use_kv_cache, eos_id, generator)
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_kv_cache=True,
                        eos_id=None, generator=None):
        """generate's new tokens one step at a time, each (B, 1) as soon as it is drawn (sample.py streams an
        answer with them)."""
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
            yield next_token
            if eos_id is not None and done.all():
                break
