"""
Export a fine-tuned published model as a Hugging Face folder that transformers, vLLM and lm-eval load
as is: `python export.py out-sft/ckpt.pt /models/my-sft`. The checkpoint is one train.py wrote for a
model it loaded from a Hugging Face folder (init_from): an SFT run's ckpt.pt or best.pt, or a LoRA
run's merged.pt (the adapters folded into the weights). The folder gets the source model's
config.json, its weights in the dtype it was published in (tied embeddings stay tied; sharded with an
index above 5 GB), generation_config.json and the tokenizer files with their chat template (a base
model fine-tuned in nanotrain's template gets that template, its four tokens and <|end|> as the stop).
A LoRA run's ckpt.pt (adapters only) becomes a PEFT adapter folder instead, which peft loads onto the
base model: `python export.py out-lora-hf/ckpt.pt /models/my-adapter`.
"""
import os
import shutil
import sys
import tempfile

from checkpoint import is_hf_folder, load_checkpoint
from configurator import UserError, install_excepthook
from hf_checkpoint import save_chat_tokenizer, save_hf_model, save_peft_adapter
from hf_tokenizer import load_hf_tokenizer
from tokenizer import ChatTokenizer

install_excepthook()
if len(sys.argv) != 3 or sys.argv[1].startswith('-'):
    print(__doc__.strip())
    print("\nusage: python export.py CHECKPOINT OUT_FOLDER")
    sys.exit(0 if len(sys.argv) == 2 and sys.argv[1] in ('-h', '--help') else 2)
ckpt_path, out_folder = sys.argv[1:]
if not os.path.isfile(ckpt_path):
    raise UserError(f"{ckpt_path} is not a checkpoint file; pass a train.py checkpoint (e.g. out-sft/ckpt.pt).")
if os.path.exists(out_folder) and not (os.path.isdir(out_folder) and not os.listdir(out_folder)):
    raise UserError(f"{out_folder} exists and is not an empty folder; export into a new folder (nothing there was "
                    f"changed).")
ckpt = load_checkpoint(ckpt_path)
if ckpt.get('kind') not in ('gpt', 'lora') or not ckpt.get('hf_config'):
    raise UserError(f"{ckpt_path} is not a fine-tune of a Hugging Face model (it was not trained with "
                    f"--init_from=<model folder>); export.py writes only such models back.")
if ckpt['kind'] == 'lora' and not is_hf_folder(ckpt['base_checkpoint']):
    raise UserError(f"the adapters in {ckpt_path} were trained on {ckpt['base_checkpoint']}, a nanotrain checkpoint, "
                    f"and a PEFT adapter must name a Hugging Face base. Export merged.pt from the same run instead "
                    f"(the adapters folded in), or export that base first and load the adapters onto it yourself.")
tokenizer_folder = ckpt['data_dir']
tokenizer = load_hf_tokenizer(tokenizer_folder)
chat_tokens_added = ChatTokenizer(tokenizer).identity() == ckpt['tokenizer']  # a base model, given nanotrain's template
if tokenizer.identity() != ckpt['tokenizer'] and not chat_tokens_added:
    raise UserError(f"the tokenizer in {tokenizer_folder} has changed since {ckpt_path} was trained with it; put "
                    f"that model folder back as it was.")

# written to a temporary folder next to out_folder and renamed at the end: a failed export leaves nothing behind
parent = os.path.dirname(os.path.abspath(out_folder))
os.makedirs(parent, exist_ok=True)
staging = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(out_folder) + '.', suffix='.tmp')
try:
    if ckpt['kind'] == 'lora':
        save_peft_adapter(ckpt['model'], ckpt['config'], ckpt['hf_config'], ckpt['base_checkpoint'], staging)
        what = f"the adapters of {ckpt_path} (PEFT LoRA on {ckpt['base_checkpoint']})"
    else:
        hf_config = dict(ckpt['hf_config'], vocab_size=ckpt['model_args']['vocab_size'])
        save_hf_model(ckpt['model'], hf_config, staging, tokenizer_folder, ckpt.get('generation_config'))
        if chat_tokens_added:
            save_chat_tokenizer(tokenizer, staging, ckpt.get('generation_config'))
        what = f"{ckpt_path} ({hf_config['architectures'][0]})"
    os.chmod(staging, 0o755)  # mkdtemp makes it 0700
    if os.path.isdir(out_folder):
        os.rmdir(out_folder)  # empty, checked above
    os.rename(staging, out_folder)
finally:
    shutil.rmtree(staging, ignore_errors=True)
print(f"exported {what} to {out_folder}")
