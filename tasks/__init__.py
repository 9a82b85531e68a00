"""The embedded tasks: number_tasks.py generates the number tasks, verifiable questions written as SFT
examples or DPO preference pairs, that fine-tuning (train.py training_type='sft' | 'lora', train_dpo.py)
trains and evaluates on when given no data of its own (lm/heldout_eval.py scores a chat model's
greedy answers to their held-out prompts)."""
