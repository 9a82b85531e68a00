# DPO of the SFT model on the embedded number-task preference pairs (the script's defaults, spelled out, plus RPO):
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
rpo_alpha = 1.0              # RPO: the script's default is plain DPO (0), which here pulled the chosen answers down with the
                             # rejected ones: eval logps/chosen -0.28 -> -33.2, kl 3.96, exact match 93.2% -> 49.6%;
                             # with 1.0: -0.28 -> -0.55, kl 0.028, 93.2% -> 93.4% (800 steps, 500 test questions)
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
