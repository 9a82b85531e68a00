# Supervised fine-tuning of the default model on the embedded number tasks (an instruction set):
#   python train.py                  # pretrain the default model: out/ckpt.pt
#   python train.py config/sft.py    # fine-tune it into out-sft/; exact match on held-out questions before and after
# The tasks (tasks/number_tasks.py: number_task) are written once to data/number_tasks as train/val/test.jsonl lines
# like {"prompt": "Reverse the digits of 4827.", "response": "7284"} or {"prompt": "What is 48+26?", "response":
# "8+6=14, 4+2+1=7, so 74"} (sums and differences worked column by column); point sft_data at your own JSONL instead.
# Relaunching the same command after an interruption continues the run in out-sft (resume=True).

training_type = 'sft'
init_from = 'out/ckpt.pt'
out_dir = 'out-sft'

batch_size = 32              # examples per micro-batch (--pack=True: rows of max_length tokens)
max_length = 64              # the tasks' examples are 13-36 tokens
exact_match_examples = 200

learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 50
max_iters = 2000
lr_decay_iters = 2000
eval_interval = 500
log_interval = 100
