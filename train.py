"""
Train a GPT. `python train.py` trains a small model on the Python standard library's own
sources (prepared once under data/stdlib); `python train.py config/shakespeare_char.py` trains on
another prepared corpus; `torchrun --nproc_per_node=8 train.py ...` runs data-parallel.
`python train.py config/sft.py` fine-tunes a trained model on chat examples (training_type='sft'),
`python train.py config/lora.py` trains low-rank adapters on it instead (training_type='lora').
`python train.py config/sft_hf.py --init_from=<Hugging Face model folder>` fine-tunes a published model;
fine-tuning runs max_iters steps, or num_train_epochs passes over its data (run/epochs.py).
Every config key below can be overridden by a config file or --key=value (`--help` lists them).
"""

import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from configurator import FOLDER, POSITIVE, SEED, UserError, at_least, check_values, configure, interval, one_of
from lm.tokenizer import dataset_file, read_meta
from losses import check_loss_weights, combine_losses, source_shares, target_weights, term_weights, token_weight_table
from memory import MemoryMonitor, halve_micro_batch, peak_memory_bytes, recover_from_oom, resumed_micro_batch
from run.checkpoint import (CHECKPOINT_FORMATS, check_compatible, restore_training_state, training_state,
                            whole_checkpoint, write_checkpoint)
from run.device import DTYPES, autocast_context, pick_dtype
from run.fsdp import PARALLEL, check_parallel, place_model, same_init_on_every_rank
from run.run_folder import open_run, require_starting_weights, run_log, run_origin
from run.runtime import (StepProfiler, StopSignal, all_reduce_metrics, bad_step, clip_grad_norm, compute_cleanup,
                         compute_init, gradient_sync, log, prepare_once, rank_batches, wrap_model)
from scheduler import SCHEDULES, LRSchedule, set_lr
from starting_model import full_model_checkpoint, hf_source, run_model_args, run_tokenizer, starting_gpt
# fine-tuning, LoRA, Muon, 8-bit moments, epochs and W&B import their code where their branch starts
# (nanoGPT's way with wandb): plain pretraining reads only what it runs

# -----------------------------------------------------------------------------
# I/O
training_type = 'from_scratch'  # 'from_scratch' | 'sft' (all weights) | 'lora' (low-rank adapters)
out_dir = 'out'              # checkpoints (ckpt.pt, best.pt), log.jsonl, tensorboard
data_dir = ''                # a data.py folder (sft/lora: its tokenizer); '' = data/stdlib
init_from = 'scratch'        # 'scratch' | a checkpoint | a Hugging Face model folder
chat_template_variables = {}  # published model's chat-template variables; {} = as it was fine-tuned
resume = True                # continue out_dir's run if any; False = start a new one, replacing it
eval_interval = 100          # steps between evals (and checkpoint saves)
eval_every_epochs = 0        # with num_train_epochs: also eval (and save) at the end of every this many epochs
eval_iters = 20              # val batches per eval
log_interval = 10            # steps between train-loss log lines
eval_only = False            # evaluate the checkpoint and exit
always_save_checkpoint = True  # save ckpt.pt at every eval, not only when val loss improves
early_stopping_patience = 0  # stop after this many evals without val improvement; 0 = never
max_bad_steps = 5            # abort after this many non-finite steps (loss/grad norm) in a row
tensorboard = True           # write TensorBoard logs to out_dir/tb
wandb_log = False            # also log to Weights & Biases (`pip install wandb`; run/tracker.py)
wandb_project = 'nanotrain'  # the W&B project
wandb_run_name = ''          # the W&B run's name; '' = out_dir's folder name
profile = False              # time data/forward/backward/optimizer per step (adds syncs on GPU)
sample_tokens = 200          # tokens generated at the end of training
seed = 1337                  # random seed
# data
batch_size = 16              # micro-batch per process: windows, examples, or packed rows (pack)
block_size = 128             # context length
gradient_accumulation_steps = 1  # micro-batches per optimizer step per process
# fine-tuning data (training_type 'sft' | 'lora'; docs/finetuning.md)
sft_data = ''                # train/val(/test).jsonl folder, or {'name': (folder, loss weight)}; '' = number tasks
max_length = 128             # longest example in tokens (<= block_size); see overlong
overlong = 'truncate'        # examples over max_length: 'truncate' (keep their start) | 'drop'
skip_malformed = False       # skip and count malformed JSONL lines instead of stopping at the first
train_on_prompt = False      # learn every token of an example, not the assistant turns' alone (TRL's messages)
pack = False                 # fill rows of max_length tokens with whole examples; batch_size then counts rows
bucket_batches = 1           # batch similar lengths from this many global batches' worth; 1 = off (not with pack)
curriculum_iters = 0         # steps for the longest allowed example to grow to max_length; 0 = off
exact_match_examples = 200   # held-out examples answered greedily and scored at every eval; 0 = skip
eval_metrics = 'exact_match'  # comma-separated: exact_match, bleu, chrf, rouge1, rouge2, rouge_l, tool_calls
# LoRA (training_type 'lora')
lora_r = 8
lora_alpha = 16.0
lora_dropout = 0.05          # dropout on the adapters' input
use_rslora = False           # scale updates by lora_alpha/sqrt(r) instead of lora_alpha/r
lora_target_modules = 'attn.q,attn.k,attn.v,attn.proj'  # comma-separated layers | 'all-linear'
lora_bias = 'none'           # biases trained too: 'none' | 'all' | 'lora_only' (adapted layers')
loraplus_lr_ratio = 1.0      # LoRA+: the B matrices learn at this times the learning rate
lora_base_dtype = 'float32'  # the frozen base's Linear weights: 'float32' | the run's dtype | 'nf4' (QLoRA)
# loss
token_weights = {}           # token-weighted CE: {'group': (weight, [tokens])}; {} = plain CE
loss_weights = {'ce': 1.0, 'z_loss': 0.0}  # weight of each term of losses.LOSS_TERMS (z_loss: PaLM's, e.g. 1e-4)
# model
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
pos_emb = 'rope'             # 'rope' | 'learned'
norm = 'rmsnorm'             # 'rmsnorm' | 'layernorm'
mlp = 'gelu'                 # 'gelu' | 'swiglu' | 'relu2'
tie_embeddings = True
qk_norm = False
logit_softcap = 0.0          # 0 = off, else cap * tanh(logits / cap)
zero_init_proj = False       # residual output projections start at zero (blocks start as identity)
activation_checkpointing = False  # recompute activations in backward to save memory
# optimizer
learning_rate = 3e-3         # peak lr of every lr_schedule
max_iters = 600              # optimizer steps in the run
num_train_epochs = 0.0       # fine-tuning: passes over sft_data, for max_iters (HF Trainer's key); 0 = off
weight_decay = 0.1           # decoupled weight decay; 0 = none
beta1 = 0.9                  # AdamW's momentum (first-moment decay)
beta2 = 0.95                 # AdamW's second-moment decay
grad_clip = 1.0              # 0 = no clipping (grad norm is still logged)
optimizer_type = 'adamw'     # 'adamw' | 'adamw8bit' (its moments in 8 bits) | 'muon' (blocks' matrices; AdamW else)
muon_lr = 0.02               # Muon's peak lr; scheduled in proportion to learning_rate
muon_momentum = 0.95         # Muon's momentum
# learning-rate schedule (scheduler.py)
lr_schedule = 'cosine'       # cosine | cosine_restarts | noam | constant | linear | wsd
warmup_iters = 50            # linear rise to learning_rate, reached at this step (every schedule)
lr_decay_iters = 600         # where the decay to min_lr ends (cosine, linear, wsd; not noam)
min_lr = 3e-4                # the lr decays to this (noam: its floor; constant: unused)
restart_iters = 200          # 'cosine_restarts': steps of the first cycle after warmup
restart_mult = 1             # 'cosine_restarts': each cycle this many times longer than the last
decay_frac = 0.2             # 'wsd': the last fraction of lr_decay_iters, a linear decay to min_lr
# system
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16 + loss scaling; fp32 on CPU
compile = False              # torch.compile the model, block by block (model.GPT.compile_blocks)
parallel = 'ddp'             # under torchrun: 'ddp' (whole model per rank) | 'fsdp' (docs/fsdp.md)
fsdp_cpu_offload = False     # 'fsdp' on GPUs: keep the shards and optimizer state in CPU memory
checkpoint_format = 'file'   # 'file' | 'sharded' (each rank's shards; docs/checkpoints.md)
num_threads = 0              # torch.set_num_threads for CPU ops; 0 = torch's default
# -----------------------------------------------------------------------------
config = configure(globals(), sources=('sft_data',))
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('batch_size', 'gradient_accumulation_steps', 'max_iters', 'eval_interval', 'log_interval',
                   'eval_iters', 'max_bad_steps', 'block_size', 'max_length', 'n_layer', 'n_head', 'n_embd', 'lora_r',
                   'bucket_batches', 'restart_iters', 'restart_mult')),
    (at_least(0), ('early_stopping_patience', 'exact_match_examples', 'warmup_iters', 'lr_decay_iters',
                   'curriculum_iters', 'sample_tokens', 'num_threads', 'learning_rate', 'min_lr', 'muon_lr',
                   'weight_decay', 'grad_clip', 'logit_softcap', 'num_train_epochs', 'eval_every_epochs')),
    (interval('[0, 1)'), ('dropout', 'lora_dropout', 'beta1', 'beta2', 'muon_momentum')),
    (interval('[0, 1]'), ('decay_frac',)),
    (POSITIVE, ('lora_alpha', 'loraplus_lr_ratio')),
    (one_of(SCHEDULES), ('lr_schedule',)),
    (one_of(('adamw', 'adamw8bit', 'muon')), ('optimizer_type',)),
    (one_of((*DTYPES, 'nf4')), ('lora_base_dtype',)),
    (one_of(PARALLEL), ('parallel',)),
    (one_of(CHECKPOINT_FORMATS), ('checkpoint_format',)),
    (FOLDER, ('out_dir',)),
])
check_loss_weights(loss_weights)
if training_type not in ('from_scratch', 'sft', 'lora'):
    raise UserError(f"training_type={training_type!r} is not supported; use 'from_scratch', 'sft' or 'lora'.")
if training_type == 'lora' and optimizer_type == 'muon':
    raise UserError("training_type='lora' trains its adapters with AdamW; set optimizer_type='adamw' (or 'adamw8bit').")
if lora_base_dtype != 'float32' and training_type != 'lora':
    raise UserError(f"lora_base_dtype={lora_base_dtype!r} keeps a LoRA run's frozen base in 4 or 16 bits, but this run "
                    f"is not one: it trains every weight. Drop lora_base_dtype, or set training_type='lora'.")
fine_tuning = training_type != 'from_scratch'
if num_train_epochs and not fine_tuning:
    raise UserError(f"num_train_epochs={num_train_epochs:g} counts passes over a fine-tuning data set; pretraining "
                    f"(training_type='from_scratch') draws random windows of its corpus, which has no epochs: set "
                    f"max_iters instead.")
by_epochs = False  # True: the run is counted in epochs (num_train_epochs, run/epochs.py), not max_iters
if num_train_epochs or eval_every_epochs:
    from run.epochs import by_epochs_checked, plan_epochs
    by_epochs = by_epochs_checked(config)
if wandb_log:
    from run.tracker import require_wandb, start_wandb
    require_wandb(wandb_log)
if fine_tuning:
    from configurator import data_sources
    from lm.chat_data import SFTBatches, concatenated, describe_sources, every_token, load_sft_sources
    from lm.heldout_eval import HeldOut, metric_names, report_heldout
    from lm.tokenizer import chat_tokenizer, prompt_and_answer
    from run.run_folder import sources_data_hash, training_data_hash
    from tasks.number_tasks import NUMBER_TASKS_DIR, is_number_tasks, prepare_number_tasks
    eval_metric_names = metric_names(eval_metrics)
    if max_length > block_size:
        raise UserError(f"max_length={max_length} is longer than block_size={block_size}; lower max_length.")

# -----------------------------------------------------------------------------
# processes and device (run/runtime.py: one process per GPU under torchrun), precision
compute = compute_init(device, seed, num_threads)
ddp, rank, local_rank, world_size, local_device = compute  # local_device: device resolved for this process
master, device_type = rank == 0, local_device.split(':')[0]
ptdtype = pick_dtype(local_device, dtype)
autocast = autocast_context(local_device, ptdtype)
check_parallel(parallel, ddp, local_device, ptdtype, optimizer_type, fsdp_cpu_offload)
if training_type == 'lora':
    from lm.lora import (apply_lora, check_lora_base_dtype, load_adapters, lora_optimizer, lora_state_dict,
                         save_merged)
    from starting_model import model_hash
    check_lora_base_dtype(lora_base_dtype, ptdtype, parallel)

# out_dir: locked before any work; a checkpoint there is this run's to continue, never another's (this_run:
# what the run is; nanoGPT's init_from='resume' continues out_dir's, begun where it began)
this_run = dict(script='train.py', training_type=training_type, init_from=run_origin(init_from, out_dir, resume))
out_dir_lock, ckpt_path, ckpt = open_run(config, this_run, master)
if ckpt is not None and (parallel != 'fsdp' or training_type == 'lora'):
    ckpt = whole_checkpoint(ckpt)  # a sharded one's weights; FSDP reads each rank's shards into its model
resuming = ckpt is not None
require_starting_weights(ckpt, init_from, eval_only, ckpt_path, hf_folders=True)
# the whole model the run starts from (None: from scratch), as stored (memory-mapped, its file's
# dtype; starting_gpt makes it the run's: float32, a LoRA base's 16 or 4 bits, FSDP's shards)
model_ckpt, model_ckpt_path = full_model_checkpoint(ckpt, ckpt_path, init_from, out_dir, training_type)
# a published model's config files, which export.py writes back
hf_files = hf_source(model_ckpt, chat_template_variables)


class TokenBatches:
    """Pretraining batches: random block_size windows of a token file `python data.py` prepared
    (train.bin, val.bin), drawn from a seeded generator whose state the checkpoint keeps.

    DDP: every rank draws the offsets of the whole global batch (same seed, same draws, so any rank's
    state resumes all) and takes its contiguous slice: rank r's micro-step k is global micro-batch
    r * grad_accum + k, so 2 ranks x grad_accum A train on the samples of 1 process x grad_accum 2A."""

    def __init__(self, bin_path, block_size, seed, vocab_size):
        self.bin_path, self.block_size, self.vocab_size = bin_path, block_size, vocab_size
        self.dtype = np.dtype(read_meta(os.path.dirname(bin_path) or '.')['dtype'])
        size = os.path.getsize(dataset_file(*os.path.split(bin_path)))
        self.n_tokens = size // self.dtype.itemsize
        if size % self.dtype.itemsize:
            raise UserError(f"{bin_path} is cut short: {size:,} bytes are not whole {self.dtype} tokens "
                            f"({self.dtype.itemsize} bytes each). Prepare the dataset again with data.py.")
        if self.n_tokens < block_size + 1:
            raise UserError(f"{bin_path} has {self.n_tokens} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}. Use a smaller --block_size or a bigger corpus.")
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def sample_offsets(self, n):
        self.batches_drawn += 1
        return torch.randint(self.n_tokens - self.block_size, (n,), generator=self.generator)

    def get(self, offsets, device='cpu'):
        """(x, y) int64 (len(offsets), block_size); y[:, t] is the token after x[:, t]."""
        # a fresh memmap per call: a long-lived one keeps growing in memory (nanoGPT's note)
        data = np.memmap(self.bin_path, dtype=self.dtype, mode='r')
        windows = np.stack([data[i:i + self.block_size + 1] for i in offsets.tolist()]).astype(np.int64)
        if windows.max() >= self.vocab_size:  # a corrupt file: an embedding lookup would fail (on a GPU, an assert)
            row, _ = np.argwhere(windows >= self.vocab_size)[0]
            raise UserError(f"{self.bin_path} holds token id {windows.max()} (in the window at token "
                            f"{offsets[row].item():,}), beyond the tokenizer's {self.vocab_size} ids: the file is "
                            f"corrupt or was prepared with another tokenizer. Prepare the dataset again with data.py.")
        x, y = (torch.from_numpy(w) for w in (windows[:, :-1].copy(), windows[:, 1:].copy()))
        if torch.device(device).type == 'cuda':  # pinned memory: the copy overlaps compute
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])
        self.batches_drawn = state['batches_drawn']


def eval_offsets(n_tokens, block_size, n, seed=1234):
    """The same n window starts at every evaluation, so successive val losses compare."""
    if n_tokens < block_size + 1:
        raise UserError(f"the eval split has {n_tokens} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}. Use a smaller --block_size or a bigger corpus.")
    return torch.randint(n_tokens - block_size, (n,), generator=torch.Generator().manual_seed(seed))


# data: the tokenizer is a published model's own, else corpus_dir's (data_dir, or the default corpus,
# which rank 0 prepares once)
if not data_dir and not hf_files:
    from data import prepare_default
    prepare_once(prepare_default, compute, key='')  # train.py names no folder for it
corpus_dir, base_tokenizer = run_tokenizer(data_dir, model_ckpt, model_ckpt_path,
                                           hf_files.get('chat_template_variables'), init_from)
eval_examples = eval_iters * batch_size
if not fine_tuning:
    # pretraining: random windows of the token files; every eval scores the same val windows
    tokenizer = base_tokenizer
    train_batches = TokenBatches(os.path.join(corpus_dir, 'train.bin'), block_size, seed, tokenizer.vocab_size)
    val_batches = TokenBatches(os.path.join(corpus_dir, 'val.bin'), block_size, seed, tokenizer.vocab_size)
    val_indices = eval_offsets(val_batches.n_tokens, block_size, eval_examples)
    sample_prompt, train_data_hash = tokenizer.encode('\n'), None
    sources = [(None, corpus_dir, 1.0)]  # one, unnamed
else:
    # fine-tuning (docs/finetuning.md): chat examples in the model's own chat template, or in
    # nanotrain's, whose special tokens it gains; sft_data: one folder, or named sources, each with
    # its loss weight, drawn as one set ('' = the embedded number tasks)
    tokenizer = chat_tokenizer(base_tokenizer)
    sources = [(name, folder or NUMBER_TASKS_DIR, weight) for name, folder, weight in data_sources(sft_data)]
    if any(is_number_tasks(folder) for _, folder, _ in sources):
        prepare_once(prepare_number_tasks, compute)
    source_data = load_sft_sources(sources, tokenizer, max_length, overlong, skip_malformed)
    train_examples, train_sources = concatenated([train for train, _, _ in source_data])
    val_examples, val_sources = concatenated([val for _, val, _ in source_data])
    if train_on_prompt:  # prompts and template tokens as well (torchtune's train_on_input)
        train_examples, val_examples = every_token(train_examples), every_token(val_examples)
    train_batches = SFTBatches(train_examples, seed, tokenizer.eos_id, max_length, pack, bucket_batches, by_epochs,
                               train_sources)
    val_batches = SFTBatches(val_examples, seed, tokenizer.eos_id, max_length, pack, sources=val_sources)
    # each source's first eval_examples val examples, the same packed or not (val losses compare), packed
    # into rows with pack=True
    val_indices = val_batches.rows(torch.cat([(val_sources == s).nonzero().flatten()[:eval_examples]
                                              for s in range(len(sources))]))
    # each source's first exact_match_examples held-out prompts
    held_out_chats = [(chat, name) for (_, _, chats), (name, _, _) in zip(source_data, sources)
                      for chat in chats[:exact_match_examples]]
    exact_match_prompts = [prompt_and_answer(tokenizer, *chat) for chat, _ in held_out_chats]
    held_out_sources = [name for _, name in held_out_chats] if sources[0][0] else []
    # the held-out prompts answered and scored at each eval
    held_out = HeldOut(tokenizer, exact_match_prompts, eval_metric_names, batch_size, max_length, held_out_sources)
    # the first held-out prompt; plain texts only: the opening of the first val text
    first_chat = next((chats[0] for _, _, chats in source_data if chats), None)
    sample_prompt = prompt_and_answer(tokenizer, *first_chat)[0] if first_chat else val_examples[0][0][:16]
    # a continued run must still read the same examples
    if sources[0][0] is None:
        train_data_hash = training_data_hash(os.path.join(sources[0][1], 'train.jsonl'), ckpt, out_dir, 'sft_data')
    else:
        train_data_hash = sources_data_hash({name: os.path.join(folder, 'train.jsonl') for name, folder, weight
                                             in sources if weight > 0}, ckpt, out_dir, 'sft_data')
    if sources[0][0]:
        log(describe_sources(sources, train_batches))
# named sources are logged apart as well (train_loss/<name>, ...); one folder has one unnamed source
source_names = [name for name, _, _ in sources if name]
source_weight = torch.tensor([weight for _, _, weight in sources], device=local_device)

# model: from scratch, a checkpoint (its shape and tokenizer must match the config's) or a published
# model (its own shape)
model_args = run_model_args(config, model_ckpt, model_ckpt_path, tokenizer)
# checkpoints written before they recorded their run (run_to_continue) are checked here
if ckpt is not None:
    check_compatible({'optimizer_type': ckpt['config'].get('optimizer_type', 'adamw'),
                      'training_type': ckpt['config'].get('training_type', 'from_scratch')},
                     {'optimizer_type': optimizer_type, 'training_type': training_type}, 'optimizer', ckpt_path)
with same_init_on_every_rank(seed, enabled=parallel == 'fsdp'):
    # fine-tuning may add the chat tokens' rows (vocab_size: the rows the model had)
    # under FSDP built around the checkpoint's tensors (or on the meta device), each rank keeping its shards
    model, vocab_size = starting_gpt(model_args, model_ckpt, model_ckpt_path, tokenizer,
                                     base_tokenizer=base_tokenizer if fine_tuning else None,
                                     assign=parallel == 'fsdp', lora_base_dtype=lora_base_dtype, resuming=resuming)
    if training_type == 'lora':
        # the chat tokens added above train too (none for a chat model)
        added_tokens = tokenizer.vocab_size - vocab_size
        apply_lora(model, lora_r, lora_alpha, lora_dropout, lora_target_modules, use_rslora, lora_bias, added_tokens)
        if ckpt is not None:
            load_adapters(model, ckpt, ckpt_path, config)
            # the base is named by where it is now (it may have moved) and its hash
            lora_base = os.path.abspath(model_ckpt_path), ckpt['base_hash']
        else:
            lora_base = os.path.abspath(init_from), model_hash(init_from)
model.activation_checkpointing = activation_checkpointing
place_model(model, parallel, local_device, ptdtype, fsdp_cpu_offload)
# what we save and sample from: never compiled or DDP-wrapped (under FSDP: sharded)
raw_model = model

# the optimizer, over the trainable parameters only (with LoRA, the adapters)
if optimizer_type == 'muon':  # Muon for the blocks' matrices, AdamW for the rest
    from lm.muon import Muon, muon_param_groups
    optimizer = Muon(muon_param_groups(raw_model, learning_rate, weight_decay, (beta1, beta2), muon_lr, muon_momentum))
elif training_type == 'lora':
    optimizer = lora_optimizer(raw_model, weight_decay, learning_rate, (beta1, beta2), device_type, loraplus_lr_ratio)
else:
    optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if optimizer_type == 'adamw8bit':  # the same groups, the moments in 8 bits
    from lm.adamw8bit import in_8_bits
    optimizer = in_8_bits(optimizer)
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)
# the step's split into micro-batches: the config's, or what a continued run (or an OOM) left
micro_batch_size, accumulation_steps = batch_size, gradient_accumulation_steps
iter_num, best_val_loss, evals_without_improvement = 0, float('inf'), 0
if ckpt is not None:
    train_batches.load_state_dict(ckpt['train_batches'])
    micro_batch_size, accumulation_steps, note = resumed_micro_batch(ckpt, batch_size, gradient_accumulation_steps,
                                                                     world_size)
    if note:
        log(note)
    iter_num, best_val_loss, evals_without_improvement = restore_training_state(ckpt, ckpt_path, optimizer, scaler,
                                                                                rank, world_size, raw_model)
# windows, or examples (rows of examples with pack) when fine-tuning
global_batch_size = micro_batch_size * accumulation_steps * world_size


def example_limit(step):
    """The length curriculum: the longest example allowed at step grows linearly from the shortest to max_length."""
    if step >= curriculum_iters:
        return max_length
    shortest = int(train_batches.lengths.min())
    return shortest + (max_length - shortest) * step // curriculum_iters


# the run's steps: max_iters, or an epoch-counted run's, planned from its data and global batch
# (run/epochs.py); its lr decays to min_lr over all of them
epoch_plan = plan_epochs(train_batches.epoch_steps(global_batch_size, math.ceil(num_train_epochs),
                                                   example_limit if curriculum_iters else None),
                         config, ckpt, ckpt_path) if by_epochs else None
run_iters = epoch_plan.steps if epoch_plan else max_iters
get_lr = LRSchedule.from_config(config, epoch_plan.steps if epoch_plan else None)
# rank 0 logs to Weights & Biases too, a continued run to its W&B run
tracker = start_wandb(config, ckpt and ckpt.get('wandb_run_id'), master) if wandb_log else None
ckpt = model_ckpt = None  # free memory

model = wrap_model(model, compile, ddp and parallel == 'ddp', local_rank, device_type)

device_name = torch.cuda.get_device_name(local_device) if device_type == 'cuda' else device_type
if not fine_tuning:
    per_step = f"{global_batch_size * block_size:,} tokens"
elif pack:
    per_step = f"{global_batch_size} packed rows of up to {max_length} tokens ({global_batch_size * max_length:,})"
else:
    per_step = f"{global_batch_size} examples"
log(f"device {local_device}, dtype {ptdtype}, {world_size} process(es){' (FSDP)' if parallel == 'fsdp' else ''}, "
    f"{raw_model.get_num_params() / 1e6:.2f}M params, {per_step} per step")
if epoch_plan:
    log(epoch_plan.describe(per_step, lr_schedule))

# loss: token-weighted cross-entropy (losses.py), plus the terms weighted in loss_weights
token_weight = token_weight_table(tokenizer.vocab_size, token_weights, tokenizer).to(local_device) \
    if token_weights else None


def get_batch(batches, indices):
    """(x, y, doc_ids, source_ids) on the device; doc_ids only for packed fine-tuning rows, else None;
    source_ids (B, T): each position's source (pretraining: all 0)."""
    if fine_tuning:
        return batches.get(indices, local_device)
    x, y = batches.get(indices, local_device)
    return x, y, None, torch.zeros_like(y)


def labelled_at(y):
    """Where the positions with a label are, a (B, T) mask (fine-tuning: only the responses pass through the
    output layer), or None: everywhere (pretraining)."""
    return y != -100 if fine_tuning else None


def at_labels(values, labels_at):
    """values (..., B, T) at the labelled positions (labelled_at's), (..., N)."""
    return values.flatten(-2) if labels_at is None else values[..., labels_at]


def loss_terms(x, y, doc_ids, source_ids, weights, totals):
    """{term: (this micro-batch's share of it, each source's share of its own mean (S,))} of the terms loss_weights
    weighs: weights (2, B, T) each position's loss weight and 1, totals (2, S) their sums over the whole global
    batch (losses.term_weights). The model computes the terms chunk by chunk, never holding (B, T, V) logits
    (losses.head_loss_terms)."""
    labels_at = labelled_at(y)
    _, terms = model(x, y, doc_ids=doc_ids, logits_at=labels_at, weights=term_weights(weights, totals, loss_weights))
    means = source_shares(terms, at_labels(weights, labels_at), at_labels(source_ids, labels_at), totals)
    return {name: (term, means[name]) for name, (term, _) in terms.items()}


def source_means(sums, counts):
    """{name: sum / count} of the named sources with a count (sums, counts: (S,) per source, in sources' order)."""
    return {name: (sums[s] / counts[s]).item() for s, (name, _, _) in enumerate(sources) if name and counts[s] > 0}


def per_source(key, means):
    """{key/<name>: mean} of each named source's mean (means: {name: mean}), for a log event."""
    return {f'{key}/{name}': mean for name, mean in means.items()}


def shown(means):
    """' (<name> <mean>, ...)' of each named source's mean for a log line; '' with none."""
    return f" ({', '.join(f'{name} {mean:.4f}' for name, mean in means.items())})" if means else ''


@torch.no_grad()
def evaluate(micro_batch_size):
    """Mean val loss per token (plain cross-entropy) over fixed val windows or examples, split across ranks:
    (of all sources, each weighted by its loss weight; {name: each named source's})."""
    model.eval()
    total = torch.zeros(2, len(sources), device=local_device)  # per source: loss sum, token count
    for indices, counted in rank_batches(val_indices, micro_batch_size, rank, world_size, lockstep=parallel == 'fsdp'):
        x, y, doc_ids, source_ids = get_batch(val_batches, indices)
        labels_at, labels = labelled_at(y), target_weights(y)  # 1 where labelled
        with autocast:
            _, terms = model(x, y, doc_ids=doc_ids, logits_at=labels_at, weights={'ce': labels})
        if counted:
            ce = terms['ce'][1].to(total.dtype)  # each position's
            total.index_add_(1, at_labels(source_ids, labels_at), torch.stack([ce, at_labels(labels, labels_at)]))
    if ddp:
        dist.all_reduce(total)
    model.train()
    weighted = total * source_weight
    return (weighted[0].sum() / weighted[1].sum()).item(), source_means(*total)


def halve_after_oom(error, where):
    """After a RuntimeError in a step or an eval (where): re-raise it unless it is an out-of-memory error this
    process can retry; else halve the micro-batch, for the steps and the evals alike."""
    global micro_batch_size, accumulation_steps
    recover_from_oom(error, ddp, optimizer, local_device)
    micro_batch_size, accumulation_steps = halve_micro_batch(micro_batch_size, accumulation_steps)
    log(f"{where}: out of memory, retrying with micro-batch {micro_batch_size} x {accumulation_steps} accumulation")


def evaluate_fitting():
    """evaluate() at the steps' micro-batch, halved while it does not fit: the step-0 eval meets a micro-batch
    too big before any step does."""
    while True:
        try:
            return evaluate(micro_batch_size)
        except RuntimeError as error:
            halve_after_oom(error, 'eval')


def save(path, iter_num, best_val_loss, evals_without_improvement):
    """A checkpoint of the run at path (write_checkpoint) at step iter_num, with the eval counters: everything
    a continued run needs. Collective under DDP and FSDP: every rank must call it."""
    # under FSDP sharded: write_checkpoint gathers or writes them
    weights = raw_model.state_dict(keep_vars=True)
    state = dict(training_state(this_run, config, optimizer, scaler, iter_num, best_val_loss,
                                evals_without_improvement),
                 kind='gpt', model=weights, model_args=model_args, tokenizer=tokenizer.identity(),
                 data_dir=os.path.abspath(corpus_dir), train_batches=train_batches.state_dict(),
                 batch_size=micro_batch_size, gradient_accumulation_steps=accumulation_steps,
                 train_data_hash=train_data_hash, epoch_steps=epoch_plan and epoch_plan.epoch_steps,
                 wandb_run_id=tracker and tracker.id, **hf_files)
    # adapters only: the frozen base stays in its own checkpoint, named by path and hash
    if training_type == 'lora':
        state.update(kind='lora', model=lora_state_dict(raw_model, weights), base_checkpoint=lora_base[0],
                     base_hash=lora_base[1])
    write_checkpoint(path, state, checkpoint_format == 'sharded', master)


profiler = StepProfiler(local_device, enabled=profile)


def train_step(micro_batch_indices):
    """Forward/backward over this rank's share of the global batch, one row of micro_batch_indices per
    micro-batch. Every position's loss is divided by the total loss weight of the whole global batch (all
    micro-batches, all ranks; a position's loss weight is its token's times its source's; the z-loss
    counts positions alike: losses.LOSS_TERMS), known before the first backward, so the gradient is the
    same however the batch is split (1 x 4 accumulation = 4 x 1). Returns this rank's shares of the total
    loss, of each term and of each named source's mean of each term (shares add up over ranks), and the
    global batch's loss weight and labelled positions per source (2, S)."""
    with profiler.section('data'):
        micro_batches = [get_batch(train_batches, indices) for indices in micro_batch_indices]
        # each position's loss weight and 1, where labelled (2, B, T)
        weights = [torch.stack([target_weights(y, token_weight) * source_weight[source_ids],
                                (y != -100).float()]) for _, y, _, source_ids in micro_batches]
        totals = sum(torch.zeros(2, len(sources), device=local_device).index_add_(1, source_ids.flatten(), w.flatten(1))
                     for (_, _, _, source_ids), w in zip(micro_batches, weights))
        if ddp:
            dist.all_reduce(totals)
    shares = {}
    for micro_step, ((x, y, doc_ids, source_ids), w) in enumerate(zip(micro_batches, weights)):
        # only the last micro-batch reduces gradients across ranks
        with gradient_sync(model, raw_model, sync=micro_step == len(micro_batches) - 1):
            with profiler.section('forward'), autocast:
                terms = loss_terms(x, y, doc_ids, source_ids, w, totals)
                loss = combine_losses({name: term for name, (term, _) in terms.items()}, loss_weights)
            with profiler.section('backward'):
                # DDP/FSDP average gradients over ranks: undo 1/world_size
                scaler.scale(loss * world_size).backward()
        shares['loss'] = shares.get('loss', 0.0) + loss.detach().float()
        by_source = {'loss': sum(loss_weights[name] * means for name, (_, means) in terms.items())}
        for name, (term, means) in terms.items():
            shares[name] = shares.get(name, 0.0) + term.detach().float()
            by_source[name] = means
        # each named source's own mean of the loss and of each term, for the logs
        for name, means in by_source.items():
            for source, mean in zip(source_names, means):
                shares[f'{name}/{source}'] = shares.get(f'{name}/{source}', 0.0) + mean
    return shares, totals


# an eval_only run appends to the log; a continued run drops what it logged past its checkpoint
record, writer = run_log(out_dir, master, tensorboard, math.inf if eval_only else iter_num if resuming else -1,
                         tracker)

if eval_only:
    val_loss, val_losses = evaluate_fitting()
    log(f"step {iter_num}: val loss {val_loss:.4f}{shown(val_losses)}, perplexity {math.exp(val_loss):.2f}")
    record(dict(step=iter_num, val_loss=val_loss, val_ppl=math.exp(val_loss), **per_source('val_loss', val_losses)))
    if fine_tuning:
        report_heldout(raw_model, held_out, autocast, iter_num, record)
    compute_cleanup(ddp)
    sys.exit(0)

# -----------------------------------------------------------------------------
# training
stop = StopSignal()
monitor = MemoryMonitor(local_device)
if iter_num == 0:
    val_loss, val_losses = evaluate_fitting()
    log(f"step 0: val loss {val_loss:.4f}{shown(val_losses)}")
    record(dict(step=0, val_loss=val_loss, val_ppl=math.exp(val_loss), lr=0.0, **per_source('val_loss', val_losses)))
    if fine_tuning:
        report_heldout(raw_model, held_out, autocast, iter_num, record)
bad_steps = 0
# throughput window; labels: the positions that pass through the output layer
window_start, window_tokens, window_labels = time.time(), 0, 0
progress = tqdm(total=run_iters, initial=iter_num, disable=not master, dynamic_ncols=True, desc='train')
while iter_num < run_iters:
    lr = get_lr(iter_num)
    set_lr(optimizer, lr)

    # the whole global batch is drawn on every rank; each rank trains on its slice
    if fine_tuning:
        global_batch = train_batches.sample(global_batch_size, example_limit(iter_num))
        step_tokens = train_batches.count_tokens(global_batch)
        step_labels = train_batches.count_labels(global_batch)
    else:
        global_batch = train_batches.sample_offsets(global_batch_size)
        step_tokens = step_labels = global_batch_size * block_size
    while True:
        try:
            # packed fine-tuning's batch is (rows, examples of a row)
            shares, totals = train_step(global_batch.tensor_split(world_size)[rank].unflatten(
                0, (accumulation_steps, micro_batch_size)))
            break
        # CUDA raises torch.OutOfMemoryError, MPS and the CPU a plain RuntimeError
        except RuntimeError as error:
            halve_after_oom(error, f'step {iter_num}')

    with profiler.section('optimizer'):
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(raw_model.parameters(), grad_clip)
        losses, (stop_requested,) = all_reduce_metrics(shares, [stop.requested is not None], ddp)
        loss = losses['loss']
        # fp16: a non-finite grad norm is an overflow: scaler.step skips it, update backs off
        if math.isfinite(loss) and (math.isfinite(grad_norm) or scaler.is_enabled()):
            scaler.step(optimizer)
            bad_steps = 0
        else:
            bad_steps = bad_step(bad_steps, config, iter_num, loss, grad_norm)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    progress.update(1)
    window_tokens += step_tokens
    window_labels += step_labels
    # an epoch-counted run's epochs done (Trainer's fractional 'epoch'), and the epoch this step ended, if any
    epoch, epoch_end = epoch_plan.after(iter_num, progress) if epoch_plan else ({}, 0)

    if iter_num % log_interval == 0 or iter_num == run_iters:
        now = time.time()
        # all of the window's time, logging included
        tokens_per_sec = window_tokens / (now - window_start)
        mfu = raw_model.estimate_mfu(tokens_per_sec / world_size, device_name, window_labels / window_tokens,
                                     block_size)
        level = monitor.check()
        event = dict(step=iter_num, **epoch, train_loss=loss, lr=lr, grad_norm=grad_norm,
                     tokens_per_sec=tokens_per_sec, tokens_per_step=step_tokens,
                     mfu=mfu, memory_level=level, memory_usage=monitor.usage, memory_check_s=monitor.overhead_s,
                     peak_memory_mb=(peak_memory_bytes(local_device) or 0) / 2**20,
                     loss_scale=scaler.get_scale())
        # each loss term separately; each named source's loss and terms, of the sources in this step
        in_step = [name for name, count in zip(source_names, totals[1].tolist()) if count]
        event.update({f'train_{k}': v for k, v in losses.items()
                      if k != 'loss' and k.partition('/')[2] in ('', *in_step)})
        event.update({f'time_ms/{k}': v for k, v in profiler.summary().items()})
        record(event)
        progress.set_postfix(loss=f'{loss:.4f}', tok_s=f'{tokens_per_sec:,.0f}')
        log(f"step {iter_num}" + (f" (epoch {epoch['epoch']:.2f})" if epoch else "") + f": loss {loss:.4f}"
            f"{shown({s: losses[f'loss/{s}'] for s in in_step})}, lr {lr:.2e}, grad norm {grad_norm:.3f}, "
            f"{tokens_per_sec:,.0f} tok/s, " + (f"MFU {mfu * 100:.1f}%" if mfu is not None else "MFU unknown"))
        window_start, window_tokens, window_labels = now, 0, 0

    if (iter_num % eval_interval == 0 or iter_num == run_iters
            or eval_every_epochs and epoch_end and epoch_end % eval_every_epochs == 0):
        val_loss, val_losses = evaluate_fitting()
        improved = val_loss < best_val_loss
        if improved:
            best_val_loss, evals_without_improvement = val_loss, 0
        else:
            evals_without_improvement += 1
        log(f"step {iter_num}" + (f" (end of epoch {epoch_end})" if epoch_end else "") + f": val loss {val_loss:.4f}"
            f"{shown(val_losses)}, perplexity {math.exp(val_loss):.2f}"
            + (" (best)" if improved else f" (no improvement for {evals_without_improvement} evals)"))
        record(dict(step=iter_num, **epoch, val_loss=val_loss, val_ppl=math.exp(val_loss), lr=lr,
                    **per_source('val_loss', val_losses)))
        if fine_tuning:
            report_heldout(raw_model, held_out, autocast, iter_num, record)
        if improved:
            save(os.path.join(out_dir, 'best.pt'), iter_num, best_val_loss, evals_without_improvement)
        if improved or always_save_checkpoint:
            save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
        if early_stopping_patience and evals_without_improvement >= early_stopping_patience:
            log(f"early stopping: no improvement for {evals_without_improvement} evals")
            break
        # throughput excludes eval time
        window_start, window_tokens, window_labels = time.time(), 0, 0

    if stop_requested:
        save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
        progress.close()
        stop.exit(ckpt_path, iter_num, ddp)
progress.close()
save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
if training_type == 'lora':
    save_merged(out_dir, raw_model, master, model_args=model_args, config=config, iter_num=iter_num,
                tokenizer=tokenizer.identity(), data_dir=os.path.abspath(corpus_dir), **hf_files)

# a fine-tuned model answers the first held-out prompt, stopping at <|end|>; in the run's precision
# (a 16-bit LoRA base computes only under autocast), as exact match does. Under FSDP each token
# would gather every layer's shards (minutes on CPUs): sample.py reads the checkpoint whole instead
if sample_tokens > 0 and parallel == 'fsdp':
    log(f"to sample: python sample.py --out_dir={out_dir} --max_new_tokens={sample_tokens} (not sampled here: "
        f"under FSDP every token is collective)")
elif sample_tokens > 0 and master:
    raw_model.eval()
    with autocast:
        sample = raw_model.generate(torch.tensor([sample_prompt], device=local_device), sample_tokens,
                                    temperature=0.8, top_k=50, eos_id=tokenizer.eos_id if fine_tuning else None,
                                    generator=torch.Generator(device=local_device).manual_seed(seed))
    print(f"--- sample (step {iter_num}, best val loss {best_val_loss:.4f}) ---")
    print(tokenizer.decode(sample[0].tolist()))
compute_cleanup(ddp)
