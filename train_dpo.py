"""
Direct Preference Optimization (Rafailov et al. 2023): train a chat model to prefer the chosen over
the rejected completion of each preference pair, relative to a frozen reference (the starting model).
`python train_dpo.py` trains the SFT model of config/sft.py (out-sft/ckpt.pt) on the embedded
number-task pairs (a correct answer chosen, a near miss rejected) into out-dpo/;
`python train_dpo.py config/dpo.py` does the same with the config's settings, and
`torchrun --nproc_per_node=8 train_dpo.py ...` runs data-parallel. A run is max_iters steps, or
num_train_epochs passes over its pairs (run/epochs.py). Every config key below can be overridden by a
config file or --key=value (`--help` lists them).
"""

import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from configurator import (FOLDER, POSITIVE, SEED, UserError, at_least, check_values, configure, data_sources, interval,
                          one_of)
from lm.chat_data import PreferenceBatches, concatenated, load_preference_split, load_sources
from lm.dpo import precomputed_reference_logps, reference_logps, sequence_logps_and_logits
from lm.heldout_eval import HeldOut, metric_names, report_heldout
from lm.tokenizer import chat_tokenizer
from losses import DPO_LOSS_TYPES, dpo_loss
from memory import halve_micro_batch, peak_memory_bytes, recover_from_oom, resumed_micro_batch
from model import GPTConfig
from run.checkpoint import (CHECKPOINT_FORMATS, check_compatible, file_sha256, restore_training_state, training_state,
                            whole_checkpoint, write_checkpoint)
from run.device import DTYPES, autocast_context, pick_dtype
from run.fsdp import PARALLEL, check_parallel, place_model, same_init_on_every_rank
from run.run_folder import open_run, run_log, run_origin, sources_data_hash, training_data_hash
from run.runtime import (StopSignal, all_reduce_metrics, bad_step, clip_grad_norm, compute_cleanup, compute_init,
                         gradient_sync, log, prepare_once, rank_batches, wrap_model)
from scheduler import SCHEDULES, LRSchedule, set_lr
from starting_model import build_model, frozen_model, hf_source, load_model, reference_checkpoint, run_tokenizer
from tasks.number_tasks import PREFERENCES_DIR, is_number_tasks, prepare_number_tasks
# LoRA, 8-bit moments, epochs and W&B import their code where their branch starts

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out-dpo'          # checkpoints (ckpt.pt, best.pt), log.jsonl, tensorboard
init_from = 'out-sft/ckpt.pt'  # the chat model the policy and reference start as (docs/dpo.md)
chat_template_variables = {}  # published model's chat-template variables; {} = as it was fine-tuned
resume = True                # continue out_dir's run if any; False = start a new one, replacing it
data_dir = ''                # the base tokenizer's data.py folder; '' = data/stdlib
dpo_data = ''                # train/val(/test).jsonl folder, or {'name': (folder, loss weight)}; '' = number tasks
eval_interval = 200          # steps between evals (and checkpoint saves)
eval_every_epochs = 0        # with num_train_epochs: also eval (and save) at the end of every this many epochs
eval_pairs = 500             # held-out pairs per eval (val.jsonl)
log_interval = 50            # steps between train log lines
eval_only = False            # evaluate init_from (or the resumed checkpoint) and exit
always_save_checkpoint = True  # save ckpt.pt at every eval, not only when eval loss improves
early_stopping_patience = 0  # stop after this many evals without eval-loss improvement; 0 = never
max_bad_steps = 5            # abort after this many non-finite steps (loss/grad norm) in a row
tensorboard = True           # write TensorBoard logs to out_dir/tb
wandb_log = False            # also log to Weights & Biases (`pip install wandb`; run/tracker.py)
wandb_project = 'nanotrain'  # the W&B project
wandb_run_name = ''          # the W&B run's name; '' = out_dir's folder name
exact_match_examples = 500   # held-out prompts answered greedily, scored against chosen each eval; 0 = skip
eval_metrics = 'exact_match'  # comma-separated: exact_match, bleu, chrf, rouge1, rouge2, rouge_l, tool_calls
seed = 1337                  # random seed
# data
batch_size = 32              # preference pairs per micro-batch (each pair is two sequences)
gradient_accumulation_steps = 1  # micro-batches per optimizer step per process
max_length = 64              # longest prompt + completion in tokens (<= the model's block_size)
max_prompt_length = 48       # longer prompts keep their last max_prompt_length tokens
skip_malformed = False       # skip and count malformed JSONL lines instead of stopping at the first
pack = True                  # pairs packed in rows, each prompt computed once; False = one per row
# DPO
beta = 0.1                   # strength of the pull towards the reference (the KL penalty's weight)
loss_type = 'sigmoid'        # 'sigmoid' (DPO) | 'robust' (rDPO) | 'ipo' | 'hinge' (SLiC)
label_smoothing = 0.0        # probability that a pair's label is flipped (cDPO, rDPO; docs/dpo.md)
ipo_length_normalize = True  # 'ipo' on per-token mean log-probs (the paper's); False: summed
reference_free = False       # no reference model: an implicit uniform reference (log-probs 0)
rpo_alpha = 0.0              # RPO: weight of the chosen completions' per-token NLL; 0 = plain DPO
precompute_ref_logps = False  # cache the reference's log-probs in out_dir once, then free it
# LoRA: train adapters on the frozen model; the reference is the same model with adapters disabled
use_lora = False
lora_r = 8
lora_alpha = 16.0
lora_dropout = 0.0           # dropout on the adapters' input
use_rslora = False           # scale updates by lora_alpha/sqrt(r) instead of lora_alpha/r
lora_target_modules = 'all-linear'  # comma-separated layers | 'all-linear'
lora_bias = 'none'           # biases trained too: 'none' | 'all' | 'lora_only' (adapted layers')
loraplus_lr_ratio = 1.0      # LoRA+: the B matrices learn at this times the learning rate
lora_base_dtype = 'float32'  # the frozen base's Linear weights: 'float32' | the run's dtype | 'nf4' (QLoRA)
# model (its shape comes from init_from)
dropout = 0.0                # 0: the policy's log-probs should not be noisier than the reference's
activation_checkpointing = False  # recompute activations in backward to save memory
# optimizer (AdamW)
learning_rate = 1e-3         # peak lr of every lr_schedule
max_iters = 800              # optimizer steps in the run
num_train_epochs = 0.0       # passes over dpo_data, for max_iters (HF Trainer's key); 0 = off
weight_decay = 0.0           # decoupled weight decay; 0 = none
beta1 = 0.9                  # AdamW's momentum (first-moment decay)
beta2 = 0.95                 # AdamW's second-moment decay
grad_clip = 1.0              # 0 = no clipping (grad norm is still logged)
optimizer_type = 'adamw'     # 'adamw' | 'adamw8bit' (its moments in 8 bits: lm/adamw8bit.py)
# learning-rate schedule (scheduler.py)
lr_schedule = 'cosine'       # cosine | cosine_restarts | noam | constant | linear | wsd
warmup_iters = 50            # linear rise to learning_rate, reached at this step (every schedule)
lr_decay_iters = 800         # where the decay to min_lr ends (cosine, linear, wsd; not noam)
min_lr = 1e-4                # the lr decays to this (noam: its floor; constant: unused)
restart_iters = 250          # 'cosine_restarts': steps of the first cycle after warmup
restart_mult = 1             # 'cosine_restarts': each cycle this many times longer than the last
decay_frac = 0.2             # 'wsd': the last fraction of lr_decay_iters, a linear decay to min_lr
# system
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16 + loss scaling; fp32 on CPU
compile = False              # torch.compile the policy, block by block (model.GPT.compile_blocks)
parallel = 'ddp'             # under torchrun: 'ddp' (whole model per rank) | 'fsdp' (docs/fsdp.md)
fsdp_cpu_offload = False     # 'fsdp' on GPUs: keep the shards and optimizer state in CPU memory
checkpoint_format = 'file'   # 'file' | 'sharded' (each rank's shards; docs/checkpoints.md)
num_threads = 0              # torch.set_num_threads for CPU ops; 0 = torch's default
# -----------------------------------------------------------------------------
config = configure(globals(), sources=('dpo_data',))
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('batch_size', 'gradient_accumulation_steps', 'max_iters', 'eval_interval', 'log_interval',
                   'eval_pairs', 'max_bad_steps', 'max_length', 'max_prompt_length', 'lora_r', 'restart_iters',
                   'restart_mult')),
    (at_least(0), ('early_stopping_patience', 'exact_match_examples', 'warmup_iters', 'lr_decay_iters', 'num_threads',
                   'learning_rate', 'min_lr', 'weight_decay', 'grad_clip', 'rpo_alpha', 'num_train_epochs',
                   'eval_every_epochs')),
    (interval('[0, 1)'), ('dropout', 'lora_dropout', 'beta1', 'beta2')),
    (interval('[0, 1]'), ('decay_frac',)),
    (POSITIVE, ('beta', 'lora_alpha', 'loraplus_lr_ratio')),
    (interval('[0, 0.5)'), ('label_smoothing',)),  # at 0.5 the labels carry no information
    (one_of(SCHEDULES), ('lr_schedule',)),
    (one_of(DPO_LOSS_TYPES), ('loss_type',)),
    (one_of((*DTYPES, 'nf4')), ('lora_base_dtype',)),
    (one_of(('adamw', 'adamw8bit')), ('optimizer_type',)),
    (one_of(PARALLEL), ('parallel',)),
    (one_of(CHECKPOINT_FORMATS), ('checkpoint_format',)),
    (FOLDER, ('out_dir',)),
])
eval_metric_names = metric_names(eval_metrics)
if label_smoothing and loss_type not in ('sigmoid', 'robust'):
    raise UserError(f"label_smoothing applies to loss_type 'sigmoid' (conservative DPO) and 'robust' only; "
                    f"drop it for loss_type={loss_type!r}.")
if parallel == 'fsdp' and use_lora and lora_bias != 'none' and not reference_free:
    # the reference swaps the starting biases in (lora.disable_adapters), which sharded biases cannot take
    raise UserError(f"lora_bias={lora_bias!r} with parallel='fsdp': the reference (the policy with its adapters "
                    f"disabled) needs the starting biases, which sharded biases cannot swap in; use lora_bias='none', "
                    f"parallel='ddp', or reference_free=True.")
if reference_free and precompute_ref_logps:
    raise UserError("reference_free=True has no reference to precompute; drop precompute_ref_logps.")
if lora_base_dtype != 'float32' and not use_lora:
    raise UserError(f"lora_base_dtype={lora_base_dtype!r} keeps a LoRA run's frozen base in 4 or 16 bits, but this run "
                    f"is not one: it trains every weight. Drop lora_base_dtype, or set use_lora=True.")
by_epochs = False  # True: the run is counted in epochs (num_train_epochs, run/epochs.py), not max_iters
if num_train_epochs or eval_every_epochs:
    from run.epochs import by_epochs_checked, plan_epochs
    by_epochs = by_epochs_checked(config)
if wandb_log:
    from run.tracker import require_wandb, start_wandb
    require_wandb(wandb_log)

# processes and device (run/runtime.py: one process per GPU under torchrun), precision
compute = compute_init(device, seed, num_threads)
# local_device: the device resolved for this process ('auto' chosen, a rank's own GPU)
ddp, rank, local_rank, world_size, local_device = compute
master, device_type = rank == 0, local_device.split(':')[0]
ptdtype = pick_dtype(local_device, dtype)
autocast = autocast_context(local_device, ptdtype)
check_parallel(parallel, ddp, local_device, ptdtype, optimizer_type, fsdp_cpu_offload)
if use_lora:
    from lm.lora import (LORA_SETTINGS, apply_lora, check_lora_base_dtype, lora_optimizer, lora_state_dict,
                         save_merged)
    check_lora_base_dtype(lora_base_dtype, ptdtype, parallel)

# out_dir: locked before any work; a checkpoint there is this run's to continue, never another's.
# this_run: what the run is (nanoGPT's init_from='resume' continues out_dir's, begun where it began)
this_run = dict(script='train_dpo.py', use_lora=use_lora, init_from=run_origin(init_from, out_dir, resume))
out_dir_lock, ckpt_path, ckpt = open_run(config, this_run, master)
if ckpt is not None and (parallel != 'fsdp' or use_lora):
    ckpt = whole_checkpoint(ckpt)  # a sharded one's weights; FSDP reads each rank's shards into its model
resuming = ckpt is not None
# the chat model the policy starts as and the loss is relative to (a continued run: the one its
# checkpoint names), as stored (as train.py reads it)
reference_ckpt, reference_path, reference_hash = reference_checkpoint(ckpt, init_from, out_dir)

# data
# a published model's config files, which export.py writes back
hf_files = hf_source(reference_ckpt, chat_template_variables)
# the tokenizer and chat template: a published model's own, else corpus_dir's (data_dir, or the
# default corpus, which rank 0 prepares once)
if not data_dir and not hf_files:
    from data import prepare_default
    prepare_once(prepare_default, compute, key='')  # train_dpo.py names no folder for it
corpus_dir, base_tokenizer = run_tokenizer(data_dir, reference_ckpt, reference_path,
                                           hf_files.get('chat_template_variables'))
tokenizer = chat_tokenizer(base_tokenizer)
check_compatible(reference_ckpt['tokenizer'], tokenizer.identity(), 'tokenizer', reference_path,
                 fix="Point data_dir at the tokenizer folder the model was trained with ('' for the default).")
model_args = dict(reference_ckpt['model_args'], dropout=dropout)
# the preference pairs of dpo_data: one folder, or named sources, each with its loss weight, drawn as one
# set ('' = the embedded number-task pairs, which rank 0 prepares once)
sources = [(name, folder or PREFERENCES_DIR, weight) for name, folder, weight in data_sources(dpo_data)]
if any(is_number_tasks(folder, PREFERENCES_DIR) for _, folder, _ in sources):
    prepare_once(prepare_number_tasks, compute, out_dir=PREFERENCES_DIR, seed=1, preferences=True)
if max_length > model_args['block_size']:
    raise UserError(f"max_length={max_length} is longer than the model's block_size={model_args['block_size']}; "
                    f"lower max_length.")
if max_prompt_length >= max_length:
    raise UserError(f"max_prompt_length={max_prompt_length} must leave room for a completion in "
                    f"max_length={max_length}; lower it.")


def read_pairs(folder, weight):
    """A source's (train pairs, val pairs, held-out references): exact match scores test.jsonl's prompts and
    chosen answers where there is one, else val.jsonl's; a source of weight 0 is evaluated, not trained."""
    train_path, val_path, test_path = (os.path.join(folder, f'{name}.jsonl') for name in ('train', 'val', 'test'))
    train = load_preference_split(train_path, tokenizer, max_length, max_prompt_length, skip_malformed)[1] \
        if weight > 0 else []
    val_references, val = load_preference_split(val_path, tokenizer, max_length, max_prompt_length, skip_malformed)
    held = load_preference_split(test_path, tokenizer, max_length, max_prompt_length, skip_malformed)[0] \
        if exact_match_examples and os.path.exists(test_path) else val_references
    return train, val, held


source_data = load_sources(sources, 'dpo_data', read_pairs)
train_pairs, train_sources = concatenated([train for train, _, _ in source_data])
val_pairs, val_sources = concatenated([val for _, val, _ in source_data])
train_batches = PreferenceBatches(train_pairs, seed, tokenizer.eos_id, max_length, pack, by_epochs)
val_batches = PreferenceBatches(val_pairs, seed, tokenizer.eos_id, max_length, pack)
# every eval scores the same first eval_pairs held-out pairs of each source
val_indices = torch.cat([(val_sources == s).nonzero().flatten()[:eval_pairs] for s in range(len(sources))])
# each source's first exact_match_examples held-out prompts
held_out_references = [(reference, name) for (_, _, references), (name, _, _) in zip(source_data, sources)
                       for reference in references[:exact_match_examples]]
# a continued run must still read the same pairs
if sources[0][0] is None:
    train_data_hash = training_data_hash(os.path.join(sources[0][1], 'train.jsonl'), ckpt, out_dir, 'dpo_data')
else:
    train_data_hash = sources_data_hash({name: os.path.join(folder, 'train.jsonl') for name, folder, weight in sources
                                         if weight > 0}, ckpt, out_dir, 'dpo_data')
# named sources are logged apart as well (eval/loss/<name>, ...); one folder has one unnamed source
source_names = [name for name, _, _ in sources if name]
pair_weight = torch.tensor([weight for _, _, weight in sources])
held_out = HeldOut(tokenizer, [reference for reference, _ in held_out_references], eval_metric_names, batch_size,
                   max_length, [name for _, name in held_out_references] if source_names else [])

# policy, and the reference: a frozen copy when training all weights, the policy itself with its
# adapters disabled when training LoRA, or none in memory with precomputed log-probs
model = build_model(GPTConfig(**model_args), reference_ckpt, parallel == 'fsdp', lora_base_dtype)
reference = (frozen_model(GPTConfig(**model_args), reference_ckpt['model'], parallel, local_device, ptdtype,
                          fsdp_cpu_offload)
             if not (use_lora or reference_free or precompute_ref_logps) else None)
if use_lora:
    with same_init_on_every_rank(seed, enabled=parallel == 'fsdp'):
        apply_lora(model, lora_r, lora_alpha, lora_dropout, lora_target_modules, use_rslora, lora_bias)
if ckpt:
    fixed = ('use_lora', 'optimizer_type', 'reference_free') + (LORA_SETTINGS if use_lora else ())
    saved = {'optimizer_type': 'adamw', **ckpt['config']}  # older checkpoints: AdamW's
    check_compatible({k: saved.get(k) for k in fixed}, {k: config[k] for k in fixed}, 'setup', ckpt_path,
                     fix="Set these keys to the checkpoint's values, or start a new run (another out_dir, or "
                         "--resume=False).")
    # a sharded checkpoint's are read into the shards (restore_training_state)
    if 'shards' not in ckpt:
        # strict: all weights, or every adapter
        model.load_state_dict({**model.state_dict(), **ckpt['model']})
model.activation_checkpointing = activation_checkpointing
place_model(model, parallel, local_device, ptdtype, fsdp_cpu_offload)
# what we save and generate with: never compiled or DDP-wrapped (under FSDP: sharded)
raw_model = model
reference_ckpt = None

optimizer = (lora_optimizer(raw_model, weight_decay, learning_rate, (beta1, beta2), device_type, loraplus_lr_ratio)
             if use_lora else raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type))
if optimizer_type == 'adamw8bit':  # the same groups, the moments in 8 bits
    from lm.adamw8bit import in_8_bits
    optimizer = in_8_bits(optimizer)
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)
# the step's split into micro-batches: the config's, or what a continued run's checkpoint holds
micro_batch_size, accumulation_steps = batch_size, gradient_accumulation_steps
iter_num, best_val_loss, evals_without_improvement = 0, float('inf'), 0
if ckpt:
    train_batches.load_state_dict(ckpt['train_batches'])
    micro_batch_size, accumulation_steps, note = resumed_micro_batch(ckpt, batch_size, gradient_accumulation_steps,
                                                                     world_size)
    if note:
        log(note)
    iter_num, best_val_loss, evals_without_improvement = restore_training_state(ckpt, ckpt_path, optimizer, scaler,
                                                                                rank, world_size, raw_model)
global_batch_size = micro_batch_size * accumulation_steps * world_size
# the run's steps: max_iters, or an epoch-counted run's (run/epochs.py); its lr decays to min_lr over all of them
epoch_plan = plan_epochs(train_batches.epoch_steps(global_batch_size, math.ceil(num_train_epochs)), config, ckpt,
                         ckpt_path) if by_epochs else None
run_iters = epoch_plan.steps if epoch_plan else max_iters
get_lr = LRSchedule.from_config(config, epoch_plan.steps if epoch_plan else None)
# rank 0 logs to Weights & Biases too, a continued run to its W&B run
tracker = start_wandb(config, ckpt and ckpt.get('wandb_run_id'), master) if wandb_log else None
ckpt = None


# precomputed reference log-probs: one pass over the data before training, cached in out_dir under a
# hash of everything they depend on; training then needs no reference in memory
ref_cache = None
if precompute_ref_logps:
    depends_on = [reference_hash, train_data_hash, *(file_sha256(os.path.join(folder, 'val.jsonl'))
                                                     for _, folder, _ in sources),
                  tokenizer.identity(), max_length, max_prompt_length, str(ptdtype)]

    def load_reference():  # the policy has trained, so it is no longer the reference: read it again
        weights = load_model(reference_path)['model']
        return frozen_model(GPTConfig(**model_args), weights, parallel, local_device, ptdtype, fsdp_cpu_offload)

    ref_cache = precomputed_reference_logps(config, depends_on, {'train': train_batches, 'val': val_batches},
                                            load_reference if iter_num > 0 and not use_lora else lambda: raw_model,
                                            autocast, compute)
    reference = None

model = wrap_model(model, compile, ddp and parallel == 'ddp', local_rank, device_type)
log(f"device {local_device}, dtype {ptdtype}, {world_size} process(es), "
    f"{raw_model.get_num_params() / 1e6:.2f}M params, {global_batch_size} pairs per step, reference: "
    + ('none (reference-free)' if reference_free else 'precomputed log-probs' if ref_cache else
       'the model with adapters disabled' if use_lora else 'a frozen copy'))
if epoch_plan:
    log(epoch_plan.describe(f"{global_batch_size} pairs", lr_schedule))


def batch_counts(batches, pair_sources, indices):
    """What the sums over a whole batch (the pairs at indices, of batches; pair_sources: each pair's source) are
    divided by: its pairs, chosen and rejected completion tokens, their loss weights (each pair's and its chosen
    tokens' weight is its source's) and each source's pairs and chosen tokens, (2, S)."""
    indices = indices[indices >= 0]  # an epoch's last batch may end with no pair (-1)
    tokens, source = batches.completion_tokens[indices], pair_sources[indices]
    weight = pair_weight[source]
    per_source = torch.zeros(2, len(sources), dtype=torch.float64).index_add_(
        1, source, torch.stack([torch.ones(len(indices), dtype=torch.float64), tokens[:, 0].double()]))
    return (len(indices), *tokens.sum(0).tolist(), weight.sum().item(), (weight * tokens[:, 0]).sum().item(),
            per_source.to(local_device, torch.float32))


def pair_terms(net, batches, pair_sources, indices, cache, counts):
    """Forward pass over the pairs at indices: (loss, metrics). Every sum is divided by the size of
    the whole batch it belongs to (counts: batch_counts' over all micro-batches and ranks), so micro-batches
    and ranks add up to the batch mean however it is split. The loss weighs each pair (and with RPO each of
    its chosen tokens) by its source's weight; each named source's own loss, reward accuracy and margin are
    metrics too (<metric>/<name>). An index -1 (no pair: the end of an epoch's last batch) is computed as pair 0
    and left out of every sum."""
    real = (indices >= 0).float().to(local_device)
    indices = indices.clamp(min=0)
    batch, n = batches.get(indices, local_device), len(indices)
    ref_logits = None
    if reference_free:
        ref_sums = torch.zeros(2 * n, device=local_device)
    elif cache is not None:
        ref_sums = cache[indices].to(local_device).T.flatten()  # chosen of every pair, then rejected
    else:
        ref_sums, ref_logits = reference_logps(raw_model if reference is None else reference, batch, n, autocast)
    with autocast:
        sums, token_logps, logits = sequence_logps_and_logits(net, batch, n)
    chosen_pos, (pairs, chosen_tokens, rejected_tokens, weighted_pairs, weighted_chosen, per_source) = \
        batch['owners'] < n, counts
    real_token = real.repeat(2)[batch['owners']]  # whether a scored token's pair is real
    source = pair_sources[indices].to(local_device)
    weight = pair_weight.to(local_device, torch.float32)[source] * real
    policy, ref = sums, ref_sums
    if loss_type == 'ipo' and ipo_length_normalize:  # per-token means
        lengths = torch.bincount(batch['owners'], minlength=2 * n)
        policy, ref = sums / lengths, ref_sums / lengths
    losses, chosen_rewards, rejected_rewards = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], beta, loss_type,
                                                        label_smoothing)
    loss = (losses * weight).sum() / weighted_pairs
    chosen_nll = -(token_logps * real_token)[chosen_pos]
    if rpo_alpha:
        loss = loss + rpo_alpha * (chosen_nll * weight[batch['owners'][chosen_pos]]).sum() / weighted_chosen
    with torch.no_grad():
        mean_logits = logits.float().mean(-1) * real_token
        metrics = {'loss': loss, 'rewards/chosen': (chosen_rewards * real).sum() / pairs,
                   'rewards/rejected': (rejected_rewards * real).sum() / pairs,
                   # TRL's: chosen strictly ahead, so a tie (every pair at step 0 with a
                   # live reference) counts wrong
                   'rewards/accuracies': ((chosen_rewards > rejected_rewards).float() * real).sum() / pairs,
                   'rewards/margins': ((chosen_rewards - rejected_rewards) * real).sum() / pairs,
                   'logps/chosen': (sums[:n] * real).sum() / pairs, 'logps/rejected': (sums[n:] * real).sum() / pairs,
                   'logits/chosen': mean_logits[chosen_pos].sum() / chosen_tokens,
                   'logits/rejected': mean_logits[~chosen_pos].sum() / rejected_tokens,
                   'nll/chosen': chosen_nll.sum() / chosen_tokens}
        # each named source's own means: of its pairs, and of its chosen tokens
        by_source = {'loss': losses, 'rewards/accuracies': (chosen_rewards > rejected_rewards).float(),
                     'rewards/margins': chosen_rewards - rejected_rewards}
        for key, values in by_source.items():
            means = torch.zeros(len(sources), device=local_device).index_add_(0, source, values.float() * real)
            means = means / per_source[0].clamp(min=1)
            if key == 'loss' and rpo_alpha:
                means += rpo_alpha * torch.zeros(len(sources), device=local_device).index_add_(
                    0, source[batch['owners'][chosen_pos]], chosen_nll.float()) / per_source[1].clamp(min=1)
            metrics.update({f'{key}/{name}': means[s] for s, name in enumerate(source_names)})
        if ref_logits is not None:
            # KL(policy || reference) per chosen completion token, exact over the vocabulary
            p, q = logits[chosen_pos].float().log_softmax(-1), ref_logits[chosen_pos].float().log_softmax(-1)
            metrics['kl'] = ((p.exp() * (p - q)).sum(-1) * real_token[chosen_pos]).sum() / chosen_tokens
    return loss, {k: v.detach().float() for k, v in metrics.items()}


def shown(metrics):
    """' (<name> <loss>, ...)' of each named source's loss in metrics, for a log line; '' with none."""
    losses = ', '.join(f"{name} {metrics[f'loss/{name}']:.4f}" for name in source_names if f'loss/{name}' in metrics)
    return f" ({losses})" if losses else ''


@torch.no_grad()
def evaluate(iter_num, micro_batch_size, epoch=None):
    """The metrics of the fixed held-out pairs (split across ranks in micro-batches, policy in eval mode),
    logged and recorded at step iter_num (with epoch: {'epoch': the epochs done}); returns the loss."""
    model.eval()
    counts, sums = batch_counts(val_batches, val_sources, val_indices), {}
    for indices, counted in rank_batches(val_indices, micro_batch_size, rank, world_size, lockstep=parallel == 'fsdp'):
        _, metrics = pair_terms(model, val_batches, val_sources, indices, ref_cache['val'] if ref_cache else None,
                                counts)
        sums = {k: sums.get(k, 0.0) + (v if counted else torch.zeros_like(v)) for k, v in metrics.items()}
    stats = torch.stack(list(sums.values()))
    if ddp:
        dist.all_reduce(stats)
    model.train()
    metrics = dict(zip(sums, stats.tolist()))
    log(f"step {iter_num}: eval loss {metrics['loss']:.4f}{shown(metrics)}, rewards/accuracies "
        f"{metrics['rewards/accuracies']:.3f}, rewards/margins {metrics['rewards/margins']:.3f}"
        + (f", kl {metrics['kl']:.4f}" if 'kl' in metrics else ''))
    record(dict(step=iter_num, **(epoch or {}), **{f'eval/{k}': v for k, v in metrics.items()}))
    return metrics['loss']


def halve_after_oom(error, where):
    """After a RuntimeError in a step or an eval (where): re-raise it unless it is an out-of-memory error this
    process can retry; else halve the micro-batch, for the steps and the evals alike."""
    global micro_batch_size, accumulation_steps
    recover_from_oom(error, ddp, optimizer, local_device)
    micro_batch_size, accumulation_steps = halve_micro_batch(micro_batch_size, accumulation_steps)
    log(f"{where}: out of memory, retrying with micro-batch {micro_batch_size} x {accumulation_steps} accumulation")


def evaluate_fitting(iter_num, epoch=None):
    """evaluate() at the steps' micro-batch, halved while it does not fit: the step-0 eval meets a micro-batch
    too big before any step does."""
    while True:
        try:
            return evaluate(iter_num, micro_batch_size, epoch)
        except RuntimeError as error:
            halve_after_oom(error, 'eval')


def save(path, iter_num, best_val_loss, evals_without_improvement):
    """A checkpoint of the run at path (write_checkpoint) at step iter_num, with the eval counters: collective
    under DDP and FSDP, every rank must call it."""
    # under FSDP sharded: write_checkpoint gathers or writes them
    weights = raw_model.state_dict(keep_vars=True)
    state = dict(training_state(this_run, dict(config, training_type='dpo'), optimizer, scaler, iter_num,
                                best_val_loss, evals_without_improvement),
                 kind='gpt', model=weights, model_args=model_args, tokenizer=tokenizer.identity(),
                 data_dir=os.path.abspath(corpus_dir), train_batches=train_batches.state_dict(),
                 batch_size=micro_batch_size, gradient_accumulation_steps=accumulation_steps,
                 reference_checkpoint=os.path.abspath(reference_path), reference_hash=reference_hash,
                 train_data_hash=train_data_hash, epoch_steps=epoch_plan and epoch_plan.epoch_steps,
                 wandb_run_id=tracker and tracker.id, **hf_files)
    if use_lora:  # adapters only: the base is the reference checkpoint, named by path and hash
        state.update(kind='lora', model=lora_state_dict(raw_model, weights),
                     base_checkpoint=state['reference_checkpoint'], base_hash=reference_hash)
    write_checkpoint(path, state, checkpoint_format == 'sharded', master)


def train_step(micro_batch_indices, counts):
    """Forward/backward over this rank's slice of the global batch, one row of micro_batch_indices (pair
    indices) per micro-batch, accumulating gradients; counts: as in pair_terms, of the whole global
    batch. Returns this rank's shares of the metrics (shares add up over ranks)."""
    sums = {}
    for micro_step, indices in enumerate(micro_batch_indices):
        # only the last micro-batch reduces gradients across ranks
        with gradient_sync(model, raw_model, sync=micro_step == len(micro_batch_indices) - 1):
            loss, metrics = pair_terms(model, train_batches, train_sources, indices,
                                       ref_cache['train'] if ref_cache else None, counts)
            # DDP/FSDP average gradients over ranks: undo 1/world_size
            scaler.scale(loss * world_size).backward()
        sums = {k: sums.get(k, 0.0) + v for k, v in metrics.items()}
    return sums


# an eval_only run appends to the log; a continued run drops what it logged past its checkpoint
record, writer = run_log(out_dir, master, tensorboard, math.inf if eval_only else iter_num if resuming else -1,
                         tracker)

if eval_only or iter_num == 0:
    evaluate_fitting(iter_num)
    report_heldout(raw_model, held_out, autocast, iter_num, record)
if eval_only:
    compute_cleanup(ddp)
    sys.exit(0)
stop = StopSignal()
bad_steps = 0
window_start, window_tokens, window_steps = time.time(), 0, 0
progress = tqdm(total=run_iters, initial=iter_num, disable=not master, dynamic_ncols=True, desc='dpo')
while iter_num < run_iters:
    lr = get_lr(iter_num)
    set_lr(optimizer, lr)

    # the whole global batch is drawn on every rank; each rank trains on its slice, and every sum is
    # divided by the whole batch's counts (pairs, chosen and rejected completion tokens, their loss weights)
    global_batch = train_batches.sample(global_batch_size)
    counts = batch_counts(train_batches, train_sources, global_batch)
    while True:
        try:
            shares = train_step(global_batch.tensor_split(world_size)[rank].view(accumulation_steps,
                                                                                 micro_batch_size), counts)
            break
        # CUDA raises torch.OutOfMemoryError, MPS and the CPU a plain RuntimeError
        except RuntimeError as error:
            halve_after_oom(error, f'step {iter_num}')
    scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(raw_model.parameters(), grad_clip)
    metrics, (stop_requested,) = all_reduce_metrics(shares, [stop.requested is not None], ddp)
    loss = metrics['loss']
    # fp16: a non-finite grad norm is an overflow, which scaler.step skips (and update backs off)
    if math.isfinite(loss) and (math.isfinite(grad_norm) or scaler.is_enabled()):
        scaler.step(optimizer)
        bad_steps = 0
    else:
        bad_steps = bad_step(bad_steps, config, iter_num, loss, grad_norm)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    progress.update(1)
    window_tokens += train_batches.count_tokens(global_batch)
    window_steps += 1
    # an epoch-counted run's epochs done (Trainer's fractional 'epoch'), and the epoch this step ended, if any
    epoch, epoch_end = epoch_plan.after(iter_num, progress) if epoch_plan else ({}, 0)

    if iter_num % log_interval == 0 or iter_num == run_iters:
        now = time.time()
        elapsed = now - window_start  # all of the window's time, logging included
        # each named source's metrics, of the sources in this step
        absent = {f'{key}/{name}' for name, count in zip(source_names, counts[-1][0].tolist()) if not count
                  for key in ('loss', 'rewards/accuracies', 'rewards/margins')}
        metrics = {k: v for k, v in metrics.items() if k not in absent}
        record(dict(step=iter_num, **epoch, lr=lr, grad_norm=grad_norm, steps_per_sec=window_steps / elapsed,
                    tokens_per_sec=window_tokens / elapsed,
                    peak_memory_mb=(peak_memory_bytes(local_device) or 0) / 2**20, loss_scale=scaler.get_scale(),
                    **metrics))
        progress.set_postfix(loss=f'{loss:.4f}', acc=f"{metrics['rewards/accuracies']:.2f}")
        log(f"step {iter_num}" + (f" (epoch {epoch['epoch']:.2f})" if epoch else "") + f": loss {loss:.4f}"
            f"{shown(metrics)}, rewards/accuracies {metrics['rewards/accuracies']:.3f}, rewards/margins "
            f"{metrics['rewards/margins']:.3f}, lr {lr:.2e}, grad norm {grad_norm:.3f}, {window_steps / elapsed:.2f} "
            f"steps/s")
        window_start, window_tokens, window_steps = now, 0, 0

    if (iter_num % eval_interval == 0 or iter_num == run_iters
            or eval_every_epochs and epoch_end and epoch_end % eval_every_epochs == 0):
        val_loss = evaluate_fitting(iter_num, epoch)
        improved = val_loss < best_val_loss
        if improved:
            best_val_loss, evals_without_improvement = val_loss, 0
        else:
            evals_without_improvement += 1
        report_heldout(raw_model, held_out, autocast, iter_num, record)
        if improved:
            save(os.path.join(out_dir, 'best.pt'), iter_num, best_val_loss, evals_without_improvement)
        if improved or always_save_checkpoint:
            save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
        if early_stopping_patience and evals_without_improvement >= early_stopping_patience:
            log(f"early stopping: no improvement for {evals_without_improvement} evals")
            break
        # throughput excludes eval time
        window_start, window_tokens, window_steps = time.time(), 0, 0

    if stop_requested:
        save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
        progress.close()
        stop.exit(ckpt_path, iter_num, ddp)
progress.close()
save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
if use_lora:
    save_merged(out_dir, raw_model, master, model_args=model_args, config=dict(config, training_type='dpo'),
                iter_num=iter_num, tokenizer=tokenizer.identity(), data_dir=os.path.abspath(corpus_dir), **hf_files)
compute_cleanup(ddp)
