"""
Hugging Face checkpoints in and out. A folder with config.json and model.safetensors (sharded with
model.safetensors.index.json, or pytorch_model.bin) of one of the ARCHITECTURES becomes a GPT of
model.py, and a GPT of such a shape is written back as a folder transformers loads as is (vLLM too, but
for Arcee only with hidden_act relu2: its Arcee takes no other activation).

- gpt_config: config.json -> GPTConfig fields; hf_model, the other way: the config.json of the family that
  computes what a GPT nanotrain trained itself computes (export.py), or a UserError saying why none does.
- load_hf_checkpoint: the folder as a train.py checkpoint; its weights are read one file at a time
  into one copy of the model (float32, nanotrain's training precision: a float32 file stays
  memory-mapped), and GPT.from_state_dict builds the model around them on the meta device, so host
  memory holds one copy plus one file. as_stored keeps every tensor memory-mapped in its stored dtype:
  under FSDP each rank makes float32 one block at a time and keeps its shard (fsdp.shard_model; each
  rank still reads the whole file).
- save_hf_model: config.json, model*.safetensors (sharded with an index above max_shard_bytes),
  generation_config.json and the tokenizer files, in the dtype the checkpoint was published in.
The tensor names map through one table per family (LLAMA_NAMES, GPT2_NAMES).
"""
import json
import math
import os
import pickle
import re
import shutil
import zipfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from configurator import UserError
from hf.tokenizer import ADDITIONAL_TEMPLATES, load_hf_tokenizer, read_json
from hf.tokenizer_json import save_tokenizer
from lm.nf4 import BLOCK, DYNAMIC_LEVELS, NF4_LEVELS, SCALE_BLOCK, NF4Weight
from lm.tokenizer import CHAT_SPECIAL_TOKENS, CHAT_TEMPLATE_JINJA
from model import GPT, ROPE_SCALING_KEYS, GPTConfig, mlp_hidden_size
from run.checkpoint import unpickling_detail
from run.runtime import log

ARCHITECTURES = ('LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'ArceeForCausalLM',
                 'GPT2LMHeadModel')
# a non-gated MLP's activation (Arcee's hidden_act, GPT-2's activation_function) -> nanotrain's mlp;
# Hugging Face's 'gelu' is the exact (erf) GELU, 'gelu_new' and 'gelu_pytorch_tanh' the tanh
# approximation, 'relu2' relu(x)**2
MLP_OF_ACTIVATION = {'gelu': 'gelu', 'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'relu2': 'relu2'}
# the same PyTorch ops
ACTIVATION_OF_MLP = {'gelu': 'gelu', 'gelu_tanh': 'gelu_pytorch_tanh', 'relu2': 'relu2'}
# tokenizer_config.json keys a tokenizer.json read as
# is has no use for (save_chat_tokenizer drops them)
SENTENCEPIECE_CONFIG = ('added_tokens_decoder', 'legacy', 'add_prefix_space', 'sp_model_kwargs')
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer.model', 'tokenizer_config.json', 'special_tokens_map.json',
                   'added_tokens.json', 'vocab.json', 'merges.txt', 'chat_template.jinja', 'chat_template.json')

# nanotrain module -> Hugging Face module ('{}' is the
# layer number); weights and biases follow their module
LLAMA_NAMES = {  # Llama, Mistral, Qwen2, Qwen3, Arcee (no gate)
    'transformer.wte': 'model.embed_tokens',
    'transformer.h.{}.ln_1': 'model.layers.{}.input_layernorm',
    'transformer.h.{}.attn.q': 'model.layers.{}.self_attn.q_proj',
    'transformer.h.{}.attn.k': 'model.layers.{}.self_attn.k_proj',
    'transformer.h.{}.attn.v': 'model.layers.{}.self_attn.v_proj',
    'transformer.h.{}.attn.q_norm': 'model.layers.{}.self_attn.q_norm',
    'transformer.h.{}.attn.k_norm': 'model.layers.{}.self_attn.k_norm',
    'transformer.h.{}.attn.proj': 'model.layers.{}.self_attn.o_proj',
    'transformer.h.{}.ln_2': 'model.layers.{}.post_attention_layernorm',
    'transformer.h.{}.mlp.gate': 'model.layers.{}.mlp.gate_proj',
    'transformer.h.{}.mlp.fc': 'model.layers.{}.mlp.up_proj',
    'transformer.h.{}.mlp.proj': 'model.layers.{}.mlp.down_proj',
    'transformer.ln_f': 'model.norm',
    'lm_head': 'lm_head',
}
# GPT-2 stores its matrices as Conv1D, (in, out): transposed; q, k and v are the thirds of c_attn
GPT2_NAMES = {
    'transformer.wte': 'transformer.wte',
    'transformer.wpe': 'transformer.wpe',
    'transformer.h.{}.ln_1': 'transformer.h.{}.ln_1',
    'transformer.h.{}.attn.q': 'transformer.h.{}.attn.c_attn',
    'transformer.h.{}.attn.k': 'transformer.h.{}.attn.c_attn',
    'transformer.h.{}.attn.v': 'transformer.h.{}.attn.c_attn',
    'transformer.h.{}.attn.proj': 'transformer.h.{}.attn.c_proj',
    'transformer.h.{}.ln_2': 'transformer.h.{}.ln_2',
    'transformer.h.{}.mlp.fc': 'transformer.h.{}.mlp.c_fc',
    'transformer.h.{}.mlp.proj': 'transformer.h.{}.mlp.c_proj',
    'transformer.ln_f': 'transformer.ln_f',
    'lm_head': 'lm_head',
}
# tensors some checkpoints carry that are not weights:
# GPT-2's causal-mask buffers, old Llamas' RoPE table
IGNORED = re.compile(r'.*\.attn\.(masked_)?bias$|.*\.rotary_emb\.inv_freq$')


def require_keys(hf, keys, what, folder):
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise UserError(f"{folder}/config.json has no {', '.join(missing)}, which {what} needs; the file is "
                        f"incomplete: download the model folder again.")


def sliding_window(hf, arch, folder):
    """GPTConfig.sliding_window as transformers reads config.json: Mistral's sliding_window (4096 if absent; null, as
    from Mistral v0.2 on, is full attention); Qwen2's and Qwen3's only with use_sliding_window, in the layers of
    layer_types or else from layer max_window_layers on, which must be all of them or none."""
    if arch == 'MistralForCausalLM':
        return hf.get('sliding_window', 4096) or 0
    window = hf.get('sliding_window', 4096) if hf.get('use_sliding_window') else None
    if arch not in ('Qwen2ForCausalLM', 'Qwen3ForCausalLM') or not window:
        return 0
    n, first = hf['num_hidden_layers'], hf.get('max_window_layers', 28)
    sliding = [kind == 'sliding_attention' for kind in hf.get('layer_types') or []] or [i >= first for i in range(n)]
    if any(sliding) and not all(sliding):
        raise UserError(f"{folder}/config.json: use_sliding_window with the window in {sum(sliding)} of {n} layers "
                        f"(max_window_layers={first}, layer_types) is not supported: nanotrain attends over the "
                        f"sliding window in every layer or in none, so it cannot load this model.")
    return window if any(sliding) else 0


def bnb_nf4(hf, folder):
    """Whether config.json (hf) says bitsandbytes quantized the model to 4-bit NormalFloat with double quantization,
    QLoRA's settings, as transformers saves such a model: nanotrain reads those bits as they are (lm/nf4.py keeps
    bitsandbytes' layout). False for an unquantized model; a UserError for any other quantization."""
    quantization = hf.get('quantization_config')
    if not quantization:
        return False
    q = quantization if isinstance(quantization, dict) else {'quant_method': quantization}
    # transformers' defaults for the keys left out: fp4 codes, no double quantization, bytes
    if (q.get('quant_method') == 'bitsandbytes' and q.get('load_in_4bit') and q.get('bnb_4bit_quant_type') == 'nf4'
            and q.get('bnb_4bit_use_double_quant') and q.get('bnb_4bit_quant_storage', 'uint8') == 'uint8'):
        return True
    settings = ', '.join(f'{k}={v!r}' for k, v in q.items() if k in ('bits', 'load_in_4bit', 'load_in_8bit',
                         'bnb_4bit_quant_type', 'bnb_4bit_use_double_quant', 'bnb_4bit_quant_storage', 'fmt'))
    raise UserError(f"{folder}/config.json: this model's weights are quantized (quantization_config, quant_method "
                    f"{q.get('quant_method', 'unnamed')!r}{', ' + settings if settings else ''}); nanotrain reads "
                    f"unquantized models and bitsandbytes' 4-bit NF4 with double quantization (QLoRA's: load_in_4bit, "
                    f"bnb_4bit_quant_type 'nf4', bnb_4bit_use_double_quant) only: use the model's bf16, fp16 or "
                    f"fp32 weights (its unquantized release) instead (LoRA training makes its base 4-bit itself: "
                    f"lora_base_dtype='nf4').")


# the tensors bitsandbytes saves beside a 4-bit weight's packed codes (<name>.weight, uint8)
BNB_PARTS = ('absmax', 'quant_map', 'nested_absmax', 'nested_quant_map', 'quant_state.bitsandbytes__nf4')
BNB_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def stored_nf4(name, parts, path):
    """The NF4Weight of the 4-bit weight name, from the tensors bitsandbytes saved of it (parts: packed, and
    BNB_PARTS), checked to be the layout lm/nf4.py reads: NF4's levels, blocks of 64, absmaxes in 8 bits
    with the dynamic map in blocks of 256."""
    def broken(why):
        return UserError(f"{path}: the 4-bit weight {name} {why}; the file is not bitsandbytes' NF4 as nanotrain reads "
                         f"it (or is corrupt): use the model's unquantized release (LoRA training makes its base "
                         f"4-bit itself: lora_base_dtype='nf4').")
    missing = [part for part in ('packed', *BNB_PARTS) if part not in parts]
    if missing:
        raise broken(f"lacks {', '.join(missing)}")
    try:
        state = json.loads(bytes(parts['quant_state.bitsandbytes__nf4'].tolist()))
        shape, dtype = [int(n) for n in state['shape']], BNB_DTYPES.get(state['dtype'])
        settings = (state['quant_type'], state['blocksize'], state['nested_blocksize'], state['nested_dtype'])
        offset = torch.tensor(float(state['nested_offset']))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise broken(f"has an unreadable quant_state ({type(e).__name__}: {e})") from None
    if settings != ('nf4', BLOCK, SCALE_BLOCK, 'float32') or dtype is None:
        raise broken(f"is quantized as {settings} in {dtype}, not ('nf4', {BLOCK}, {SCALE_BLOCK}, 'float32')")
    if not (torch.equal(parts['quant_map'].float(), NF4_LEVELS) and
            torch.equal(parts['nested_quant_map'].float(), DYNAMIC_LEVELS)):
        raise broken("has other code books than NF4's levels and the dynamic 8-bit map")
    n = math.prod(shape)
    absmaxes = -(-n // BLOCK)
    sizes = {'packed': n // 2, 'absmax': absmaxes, 'nested_absmax': -(-absmaxes // SCALE_BLOCK)}
    wrong = {part: parts[part].numel() for part, size in sizes.items() if parts[part].numel() != size or n % 2}
    if wrong:
        raise broken(f"of shape {tuple(shape)} has {wrong} values, not {sizes}")
    return NF4Weight.stored(shape, dtype, parts['packed'].reshape(-1), parts['absmax'].reshape(-1),
                            parts['nested_absmax'].float().reshape(-1), offset)


def gpt_config(hf, folder):
    """GPTConfig fields of the model whose config.json holds hf (a dict)."""
    archs = hf.get('architectures')
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise UserError(f"{folder}/config.json: architectures={archs!r} must be a list of one model class, e.g. "
                        f"[\"LlamaForCausalLM\"]; the file is corrupt: download the model folder again.")
    arch = archs[0]
    bnb_nf4(hf, folder)  # another quantization: refused here, not as a "corrupt" file later
    if arch not in ARCHITECTURES:
        raise UserError(f"{folder}/config.json: architecture {arch} is not supported; nanotrain loads "
                        f"{', '.join(ARCHITECTURES)}.")
    if arch == 'GPT2LMHeadModel':
        require_keys(hf, ('n_positions', 'vocab_size', 'n_layer', 'n_head', 'n_embd'), arch, folder)
        activation = hf.get('activation_function', 'gelu_new')
        if activation not in MLP_OF_ACTIVATION:
            raise UserError(f"{folder}/config.json: activation_function={activation!r} is not supported; nanotrain "
                            f"loads GPT-2 models with {', '.join(map(repr, MLP_OF_ACTIVATION))}.")
        if hf.get('scale_attn_by_inverse_layer_idx') or hf.get('reorder_and_upcast_attn') \
                or not hf.get('scale_attn_weights', True):
            raise UserError(f"{folder}/config.json: scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or "
                            f"scale_attn_weights=false change GPT-2's attention, and nanotrain does not implement "
                            f"them; it loads GPT-2 models with their defaults.")
        fields = dict(block_size=hf['n_positions'], vocab_size=hf['vocab_size'], n_layer=hf['n_layer'],
                      n_head=hf['n_head'], n_embd=hf['n_embd'], mlp_hidden=hf.get('n_inner') or 0, bias=True,
                      pos_emb='learned', norm='layernorm', norm_eps=hf.get('layer_norm_epsilon', 1e-5),
                      mlp=MLP_OF_ACTIVATION[activation], tie_embeddings=ties_embeddings(hf))
        return checked_sizes(fields, GPT2_KEYS, folder)
    arcee = arch == 'ArceeForCausalLM'
    activation, supported = hf.get('hidden_act', 'relu2' if arcee else 'silu'), MLP_OF_ACTIVATION if arcee else ['silu']
    if activation not in supported:
        raise UserError(f"{folder}/config.json: hidden_act={activation!r} is not supported; nanotrain loads {arch} "
                        f"models with hidden_act {', '.join(map(repr, supported))}.")
    # nanotrain's bias=True puts a bias on every linear layer:
    # Llama's and Arcee's attention_bias and mlp_bias together
    bias = bool(hf.get('attention_bias')) and bool(hf.get('mlp_bias'))
    biased_families = ('LlamaForCausalLM', 'ArceeForCausalLM')
    if (hf.get('attention_bias') or hf.get('mlp_bias')) and not (bias and arch in biased_families):
        raise UserError(f"{folder}/config.json: attention_bias={hf.get('attention_bias')}, mlp_bias="
                        f"{hf.get('mlp_bias')} is not supported; nanotrain loads {arch} models without biases (a Llama "
                        f"or Arcee model may have both).")
    require_keys(hf, ('max_position_embeddings', 'vocab_size', 'num_hidden_layers', 'num_attention_heads',
                      'hidden_size', 'intermediate_size'), arch, folder)
    # transformers 5: rope_parameters
    rope_key = 'rope_parameters' if hf.get('rope_parameters') else 'rope_scaling'
    rope = hf.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise UserError(f"{folder}/config.json: {rope_key}={rope!r} must be an object such as {{\"rope_type\": "
                        f"\"llama3\", \"factor\": 8.0, ...}} or null; the file is corrupt: download the model folder "
                        f"again.")
    rope_type = rope.get('rope_type', rope.get('type', 'default'))
    if rope_type not in ('default', 'llama3'):
        raise UserError(f"{folder}/config.json: RoPE scaling {rope_type!r} is not supported; nanotrain supports "
                        f"none and Llama 3.1's 'llama3'.")
    if rope_type == 'llama3':
        require_keys(rope, ROPE_SCALING_KEYS, "rope_scaling of type 'llama3'", folder)
    qwen3 = arch == 'Qwen3ForCausalLM'
    # without head_dim, transformers' Qwen3Config gives
    # 128; the other families' configs n_embd / n_head
    fields = dict(block_size=hf['max_position_embeddings'], vocab_size=hf['vocab_size'],
                  n_layer=hf['num_hidden_layers'], n_head=hf['num_attention_heads'],
                  n_kv_head=hf.get('num_key_value_heads') or 0,
                  n_embd=hf['hidden_size'], head_dim=hf.get('head_dim') or (128 if qwen3 else 0),
                  mlp=MLP_OF_ACTIVATION[activation] if arcee else 'swiglu', mlp_hidden=hf['intermediate_size'],
                  bias=bias, qkv_bias=arch == 'Qwen2ForCausalLM',
                  pos_emb='rope', norm='rmsnorm', norm_eps=hf.get('rms_norm_eps', 1e-5 if arcee else 1e-6),
                  tie_embeddings=ties_embeddings(hf),
                  rope_theta=rope.get('rope_theta', 10000.0) if hf.get('rope_theta') is None else hf['rope_theta'],
                  rope_scaling={k: rope[k] for k in ROPE_SCALING_KEYS} if rope_type == 'llama3' else {},
                  qk_norm=qwen3, sliding_window=sliding_window(hf, arch, folder))
    fields = checked_sizes(fields, LLAMA_KEYS, folder)
    return dict(fields, rope_theta=float(fields['rope_theta']))


# the config.json key each size comes from
GPT2_KEYS = dict(block_size='n_positions', vocab_size='vocab_size', n_layer='n_layer', n_head='n_head', n_embd='n_embd',
                 mlp_hidden='n_inner', norm_eps='layer_norm_epsilon')
LLAMA_KEYS = dict(block_size='max_position_embeddings', vocab_size='vocab_size', n_layer='num_hidden_layers',
                  n_head='num_attention_heads', n_kv_head='num_key_value_heads', n_embd='hidden_size',
                  head_dim='head_dim', mlp_hidden='intermediate_size', norm_eps='rms_norm_eps', rope_theta='rope_theta')


def checked_sizes(fields, keys, folder):
    """fields (gpt_config's), refused in config.json's names when a size is not a whole number (>= 1; those that
    may be left out, >= 0), an epsilon or RoPE base not positive, or the sizes do not fit together (GPTConfig's
    checks): a corrupt or edited file, named before any tensor is made of it."""
    for field, key in keys.items():
        value, optional = fields[field], key in ('num_key_value_heads', 'head_dim', 'n_inner')  # null: a default
        if field in ('norm_eps', 'rope_theta'):
            bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
            want = 'a positive number'
        else:
            bad = type(value) is not int or value < (0 if optional else 1)
            want = 'a whole number' + (' (or null)' if optional else ' >= 1')
        if bad:
            raise UserError(f"{folder}/config.json: {key}={json.dumps(value)} must be {want}; the file is corrupt "
                            f"or was edited: download the model folder again.")
    try:
        GPTConfig(**fields)
    except UserError as e:
        # what is wrong, in config.json's names (GPTConfig's advice is for a config of nanotrain's)
        said = str(e).removeprefix('model config: ').split('; ')[0]
        said = re.sub(r'\b(\w+)=', lambda m: keys.get(m[1], m[1]) + '=', said)
        raise UserError(f"{folder}/config.json: {said}; the file is corrupt or was edited: download the model folder "
                        f"again.") from None
    return fields


EXPORTABLE = ("pos_emb='rope', norm='rmsnorm' and mlp='swiglu' (LlamaForCausalLM; with qkv_bias Qwen2ForCausalLM, with "
              "qk_norm Qwen3ForCausalLM; with sliding_window MistralForCausalLM, or one of these two); pos_emb='rope', "
              "norm='rmsnorm' and mlp 'gelu', 'gelu_tanh' or 'relu2' (ArceeForCausalLM, as nanotrain's default model); "
              "pos_emb='learned', norm='layernorm' and mlp 'gelu', 'gelu_tanh' or 'relu2' (GPT2LMHeadModel); all "
              "without logit_softcap")


def export_problems(c):
    """The settings of c (a GPTConfig) that no supported Hugging Face family has, as phrases; [] if one has them all."""
    problems = [f"logit_softcap={c.logit_softcap} (no family caps its logits)"] if c.logit_softcap else []
    if c.pos_emb == 'learned':  # GPT-2, the one family with learned positions
        problems += [f"{setting} with pos_emb='learned' (GPT-2 {has})" for setting, has, wrong in (
            ("norm='rmsnorm'", "normalizes with LayerNorm", c.norm != 'layernorm'),
            (f"mlp={c.mlp!r}", "has no gated MLP", c.mlp not in ACTIVATION_OF_MLP),
            ("qk_norm=True", "has no q/k norms", c.qk_norm),
            (f"n_kv_head={c.n_kv_head}", "has no grouped-query attention", c.kv_heads != c.n_head),
            (f"head_dim={c.head_dim}", "has heads of n_embd / n_head", c.head_size * c.n_head != c.n_embd),
            (f"sliding_window={c.sliding_window}", "attends over every earlier token", c.sliding_window)) if wrong]
        return problems
    if c.norm != 'rmsnorm':
        problems.append("norm='layernorm' with pos_emb='rope' (the RoPE families normalize with RMSNorm)")
    if c.qk_norm and c.mlp != 'swiglu':
        problems.append(f"qk_norm=True with mlp={c.mlp!r} (Qwen3, the family with q/k norms, has a SwiGLU MLP)")
    if c.qk_norm and (c.bias or c.qkv_bias):
        problems.append("qk_norm=True with bias or qkv_bias (Qwen3 has no q/k/v-only or MLP biases)")
    if c.qkv_bias and not c.bias and c.mlp != 'swiglu':
        problems.append(f"qkv_bias=True with mlp={c.mlp!r} (Qwen2, the family with q/k/v biases, has a SwiGLU MLP)")
    if c.sliding_window and (c.bias or c.mlp != 'swiglu'):
        other = 'bias=True' if c.bias else f'mlp={c.mlp!r}'
        problems.append(f"sliding_window={c.sliding_window} with {other} (Mistral, Qwen2 and Qwen3, the families with "
                        f"a sliding window, have a SwiGLU MLP and no MLP biases)")
    if c.n_embd % c.n_head and not c.qk_norm:
        problems.append(f"n_embd={c.n_embd} not a multiple of n_head={c.n_head} (Llama and Arcee configs refuse it)")
    return problems


def hf_model(state, model_args):
    """(config.json, state dict) of the Hugging Face model that computes what the GPT of model_args (GPTConfig
    fields) holding state computes: a model nanotrain trained itself, written out by export.py. GPT-2 gets zero
    biases where the GPT has none (bias=False), which changes nothing. A UserError names the settings no family has."""
    c = GPTConfig(**model_args)
    problems = export_problems(c)
    if problems:
        raise UserError(f"this model has {'; '.join(problems)}: no Hugging Face model computes the same function, so "
                        f"export.py cannot write it as a Hugging Face folder (sample.py and init_from still use the "
                        f"checkpoint). Models that export: {EXPORTABLE}; train one with those model settings.")
    # nanotrain's models are trained in float32 (their master weights): written as they are
    dtype = 'float32'
    # bos/eos_token_id: None, not the family's defaults (ids
    # of its published vocabulary); export.py sets ours
    if c.pos_emb == 'learned':
        hf = dict(architectures=['GPT2LMHeadModel'], model_type='gpt2', vocab_size=c.vocab_size,
                  n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
                  n_inner=mlp_hidden_size(c), activation_function=ACTIVATION_OF_MLP[c.mlp],
                  layer_norm_epsilon=c.norm_eps or 1e-5, tie_word_embeddings=c.tie_embeddings,
                  resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, torch_dtype=dtype,
                  bos_token_id=None, eos_token_id=None)
        with torch.device('meta'):  # GPT-2 has every bias: the GPT of its config holds them all
            shapes = GPT(GPTConfig(**gpt_config(hf, 'export'))).state_dict()
        return hf, dict(state, **{k: torch.zeros(v.shape) for k, v in shapes.items() if k not in state})
    arch = ('Qwen3ForCausalLM' if c.qk_norm else 'Qwen2ForCausalLM' if c.qkv_bias and not c.bias
            else 'MistralForCausalLM' if c.sliding_window
            else 'LlamaForCausalLM' if c.mlp == 'swiglu' else 'ArceeForCausalLM')
    hf = dict(architectures=[arch], model_type=arch.removesuffix('ForCausalLM').lower(), vocab_size=c.vocab_size,
              hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
              num_key_value_heads=c.kv_heads, head_dim=c.head_size, intermediate_size=mlp_hidden_size(c),
              hidden_act='silu' if c.mlp == 'swiglu' else ACTIVATION_OF_MLP[c.mlp],
              max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps or 1e-6, rope_theta=c.rope_theta,
              rope_scaling=dict(rope_type='llama3', **c.rope_scaling) if c.rope_scaling else None,
              tie_word_embeddings=c.tie_embeddings, attention_dropout=c.dropout, torch_dtype=dtype,
              bos_token_id=None, eos_token_id=None)
    if arch in ('LlamaForCausalLM', 'ArceeForCausalLM'):
        hf.update(attention_bias=c.bias, mlp_bias=c.bias)
    elif arch == 'MistralForCausalLM':
        hf.update(sliding_window=c.sliding_window)
    # Qwen2 and Qwen3 attend over the window in the
    # layers from max_window_layers on: here all of them
    else:
        hf.update(use_sliding_window=bool(c.sliding_window))
        if c.sliding_window:
            hf.update(sliding_window=c.sliding_window, max_window_layers=0)
    return hf, state


def is_gpt2(hf_config):
    return hf_config['architectures'][0] == 'GPT2LMHeadModel'


def ties_embeddings(hf_config):
    """Whether lm_head is the token embedding (then the checkpoint holds it once, under the embedding's name)."""
    return hf_config.get('tie_word_embeddings', is_gpt2(hf_config))


def hf_names(state_keys, hf_config):
    """{nanotrain tensor name: Hugging Face tensor name} for the tensors of a GPT of this family."""
    table = GPT2_NAMES if is_gpt2(hf_config) else LLAMA_NAMES
    names = {}
    for name in state_keys:
        module, param = name.rsplit('.', 1)
        names[name] = table[re.sub(r'\.\d+\.', '.{}.', module)].format(*re.findall(r'\.(\d+)\.', module)) + '.' + param
    return names


def is_conv1d(hf_name, hf_config):
    return is_gpt2(hf_config) and '.h.' in hf_name and hf_name.endswith('.weight')


def weight_files(folder):
    """The checkpoint's weight files, in order: one file, or the shards its index lists."""
    for index, single in (('model.safetensors.index.json', 'model.safetensors'),
                          ('pytorch_model.bin.index.json', 'pytorch_model.bin')):
        if os.path.isfile(os.path.join(folder, index)):
            weight_map = (read_json(folder, index) or {}).get('weight_map')
            if not (isinstance(weight_map, dict) and weight_map and all(
                    isinstance(s, str) and s and not os.path.isabs(s)
                    and not os.path.normpath(s).startswith('..') for s in weight_map.values())):
                raise UserError(f"{folder}/{index}: its weight_map must map each tensor's name to a weight file in "
                                f"the folder, got {json.dumps(weight_map)[:100]}; the file is corrupt: download the "
                                f"model folder again.")
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
            if missing:
                raise UserError(f"{folder}/{index} lists {', '.join(missing)}, which is missing; the download is "
                                f"incomplete: fetch the missing shards.")
            return [os.path.join(folder, s) for s in shards]
        if os.path.isfile(os.path.join(folder, single)):
            return [os.path.join(folder, single)]
    raise UserError(f"{folder} holds no weights: expected model.safetensors, model.safetensors.index.json or "
                    f"pytorch_model.bin next to its config.json.")


SAFETENSORS_DTYPES = {'F64': torch.float64, 'F32': torch.float32, 'F16': torch.float16, 'BF16': torch.bfloat16,
                      'I64': torch.int64, 'I32': torch.int32, 'I16': torch.int16, 'I8': torch.int8, 'U8': torch.uint8,
                      'BOOL': torch.bool}


def read_safetensors(path):
    """{name: tensor} of a .safetensors file, memory-mapped: a tensor's bytes are read from disk when used
    (the safetensors library's get_tensor copies each one into memory). The format: an 8-byte header length,
    a JSON header of each tensor's dtype, shape and byte range, then the bytes."""
    size = os.path.getsize(path)
    with open(path, 'rb') as f:
        header_length = int.from_bytes(f.read(8), 'little')
        if not 0 < header_length <= size - 8:
            raise EOFError('no safetensors header')
        header = json.loads(f.read(header_length))
    data_start = 8 + header_length
    if max((info['data_offsets'][1] for k, info in header.items() if k != '__metadata__'), default=0) > size - data_start:
        raise EOFError('the file ends before its last tensor')
    data = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(path, shared=False, nbytes=size))
    tensors = {}
    for name, info in header.items():
        if name == '__metadata__':
            continue
        start, end = info['data_offsets']
        dtype = SAFETENSORS_DTYPES[info['dtype']]
        raw = data[data_start + start:data_start + end]
        # not aligned for its dtype: copied instead of viewed
        if (data_start + start) % dtype.itemsize:
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(info['shape'])
    return tensors


def read_weights(path):
    """{Hugging Face name: tensor} of one weight file, memory-mapped (a .bin loaded weights-only)."""
    try:
        if path.endswith('.safetensors'):
            return read_safetensors(path)
        # torch.save's format before torch 1.6 (an older model's .bin) is not a zip, which mmap needs
        weights = torch.load(path, map_location='cpu', weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:  # weights_only's refusal
        detail = unpickling_detail(e) or 'not a weights file'
        raise UserError(f"could not read {path} ({detail}): it is corrupt, or holds objects "
                        f"other than tensors, which nanotrain does not load (loading them can run code). Download it "
                        f"again, or use the model's safetensors release.") from None
    except Exception as e:  # a corrupt pickle fails anywhere in the unpickler (an IndexError, a KeyError, ...)
        raise UserError(f"could not read {path} ({type(e).__name__}: {str(e)[:200]}); the file is truncated or "
                        f"corrupt: download it again.") from None
    if not (isinstance(weights, dict) and all(isinstance(v, torch.Tensor) for v in weights.values())):
        raise UserError(f"{path} holds a {type(weights).__name__}, not a model's weights ({{name: tensor}}); download "
                        f"it again.")
    return weights


def read_hf_weights(folder, hf, as_stored=False, keep_nf4=False):
    """The GPT state dict (float32, CPU; as_stored: memory-mapped in the stored dtype) of the checkpoint folder
    whose config.json holds hf, read one weight file at a time; every tensor is checked against the shapes
    config.json gives. A model bitsandbytes saved in 4 bits (bnb_nf4): each 4-bit weight dequantized as
    bitsandbytes does (to float32, or as_stored its dtype), or with keep_nf4, in the blocks (a 4-bit base's), its
    NF4Weight, bits as stored."""
    four_bit, quantized = bnb_nf4(hf, folder), {}
    with torch.device('meta'):
        expected = GPT(GPTConfig(**gpt_config(hf, folder))).state_dict()
    if ties_embeddings(hf):
        del expected['lm_head.weight']  # the token embedding; transformers does not save it twice
    nano_names, state = {}, {}
    for nano, hf_name in hf_names(expected, hf).items():
        nano_names.setdefault(hf_name, []).append(nano)
    loaded = set()
    for path in weight_files(folder):
        for hf_name, tensor in read_weights(path).items():
            if is_gpt2(hf) and not hf_name.startswith(('transformer.', 'lm_head.')):
                # GPT-2's own upload names its tensors without the prefix
                hf_name = 'transformer.' + hf_name
            if IGNORED.match(hf_name) or (hf_name == 'lm_head.weight' and 'lm_head.weight' not in expected):
                continue
            # a 4-bit weight: its packed codes, then the tensors of its quantization (all files read first)
            layer, _, part = hf_name.partition('.weight.')
            if four_bit and (part in BNB_PARTS or tensor.dtype == torch.uint8):
                quantized.setdefault(f'{layer}.weight' if part else hf_name, {})[part or 'packed'] = tensor
                continue
            if part in BNB_PARTS or tensor.dtype == torch.uint8:  # the same model, its config.json's entry lost
                raise UserError(f"{path}: tensor {hf_name} is part of a weight bitsandbytes saved in 4 bits, but "
                                f"{folder}/config.json has no quantization_config, which transformers writes beside "
                                f"such weights: the entry is missing. Put back the model's quantization_config "
                                f"(quant_method 'bitsandbytes', load_in_4bit, bnb_4bit_quant_type 'nf4', "
                                f"bnb_4bit_use_double_quant), or use the model's unquantized release.")
            if hf_name not in nano_names:
                raise UserError(f"{path}: tensor {hf_name} is not part of a {hf['architectures'][0]} with this "
                                f"config.json; the weights and config.json are of different models.")
            tensor = tensor.t() if is_conv1d(hf_name, hf) else tensor
            for nano, part in zip(nano_names[hf_name], tensor.chunk(len(nano_names[hf_name]))):
                if part.shape != expected[nano].shape:
                    raise UserError(f"{path}: tensor {hf_name} has shape {tuple(tensor.shape)}, but config.json "
                                    f"makes it {tuple(expected[nano].shape)} (as {nano}); the weights and "
                                    f"config.json are of different models.")
                state[nano] = (part if as_stored else part.float()).contiguous()
            loaded.add(hf_name)
    if four_bit and not quantized:  # a 4-bit config.json beside unquantized weights
        log(f"note: {folder}/config.json says its weights are bitsandbytes' 4-bit NF4 (quantization_config), but "
            f"none of them is quantized: they are read as stored, and quantization_config is ignored")
    for hf_name, parts in quantized.items():
        nano = nano_names.get(hf_name, [])
        if len(nano) != 1 or is_conv1d(hf_name, hf):
            raise UserError(f"{folder}: the 4-bit tensor {hf_name} is not one Linear weight of a "
                            f"{hf['architectures'][0]} with this config.json; nanotrain reads 4-bit Linear weights "
                            f"only.")
        nf4 = stored_nf4(hf_name, parts, folder)
        if nf4.shape != tuple(expected[nano[0]].shape):
            raise UserError(f"{folder}: the 4-bit weight {hf_name} has shape {nf4.shape}, but config.json makes it "
                            f"{tuple(expected[nano[0]].shape)}; the weights and config.json are of different models.")
        if keep_nf4 and nano[0].startswith('transformer.h.'):  # what a 4-bit base holds in 4 bits
            state[nano[0]] = nf4
        else:
            state[nano[0]] = nf4.dequantize() if as_stored else nf4.dequantize().float()
        loaded.add(hf_name)
    missing = sorted(set(nano_names) - loaded)
    if missing:
        raise UserError(f"{folder}: the weight files lack {len(missing)} tensor(s) a {hf['architectures'][0]} "
                        f"with this config.json needs: {', '.join(missing[:5])}; the download is incomplete or "
                        f"of another model.")
    # tied: the same tensor under both names, as in GPT.state_dict()
    if 'lm_head.weight' not in expected:
        state['lm_head.weight'] = state['transformer.wte.weight']
    return state


def load_hf_checkpoint(folder, as_stored=False, keep_nf4=False):
    """A Hugging Face folder as a checkpoint of train.py's kind 'gpt': model (state dict), model_args,
    its tokenizer's identity and folder (data_dir), config (training_type 'sft' if the tokenizer has a chat template: a chat
    model), and hf_config / generation_config, which the exporter writes back (without a 4-bit model's
    quantization_config: what nanotrain writes is never quantized). as_stored, keep_nf4: as in read_hf_weights."""
    hf = read_json(folder, 'config.json')
    model_args = gpt_config(hf, folder)
    tokenizer = load_hf_tokenizer(folder)
    return dict(kind='gpt', model=read_hf_weights(folder, hf, as_stored, keep_nf4), model_args=model_args,
                tokenizer=tokenizer.identity(), data_dir=os.path.abspath(folder),
                config={'training_type': 'sft' if tokenizer.chat_template else 'from_scratch'},
                hf_config={k: v for k, v in hf.items() if k != 'quantization_config'},
                generation_config=read_json(folder, 'generation_config.json'))


def write_safetensors(tensors, path):
    save_file(tensors, path, metadata={'format': 'pt'})  # transformers expects the format tag
    # safetensors creates it 0600: a server running as another user could not read it
    os.chmod(path, 0o644)


def hf_state_dict(state, hf_config, dtype):
    """A GPT state dict under Hugging Face names, in dtype (the inverse of read_hf_weights' mapping)."""
    if ties_embeddings(hf_config):
        state = {k: v for k, v in state.items() if k != 'lm_head.weight'}
    parts = {}
    for nano, hf_name in hf_names(state, hf_config).items():
        parts.setdefault(hf_name, []).append(state[nano])
    return {name: (torch.cat(ts).t() if is_conv1d(name, hf_config) else torch.cat(ts)).to(dtype).contiguous()
            for name, ts in parts.items()}


def save_hf_model(state, hf_config, out_folder, tokenizer_folder, generation_config=None,
                  max_shard_bytes=5 * 2**30):
    """Write a Hugging Face folder: config.json (hf_config), the weights of state (a GPT state dict) in
    hf_config's torch_dtype, sharded above max_shard_bytes, generation_config and the tokenizer files
    found in tokenizer_folder (None: the caller writes them)."""
    dtype = getattr(torch, hf_config.get('torch_dtype') or hf_config.get('dtype') or 'float32')
    tensors = hf_state_dict(state, hf_config, dtype)
    os.makedirs(out_folder, exist_ok=True)
    shards, size = [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        write_safetensors(shards[0], os.path.join(out_folder, 'model.safetensors'))
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f'model-{i:05d}-of-{len(shards):05d}.safetensors'
            write_safetensors(shard, os.path.join(out_folder, file))
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_folder, 'model.safetensors.index.json'), 'w') as f:
            json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
    with open(os.path.join(out_folder, 'config.json'), 'w') as f:
        json.dump(hf_config, f, indent=2)
    if generation_config is not None:
        with open(os.path.join(out_folder, 'generation_config.json'), 'w') as f:
            json.dump(generation_config, f, indent=2)
    for name in TOKENIZER_FILES if tokenizer_folder else ():
        if os.path.isfile(os.path.join(tokenizer_folder, name)):
            shutil.copyfile(os.path.join(tokenizer_folder, name), os.path.join(out_folder, name))
    # named templates beside chat_template.jinja (transformers' tool_use one, say)
    for name in additional_templates(tokenizer_folder) if tokenizer_folder else ():
        os.makedirs(os.path.join(out_folder, ADDITIONAL_TEMPLATES), exist_ok=True)
        shutil.copyfile(os.path.join(tokenizer_folder, ADDITIONAL_TEMPLATES, name),
                        os.path.join(out_folder, ADDITIONAL_TEMPLATES, name))


def additional_templates(folder):
    """The file names of a folder's named chat templates beside chat_template.jinja (additional_chat_templates/)."""
    path = os.path.join(folder, ADDITIONAL_TEMPLATES)
    return sorted(name for name in os.listdir(path) if name.endswith('.jinja')) if os.path.isdir(path) else []


def peft_name(adapter_name, hf_config):
    """PEFT's name of a nanotrain adapter tensor: transformer.h.0.attn.q.lora_A ->
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    module, matrix = adapter_name.rsplit('.', 1)
    return 'base_model.model.' + hf_names([module + '.weight'], hf_config)[module + '.weight'][:-len('.weight')] \
        + f'.{matrix}.weight'


def save_peft_adapter(adapters, lora_config, hf_config, base_folder, out_folder):
    """A PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) holding a nanotrain
    LoRA run's adapters (lora.lora_state_dict) on the Hugging Face model in base_folder; peft loads it
    with PeftModel.from_pretrained(base model, out_folder). lora_config: the run's config."""
    if is_gpt2(hf_config):
        raise UserError("GPT-2's q, k and v are one layer (c_attn) in Hugging Face, so nanotrain's separate q/k/v "
                        "adapters have no PEFT form; export the run's merged.pt instead.")
    rows = sorted(k for k in adapters if k.endswith('.added_rows'))
    # PEFT's trainable_token_indices (>= 0.15) replace
    # rows the base has; these lie past its embedding
    if rows:
        raise UserError(f"the run trained the rows of the chat tokens it added to the base's vocabulary ({rows[0]}), "
                        f"which a PEFT adapter cannot hold: PEFT's trainable tokens replace rows the base model "
                        f"already has, and these come after its last one, so PeftModel.from_pretrained on the "
                        f"published base would fail. Export the run's merged.pt instead (a whole model, with them).")
    other = sorted(k for k in adapters if not k.endswith(('.lora_A', '.lora_B')))
    if other:
        raise UserError(f"the run also trained {', '.join(other[:3])}, which a PEFT LoRA adapter cannot hold "
                        f"(added chat-token rows or biases); export the run's merged.pt instead.")
    tensors = {peft_name(k, hf_config): v.contiguous() for k, v in adapters.items()}
    targets = sorted({name.split('.')[-3] for name in tensors})
    os.makedirs(out_folder, exist_ok=True)
    write_safetensors(tensors, os.path.join(out_folder, 'adapter_model.safetensors'))
    config = dict(peft_type='LORA', task_type='CAUSAL_LM', base_model_name_or_path=os.path.abspath(base_folder),
                  r=lora_config['lora_r'], lora_alpha=lora_config['lora_alpha'], use_rslora=lora_config['use_rslora'],
                  lora_dropout=lora_config['lora_dropout'], target_modules=targets, bias='none',
                  fan_in_fan_out=False, init_lora_weights=True, inference_mode=True, modules_to_save=None)
    with open(os.path.join(out_folder, 'adapter_config.json'), 'w') as f:
        json.dump(config, f, indent=2)


def save_chat_tokenizer(source, out_folder, generation_config):
    """Write into out_folder the tokenizer source (a base model's HFTokenizer, without a chat template)
    with nanotrain's chat template and its special tokens added after the vocabulary, as ChatTokenizer
    numbers them, and <|end|> as the token generation stops at."""
    tokenizer_folder = source.folder
    spec = json.loads(source.tokenizer.to_str())  # (for a tokenizer.model: the converted one)
    # ChatTokenizer encodes each message on its own, so a sentencepiece-style space prefix opens
    # every message; transformers encodes the rendered text in pieces between special tokens: the
    # prefix must open each piece
    if (spec.get('pre_tokenizer') or {}).get('type') == 'Metaspace' and spec['pre_tokenizer'].get('prepend_scheme') == 'first':
        spec['pre_tokenizer']['prepend_scheme'] = 'always'
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    first = source.vocab_size
    if tokenizer.get_vocab_size(with_added_tokens=True) != first:
        raise UserError(f"the model in {tokenizer_folder} has more embedding rows than its tokenizer has tokens, so "
                        f"nanotrain's chat tokens (ids from {first}) cannot be appended to its tokenizer.json; "
                        f"export.py cannot write this model's tokenizer.")
    tokenizer.add_special_tokens(list(CHAT_SPECIAL_TOKENS))
    save_tokenizer(tokenizer, os.path.join(out_folder, 'tokenizer.json'))
    ids = {token: tokenizer.token_to_id(token) for token in CHAT_SPECIAL_TOKENS}
    tokenizer_config = read_json(tokenizer_folder, 'tokenizer_config.json') or {}
    # a class of its own (transformers 5's LlamaTokenizer) would rebuild the spaces patched above
    tokenizer_config = {k: v for k, v in tokenizer_config.items() if k not in SENTENCEPIECE_CONFIG}
    with open(os.path.join(out_folder, 'tokenizer_config.json'), 'w') as f:
        template = ('{{ bos_token }}' if source.document_prefix else '') + CHAT_TEMPLATE_JINJA
        json.dump(dict(tokenizer_config, chat_template=template, eos_token='<|end|>',
                       tokenizer_class='PreTrainedTokenizerFast'), f, indent=2)
    for stale in ('special_tokens_map.json', 'chat_template.jinja', 'chat_template.json'):
        if os.path.isfile(os.path.join(out_folder, stale)):
            os.remove(os.path.join(out_folder, stale))
    with open(os.path.join(out_folder, 'generation_config.json'), 'w') as f:
        json.dump(dict(generation_config or {}, eos_token_id=ids['<|end|>']), f, indent=2)


def jinja_literal(value):
    """value (JSON data) as a Jinja expression."""
    if value is None or isinstance(value, bool):
        return {None: 'none', True: 'true', False: 'false'}[value]
    if isinstance(value, (list, tuple)):
        return '[' + ', '.join(map(jinja_literal, value)) + ']'
    if isinstance(value, dict):
        return '{' + ', '.join(f'{json.dumps(str(k))}: {jinja_literal(v)}' for k, v in value.items()) + '}'
    return json.dumps(value)  # a number, or a string in escapes Jinja reads as Python's


def set_template_defaults(out_folder, variables):
    """Make the chat template(s) in out_folder render with variables (a run's chat_template_variables, e.g.
    Qwen3's {'enable_thinking': False}) unless the caller passes others: transformers and vLLM render an
    export without the run's variables, so each one is set at the top of the template when undefined."""
    bad = [k for k in variables or {} if not (isinstance(k, str) and k.isidentifier())]
    if bad:
        raise UserError(f"chat_template_variables {bad} are not names a chat template can use, so the export cannot "
                        f"carry them.")
    prefix = ''.join(f"{{%- if {k} is not defined %}}{{%- set {k} = {jinja_literal(v)} %}}{{%- endif %}}"
                     for k, v in (variables or {}).items())
    if not prefix:
        return
    for path in [os.path.join(out_folder, 'chat_template.jinja')] + [
            os.path.join(out_folder, ADDITIONAL_TEMPLATES, name) for name in additional_templates(out_folder)]:
        if not os.path.isfile(path):
            continue
        with open(path, encoding='utf-8') as f:
            template = f.read()
        with open(path, 'w', encoding='utf-8') as f:
            f.write(prefix + template)
    for name in ('tokenizer_config.json', 'chat_template.json'):
        config = read_json(out_folder, name)
        template = (config or {}).get('chat_template')
        if isinstance(template, str):
            config['chat_template'] = prefix + template
        elif isinstance(template, list):  # named templates: each gets them
            config['chat_template'] = [dict(t, template=prefix + t['template']) if isinstance(t, dict) and
                                       isinstance(t.get('template'), str) else t for t in template]
        else:
            continue
        with open(os.path.join(out_folder, name), 'w', encoding='utf-8') as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
