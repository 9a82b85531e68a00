# Online RL (GRPO family) of the SFT model on the embedded number tasks, their answer checker as the reward:
#   python train.py                       # pretrain the default model: out/ckpt.pt
#   python train.py config/sft.py         # fine-tune it on the number tasks: out-sft/ckpt.pt
#   python train_rl.py config/rl.py       # sample 8 answers per question, learn from the right ones: out-rl/
# From a LoRA run instead: --init_from=out-lora/merged.pt (add --use_lora=True to train adapters again; the
# reference is then the model with its adapters off). data/number_tasks holds lines like {"prompt": "What is
# 48+26?", "response": "8+6=14, 4+2+1=7, so 74"}; the reward is 1 when the final answer (after ", so ") is
# right, plus format_reward when the answer is laid out as the reference's. Point rl_data at your own JSONL
# and reward at your own function (reward='my_rewards.py:score') instead.

init_from = 'out-sft/ckpt.pt'
out_dir = 'out-rl'

reward = 'number_tasks'
format_reward = 0.1          # keeps the working of sums and differences, which the right answers come from
prompts_per_step = 16
num_generations = 8          # G
max_prompt_length = 48       # the questions are 17-37 tokens with the chat template
max_new_tokens = 32          # the answers (with their working) are 2-24 tokens
temperature = 1.0

loss_type = 'dapo'
scale_rewards = 'group'
beta = 0.0                   # no KL penalty (TRL's default): no reference in memory
epsilon = 0.2
epsilon_high = 0.28          # DAPO's clip-higher
num_iterations = 1

learning_rate = 1e-4
lr_schedule = 'constant'
warmup_iters = 0
max_iters = 200
eval_interval = 50
eval_prompts = 200           # held-out questions, sampled pass_k times each
pass_k = 4
exact_match_examples = 500   # greedy exact match on held-out questions at the start and the end
log_interval = 10
