"""
A model to generate from or score, whatever it was saved as: what sample.py and eval.py load.

- model_path: the file or folder a command names: init_from (a checkpoint file, a run folder, a
  Hugging Face folder), else out_dir's ckpt_name, with clear errors when there is none.
- load_for_generation: that model in eval mode with its tokenizer: a train.py / train_dpo.py
  checkpoint (full weights; a LoRA run's merged.pt; or its ckpt.pt of adapters, put on the base
  model it names and merged), or a Hugging Face folder. A chat model (fine-tuned: sft, lora, dpo,
  or a published model with a chat template) gets its chat tokenizer, which answers a prompt as a
  user turn (encode_prompt) and ends its answer with eos_id.
"""
import os
from typing import NamedTuple

from configurator import UserError
from lm.tokenizer import chat_tokenizer, load_tokenizer
from model import GPT, GPTConfig
from run.checkpoint import check_model_fields, load_checkpoint
from run.run_folder import is_hf_folder
from starting_model import build_model, hf_source, load_model, model_hash


class Loaded(NamedTuple):
    model: GPT  # in eval mode, on the device
    tokenizer: object  # a chat model's chat tokenizer (encode_prompt), else the plain one
    chat: bool  # a chat model: prompts go through its chat template, answers end at tokenizer.eos_id
    path: str  # the checkpoint file or Hugging Face folder it was read from


def model_path(init_from, out_dir='out', ckpt_name='ckpt.pt'):
    """The checkpoint file or Hugging Face folder to load: init_from (a run folder: its ckpt.pt, else its
    merged.pt), or with init_from '' out_dir's ckpt_name."""
    if not init_from:
        path = os.path.join(out_dir, ckpt_name)
        if not os.path.exists(path):
            found = sorted(f for f in os.listdir(out_dir) if f.endswith('.pt')) if os.path.isdir(out_dir) else []
            raise UserError(f"no model to load: {path} does not exist. " + (
                f"{out_dir} holds {', '.join(found)}: pick one with --ckpt_name." if found else
                f"Train one there first (`python train.py --out_dir={out_dir}`), or point --out_dir at a run's "
                f"folder (or --init_from at a checkpoint or a Hugging Face model folder)."))
        return path
    if os.path.isdir(init_from) and not is_hf_folder(init_from):
        for name in ('ckpt.pt', 'merged.pt'):
            if os.path.exists(os.path.join(init_from, name)):
                return os.path.join(init_from, name)
        raise UserError(f"init_from={init_from!r} is a folder with neither a checkpoint (ckpt.pt, merged.pt) nor a "
                        f"Hugging Face model (config.json); name a checkpoint file, a run's folder or a model folder.")
    if not os.path.exists(init_from):
        raise UserError(f"init_from={init_from!r} does not exist; name a checkpoint file (e.g. out-sft/ckpt.pt), a "
                        f"run's folder or a Hugging Face model folder.")
    return init_from


def lora_merged_model(ckpt, path):
    """The GPT a LoRA run's adapter checkpoint (ckpt, read from path) fine-tunes: its base model (the file or
    folder the checkpoint names, unchanged since: its sha256) with the adapters applied as the run applied
    them, then folded in as merged.pt holds them (lora.merged_state_dict)."""
    from lm.lora import apply_lora, merged_state_dict
    base_path, config = ckpt['base_checkpoint'], ckpt['config']
    if not os.path.exists(base_path):
        raise UserError(f"{base_path}, the base model of the LoRA adapters in {path} (named in it), no longer "
                        f"exists. Put it back there, or load the run's merged.pt (adapters folded in) instead.")
    if model_hash(base_path) != ckpt['base_hash']:
        raise UserError(f"{base_path} is not the base model the adapters in {path} were trained on: it has changed "
                        f"since, so they no longer fit. Restore it, or load the run's merged.pt instead.")
    # a QLoRA run's adapters go on the 4-bit base they were trained on (a 4-bit folder's bits as they are)
    base = load_model(base_path)
    base_vocab = base['model_args']['vocab_size']
    model = build_model(GPTConfig(**dict(ckpt['model_args'], vocab_size=base_vocab)), base,
                        lora_base_dtype='nf4' if config.get('lora_base_dtype') == 'nf4' else 'float32')
    added_tokens = ckpt['model_args']['vocab_size'] - base_vocab  # the chat tokens an SFT run added
    if added_tokens:
        model.resize_vocab(ckpt['model_args']['vocab_size'])
    apply_lora(model, config['lora_r'], config['lora_alpha'], 0.0, config['lora_target_modules'],
               config['use_rslora'], config['lora_bias'], added_tokens)
    model.load_state_dict({**model.state_dict(), **ckpt['model']})  # strict: every adapter must fit
    return GPT.from_state_dict(GPTConfig(**ckpt['model_args']), merged_state_dict(model))


def load_for_generation(path, data_dir='', chat_template_variables=None, device='cpu'):
    """Loaded(model, tokenizer, chat, path) of a checkpoint file or Hugging Face folder (model_path's
    answer). data_dir: the tokenizer's folder when it moved since training ('' = the one the checkpoint
    names); chat_template_variables: a published model's chat-template variables (None: as fine-tuned)."""
    ckpt = load_model(path) if is_hf_folder(path) else load_checkpoint(
        path, fix="point --init_from (or --out_dir and --ckpt_name) at another model")
    if ckpt.get('kind') == 'tts':
        folder, name = os.path.split(path)
        raise UserError(f"{path} is a text-to-speech checkpoint (train_tts.py); speak with it: `python sample_tts.py "
                        f"--out_dir={folder or '.'}" + (f" --ckpt_name={name}" if name != 'ckpt.pt' else '') + "`.")
    if ckpt.get('kind') == 'vocoder':
        raise UserError(f"{path} is a train_vocoder.py run's checkpoint (a HiFi-GAN generator); speak through it: "
                        f"`python sample_tts.py --vocoder={os.path.join(os.path.dirname(path), 'generator.pth.tar')}"
                        f" --out_dir=<a train_tts.py run>`.")
    if ckpt.get('kind') not in ('gpt', 'lora'):
        raise UserError(f"{path} is not a language model's checkpoint (its kind: {ckpt.get('kind')!r}); point "
                        f"--init_from (or --out_dir and --ckpt_name) at a train.py, train_dpo.py or train_rl.py run.")
    check_model_fields(ckpt, path, "point --init_from (or --out_dir and --ckpt_name) at another model")
    if ckpt['kind'] == 'lora':
        model = lora_merged_model(ckpt, path)
    else:  # a published model is built around its weights as read: one copy of it in memory
        model = build_model(GPTConfig(**ckpt['model_args']), ckpt)
    model.eval().to(device)
    tokenizer_files = ('meta.json', 'config.json')
    if not data_dir and not any(os.path.isfile(os.path.join(ckpt['data_dir'], f)) for f in tokenizer_files):
        raise UserError(f"{path} was trained on the dataset in {ckpt['data_dir']}, which is no longer there (moved "
                        f"or copied elsewhere?); pass --data_dir=<that dataset's folder now>.")
    if chat_template_variables and not ckpt.get('hf_config'):
        raise UserError(f"chat_template_variables {sorted(chat_template_variables)}: {path} is a model of nanotrain's "
                        f"own, whose chat template reads no variables (a published model's Jinja template does); "
                        f"leave them out.")
    if ckpt.get('hf_config'):
        from hf.tokenizer import load_hf_tokenizer
        tokenizer = load_hf_tokenizer(data_dir or ckpt['data_dir'],
                                      hf_source(ckpt, chat_template_variables)['chat_template_variables'])
    else:
        tokenizer = load_tokenizer(data_dir or ckpt['data_dir'], fix=(
            f"Point --data_dir at the dataset folder {path} was trained on: its tokenizer is the model's."))
    # fine-tuned (sft, lora, dpo), or a published model with a chat template
    chat = ckpt['config'].get('training_type', 'from_scratch') != 'from_scratch'
    if chat:
        tokenizer = chat_tokenizer(tokenizer)
    if tokenizer.identity() != ckpt['tokenizer']:
        raise UserError(f"the tokenizer in {data_dir or ckpt['data_dir']} is not the one {path} was trained with. "
                        f"Pass --data_dir=<the dataset folder used for training>.")
    return Loaded(model, tokenizer, chat, path)
