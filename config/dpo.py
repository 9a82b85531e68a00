# DPO of the SFT model on the embedded number-task pairs: reference-free, with RPO (why: below).
#   python train.py                       # pretrain the default model: out/ckpt.pt
#   python train.py config/sft.py         # fine-tune it on the number tasks: out-sft/ckpt.pt
#   python train_dpo.py config/dpo.py     # prefer right answers over plausible wrong ones: out-dpo/
# data/number_preferences holds lines like
#   {"prompt": "Which is larger, 965 or 791?", "chosen": "965", "rejected": "995"}
# (train/val/test.jsonl; the test questions are held out from SFT too); point dpo_data at your own.
# Eval metrics on all 500 val pairs and exact match on 500 test questions, before and after.

init_from = 'out-sft/ckpt.pt'
out_dir = 'out-dpo'

# The SFT model already ranks the pairs: at step 0 a chosen answer has log-prob -0.3, a rejected one
# -12.5. DPO's loss, against that same model as reference, reads every pair as unsolved and pushes
# all of them (eval logps/rejected -12.5 -> -41.5): greedy exact match fell 93.6% -> 81.6% at step
# 200 (lr 1e-3) and ended at 91.6% with lr 1e-4. Reference-free with beta 1 weighs a pair by
# sigmoid(-margin), ~6e-6 for a solved one, so it learns from the pairs the model still gets wrong:
# 93.6% -> 94.8%, 95.8% -> 96.4%, 98.2% -> 99.2% on three seeds' SFT models (dev/LOG.md).
reference_free = True        # an implicit uniform reference (no reference model is kept)
beta = 1.0
loss_type = 'sigmoid'
rpo_alpha = 1.0              # RPO; without it DPO (lr 1e-3) pulled the chosen answers down with the
                             # rejected: logps/chosen -0.28 -> -33.2, exact match 93.2% -> 49.6%
batch_size = 32              # pairs per micro-batch
max_length = 64              # the pairs' sequences are 14-23 tokens

learning_rate = 1e-4         # 1e-3 broke answers, reference-free too (72.4% at step 200)
min_lr = 1e-5
lr_schedule = 'cosine'
warmup_iters = 50
max_iters = 800
lr_decay_iters = 800
eval_interval = 200
eval_pairs = 500
exact_match_examples = 500
