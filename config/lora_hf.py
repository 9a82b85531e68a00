# LoRA fine-tuning of a published Hugging Face model in its own chat template (see config/sft_hf.py):
#   python train.py config/lora_hf.py --init_from=/models/Llama-3.2-1B-Instruct --lora_target_modules=q_proj,v_proj
# out-lora-hf/ckpt.pt holds the adapters, naming the model folder by path and sha256 of its weights; at the end
# out-lora-hf/merged.pt has them folded in: python export.py out-lora-hf/merged.pt /models/my-lora-merged

training_type = 'lora'
init_from = 'models/smollm2-135m-instruct'
out_dir = 'out-lora-hf'

lora_r = 16
lora_alpha = 32.0
lora_dropout = 0.05
lora_target_modules = 'q_proj,k_proj,v_proj,o_proj'  # Hugging Face names (PEFT's target_modules) or nanotrain's

batch_size = 8               # examples per micro-batch (--pack=True: rows of max_length tokens)
gradient_accumulation_steps = 2
block_size = 512
max_length = 512
exact_match_examples = 100

learning_rate = 2e-4         # adapters start at zero and learn faster than full weights
min_lr = 2e-5
weight_decay = 0.0
warmup_iters = 20
max_iters = 150
lr_decay_iters = 150
eval_interval = 50
eval_iters = 10
log_interval = 10
