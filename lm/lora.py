"""
LoRA fine-tuning of a GPT (model.py), in the spirit of litgpt's lora.py: the adapter layer LoRALinear,
apply_lora to wrap a model's Linear layers (and train the chat-token rows resize_vocab added), merging
adapters into the weights and back, disabling them (DPO's reference model), the adapter checkpoint's
state dict, a merged plain-GPT state dict, and the optimizer over the adapters (LoRA+).
"""
import math
import os
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import UserError
from lm.nf4 import nf4_linear, quantize_blocks
from memory import page_out
from model import GPT
from run.checkpoint import check_compatible, save_checkpoint
from run.device import DTYPES
from run.fsdp import model_state_dict
from run.runtime import log

# LoRA (Hu et al. 2021): a frozen layer W plus a trainable low-rank update, y = W x + s B A x with A
# (r, in), B (out, r), s = lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA, Kalajdzievski 2023,
# whose update keeps its size as r grows). Written here by hand; no peft.

LORA_TARGETS = ('attn.q', 'attn.k', 'attn.v', 'attn.proj', 'mlp.fc', 'mlp.gate', 'mlp.proj')
# the Hugging Face module names LoRA configs bring (PEFT's target_modules) for the same layers
HF_LORA_TARGETS = {'q_proj': ('attn.q',), 'k_proj': ('attn.k',), 'v_proj': ('attn.v',), 'o_proj': ('attn.proj',),
                   'gate_proj': ('mlp.gate',), 'up_proj': ('mlp.fc',), 'down_proj': ('mlp.proj',),
                   'c_attn': ('attn.q', 'attn.k', 'attn.v'), 'c_fc': ('mlp.fc',), 'c_proj': ('attn.proj', 'mlp.proj')}
# the config keys the adapters' shapes and scale depend on: a resumed LoRA run must keep them
LORA_SETTINGS = ('lora_r', 'lora_alpha', 'use_rslora', 'lora_target_modules', 'lora_bias')
LORA_BIAS = ('none', 'all', 'lora_only')


def low_rank_delta(lora_A, lora_B, scaling):
    """The update an adapter adds to its layer's weight (also folded from saved tensors: merged_state_dict)."""
    return (lora_B @ lora_A) * scaling


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter. It takes over the wrapped layer's weight and bias (the
    same parameters under the same state-dict names), so a base checkpoint loads into it unchanged;
    a 4-bit base (lm/nf4.py's NF4Linear) brings its nf4 weight instead (weight is None)."""

    def __init__(self, base, r, lora_alpha, lora_dropout=0.0, use_rslora=False):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device='meta')
        self.weight, self.bias, self.nf4 = base.weight, base.bias, getattr(base, 'nf4', None)
        # trained in fp32 whatever the base's dtype
        like = dict(device=(base.weight if self.nf4 is None else self.nf4.packed).device, dtype=torch.float32)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, **like))
        # zero: the model starts unchanged
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own init
        self.scaling = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        self.lora_dropout = nn.Dropout(lora_dropout)
        self.merged = False  # the update is folded into weight
        self.enabled = True  # False: the exact base layer (disable_adapters)

    def forward(self, x):
        frozen = F.linear(x, self.weight, self.bias) if self.nf4 is None else nf4_linear(x, self.nf4, self.bias)
        return self.add_adapter(x, frozen)

    def add_adapter(self, x, y):
        """y, the frozen layer's output for x, plus the adapter's update (unless merged or disabled)."""
        if self.merged or not self.enabled:
            return y
        return y + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling

    def delta_weight(self):
        return low_rank_delta(self.lora_A, self.lora_B, self.scaling)

    @torch.no_grad()
    def merge(self):
        if self.nf4 is not None:
            raise RuntimeError("a 4-bit base cannot hold the update: merged_state_dict folds it into the "
                               "dequantized weight instead")
        if not self.merged:
            self.weight += self.delta_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight -= self.delta_weight()
            self.merged = False


# A fine-tune of a pretrained model adds chat-token rows to the vocabulary (resize_vocab); with LoRA
# those rows, and only those, train as well (PEFT's trainable_token_indices): the layer's weight
# stays frozen and its last rows are replaced by a separate trainable parameter, added_rows.

def with_added_rows(layer):
    """The weight the layer computes with: its frozen weight with the last rows replaced by the trained
    ones (unless the adapters are disabled)."""
    if not layer.enabled:
        return layer.weight
    return rows_replaced(layer.weight, layer.added_rows)


def rows_replaced(weight, added_rows):
    return torch.cat([weight[:-len(added_rows)], added_rows])


class AddedRowsEmbedding(nn.Embedding):
    """The token embedding with trainable added rows; takes over the wrapped weight under its name."""

    def __init__(self, base, added_rows):
        super().__init__(base.num_embeddings, base.embedding_dim, device='meta')
        self.weight, self.added_rows = base.weight, added_rows
        self.enabled = True

    def forward(self, idx):
        return F.embedding(idx, with_added_rows(self))


class AddedRowsLinear(nn.Linear):
    """lm_head with trainable added rows (for a tied lm_head, the embedding's added_rows parameter)."""

    def __init__(self, base, added_rows):
        super().__init__(base.in_features, base.out_features, bias=False, device='meta')
        self.weight, self.added_rows = base.weight, added_rows
        self.enabled = True

    def forward(self, x):
        return F.linear(x, self.computed_weight())

    def computed_weight(self):
        """The matrix the layer computes with (model.GPT.head_weight: the loss takes it without the logits)."""
        return with_added_rows(self)


# The frozen base may be kept in the run's 16-bit dtype (lora_base_dtype; torchtune and litgpt keep
# it in bf16): the Linear weights of the blocks, the bulk of a model, which autocast casts to that
# dtype at every use anyway, so storing them so changes the memory and nothing the run computes. The
# rest stays float32: the token embedding, whose lookup autocast does not cast (a 16-bit table would
# turn the residual stream 16-bit), with lm_head (tied to it, or holding the added chat-token rows'
# start), the norms and biases (small, and some of them train), and everything that trains
# (adapters, added rows): AdamW's masters.


def check_lora_base_dtype(lora_base_dtype, run_dtype, parallel):
    """Refuse a lora_base_dtype (how a LoRA run keeps its frozen base's Linear weights: 'float32', 'bfloat16',
    'float16' or 'nf4', QLoRA: lm/nf4.py) that cannot work: 'nf4' or 16 bits under FSDP; 16 bits in a run that
    computes in another dtype (run_dtype, the resolved dtype key)."""
    if lora_base_dtype == 'nf4' and parallel == 'fsdp':
        raise UserError("lora_base_dtype='nf4' is not supported with parallel='fsdp' yet: FSDP would shard the "
                        "4-bit weights' packed bytes and scales as separate tensors. Use parallel='ddp' (each GPU "
                        "holds the 4-bit base: 8B parameters take about 5 GB), or lora_base_dtype='bfloat16' "
                        "with FSDP.")
    if lora_base_dtype in ('nf4', 'float32'):
        return
    if DTYPES[lora_base_dtype] != run_dtype:
        raise UserError(f"lora_base_dtype={lora_base_dtype!r} needs a run that computes in {lora_base_dtype} (the frozen "
                        f"weights are used under autocast in the run's dtype), but dtype resolves to "
                        f"{str(run_dtype).removeprefix('torch.')} here. Set --dtype={lora_base_dtype} (on a CPU slower "
                        f"than float32 without bf16 units), or lora_base_dtype='float32'.")
    if parallel == 'fsdp':
        raise UserError(f"lora_base_dtype={lora_base_dtype!r} is not supported with parallel='fsdp', which keeps its "
                        f"shards in float32 and computes in the run's dtype by its own mixed-precision policy. Set "
                        f"lora_base_dtype='float32', or parallel='ddp'.")


@torch.no_grad()
def cast_frozen_base(model, dtype, device=None, stored=None):
    """The Linear weights of model's blocks in dtype (what LoRA freezes; 'nf4': NF4Linear layers, lm/nf4.py),
    every other parameter in float32 (see above); a tensor under two names (a tied lm_head) stays one. For a
    model built around a checkpoint's tensors in their stored dtype, before resize_vocab and apply_lora, so no
    float32 copy of the blocks is ever made. device: every parameter becomes its own copy there (DPO's
    reference: frozen_model). stored: as in nf4.quantize_blocks."""
    in_blocks = {id(m) for m in model.transformer.h.modules() if isinstance(m, nn.Linear)}
    converted = {}
    for module in model.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if dtype == 'nf4' and id(module) in in_blocks and key == 'weight':
                continue  # quantized below from the weight as stored
            target = dtype if id(module) in in_blocks and key == 'weight' else torch.float32
            # a copy even if float32 already: a view of a memory-mapped file keeps it all mapped
            copy = target == torch.float32 or device is not None
            if p.dtype != target or copy:
                if id(p) not in converted:
                    converted[id(p)] = nn.Parameter(p.to(device, target, copy=copy), requires_grad=p.requires_grad)
                    if dtype == 'nf4':  # a 4-bit base's host memory: no page of the file kept (quantize_blocks)
                        page_out(p)
                setattr(module, key, converted[id(p)])
    if dtype == 'nf4':  # from the weights as stored, one at a time
        quantize_blocks(model, stored)


def apply_lora(model, r=8, lora_alpha=16, lora_dropout=0.0, target_modules='attn.q,attn.k,attn.v,attn.proj',
               use_rslora=False, bias='none', added_tokens=0):
    """Wrap the targeted Linear layers of model's blocks in LoRALinear and freeze everything else by
    requires_grad=False. target_modules: comma-separated names from LORA_TARGETS or HF_LORA_TARGETS, or
    'all-linear' (every Linear in the blocks; lm_head is not adapted). bias: which biases train too, 'none' | 'all' |
    'lora_only' (those of the wrapped layers). added_tokens: the last rows of the vocabulary, added by
    resize_vocab for the chat tokens, train too (AddedRowsEmbedding/AddedRowsLinear). Returns the wrapped
    layers' names."""
    names = [t.strip() for t in target_modules.split(',') if t.strip()]
    targets = LORA_TARGETS if target_modules == 'all-linear' else \
        list(dict.fromkeys(t for name in names for t in HF_LORA_TARGETS.get(name, (name,))))
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise UserError(f"lora_target_modules={target_modules!r}: {', '.join(map(repr, unknown)) or 'no name'} is "
                        f"not a LoRA target; use comma-separated names from {', '.join(LORA_TARGETS)} (or Hugging Face's "
                        f"{', '.join(HF_LORA_TARGETS)}), or 'all-linear'.")
    if bias not in LORA_BIAS:
        raise UserError(f"lora_bias={bias!r} is not supported; use one of {', '.join(map(repr, LORA_BIAS))}.")
    model.requires_grad_(False)
    wrapped = []
    for name, module in list(model.transformer.h.named_modules(prefix='transformer.h')):
        if isinstance(module, nn.Linear) and name.split('.', 3)[-1] in targets:
            parent, _, child = name.rpartition('.')
            setattr(model.get_submodule(parent), child, LoRALinear(module, r, lora_alpha, lora_dropout, use_rslora))
            wrapped.append(name)
    missing = [t for t in targets if not any(n.endswith('.' + t) for n in wrapped)]
    if missing and target_modules != 'all-linear':
        raise UserError(f"lora_target_modules={target_modules!r} names {', '.join(missing)}, which this model does not "
                        f"have (mlp.gate, Hugging Face's gate_proj, exists only in SwiGLU models such as Llama and "
                        f"Qwen); remove it from lora_target_modules.")
    for name, p in model.named_parameters():
        trained_bias = name.endswith('.bias') and (bias == 'all' or bias == 'lora_only' and name[:-5] in wrapped)
        p.requires_grad_(name.endswith(('lora_A', 'lora_B')) or trained_bias)
        if trained_bias:  # disable_adapters' base model has the biases it started with
            model.get_submodule(name[:-5]).register_buffer('initial_bias', p.detach().clone(), persistent=False)
    if added_tokens:
        # the new rows start at resize_vocab's values but are otherwise untrained: frozen, the model
        # could neither read the chat tokens nor predict <|end|>. A tied lm_head shares them.
        wte, lm_head = model.transformer.wte, model.lm_head
        model.transformer.wte = AddedRowsEmbedding(wte, nn.Parameter(wte.weight[-added_tokens:].clone()))
        tied = lm_head.weight is wte.weight
        rows = model.transformer.wte.added_rows if tied else nn.Parameter(lm_head.weight[-added_tokens:].clone())
        model.lm_head = AddedRowsLinear(lm_head, rows)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"LoRA r={r} on {len(wrapped)} layers + {added_tokens} added token rows: {trainable:,} trainable parameters "
        f"({100 * trainable / sum(p.numel() for p in model.parameters()):.2f}% of all)")
    return wrapped


def load_adapters(model, ckpt, ckpt_path, config):
    """Load a continued LoRA run's adapters (ckpt, read from ckpt_path) into model, wrapped by apply_lora
    with this run's config, after checking that it sets LoRA up as the run did."""
    check_compatible({k: ckpt['config'][k] for k in LORA_SETTINGS}, {k: config[k] for k in LORA_SETTINGS},
                     'LoRA setup', ckpt_path, fix="Set these keys to the checkpoint's values, or start a new run "
                                                 "in another out_dir.")
    check_compatible({'trained tensors': sorted(ckpt['model'])}, {'trained tensors': sorted(lora_state_dict(model))},
                     'LoRA setup', ckpt_path, fix="It was written by an older nanotrain (before the added chat "
                     "tokens trained); start a new run: --resume=False, or another out_dir.")
    model.load_state_dict({**model.state_dict(), **ckpt['model']})  # strict: every adapter must fit


def lora_layers(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def adapter_layers(model):
    """Every layer that adapts the base model: the LoRA layers and those with trained added rows."""
    return [m for m in model.modules() if isinstance(m, (LoRALinear, AddedRowsEmbedding, AddedRowsLinear))]


def merge_lora(model):
    """Fold every adapter into its weight: the forward pass then costs what the base model's does."""
    for m in lora_layers(model):
        m.merge()


def unmerge_lora(model):
    """Undo merge_lora (up to float rounding: W + dW - dW is not always W)."""
    for m in lora_layers(model):
        m.unmerge()


@contextmanager
def disable_adapters(model):
    """Inside the block the model is exactly the base model, bit for bit (DPO's and RL's reference model):
    the adapters (and trained added rows) are skipped, not subtracted, and trained biases hold their starting
    values (apply_lora's initial_bias, swapped in by .data: no in-place change that autograd would see)."""
    layers = adapter_layers(model)
    if any(m.merged for m in lora_layers(model)):
        raise RuntimeError("disable_adapters needs unmerged adapters (merged ones cannot be removed exactly); "
                           "call unmerge_lora(model) first.")
    biased = [m for m in model.modules() if 'initial_bias' in m._buffers]
    for m in layers:
        m.enabled = False
    for m in biased:
        m.bias.data, m.initial_bias.data = m.initial_bias.data, m.bias.data
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True
        for m in biased:
            m.bias.data, m.initial_bias.data = m.initial_bias.data, m.bias.data


def lora_state_dict(model, state=None):
    """The trained parameters only (adapters, trained biases, added rows): an adapter checkpoint's weights.
    state: the model's whole state dict when the model holds only its shard of it (fsdp.full_state_dict)."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in (model.state_dict() if state is None else state).items() if k in trained}


@torch.no_grad()
def merged_state_dict(model, state=None):
    """A plain float32 GPT state dict with every adapter and the added rows folded into their weights (a 16-bit
    frozen base upcast: its values exactly, plus the update; a 4-bit one dequantized to the dtype it came in,
    then upcast); the model is left as it is. state: as in lora_state_dict."""
    state = dict(model.state_dict() if state is None else state)
    folded = {}  # a tied lm_head gets the embedding's tensor, so the checkpoint stores it once
    for name, m in model.named_modules():
        if getattr(m, 'nf4', None) is not None:  # a 4-bit base: its weight dequantized, in its own dtype
            for key in [k for k in state if k.startswith(name + '.nf4.')]:
                del state[key]
            state[name + '.weight'] = m.nf4.dequantize()
        if isinstance(m, LoRALinear):
            lora_A, lora_B = state.pop(name + '.lora_A'), state.pop(name + '.lora_B')
            if not m.merged:
                state[name + '.weight'] = state[name + '.weight'] + low_rank_delta(lora_A, lora_B, m.scaling)
        elif isinstance(m, (AddedRowsEmbedding, AddedRowsLinear)):
            added_rows = state.pop(name + '.added_rows')
            if id(m.weight) not in folded:
                folded[id(m.weight)] = rows_replaced(state[name + '.weight'], added_rows)
            state[name + '.weight'] = folded[id(m.weight)]
    # float32 stays the same tensor: a tied weight stays one
    return {k: v.float() for k, v in state.items()}


# Sampling from a LoRA model computes each adapted layer's frozen matmul and its adapter's two small ones, and
# casts float32 weights to the run's dtype at every use: on a GPU, where a decode step waits on launches, that
# took 1.7x the rollout time of a plain model (runs/RESULTS.md). train_rl.py samples from a merged copy instead:
# a plain GPT whose Linear weights are base + update in the run's dtype, refreshed after each optimizer step.

def linear_weight(layer):
    """The weight a Linear layer of a (LoRA) model computes with, in float32: a 4-bit base dequantized, an
    adapter's update added (unless merged or disabled)."""
    base = layer.nf4.dequantize() if getattr(layer, 'nf4', None) is not None else layer.weight
    if isinstance(layer, LoRALinear) and layer.enabled and not layer.merged:
        return torch.addmm(base.float(), layer.lora_B, layer.lora_A, alpha=layer.scaling)
    return base.float()


@torch.no_grad()
def merged_copy(model, dtype):
    """A plain GPT (eval mode, nothing trains) computing what model computes with its adapters, to sample from: every
    Linear layer of its blocks a dtype weight of its own holding linear_weight (refresh_merged_copy writes it
    again in place, so a captured CUDA graph reads the new values), and with dtype not float32 (the run's 16-bit
    dtype) an untied lm_head in dtype, which autocast would cast every step; every other tensor the model's own
    (embedding, norms, biases: a trained bias is read as it is). Memory: dtype's bytes for every block weight
    (2 a parameter in 16 bits: on a 1B model 2 GB; with a 4-bit base 4x what the base takes), and lm_head's."""
    if any(isinstance(m, (AddedRowsEmbedding, AddedRowsLinear)) for m in model.modules()):
        raise ValueError("merged_copy does not fold trained added rows (train_rl.py trains none)")
    linears = {name: m for name, m in model.transformer.h.named_modules(prefix='transformer.h')
               if isinstance(m, nn.Linear)}
    state = {k: v for k, v in model.state_dict(keep_vars=True).items()
             if k.rsplit('.', 1)[0] not in linears and not any(k.startswith(name + '.nf4.') for name in linears)}
    for name, m in linears.items():
        state[name + '.weight'] = linear_weight(m).to(dtype)
        if m.bias is not None:
            state[name + '.bias'] = m.bias
    # detached: the copy's parameters are its own, the same memory
    copy = GPT.from_state_dict(model.config, {k: v.detach() for k, v in state.items()})
    if dtype != torch.float32:
        copy.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().to(dtype))
    return copy.to(model.lm_head.weight.device).requires_grad_(False).eval()  # .to: the RoPE tables


@torch.no_grad()
def refresh_merged_copy(copy, model):
    """Write model's adapted weights (linear_weight) into merged_copy's, in place (after an optimizer step)."""
    for name, m in model.transformer.h.named_modules(prefix='transformer.h'):
        if isinstance(m, LoRALinear):
            copy.get_submodule(name).weight.copy_(linear_weight(m))


def lora_param_groups(model, weight_decay, loraplus_lr_ratio=1.0):
    """Optimizer groups of the trainable parameters only: the A matrices; the B matrices at
    loraplus_lr_ratio times the learning rate (LoRA+, Hayou et al. 2024: B learns best with a larger
    step); trained biases and added rows (embeddings) without weight decay. The training loop reads 'lr_scale'."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [dict(params=[p for n, p in named if n.endswith('lora_A')], weight_decay=weight_decay),
              dict(params=[p for n, p in named if n.endswith('lora_B')], weight_decay=weight_decay,
                   lr_scale=loraplus_lr_ratio),
              dict(params=[p for n, p in named if not n.endswith(('lora_A', 'lora_B'))], weight_decay=0.0)]
    return [g for g in groups if g['params']]


def lora_optimizer(model, weight_decay, learning_rate, betas, device_type, loraplus_lr_ratio=1.0):
    """AdamW over lora_param_groups; fused where GPT.configure_optimizers fuses it."""
    fused = device_type in ('cuda', 'cpu')
    return torch.optim.AdamW(lora_param_groups(model, weight_decay, loraplus_lr_ratio), lr=learning_rate,
                             betas=betas, fused=fused)


def save_merged(out_dir, model, master, **fields):
    """out_dir/merged.pt: the adapters folded into the weights, a plain GPT checkpoint (kind 'gpt') for
    sample.py or a later init_from; fields: the rest of it (model_args, config, tokenizer, ...). Collective
    under FSDP (the shards are gathered whole): every rank calls it, rank 0 (master) writes."""
    state = model_state_dict(model)
    if master:
        path = os.path.join(out_dir, 'merged.pt')
        save_checkpoint(path, dict(fields, kind='gpt', model=merged_state_dict(model, state)))
        log(f"saved {path} (adapters merged into the weights)")
