# the fastest path to nanoGPT's CPU-quickstart val loss on a small CPU (bench/README.md has the
# side-by-side benchmark and the ablation table behind every value here).
# Prepare the data once: python data.py --input=../shared/data/tinyshakespeare.txt --out_dir=data/shakespeare_char --tokenizer=char
# then: python train.py config/speedrun_cpu.py

out_dir = 'out-speedrun-cpu'
data_dir = 'data/shakespeare_char'
init_from = 'scratch'
device = 'cpu'
dtype = 'float32'            # no bf16 units on this CPU: autocast to bf16 would be emulated and slower
tensorboard = False          # importing tensorboard alone costs ~1-2 s of start-up
sample_tokens = 0
eval_interval = 50           # checkpoints for the benchmark's loss curve; their evals are one batch
eval_iters = 1
log_interval = 50

# nanoGPT's quickstart model size and context
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
dropout = 0.0
pos_emb = 'rope'
norm = 'rmsnorm'
mlp = 'relu2'
bias = False

batch_size = 32
max_iters = 200
optimizer_type = 'muon'
muon_lr = 0.02
learning_rate = 3e-3         # AdamW's, for the embedding and norm gains
weight_decay = 0.0
beta2 = 0.95
lr_schedule = 'wsd'
warmup_iters = 20
lr_decay_iters = 200
min_lr = 0.0
