# Supervised fine-tuning of a published Hugging Face model (Llama 3.x, Qwen2.5, Qwen3, Mistral, SmolLM2, GPT-2)
# in its own chat template, on the embedded number tasks or on your JSONL (--sft_data):
#   python train.py config/sft_hf.py --init_from=/models/Qwen2.5-0.5B-Instruct --sft_data=data/my_chat
#   python export.py out-sft-hf/ckpt.pt /models/my-sft          # back to a Hugging Face folder
# The model's shape comes from its config.json and its tokenizer from the folder, so the model keys of train.py
# and data_dir do not apply. The default init_from is SmolLM2-135M-Instruct as ../shared/tools/make_smollm2_hf.py
# builds it (--out models/smollm2-135m-instruct).

training_type = 'sft'
init_from = 'models/smollm2-135m-instruct'
out_dir = 'out-sft-hf'

batch_size = 8               # examples per micro-batch (--pack=True: rows of max_length tokens)
gradient_accumulation_steps = 2
block_size = 512
max_length = 512
exact_match_examples = 100

learning_rate = 2e-5         # full fine-tuning of a pretrained model: a small step
min_lr = 2e-6
weight_decay = 0.0
warmup_iters = 20
max_iters = 300
lr_decay_iters = 300
eval_interval = 100
eval_iters = 10
log_interval = 10
