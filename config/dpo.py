# DPO of the SFT model on the embedded number-task preference pairs (the script's defaults, spelled out):
#   python train.py                       # pretrain the default model: out/ckpt.pt
#   python train.py config/sft.py         # fine-tune it on the number tasks: out-sft/ckpt.pt
#   python train_dpo.py config/dpo.py     # prefer right answers over plausible wrong ones: out-dpo/
# data/number_preferences holds lines like {"prompt": "Which is larger, 965 or 791?", "chosen": "965", "rejected": "995"}
# (train/val/test.jsonl; the test questions are held out from SFT too); point dpo_data at your own JSONL.
# Eval metrics on all 500 val pairs and exact match on 500 test questions, before (= the SFT model) and after.

init_from = 'out-sft/ckpt.pt'
out_dir = 'out-dpo'

beta = 0.1
loss_type = 'sigmoid'
rpo_alpha = 1.0              # without it, lr 3e-4 x 800 steps lowered exact match (200 questions) 59.0% -> 52.5%: chosen log-probs fell
batch_size = 32              # pairs per micro-batch
max_length = 64              # the pairs' sequences are 14-23 tokens

learning_rate = 1e-3
min_lr = 1e-4
lr_schedule = 'cosine'
warmup_iters = 50
max_iters = 800
lr_decay_iters = 800
eval_interval = 200
eval_pairs = 500
exact_match_examples = 500
