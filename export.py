"""
Export a model as a Hugging Face folder that transformers and lm-eval load as is (vLLM too, except an Arcee
model whose hidden_act is not relu2, such as nanotrain's default gelu one: vLLM's Arcee takes relu2 only):
`python export.py out-sft/ckpt.pt /models/my-sft`. The checkpoint is a train.py (or train_dpo.py) GPT
checkpoint, ckpt.pt or best.pt, or a LoRA run's merged.pt (the adapters folded into the weights).

A fine-tune of a published model (init_from a Hugging Face folder) gets the source model's config.json, its
weights in the dtype it was published in (tied embeddings stay tied; sharded with an index above 5 GB),
generation_config.json and the tokenizer files with their chat template (a base model fine-tuned in
nanotrain's template gets that template, its four tokens and <|end|> as the stop). A LoRA run's ckpt.pt
(adapters only) on such a model becomes a PEFT adapter folder instead, which peft loads onto the base
model: `python export.py out-lora-hf/ckpt.pt /models/my-adapter`.

A model nanotrain trained itself is written as the family that computes the same function, in float32
(hf_checkpoint.hf_model), with its tokenizer (chat template and <|end|> after SFT, LoRA or DPO):
- pos_emb='rope', norm='rmsnorm', mlp 'gelu' / 'gelu_tanh' / 'relu2': ArceeForCausalLM (Llama with a plain
  MLP). This is the default `python train.py` model, so its SFT, LoRA and DPO runs (config/sft.py,
  config/lora.py, config/dpo.py) and config/shakespeare_char.py export as Arcee.
- the same with mlp='swiglu': LlamaForCausalLM; with qkv_bias Qwen2ForCausalLM; with qk_norm Qwen3ForCausalLM.
- pos_emb='learned', norm='layernorm', mlp 'gelu' / 'gelu_tanh': GPT2LMHeadModel (zero biases if bias=False).
Any other model is refused, naming the settings no family has: config/speedrun_cpu.py's (qk_norm with a
GELU MLP), logit_softcap, RoPE with LayerNorm, learned positions with RMSNorm.

--dtype=float32 (or bfloat16, float16) writes the weights in that dtype instead, config.json saying so: a
fine-tune of a bf16 model, or a QLoRA run's merged.pt, trained in float32 and is written in bf16 by default
(its logits then differ from the run's by bf16's rounding); the line printed names the dtype written.
"""
import os
import shutil
import sys
import tempfile

import torch
from safetensors import SafetensorError

from configurator import UserError, install_excepthook
from hf.checkpoint import hf_model, save_chat_tokenizer, save_hf_model, save_peft_adapter, set_template_defaults
from hf.tokenizer import load_hf_tokenizer
from hf.tokenizer_json import write_tokenizer_files
from lm.tokenizer import ChatTokenizer, load_tokenizer
from run.checkpoint import check_model_fields, load_checkpoint
from run.run_folder import is_hf_folder

DTYPES = ('float32', 'bfloat16', 'float16')

install_excepthook()
options = [arg for arg in sys.argv[1:] if arg.startswith('--dtype=')]
paths = [arg for arg in sys.argv[1:] if arg not in options]
if len(paths) != 2 or len(options) > 1 or paths[0].startswith('-') or not all(paths):  # '' names no file
    print(__doc__.strip())
    print(f"\nusage: python export.py CHECKPOINT OUT_FOLDER [--dtype={'|'.join(DTYPES)}]")
    sys.exit(0 if len(sys.argv) == 2 and sys.argv[1] in ('-h', '--help') else 2)
ckpt_path, out_folder = paths
dtype = options[0].partition('=')[2] if options else ''  # '' = the published model's dtype, or float32
if dtype and dtype not in DTYPES:
    raise UserError(f"--dtype={dtype}: write the weights in one of {', '.join(DTYPES)} (or leave --dtype out: the "
                    f"published model's dtype, float32 for a model nanotrain trained itself).")
if not os.path.isfile(ckpt_path):
    raise UserError(f"{ckpt_path} is not a checkpoint file; pass a train.py checkpoint (e.g. out-sft/ckpt.pt).")
if os.path.exists(out_folder) and not (os.path.isdir(out_folder) and not os.listdir(out_folder)):
    raise UserError(f"{out_folder} exists and is not an empty folder; export into a new folder (nothing there was "
                    f"changed).")
# where the export goes: the nearest folder that exists
# above out_folder, and the first one to create below it
parent = os.path.dirname(os.path.abspath(out_folder))
existing = parent
while not os.path.lexists(existing):
    existing, created = os.path.dirname(existing), existing
if not os.path.isdir(existing):  # /dev/null/x, some_file/sub
    raise UserError(f"cannot export to {out_folder}: {existing} is a file, not a folder. Export into a folder path "
                    f"you can create, e.g. `python export.py {ckpt_path} exported-model`.")
ckpt = load_checkpoint(ckpt_path, fix="export another checkpoint (the run's best.pt, say)")
if ckpt.get('kind') not in ('gpt', 'lora'):
    raise UserError(f"{ckpt_path} is a {ckpt.get('kind')!r} checkpoint; export.py writes GPT models (train.py and "
                    f"train_dpo.py checkpoints).")
check_model_fields(ckpt, ckpt_path, "export another checkpoint (the run's best.pt, say)")
if ckpt['kind'] == 'lora' and not is_hf_folder(ckpt['base_checkpoint']):
    raise UserError(f"the adapters in {ckpt_path} were trained on {ckpt['base_checkpoint']}, a nanotrain checkpoint, "
                    f"and a PEFT adapter must name a Hugging Face base. Export merged.pt from the same run instead "
                    f"(the adapters folded in), or export that base first and load the adapters onto it yourself.")
# a fine-tune of a published model: written back as its own family
published = bool(ckpt.get('hf_config'))
if not published:
    # first: a model that cannot export writes nothing
    hf_config, state = hf_model(ckpt['model'], ckpt['model_args'])
tokenizer_folder = ckpt['data_dir']
if not os.path.isdir(tokenizer_folder):
    raise UserError(f"{tokenizer_folder}, the folder of the tokenizer {ckpt_path} was trained with (named in it), no "
                    f"longer exists; put it back there: its tokenizer is written into the export.")
tokenizer = load_hf_tokenizer(tokenizer_folder) if published else load_tokenizer(
    tokenizer_folder, fix=f"Put back the dataset folder {ckpt_path} was trained on: the export holds its tokenizer.")
# a base model, given nanotrain's template
chat_tokens_added = ChatTokenizer(tokenizer).identity() == ckpt['tokenizer']
if tokenizer.identity() != ckpt['tokenizer'] and not chat_tokens_added:
    raise UserError(f"the tokenizer in {tokenizer_folder} has changed since {ckpt_path} was trained with it; put "
                    f"that folder back as it was.")

def with_dtype(hf_config, dtype):
    """hf_config with its dtype (torch_dtype, or newer transformers' dtype: save_hf_model writes the weights in
    it) set to dtype; '' leaves it as it is."""
    keys = [k for k in ('torch_dtype', 'dtype') if k in hf_config] or ['torch_dtype']
    return dict(hf_config, **dict.fromkeys(keys, dtype)) if dtype else hf_config


def written_dtype(hf_config, state):
    """The dtype save_hf_model writes (hf_config's), for the line printed; without --dtype, with the way to the
    checkpoint's own where it is wider (a float32 fine-tune of a bf16 model)."""
    name = hf_config.get('torch_dtype') or hf_config.get('dtype') or 'float32'
    held = {str(t.dtype).removeprefix('torch.') for t in state.values() if t.is_floating_point()}
    wider = not dtype and held == {'float32'} and name != 'float32'
    return name + (", the published model's; the checkpoint holds float32, which --dtype=float32 writes" if wider
                   else '')


# written to a temporary folder next to out_folder and
# renamed at the end: a failed export leaves nothing behind
staging = None
try:
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(out_folder) + '.', suffix='.tmp')
    if ckpt['kind'] == 'lora':
        adapters = {k: v.to(getattr(torch, dtype)) for k, v in ckpt['model'].items()} if dtype else ckpt['model']
        save_peft_adapter(adapters, ckpt['config'], ckpt['hf_config'], ckpt['base_checkpoint'], staging)
        written = str(next(iter(adapters.values())).dtype).removeprefix('torch.')
        what = f"the adapters of {ckpt_path} (PEFT LoRA on {ckpt['base_checkpoint']}, {written})"
    elif published:
        hf_config = with_dtype(dict(ckpt['hf_config'], vocab_size=ckpt['model_args']['vocab_size']), dtype)
        save_hf_model(ckpt['model'], hf_config, staging, tokenizer_folder, ckpt.get('generation_config'))
        if chat_tokens_added:
            save_chat_tokenizer(tokenizer, staging, ckpt.get('generation_config'))
        else:  # the variables the run rendered its template with, as the template's defaults
            set_template_defaults(staging, ckpt.get('chat_template_variables'))
        what = f"{ckpt_path} ({hf_config['architectures'][0]}, {written_dtype(hf_config, ckpt['model'])})"
    else:
        generation = write_tokenizer_files(ChatTokenizer(tokenizer) if chat_tokens_added else tokenizer, staging)
        hf_config = with_dtype(dict(hf_config, **{k: generation.get(k) for k in ('bos_token_id', 'eos_token_id')}),
                               dtype)
        save_hf_model(state, hf_config, staging, None, generation)
        what = f"{ckpt_path} ({hf_config['architectures'][0]}, {written_dtype(hf_config, state)})"
    os.chmod(staging, 0o755)  # mkdtemp makes it 0700
    if os.path.isdir(out_folder):
        os.rmdir(out_folder)  # empty, checked above
    os.rename(staging, out_folder)
# safetensors reports a failed write (disk full, ulimit -f) as its own error
except (OSError, SafetensorError) as e:
    if parent != existing:
        shutil.rmtree(created, ignore_errors=True)  # the folders made above for it
    detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
    raise UserError(f"cannot write the export into {parent if staging is None else out_folder} ({detail}); "
                    f"nothing was left there. Export into a folder you can write, with room for the model (a full "
                    f"disk or a file-size limit, ulimit -f, stops it too), e.g. `python export.py {ckpt_path} "
                    f"exported-model`.") from None
finally:
    if staging:
        shutil.rmtree(staging, ignore_errors=True)
print(f"exported {what} to {out_folder}")
