"""
Generate from a trained checkpoint: `python sample.py --out_dir=out --start="def main("`.
A fine-tuned (sft/lora) model takes start as a user turn of its chat template and answers it:
`python sample.py --out_dir=out-sft --start="What is 48+27?"` (for LoRA runs, --ckpt_name=merged.pt).
A published model samples straight from its Hugging Face folder, answering in its own chat template:
`python sample.py --init_from=/models/Qwen2.5-0.5B-Instruct --start="Why is the sky blue?"`.
A train_tts.py checkpoint speaks instead: `python sample.py --out_dir=out-tts --text="Hello there." --wav=out.wav`.
"""

import os
import sys
import time

import torch

from configurator import FOLDER, POSITIVE, UserError, at_least, check_values, configure, interval
from hf.tokenizer import load_hf_tokenizer
from lm.tokenizer import chat_tokenizer, load_tokenizer
from model import GPT, GPTConfig
from run.checkpoint import load_checkpoint
from run.device import autocast_context, pick_device, pick_dtype
from run.starting_model import hf_source, load_model
from tts.data import MEL_SETTINGS, write_wav
from tts.model import load_tts, synthesize

# -----------------------------------------------------------------------------
out_dir = 'out'              # folder of the run to sample from
ckpt_name = 'ckpt.pt'        # 'ckpt.pt' (latest) or 'best.pt'; LoRA runs: 'merged.pt'
init_from = ''               # a Hugging Face model folder to sample instead of out_dir's checkpoint
data_dir = ''                # tokenizer folder; '' = the one recorded in the checkpoint
chat_template_variables = {}  # published model's chat-template variables; {} = as it was fine-tuned
start = '\n'                 # prompt text, or 'FILE:path.txt' to read it from a file
num_samples = 1              # samples to generate
max_new_tokens = 300         # tokens generated per sample
temperature = 0.8            # 0 = greedy
top_k = 50                   # 0 = off
top_p = 0.0                  # nucleus sampling; 0 = off
use_kv_cache = True          # cache keys and values while generating (same samples, faster)
seed = 1337                  # random seed
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16; fp32 on CPU
# text-to-speech checkpoints (train_tts.py)
text = 'I will unfold some causes of your deaths.'  # what to say
wav = 'out.wav'              # where to write the waveform
n_timesteps = 10             # Euler steps of the flow-matching ODE
tts_temperature = 0.667      # scale of the starting noise
length_scale = 1.0           # > 1 speaks slower
guidance = 0.0               # classifier-free guidance weight (models trained with cfg_drop > 0)
# -----------------------------------------------------------------------------
_defaults = dict(globals())  # to tell which keys the command line or a config file changed
config = configure(globals())
check_values(config, [
    (at_least(1), ('num_samples', 'max_new_tokens', 'n_timesteps')),
    (at_least(0), ('top_k', 'temperature', 'tts_temperature', 'guidance')),
    (interval('[0, 1]'), ('top_p',)),
    (POSITIVE, ('length_scale',)),
    (FOLDER, ('out_dir',)),
])
# keys that only one kind of checkpoint reads: setting
# one for the other kind is refused, not silently ignored
GPT_KEYS = ['init_from', 'data_dir', 'chat_template_variables', 'start', 'num_samples', 'max_new_tokens', 'temperature', 'top_k', 'top_p', 'use_kv_cache']
TTS_KEYS = ['text', 'wav', 'n_timesteps', 'tts_temperature', 'length_scale', 'guidance']

# nanoGPT's spelling of "out_dir's checkpoint"
init_from = '' if init_from == 'resume' else init_from
device = pick_device(device)
autocast = autocast_context(device, pick_dtype(device, dtype))
ckpt_path = init_from or os.path.join(out_dir, ckpt_name)
if not init_from and not os.path.exists(ckpt_path):
    found = sorted(f for f in os.listdir(out_dir) if f.endswith('.pt')) if os.path.isdir(out_dir) else []
    raise UserError(f"no run to sample from: {ckpt_path} does not exist. " + (
        f"{out_dir} holds {', '.join(found)}: pick one with --ckpt_name." if found else
        f"Train one there first (`python train.py --out_dir={out_dir}`), or point --out_dir at a run's folder."))
ckpt = load_model(init_from) if init_from else load_checkpoint(ckpt_path)
kind, keys, other_keys = (('text-to-speech (train_tts.py)', TTS_KEYS, GPT_KEYS) if ckpt['kind'] == 'tts' else
                          ('GPT (train.py/train_dpo.py)', GPT_KEYS, TTS_KEYS))
ignored = [k for k in other_keys if config[k] != _defaults[k]]
if ignored:
    raise UserError(f"{', '.join(f'{k}={config[k]!r}' for k in ignored)}: {ckpt_path} is a {kind} checkpoint, "
                    f"which does not read {'this key; drop it' if len(ignored) == 1 else 'these keys; drop them'}. "
                    f"It reads {', '.join(keys)} besides out_dir, ckpt_name, seed, device and dtype.")
if ckpt['kind'] == 'tts':
    if os.path.isdir(wav) or not os.path.isdir(os.path.dirname(os.path.abspath(wav))):
        raise UserError(f"wav={wav!r} must be a file path in an existing folder, e.g. out.wav.")
    model = load_tts(ckpt, device)
    t0 = time.time()
    audio, _ = synthesize(model, text, n_timesteps=n_timesteps, temperature=tts_temperature,
                          length_scale=length_scale, guidance=guidance, seed=seed)
    write_wav(wav, audio, MEL_SETTINGS['sample_rate'])
    seconds = len(audio) / MEL_SETTINGS['sample_rate']
    print(f"wrote {wav}: {seconds:.2f} s of audio, real-time factor {(time.time() - t0) / seconds:.3f}")
    sys.exit(0)
if ckpt['kind'] == 'lora':
    raise UserError(f"{ckpt_path} holds LoRA adapters only; sample from the run's merged model: --ckpt_name=merged.pt "
                    f"(written at the end of training).")
if ckpt.get('hf_config'):  # built around its weights: one copy of a published model in memory
    model = GPT.from_state_dict(GPTConfig(**ckpt['model_args']), ckpt['model'])
else:
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
model.eval().to(device)
if not data_dir and not any(os.path.isfile(os.path.join(ckpt['data_dir'], f)) for f in ('meta.json', 'config.json')):
    raise UserError(f"{ckpt_path} was trained on the dataset in {ckpt['data_dir']}, which is no longer there (moved "
                    f"or copied elsewhere?); pass --data_dir=<that dataset's folder now>.")
if ckpt.get('hf_config'):
    tokenizer = load_hf_tokenizer(data_dir or ckpt['data_dir'],
                                  hf_source(ckpt, chat_template_variables)['chat_template_variables'])
else:
    tokenizer = load_tokenizer(data_dir or ckpt['data_dir'])
chat = ckpt['config'].get('training_type', 'from_scratch') != 'from_scratch'
if chat:
    tokenizer = chat_tokenizer(tokenizer)
if tokenizer.identity() != ckpt['tokenizer']:
    raise UserError(f"the tokenizer in {data_dir or ckpt['data_dir']} is not the one {ckpt_path} was trained with. "
                    f"Pass --data_dir=<the dataset folder used for training>.")

if start.startswith('FILE:'):
    try:
        with open(start[5:], encoding='utf-8') as f:
            start = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"start={start!r}: cannot read the prompt file ({e}); name a UTF-8 text file.") from None
# a chat model answers start as a user turn; other text opens
# as the tokenizer opens a text (a published model's BOS)
ids = (tokenizer.encode_prompt([{'role': 'user', 'content': start}]) if chat
       else tokenizer.document_prefix + tokenizer.encode(start))
if not ids:
    raise UserError("start is empty: give the model something to continue, e.g. --start='\\n' or a sentence.")
prompt = torch.tensor([ids], dtype=torch.long, device=device)
generator = torch.Generator(device=device).manual_seed(seed)
with torch.no_grad(), autocast:
    for _ in range(num_samples):
        out = model.generate(prompt, max_new_tokens, temperature=temperature, top_k=top_k or None,
                             top_p=top_p or None, use_kv_cache=use_kv_cache, generator=generator,
                             # a chat answer ends at <|end|>
                             eos_id=tokenizer.eos_id if chat else None)
        print(tokenizer.decode(out[0].tolist()))
        print('---------------')
