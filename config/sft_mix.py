# Two data sets in one fine-tuning run, each with a loss weight (docs/finetuning.md, "Several data sets in one
# run"): the embedded number tasks split by kind, sums and differences worked column by column ('arithmetic': 37%
# of the examples, 74% of the response tokens) and the four one-line kinds ('digits'):
#   python train.py                      # pretrain the default model: out/ckpt.pt
#   python train.py config/sft_mix.py    # fine-tune it on both into out-sft-mix/
# The two folders hold config/sft.py's examples, so the run trains on the same data with the digits' tokens at
# half weight. Each source's train and val loss and exact match are logged under its name (train_loss/arithmetic,
# val_loss/digits, eval/exact_match/arithmetic, ...; the console shows them in brackets). Point the folders at
# your own JSONL (each a folder of train/val(/test).jsonl) and the weights where you want them.

training_type = 'sft'
init_from = 'out/ckpt.pt'
out_dir = 'out-sft-mix'
sft_data = {'arithmetic': ('data/number_tasks/arithmetic', 1.0), 'digits': ('data/number_tasks/digits', 0.5)}

batch_size = 32              # examples per micro-batch (--pack=True: rows of max_length tokens)
max_length = 64              # the tasks' examples are 13-36 tokens
exact_match_examples = 200   # each source's first 200 test prompts (arithmetic has 197)

learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
max_iters = 2000
lr_decay_iters = 2000
eval_interval = 500
log_interval = 100
