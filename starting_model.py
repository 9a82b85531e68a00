"""
The model a GPT run starts from: a train.py checkpoint or a Hugging Face model folder (read as one by
hf/checkpoint.py), and the checks that it fits the run.

- load_model / model_hash: either kind of source, and the sha256 a run names it by (a LoRA run's base,
  a DPO run's reference), so that a changed base or reference is caught on resume.
- full_model_checkpoint: the whole model a train.py run starts from (its own checkpoint, a LoRA run's
  base, or init_from); check_starting_model: its tokenizer and shape against the run's.
- run_tokenizer: the tokenizer the model brings (a published model's own), or data_dir's; run_model_args:
  the shape of a train.py run's model.
- reference_checkpoint: a DPO or RL run's reference, the chat model it began as; frozen_model: a frozen
  copy of it.
"""
import os

import torch

from configurator import UserError, dataclass_args
from lm.tokenizer import DEFAULT_DATA_DIR, load_tokenizer
from model import GPT, GPTConfig, new_seed
from run.checkpoint import NEW_RUN, RESUME_FIX, check_compatible, file_sha256, load_checkpoint
from run.device import DTYPES
from run.fsdp import place_model
from run.run_folder import is_hf_folder, require_init_from


def check_starting_model(model_ckpt, path, model_args, tokenizer, base_tokenizer=None, resuming=False):
    """The vocabulary size of the model a train.py run starts from (model_ckpt, read from path), after
    checking that it fits the run: a chat model is not pretrained further; its tokenizer is the run's
    (a pretrained model being fine-tuned has base_tokenizer, the run's without the chat template's
    tokens; None when pretraining); its shape is model_args'. resuming: model_ckpt is the checkpoint of the
    run this launch continues (a new run needs another out_dir or resume=False), not init_from's."""
    chat_model = model_ckpt['config'].get('training_type', 'from_scratch') != 'from_scratch'
    if chat_model and base_tokenizer is None:
        raise UserError(f"{path} is a chat model (training_type={model_ckpt['config']['training_type']!r}); "
                        f"train it further with training_type='sft' or 'lora', not as pretraining.")
    expected = (base_tokenizer if base_tokenizer is not None and not chat_model else tokenizer).identity()
    check_compatible(model_ckpt['tokenizer'], expected, 'tokenizer', path,
                     fix="Point data_dir at the tokenizer folder it was trained with, " + (
                         f"{NEW_RUN}." if resuming else "or start from another model (--init_from) or from scratch."))
    check_compatible(model_ckpt['model_args'], dict(model_args, vocab_size=expected['vocab_size']), 'model shape',
                     path, fix="Set these keys to the checkpoint's values (a fine-tune keeps its model's shape), " + (
                         f"{NEW_RUN}." if resuming else "or point --init_from at a model of the config's shape."),
                     may_differ=('dropout',))
    return expected['vocab_size']


def run_tokenizer(data_dir, model_ckpt, model_path, chat_template_variables=None, init_from=''):
    """(data_dir, tokenizer) of a GPT run whose model starts from model_ckpt (read from model_path; None
    from scratch): a published model's own tokenizer, in the folder it came from (moved: the folder init_from
    names), rendering its chat template with chat_template_variables; else data_dir's, or with data_dir '' the
    embedded default corpus's (data.py's prepare_default, which the script runs first)."""
    if hf_source(model_ckpt):
        from hf.tokenizer import load_hf_tokenizer
        data_dir = moved_to(model_ckpt['data_dir'], init_from if is_hf_folder(init_from) else '')
        if not os.path.isdir(data_dir):
            raise UserError(f"{data_dir}, the Hugging Face folder {model_path}'s model came from (named in it), no "
                            f"longer exists, and its tokenizer is this run's. Put the folder back there (train.py: or "
                            f"pass --init_from=<where it is now>).")
        return data_dir, load_hf_tokenizer(data_dir, chat_template_variables)
    data_dir = data_dir or DEFAULT_DATA_DIR
    # a model's own dataset holds its tokenizer: a newly prepared one would hold another
    fix = '' if model_ckpt is None else (f"Point --data_dir at the dataset folder {model_path} was trained on "
                                         f"({model_ckpt.get('data_dir')}): its tokenizer is the model's.")
    return data_dir, load_tokenizer(data_dir, fix)


def run_model_args(config, model_ckpt, model_path, tokenizer):
    """The GPTConfig arguments of a train.py run (config: its config keys): a published model's shape is its
    config.json's, whatever the model keys say, with the run's dropout; otherwise the model keys'. The
    vocabulary is the tokenizer's."""
    if not hf_source(model_ckpt):
        return dataclass_args(GPTConfig, config, vocab_size=tokenizer.vocab_size)
    model_args = dict(model_ckpt['model_args'], dropout=config['dropout'], vocab_size=tokenizer.vocab_size)
    if config['block_size'] > model_args['block_size']:
        raise UserError(f"block_size={config['block_size']} is longer than the {model_args['block_size']} positions "
                        f"{model_path} can attend over; lower block_size and max_length.")
    return model_args


def model_hash(path):
    """The sha256 of a model a run depends on: a checkpoint file, or a Hugging Face folder's config and weights."""
    if not is_hf_folder(path):
        return file_sha256(path)
    from hf.checkpoint import weight_files
    return file_sha256(os.path.join(path, 'config.json'), *weight_files(path))


def moved_to(recorded, init_from):
    """The model (file or folder) a continued run names, recorded; if it is gone, the relaunch's init_from: the
    same model moved elsewhere (the caller checks that it is: its sha256, or its tokenizer's identity)."""
    return recorded if os.path.exists(recorded) or init_from in ('', 'scratch', 'resume') else init_from


def load_model(path):
    """A checkpoint file, or a Hugging Face model folder read as a checkpoint (hf/checkpoint.py), its tensors
    as stored: memory-mapped in the file's dtype, and a folder bitsandbytes saved in 4 bits keeps its blocks'
    weights so (NF4Weights). build_model makes them the run's (float32; 16 or 4 bits for a LoRA base; FSDP's
    shards), so memory never holds a float32 copy that the run does not keep."""
    if not is_hf_folder(path):
        return load_checkpoint(path)
    from hf.checkpoint import load_hf_checkpoint
    return load_hf_checkpoint(path, as_stored=True, keep_nf4=True)


def full_model_checkpoint(ckpt, ckpt_path, init_from, out_dir, training_type):
    """(checkpoint, path) of the whole GPT a train.py run of training_type starts from: the continued run's
    own (ckpt), for a LoRA run its base model's (the same file or folder as when the run began), else
    init_from's; (None, None) for a new run from scratch, which a LoRA run cannot be. A published model is
    fine-tuned, never pretrained further. Read as load_model reads it."""
    if ckpt is None and init_from == 'scratch':
        if training_type == 'lora':
            raise UserError("training_type='lora' adapts a trained model, but there is none: set init_from to its "
                            "checkpoint (e.g. --init_from=out/ckpt.pt).")
        return None, None
    if ckpt is not None:
        path, model_ckpt = ckpt_path, ckpt
    else:
        path, model_ckpt = init_from, load_model(init_from)
    if model_ckpt['kind'] not in ('gpt', 'lora'):
        raise UserError(f"{path} is a {model_ckpt['kind']!r} checkpoint, not a GPT's; " + (
            RESUME_FIX if ckpt is not None else "point --init_from at a train.py checkpoint or a Hugging Face model "
                                                "folder") + ".")
    if model_ckpt['kind'] == 'lora':
        if ckpt is None:
            raise UserError(f"{path} holds LoRA adapters only; start from the merged model of that run "
                            f"(merged.pt next to it) instead.")
        path = moved_to(ckpt['base_checkpoint'], init_from)
        if not os.path.exists(path):
            raise UserError(f"{path}, the base model of the LoRA run in {out_dir} (named in its ckpt.pt), no longer "
                            f"exists. Put it back there, or pass --init_from=<where it is now>, or start a new run "
                            f"(another out_dir, or --resume=False).")
        model_ckpt = load_model(path)
        if model_hash(path) != ckpt['base_hash']:
            raise UserError(f"{path} is not the base model the LoRA run in {out_dir} began with "
                            f"({ckpt['base_checkpoint']}): it has changed since, or is another model, so the adapters "
                            f"no longer fit. Restore that model, or start a new run (another out_dir) from it.")
    if training_type == 'from_scratch' and hf_source(model_ckpt):
        raise UserError(f"{path} is a Hugging Face model; fine-tune it with training_type='sft' or 'lora' "
                        f"(e.g. python train.py config/sft_hf.py --init_from={init_from}).")
    return model_ckpt, path


def reference_checkpoint(ckpt, init_from, out_dir):
    """(checkpoint, path, sha256) of a DPO or RL run's reference, the chat model the run began as (its
    policy starts as this model, and its loss is relative to it): init_from for a new run; for the continued
    run (ckpt), the file its checkpoint names, which must still be there, unchanged. Read as load_model
    reads it."""
    if ckpt and 'reference_hash' not in ckpt:
        raise UserError(f"{os.path.join(out_dir, 'ckpt.pt')} names no reference model, so it is not a checkpoint of "
                        f"this run, and there is nothing to resume. Use another out_dir, or --resume=False to start a "
                        f"new run there (its checkpoints are then overwritten).")
    path = moved_to(ckpt['reference_checkpoint'], init_from) if ckpt else init_from
    if ckpt and not os.path.exists(path):
        raise UserError(f"{path}, the reference of the run in {out_dir} (named in its ckpt.pt), no longer "
                        f"exists. Put it back there, or pass --init_from=<where it is now>, or start a new run "
                        f"(another out_dir, or --resume=False).")
    if not ckpt:
        require_init_from(init_from, hf_folders=True)
    reference = load_model(path)
    if reference['kind'] != 'gpt':
        raise UserError(f"{path} is a {reference['kind']!r} checkpoint; this run starts from a GPT chat model "
                        + ("(for a LoRA run, its merged.pt)." if reference['kind'] == 'lora' else "."))
    if reference['config'].get('training_type', 'from_scratch') == 'from_scratch':
        raise UserError(f"{path} is a pretrained model without the chat template; fine-tune it first, e.g. "
                        f"`python train.py {'config/sft_hf.py' if is_hf_folder(path) else 'config/sft.py'} "
                        f"--init_from={path}`, and point --init_from at that run's checkpoint.")
    reference_hash = model_hash(path)
    if ckpt and reference_hash != ckpt['reference_hash']:
        raise UserError(f"{path} is not the reference the run in {out_dir} began with "
                        f"({ckpt['reference_checkpoint']}): it has changed since, or is another model. Restore that "
                        f"model, or start a new run (another out_dir, or --resume=False to overwrite).")
    return reference, path, reference_hash


def starting_gpt(model_args, model_ckpt, model_path, tokenizer, base_tokenizer=None, assign=False,
                 lora_base_dtype='float32', resuming=False):
    """(the GPT a train.py run starts from, the vocabulary size it starts with): model_ckpt's (None: a new
    model of model_args), checked with check_starting_model, its vocabulary grown to tokenizer's when the
    run adds the chat template's tokens. assign, lora_base_dtype: as in build_model; resuming: as in
    check_starting_model."""
    vocab_size = tokenizer.vocab_size
    if model_ckpt is not None:  # a pretrained model being fine-tuned has the base tokenizer
        vocab_size = check_starting_model(model_ckpt, model_path, model_args, tokenizer, base_tokenizer, resuming)
    model = build_model(GPTConfig(**dict(model_args, vocab_size=vocab_size)), model_ckpt, assign, lora_base_dtype)
    if vocab_size < tokenizer.vocab_size:
        model.resize_vocab(tokenizer.vocab_size)
    return model, vocab_size


def build_model(config, model_ckpt, assign=False, lora_base_dtype='float32'):
    """The GPT of config (a GPTConfig) holding model_ckpt's weights, or initialised at random when
    model_ckpt is None. A published model's is built around its tensors as stored (GPT.from_state_dict),
    then made float32, so memory holds one copy; so is any checkpoint's with assign (FSDP: the tensors are
    memory-mapped, perhaps in a stored bf16, and fsdp.shard_model makes each rank's shard float32) or a
    lora_base_dtype other than 'float32' (a LoRA run's 'bfloat16', 'float16' or 'nf4': its blocks' Linear
    weights go from their stored dtype straight to it, the rest to float32: lora.cast_frozen_base; a 4-bit
    folder's NF4 weights are built in as they are). A new model with assign (FSDP) is built on the meta
    device, holding no weights: fsdp.shard_model draws each rank's shards of it, the values one process
    draws from the same seed (its init_seed, drawn here from torch's global stream)."""
    if model_ckpt is None and assign:
        init_seed = new_seed()
        with torch.device('meta'):
            return GPT(config, init_seed)
    if model_ckpt is None or not (assign or model_ckpt.get('hf_config') or lora_base_dtype != 'float32'):
        model = GPT(config)
        if model_ckpt is not None:
            model.load_state_dict(model_ckpt['model'])
        return model
    # only a published folder holds NF4 weights: a 4-bit base keeps them, any other run dequantizes them
    stored = nf4_weights(model_ckpt['model']) if model_ckpt.get('hf_config') and lora_base_dtype == 'nf4' else {}
    state = dense({k: torch.empty(v.shape, dtype=v.dtype, device='meta') if k in stored else v
                   for k, v in model_ckpt['model'].items()})
    if lora_base_dtype == 'float32' and not assign:  # a run that trains every weight
        state = in_float32(state)
    model = GPT.from_state_dict(config, state)
    if lora_base_dtype != 'float32':
        from lm.lora import cast_frozen_base
        cast_frozen_base(model, 'nf4' if lora_base_dtype == 'nf4' else DTYPES[lora_base_dtype], stored=stored)
    return model


def dense(state):
    """state with a 4-bit folder's NF4 weights (load_model) dequantized to the dtype they came in."""
    return {k: v if isinstance(v, torch.Tensor) else v.dequantize() for k, v in state.items()}


def in_float32(state):
    """state in float32: a float32 tensor as it is (a file's memory-mapped pages, no copy), any other copied
    once, so that a tensor under two names (a tied lm_head) stays one."""
    copies = {}
    for v in state.values():
        if id(v) not in copies:
            copies[id(v)] = v.float()
    return {k: copies[id(v)] for k, v in state.items()}


def nf4_weights(state):
    """{name: NF4Weight} of the weights a 4-bit folder keeps in 4 bits (load_model)."""
    from lm.nf4 import NF4Weight
    return {k: v for k, v in state.items() if isinstance(v, NF4Weight)}


def hf_source(model_ckpt, chat_template_variables=None):
    """{'hf_config', 'generation_config', 'chat_template_variables'} of a model that came from a Hugging Face
    folder (its config.json and generation_config.json, which export.py writes back, and the variables its chat
    template is rendered with: chat_template_variables, else those it was fine-tuned with), else {}."""
    if model_ckpt is None or not model_ckpt.get('hf_config'):
        return {}
    variables = chat_template_variables or model_ckpt.get('chat_template_variables') or {}
    return dict(hf_config=model_ckpt['hf_config'], generation_config=model_ckpt['generation_config'],
                chat_template_variables=variables)


def frozen_model(config, state, parallel, device, param_dtype, cpu_offload):
    """A frozen GPT of config (a GPTConfig) holding state (a DPO run's reference), in eval mode, on
    device; with parallel='fsdp' built around state's (memory-mapped) tensors, then each rank keeps
    its shard (in a bf16 run in bf16: fsdp.shard_model), else around a copy of them (the policy may
    be built around the same tensors) whose blocks' Linear weights are in param_dtype
    (lora.cast_frozen_base: half their memory in a 16-bit run, the same log-probs under its
    autocast, which casts them so at every use anyway)."""
    model = GPT.from_state_dict(config, dense(state))  # never first initialised at random (seconds for 1B)
    if parallel != 'fsdp':  # its own copy, made on the device
        from lm.lora import cast_frozen_base
        cast_frozen_base(model, param_dtype, device)
    model.requires_grad_(False).eval()
    place_model(model, parallel, device, param_dtype, cpu_offload, frozen=True)
    return model
