# Online RL of a published chat model after its LoRA SFT (config/lora_hf.py), on the embedded number tasks:
#   python train.py config/lora_hf.py                       # SmolLM2-135M-Instruct + LoRA SFT: out-lora-hf/merged.pt
#   python train_rl.py config/rl_hf.py                      # new adapters on it, trained by reward: out-rl-hf/
# The model answers in its own chat template (its system prompt included), so prompts are longer than the
# toy model's. A LoRA run: the frozen SFT model is also the reference, should beta be raised.

init_from = 'out-lora-hf/merged.pt'
out_dir = 'out-rl-hf'

use_lora = True
lora_r = 16
lora_alpha = 32.0
lora_target_modules = 'all-linear'

reward = 'number_tasks_exact'  # the whole answer; the final answer alone let wrong carries spread (RESULTS)
format_reward = 0.0          # the whole answer has the reference's shape already
prompts_per_step = 8
num_generations = 8          # G
max_prompt_length = 96       # SmolLM2's template adds a system turn: the questions are 40-60 tokens
max_new_tokens = 32
temperature = 1.0

loss_type = 'dapo'
scale_rewards = 'group'
beta = 0.0
epsilon = 0.2
epsilon_high = 0.28
num_iterations = 1

learning_rate = 1e-4         # 2e-4 lost greedy answers; 1e-4: 48.0% -> 51.0% (48 steps) -> 54.0% (96)
lr_schedule = 'constant'
max_iters = 96               # ~23 min a run, evals included, on one thread of the 2-core CPU
eval_interval = 48
eval_prompts = 64
pass_k = 4
exact_match_examples = 200
log_interval = 5
