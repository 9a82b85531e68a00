"""
Generate from a trained checkpoint: `python sample.py --out_dir=out --start="def main("`.
A fine-tuned (sft/lora/dpo) model takes start as a user turn of its chat template and answers it:
`python sample.py --out_dir=out-sft --start="What is 48+27?"`; a LoRA run's ckpt.pt (adapters, put
on the base model it names) and its merged.pt answer alike.
A published model samples straight from its Hugging Face folder, answering in its own chat template:
`python sample.py --init_from=/models/Qwen2.5-0.5B-Instruct --start="Why is the sky blue?"`.
A conversation in the terminal, each answer printed as it is drawn, the turns before it its prompt:
`python sample.py --out_dir=out-sft --interactive=True` (/clear forgets them, /quit or Ctrl-D ends).
Text-to-speech checkpoints (train_tts.py) speak with sample_tts.py.
"""

import sys

import torch

from configurator import FOLDER, SEED, UserError, at_least, check_values, configure, interval
from lm.chat_data import chat_tools
from lm.generate import CompiledDecoding, stop_tokens, stream_tokens
from lm.tokenizer import decoded_pieces
from loading import load_for_generation, model_path
from run.device import autocast_context, pick_device, pick_dtype

# -----------------------------------------------------------------------------
out_dir = 'out'              # folder of the run to sample from
ckpt_name = 'ckpt.pt'        # 'ckpt.pt' (latest) or 'best.pt'; LoRA runs: ckpt.pt (adapters) or 'merged.pt'
init_from = ''               # instead of out_dir's checkpoint: a checkpoint file, a run folder or a Hugging Face folder
data_dir = ''                # tokenizer folder; '' = the one recorded in the checkpoint
chat_template_variables = {}  # published model's chat-template variables; {} = as it was fine-tuned
start = '\n'                 # prompt text, or 'FILE:path.txt' to read it from a file
system = ''                  # a chat model's system turn before start; '' = none (its template's default, if any)
tools = ''                   # a chat model's tools: a JSON file of function schemas its template shows; '' = none
num_samples = 1              # samples to generate
max_new_tokens = 300         # tokens generated per sample
temperature = 0.8            # 0 = greedy
top_k = 50                   # 0 = off
top_p = 0.0                  # nucleus sampling; 0 = off
use_kv_cache = True          # cache keys and values while generating (same samples, faster)
interactive = False          # a chat model in the terminal: each line a user turn, answers stream, the turns kept
compile_decode = False       # decode through torch.compile over a static KV cache (CUDA graphs): ~1 min to compile
seed = 1337                  # random seed
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16; fp32 on CPU
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('num_samples', 'max_new_tokens')),
    (at_least(0), ('top_k', 'temperature')),
    (interval('[0, 1]'), ('top_p',)),
    (FOLDER, ('out_dir',)),
])

# '' and nanoGPT's 'resume' mean out_dir's checkpoint
local_device = pick_device(device)  # 'auto' resolved
autocast = autocast_context(local_device, pick_dtype(local_device, dtype))
model, tokenizer, chat, path = load_for_generation(model_path('' if init_from == 'resume' else init_from, out_dir,
                                                              ckpt_name), data_dir, chat_template_variables,
                                                   local_device)

text = start
if start.startswith('FILE:'):
    try:
        with open(start[5:], encoding='utf-8') as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"start={start!r}: cannot read the prompt file ({e}); name a UTF-8 text file.") from None
if (system or tools) and not chat:
    raise UserError(f"{'system' if system else 'tools'}=...: a base model has no chat template to show it; "
                    f"give the text to continue as start.")
schemas = None
if tools:  # the "tools" of a fine-tuning row
    try:
        with open(tools, encoding='utf-8') as f:
            schemas = chat_tools({'tools': f.read()})
    except (OSError, ValueError) as e:
        raise UserError(f"tools={tools!r}: {e}; name a JSON file holding a list of function schemas, "
                        f"[{{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}].") from None
if interactive and not chat:
    raise UserError(f"interactive=True: {path} is a base model, which continues a text (no chat template to hold "
                    f"turns); chat with a fine-tuned run or a published instruct model, or give it --start=...")
if compile_decode and not use_kv_cache:
    raise UserError("compile_decode=True decodes over a static KV cache; it cannot run with use_kv_cache=False. "
                    "Drop one of them.")
generator = torch.Generator(device=local_device).manual_seed(seed)
decoding = CompiledDecoding() if compile_decode else None
system_turns = [{'role': 'system', 'content': system}] * bool(system)


def conversation_prompt(history):
    """(prompt ids, the turns kept): the oldest exchanges left out while the prompt and an answer would pass
    block_size (as GPT.generate slides, they would be cut off at any token, the template's first included)."""
    while True:
        ids = tokenizer.encode_prompt(system_turns + history, schemas)
        if len(ids) + max_new_tokens - 1 <= model.config.block_size or len(history) == 1:
            return ids, history
        history = history[2:]  # a user turn and its answer


def answer_tokens(ids):
    """The tokens of the answer to ids as they are drawn, up to a stop token (a chat model's end of turn)."""
    stops = stop_tokens(tokenizer)
    with torch.no_grad(), autocast:
        for token in stream_tokens(model, ids, max_new_tokens, temperature, top_k or None, top_p or None, generator,
                                   use_kv_cache, decoding):
            if token in stops:
                return
            yield token


if interactive:
    print(f"Chatting with {path}: type a message; /clear forgets the conversation, /quit or Ctrl-D ends.")
    history = []
    sys.stdin.reconfigure(errors='surrogateescape')  # a line that is not UTF-8 is refused below, not a traceback
    while True:
        try:
            line = input('> ')
        except (EOFError, KeyboardInterrupt):
            print()
            break
        if line.strip() in ('/quit', '/exit'):
            break
        if line.strip() == '/clear':
            history = []
            continue
        if not line.strip():
            continue
        try:
            line.encode('utf-8')  # bytes stdin could not decode come as lone surrogates
        except UnicodeEncodeError:
            print("[the line holds bytes that are not UTF-8 text (the terminal's encoding?): left out]")
            continue
        try:
            ids, kept = conversation_prompt(history + [{'role': 'user', 'content': line}])
        except UserError as e:  # a character a char vocabulary lacks, say: the conversation goes on without it
            print(f"[{e}]")
            continue
        if len(kept) <= len(history):
            print(f"[the oldest {(len(history) + 1 - len(kept)) // 2} exchange(s) left out: the conversation and "
                  f"max_new_tokens={max_new_tokens} pass block_size={model.config.block_size}]")
        pieces = []
        try:  # printed as it is drawn; Ctrl-C stops it there
            for piece in decoded_pieces(tokenizer, answer_tokens(ids)):
                print(piece, end='', flush=True)
                pieces.append(piece)
        except KeyboardInterrupt:
            print(' [stopped]', end='')
        print()
        history = kept + [{'role': 'assistant', 'content': ''.join(pieces)}]
else:  # start, answered (a chat model) or continued, num_samples times
    # a chat model answers start as a user turn; other text opens
    # as the tokenizer opens a text (a published model's BOS)
    turns = system_turns + [{'role': 'user', 'content': text}]
    ids = (tokenizer.encode_prompt(turns, schemas) if chat else tokenizer.document_prefix + tokenizer.encode(text))
    if not ids:
        raise UserError("start is empty: give the model something to continue, e.g. --start='\\n' or a sentence.")
    # a static cache holds the whole sample: one that passes block_size slides its context (GPT.generate) instead
    if compile_decode and len(ids) + max_new_tokens - 1 > model.config.block_size:
        print(f"compile_decode: {len(ids)} prompt tokens + max_new_tokens={max_new_tokens} pass block_size="
              f"{model.config.block_size}, so the context slides; sampling without compiling")
    eos_id = tokenizer.eos_id if chat else None  # a chat answer ends at <|end|>
    with torch.no_grad(), autocast:
        for _ in range(num_samples):
            out = list(ids)
            for token in stream_tokens(model, ids, max_new_tokens, temperature, top_k or None, top_p or None,
                                       generator, use_kv_cache, decoding):
                out.append(token)
                if token == eos_id:
                    break
            print(tokenizer.decode(out))
            print('---------------')
