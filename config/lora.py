# LoRA fine-tuning of the default model on the embedded number tasks (the same data as config/sft.py):
#   python train.py                  # pretrain the default model: out/ckpt.pt
#   python train.py config/lora.py   # train adapters into out-lora/; exact match before and after
# out-lora/ckpt.pt holds only the adapters (plus optimizer and sampler state to resume), naming the base
# checkpoint by path and sha256; at the end, out-lora/merged.pt is a plain checkpoint with the adapters
# folded in: python sample.py --out_dir=out-lora --ckpt_name=merged.pt --start="What is 48+27?"
# Relaunching the same command after an interruption continues the run in out-lora (resume=True).

training_type = 'lora'
init_from = 'out/ckpt.pt'
out_dir = 'out-lora'

lora_r = 8
lora_alpha = 16.0
lora_dropout = 0.0           # the task has plenty of data for the adapters' few parameters
lora_target_modules = 'all-linear'

batch_size = 32              # examples per micro-batch (--pack=True: rows of max_length tokens)
max_length = 64              # the tasks' examples are 13-36 tokens
exact_match_examples = 200

# From the sweep in runs/lora_sweep.md (python runs/report.py --lora_sweep=True): at 2000 steps exact match
# peaks near lr 5e-3 (84.5%) and collapses above it (1e-2: 26%); lr 2e-3 over 4000 steps reached 95.5%,
# against 91.5% for full SFT from the same pretrained model.
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
max_iters = 4000
lr_decay_iters = 4000
eval_interval = 500
log_interval = 100
