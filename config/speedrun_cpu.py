# The fastest path we found to nanoGPT's CPU-quickstart val loss (tiny Shakespeare, char level) on a
# 2-core CPU: bench/README.md has the side-by-side benchmark and the ablation behind every value here.
# Prepare the data once: python data.py --input=../shared/data/tinyshakespeare.txt --out_dir=data/shakespeare_char --tokenizer=char
# then: python train.py config/speedrun_cpu.py

out_dir = 'out-speedrun-cpu'
data_dir = 'data/shakespeare_char'
init_from = 'scratch'
device = 'cpu'
dtype = 'float32'            # as 'auto' on CPU; bf16 autocast without bf16 units is slower
tensorboard = False          # importing TensorBoard adds up to a second of start-up to a ~12 s run
sample_tokens = 0
eval_interval = 55           # checkpoints for the benchmark's loss curve; train.py's own evals are one batch
eval_iters = 1
log_interval = 55

# a smaller model than the quickstart's 4x128: at this loss, fewer FLOPs per token win over the extra steps
n_layer = 2
n_head = 4
n_embd = 64
block_size = 64
dropout = 0.0
bias = False
pos_emb = 'rope'
norm = 'rmsnorm'
mlp = 'gelu'                 # beat relu2 and swiglu at this size
qk_norm = True
tie_embeddings = False

batch_size = 32
max_iters = 220
optimizer_type = 'muon'      # Muon for the blocks' matrices, AdamW for embeddings, head and gains
muon_lr = 0.03
learning_rate = 1e-2         # AdamW's
weight_decay = 0.1           # AdamW's matrices (the untied lm_head); Muon's matrices are not decayed
beta2 = 0.95
lr_schedule = 'wsd'          # warmup, hold, then linear decay to zero over the last 40%
warmup_iters = 20
lr_decay_iters = 220
decay_frac = 0.4
min_lr = 0.0
