"""
Online reinforcement learning with verifiable rewards, the GRPO family (GRPO, DAPO, Dr. GRPO, by the names
TRL's GRPOTrainer uses): each step samples G completions of every prompt, scores them with a reward program,
and pushes the policy towards the completions that beat their group's mean. `python train_rl.py` trains the
SFT model of config/sft.py (out-sft/ckpt.pt) on the embedded number tasks, their whole-answer checker as
the reward, into out-rl/, with the recipe that keeps what the SFT model got right (docs/rl.md); `python
train_rl.py config/rl.py` does the same, measured on more held-out prompts;
`--rl_data=folder --reward=my_rewards.py:score` trains on one's own prompts and reward; `torchrun
--nproc_per_node=8 train_rl.py ...` runs data-parallel. Every config key below can be overridden by a
config file or --key=value (`--help` lists them). The losses and metrics: docs/rl.md.
"""

import hashlib
import json
import math
import os
import sys
import time
from collections import defaultdict
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from configurator import FOLDER, POSITIVE, SEED, UserError, at_least, check_values, configure, interval, one_of
from lm.chat_data import EpochSampler, load_prompt_split, rl_prompt, rl_reference
from lm.generate import CompiledDecoding, generate_batch, stop_tokens
from lm.heldout_eval import HeldOut, report_heldout
from lm.metrics import mean_pass_at_k
from lm.rewards import check_rows, load_rewards, reward_values
from lm.rl import (IMPORTANCE_LEVELS, LOSS_TYPES, SCALE_REWARDS, clipped_token_loss, completion_batches,
                   group_advantages, k3_kl, normalized_loss, sequence_log_ratio, token_entropy)
from lm.tokenizer import chat_tokenizer
from memory import in_parts, peak_memory_bytes, recover_from_oom
from model import GPTConfig
from run.checkpoint import NEW_RUN, check_compatible, restore_training_state, training_state, write_checkpoint
from run.device import DTYPES, autocast_context, pick_dtype
from run.fsdp import place_model
from run.run_folder import open_run, run_log, run_origin, training_data_hash
from run.runtime import (StopSignal, all_reduce_metrics, bad_step, clip_grad_norm, compute_cleanup, compute_init,
                         gradient_sync, log, prepare_once, wrap_model)
from scheduler import SCHEDULES, LRSchedule, set_lr
from starting_model import build_model, frozen_model, hf_source, reference_checkpoint, run_tokenizer
from tasks.number_tasks import NUMBER_TASKS_DIR, prepare_number_tasks
# LoRA, 8-bit moments and W&B import their code where their branch starts

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out-rl'           # checkpoints (ckpt.pt, best.pt), log.jsonl, tensorboard
init_from = 'out-sft/ckpt.pt'  # the chat model the policy (and the reference) start as
chat_template_variables = {}  # published model's chat-template variables; {} = as it was fine-tuned
resume = True                # continue out_dir's run if any; False = start a new one, replacing it
data_dir = ''                # the base tokenizer's data.py folder; '' = data/stdlib
rl_data = ''                 # folder of train/val(/test).jsonl prompts; '' = the embedded number tasks
reward = 'number_tasks_exact'  # | 'number_tasks' (final answer) | 'tool_calls' | 'path.py:name'; comma-separated
reward_weights = ''          # comma-separated weights of the rewards (TRL's reward_weights); '' = 1 each
format_reward = 0.0          # number_tasks: added when a completion is shaped like the reference answer
correct_reward = 1.0         # a completion whose reward reaches this counts as correct (accuracy, pass@k)
eval_interval = 50           # steps between evals (and checkpoint saves)
eval_prompts = 100           # held-out prompts sampled pass_k times at each eval
pass_k = 4                   # samples per held-out prompt: pass@1 and pass@pass_k
exact_match_examples = 200   # held-out prompts with a reference answered greedily at the start and end; 0 = skip
log_interval = 1             # steps between train log lines
eval_only = False            # evaluate init_from (or the resumed checkpoint) and exit
always_save_checkpoint = True  # save ckpt.pt at every eval, not only when pass@1 improves
max_bad_steps = 5            # abort after this many non-finite steps (loss/grad norm) in a row
tensorboard = True           # write TensorBoard logs to out_dir/tb
wandb_log = False            # also log to Weights & Biases (`pip install wandb`; run/tracker.py)
wandb_project = 'nanotrain'  # the W&B project
wandb_run_name = ''          # the W&B run's name; '' = out_dir's folder name
seed = 1337                  # random seed
skip_malformed = False       # skip and count malformed JSONL lines instead of stopping at the first
# rollouts
prompts_per_step = 16        # prompts per step over all processes
num_generations = 8          # G: completions sampled per prompt, the group its advantages are relative to
max_prompt_length = 48       # longer prompts are dropped (counted)
max_new_tokens = 32          # a completion's length limit; one that reaches it without stopping is truncated
temperature = 1.0            # sampling temperature (> 0); the loss's log-probs are of logits / temperature, as TRL's
top_k = 0                    # sample from the k most likely tokens; 0 = all
top_p = 1.0                  # sample from the smallest set of tokens whose probability reaches top_p
# loss (docs/rl.md)
loss_type = 'dapo'           # 'grpo' (per-sequence mean) | 'dapo' (per-token, global batch) | 'dr_grpo' (constant)
scale_rewards = 'group'      # advantages divided by the std of the 'group' | the 'batch' | 'none' (Dr. GRPO)
beta = 0.04                  # weight of the k3 KL penalty against the reference; 0 = no reference at all
epsilon = 0.2                # PPO clip: the ratio's lower bound is 1 - epsilon
epsilon_high = None          # the upper bound is 1 + epsilon_high; None = epsilon, as TRL (DAPO's clip-higher: 0.28)
num_iterations = 1           # optimizer steps on each batch of rollouts (PPO's epochs, TRL's mu)
importance_sampling_level = 'token'  # the PPO ratio of each 'token', or of its 'sequence': their mean log-ratio (GSPO)
mask_truncated_completions = False  # completions cut at max_new_tokens add nothing to the loss (DAPO)
gradient_accumulation_steps = 1  # micro-batches per optimizer step per process (splitting its completions)
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
dropout = 0.0                # 0: the ratio to the sampling policy should be 1 at the first iteration
# optimizer (AdamW)
learning_rate = 1e-5         # peak lr; 1e-4 lost greedy answers of a 96% SFT model (dev/LOG.md, 2026-11-27)
max_iters = 200              # steps (rollout batches) in the run
weight_decay = 0.0           # decoupled weight decay; 0 = none
beta1 = 0.9                  # AdamW's momentum (first-moment decay)
beta2 = 0.99                 # AdamW's second-moment decay
grad_clip = 1.0              # 0 = no clipping (grad norm is still logged)
optimizer_type = 'adamw'     # 'adamw' | 'adamw8bit' (its moments in 8 bits: lm/adamw8bit.py)
# learning-rate schedule (scheduler.py)
lr_schedule = 'cosine'       # cosine | cosine_restarts | noam | constant | linear | wsd
warmup_iters = 0             # linear rise to learning_rate, reached at this step (every schedule)
lr_decay_iters = 200         # where the decay to min_lr ends (cosine, linear, wsd; not noam)
min_lr = 0.0                 # the lr decays to this (noam: its floor; constant: unused)
restart_iters = 250          # 'cosine_restarts': steps of the first cycle after warmup
restart_mult = 1             # 'cosine_restarts': each cycle this many times longer than the last
decay_frac = 0.2             # 'wsd': the last fraction of lr_decay_iters, a linear decay to min_lr
# system
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16 + loss scaling; fp32 on CPU
compile = False              # torch.compile the policy's training forward
compile_decode = None        # rollouts decode through torch.compile over a static KV cache (CUDA graphs); None = on CUDA
merged_rollouts = None       # LoRA: rollouts from a copy in the run's dtype, adapters merged, refreshed each step; None = on CUDA
num_threads = 0              # torch.set_num_threads for CPU ops; 0 = torch's default
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('prompts_per_step', 'max_new_tokens', 'gradient_accumulation_steps', 'max_iters', 'eval_interval',
                   'log_interval', 'eval_prompts', 'pass_k', 'max_bad_steps', 'max_prompt_length', 'num_iterations',
                   'lora_r', 'restart_iters', 'restart_mult')),
    (at_least(2), ('num_generations',)),  # one completion has no group to be better than: advantage 0
    (at_least(0), ('exact_match_examples', 'warmup_iters', 'lr_decay_iters', 'num_threads', 'learning_rate', 'min_lr',
                   'weight_decay', 'grad_clip', 'beta', 'format_reward', 'top_k')),
    (interval('[0, 1)'), ('dropout', 'lora_dropout', 'beta1', 'beta2', 'epsilon')),
    (interval('(0, 1]'), ('top_p',)),
    (interval('[0, 1]'), ('decay_frac',)),
    (POSITIVE, ('temperature', 'lora_alpha', 'loraplus_lr_ratio')),
    (one_of(SCHEDULES), ('lr_schedule',)),
    (one_of(LOSS_TYPES), ('loss_type',)),
    (one_of(IMPORTANCE_LEVELS), ('importance_sampling_level',)),
    (one_of(SCALE_REWARDS), ('scale_rewards',)),
    (one_of((*DTYPES, 'nf4')), ('lora_base_dtype',)),
    (one_of(('adamw', 'adamw8bit')), ('optimizer_type',)),
    (FOLDER, ('out_dir',)),
])
if epsilon_high is not None and (isinstance(epsilon_high, bool) or not isinstance(epsilon_high, (int, float))
                                 or not 0 <= epsilon_high < math.inf):
    raise UserError(f"epsilon_high={epsilon_high!r} must be a number >= 0 (e.g. 0.28), or None for epsilon's value.")
clip_high = epsilon if epsilon_high is None else epsilon_high  # the ratio's upper bound is 1 + clip_high
for key in ('compile_decode', 'merged_rollouts'):
    if config[key] not in (None, True, False):
        raise UserError(f"{key}={config[key]!r} must be True, False or None (None: on a GPU, not on a CPU).")
if merged_rollouts and not use_lora:
    raise UserError("merged_rollouts=True merges LoRA adapters into a copy for the rollouts, but this run trains every "
                    "weight (use_lora=False) and samples from the model itself; drop merged_rollouts or set use_lora=True.")
if lora_base_dtype != 'float32' and not use_lora:
    raise UserError(f"lora_base_dtype={lora_base_dtype!r} keeps a LoRA run's frozen base in 4 or 16 bits, but this run "
                    f"is not one: it trains every weight. Drop lora_base_dtype, or set use_lora=True.")
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
if use_lora:
    from lm.lora import (LORA_SETTINGS, apply_lora, check_lora_base_dtype, disable_adapters, lora_optimizer,
                         lora_state_dict, merged_copy, refresh_merged_copy, save_merged)
    check_lora_base_dtype(lora_base_dtype, ptdtype, 'ddp')
# on a GPU a decode step waits on kernel launches, which a CUDA graph and merged adapters remove; on a CPU it
# waits on arithmetic, and compiling costs minutes (docs/rl.md)
decoding = CompiledDecoding() if (device_type == 'cuda' if compile_decode is None else compile_decode) else None
sample_merged = use_lora and (device_type == 'cuda' if merged_rollouts is None else merged_rollouts)
if prompts_per_step % world_size or prompts_per_step // world_size * num_generations % gradient_accumulation_steps:
    raise UserError(f"prompts_per_step={prompts_per_step} must split evenly over the {world_size} process(es), and "
                    f"each one's {prompts_per_step // world_size} x num_generations={num_generations} completions "
                    f"over gradient_accumulation_steps={gradient_accumulation_steps} micro-batches; change one.")
completions_per_rank = prompts_per_step // world_size * num_generations
completions_per_micro_batch = completions_per_rank // gradient_accumulation_steps
prompts_per_sampling = None  # prompts sampled at once: all of a rank's share, until they run out of memory

# out_dir: locked before any work; a checkpoint there is this run's to continue, never another's.
# this_run: what the run is (nanoGPT's init_from='resume' continues out_dir's, begun where it began)
this_run = dict(script='train_rl.py', use_lora=use_lora, init_from=run_origin(init_from, out_dir, resume))
out_dir_lock, ckpt_path, ckpt = open_run(config, this_run, master)
resuming = ckpt is not None
# the chat model the policy starts as and the KL penalty measures against (a continued run: the one
# its checkpoint names)
reference_ckpt, reference_path, reference_hash = reference_checkpoint(ckpt, init_from, out_dir)

# data
# a published model's config files, which export.py writes back
hf_files = hf_source(reference_ckpt, chat_template_variables)
# the tokenizer and chat template: a published model's own, else corpus_dir's (data_dir, or the
# default corpus, which rank 0 prepares once)
if not data_dir and not hf_files:
    from data import prepare_default
    prepare_once(prepare_default, compute, key='')  # train_rl.py names no folder for it
corpus_dir, base_tokenizer = run_tokenizer(data_dir, reference_ckpt, reference_path,
                                           hf_files.get('chat_template_variables'))
tokenizer = chat_tokenizer(base_tokenizer)
check_compatible(reference_ckpt['tokenizer'], tokenizer.identity(), 'tokenizer', reference_path,
                 fix="Point data_dir at the tokenizer folder the model was trained with ('' for the default).")
model_args = dict(reference_ckpt['model_args'], dropout=dropout)
if max_prompt_length + max_new_tokens > model_args['block_size']:
    raise UserError(f"max_prompt_length={max_prompt_length} + max_new_tokens={max_new_tokens} is longer than the "
                    f"model's block_size={model_args['block_size']}; lower one of them.")
# the prompts of rl_data, or of the embedded number tasks (rank 0 prepares them once): each
# (prompt ids, record, where), where naming its file and row for a reward's messages
prompts_dir = rl_data or NUMBER_TASKS_DIR
if not rl_data:
    prepare_once(prepare_number_tasks, compute)
train_path, test_path = os.path.join(prompts_dir, 'train.jsonl'), os.path.join(prompts_dir, 'test.jsonl')
held_out_path = test_path if os.path.exists(test_path) else os.path.join(prompts_dir, 'val.jsonl')
train_prompts, held_out_rows = ([(ids, record, f'{path} (prompt {i + 1})') for i, (ids, record) in
                                 enumerate(load_prompt_split(path, tokenizer, max_prompt_length, skip_malformed))]
                                for path in (train_path, held_out_path))
# each eval samples the first eval_prompts held-out prompts
held_out_prompts = held_out_rows[:eval_prompts]
exact_match_prompts = [(ids, reference) for ids, reference in ((ids, rl_reference(tokenizer, record))
                                                                for ids, record, _ in held_out_rows)
                       if reference is not None][:exact_match_examples]
# a continued run must still draw the same prompts; the rows' other fields (a reward's) may change
train_prompts_hash = hashlib.sha256(json.dumps([ids for ids, _, _ in train_prompts]).encode()).hexdigest()
same_prompts = bool(ckpt) and ckpt.get('train_prompts_hash') == train_prompts_hash
train_data_hash = training_data_hash(train_path, ckpt, out_dir, 'rl_data', same_prompts)
train_sampler = EpochSampler(len(train_prompts), seed)
# greedy exact match on the held-out prompts that have a reference answer, at the start and the end
held_out = HeldOut(tokenizer, exact_match_prompts, ['exact_match'], prompts_per_step, model_args['block_size'])
reward_fns, reward_weights_list = load_rewards(reward, reward_weights, format_reward)
check_rows(reward_fns, train_prompts + held_out_prompts)
reward_name = ' + '.join(f'{w:g} x {r.name}' if len(reward_fns) > 1 else r.name
                         for r, w in zip(reward_fns, reward_weights_list))
stop_ids = stop_tokens(tokenizer)  # the end of the assistant's turn

# policy, and the reference (only with beta > 0): a frozen copy when training all weights, the
# policy itself with its adapters disabled when training LoRA
model = build_model(GPTConfig(**model_args), reference_ckpt, False, lora_base_dtype)
reference = (frozen_model(GPTConfig(**model_args), reference_ckpt['model'], 'ddp', local_device, ptdtype, False)
             if beta > 0 and not use_lora else None)
if use_lora:
    apply_lora(model, lora_r, lora_alpha, lora_dropout, lora_target_modules, use_rslora, lora_bias)
if ckpt:
    fixed = ('use_lora', 'optimizer_type') + (LORA_SETTINGS if use_lora else ())
    saved = {'optimizer_type': 'adamw', **ckpt['config']}  # older checkpoints: AdamW's
    check_compatible({k: saved.get(k) for k in fixed}, {k: config[k] for k in fixed}, 'setup', ckpt_path,
                     fix="Set these keys to the checkpoint's values, or start a new run (another out_dir, or "
                         "--resume=False).")
    model.load_state_dict({**model.state_dict(), **ckpt['model']})  # strict: all weights, or every adapter
place_model(model, 'ddp', local_device, ptdtype, False)
raw_model = model  # what we save and generate with: never compiled or DDP-wrapped
reference_ckpt = None

optimizer = (lora_optimizer(raw_model, weight_decay, learning_rate, (beta1, beta2), device_type, loraplus_lr_ratio)
             if use_lora else raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type))
if optimizer_type == 'adamw8bit':  # the same groups, the moments in 8 bits
    from lm.adamw8bit import in_8_bits
    optimizer = in_8_bits(optimizer)
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)
get_lr = LRSchedule.from_config(config)
# best_pass_at_1: the best held-out pass@1 of an eval so far
iter_num, best_pass_at_1, evals_without_improvement = 0, -math.inf, 0
if ckpt:
    if (ckpt['prompts_per_step'], ckpt['num_generations']) != (prompts_per_step, num_generations):
        raise UserError(f"{ckpt_path} was trained with prompts_per_step={ckpt['prompts_per_step']} and "
                        f"num_generations={ckpt['num_generations']}; resume with those, {NEW_RUN}.")
    train_sampler.load_state_dict(ckpt['train_sampler'])
    iter_num, stored_best, evals_without_improvement = restore_training_state(ckpt, ckpt_path, optimizer, scaler,
                                                                              rank, world_size, raw_model)
    # checkpoints store it as a loss, -pass@1 (save)
    best_pass_at_1 = -stored_best
    # an out-of-memory error halved the micro-batch (halve_after_oom): the same split continues halved
    saved_split = (ckpt['config']['gradient_accumulation_steps'], len(ckpt['rng']))  # one random state a process
    if saved_split == (gradient_accumulation_steps, world_size) and ckpt.get('completions_per_micro_batch', 0) and \
            ckpt['completions_per_micro_batch'] < completions_per_micro_batch:
        completions_per_micro_batch = ckpt['completions_per_micro_batch']
        log(f"continuing with {completions_per_micro_batch} completions a micro-batch (halved after an "
            f"out-of-memory error)")
    if len(ckpt['rng']) == world_size and ckpt.get('prompts_per_sampling'):  # of a rank's share: same ranks
        prompts_per_sampling = ckpt['prompts_per_sampling']
        log(f"continuing to sample {prompts_per_sampling} prompts at a time (halved after an out-of-memory error)")
# rank 0 logs to Weights & Biases too, a continued run to its W&B run
tracker = start_wandb(config, ckpt and ckpt.get('wandb_run_id'), master) if wandb_log else None
ckpt = None
model = wrap_model(model, compile, ddp, local_rank, device_type)
# the model rollouts sample from: the adapters merged into a copy of the weights in the run's dtype, or the model
policy = merged_copy(raw_model, ptdtype) if sample_merged else raw_model
log(f"device {local_device}, dtype {ptdtype}, {world_size} process(es), "
    f"{raw_model.get_num_params() / 1e6:.2f}M params, {prompts_per_step} prompts x {num_generations} completions "
    f"per step, loss {loss_type}, ratio clipped to [{1 - epsilon:g}, {1 + clip_high:g}], reward {reward_name}, "
    f"reference: " + ('none (beta=0)' if beta == 0 else 'the model with adapters disabled' if use_lora else
                      'a frozen copy'))


def draws(*key):
    """The random numbers of one batch of rollouts, the same on every rank: a generator seeded by key."""
    return torch.Generator(device=local_device).manual_seed(hash((seed, *key)) & (2 ** 63 - 1))


def my_share(n):
    """(start, stop): this rank's contiguous share of a batch of n prompts (tensor_split's; all on one process)."""
    start = rank * (n // world_size) + min(rank, n % world_size)
    return start, start + n // world_size + (rank < n % world_size)


@torch.no_grad()
def rollouts(batch, n_samples, generator):
    """n_samples completions of each of this rank's share (my_share) of a batch of prompts ((ids, record,
    where) triples) sampled by the policy, and their rewards: (completions (token ids), rewards (n,) the weighted
    sum, stopped (n,) bool: ended with a stop token, per_reward (n, rewards): each reward's values, NaN where it
    returned None). Every rank draws the whole batch's numbers from generator and samples
    its rows with its own: the rollouts are one process's, whatever the number of ranks."""
    start, stop = my_share(len(batch))
    prompts = batch[start:stop]
    raw_model.eval()
    try:
        completions = sampled(prompts, n_samples, generator, start, len(batch))
    finally:
        raw_model.train()
    stopped = torch.tensor([bool(c) and c[-1] in stop_ids for c in completions])
    rows = [prompts[i // n_samples] for i in range(len(completions))]
    records, wheres = [record for _, record, _ in rows], [where for _, _, where in rows]
    messages = [rl_prompt(record) for record in records]
    texts = [tokenizer.decode(c[:-1] if s else c, skip_special=True) for c, s in zip(completions, stopped)]  # as TRL
    # each reward's values (NaN: it could not score it), their weighted sum, NaNs adding 0 (TRL's)
    per_reward = torch.tensor([reward_values(r, messages, texts, records, wheres) for r in reward_fns],
                              device=local_device).T
    total = (per_reward * torch.tensor(reward_weights_list, device=local_device)).nansum(1)
    return completions, total, stopped, per_reward


def sampled(prompts, n_samples, generator, first, n_prompts):
    """generate_batch's n_samples completions of each of prompts, the batch's first... of n_prompts, at most
    prompts_per_sampling at a time: halved where they run out of memory (memory.in_parts), each part from the
    generator's state again, so every completion draws the numbers it would in one batch (rows_of)."""
    state, completions = generator.get_state(), []

    def sample(start, stop):
        generator.set_state(state)
        with autocast:
            completions.extend(generate_batch(policy, [ids for ids, _, _ in prompts[start:stop]], max_new_tokens,
                                              temperature, top_k or None, top_p, stop_ids, n_samples, generator,
                                              rows_of=((first + start) * n_samples, n_prompts * n_samples),
                                              decoding=decoding))

    def smaller(size):
        global prompts_per_sampling
        prompts_per_sampling = size
        log(f"rollouts: out of memory, sampling {size} prompts at a time from here on")
    in_parts(len(prompts), prompts_per_sampling or len(prompts), sample, local_device,
             f"out of memory sampling one prompt's {n_samples} completions: lower num_generations (pass_k in the "
             f"evals) or max_new_tokens, or use a device with more memory.", smaller)
    return completions


def token_logps_and_logits(net, batch):
    """Per-token log-probs (N',) of a micro-batch's (lm/rl.CompletionBatch) scored completion tokens under net,
    and the logits (N', V) they come from, divided by the sampling temperature (the distribution the
    completions were drawn from)."""
    logits, _ = net(batch.x, positions=batch.positions, mask=batch.mask, logits_at=(batch.rows, batch.cols))
    logits = logits.float() / temperature
    return -F.cross_entropy(logits, batch.targets, reduction='none'), logits


@torch.no_grad()
def fixed_logps(batches, use_reference):
    """Per micro-batch, the per-token log-probs of the policy as it sampled (the PPO ratio's denominator) or, with
    use_reference, of the reference: the frozen copy, or the policy with its adapters disabled."""
    net = reference if use_reference and reference is not None else raw_model
    raw_model.eval()
    try:
        with disable_adapters(raw_model) if use_reference and use_lora else nullcontext(), autocast:
            logps = [token_logps_and_logits(net, batch)[0] for batch in batches]
    finally:  # an out-of-memory error, retried, must not leave the policy in eval mode
        raw_model.train()
    return logps


def train_step(batches, advantages, old_logps, ref_logps, totals):
    """Forward/backward of this rank's micro-batches (lm/rl.CompletionBatch, accumulating gradients); returns its
    shares of the loss and token metrics (shares add up over ranks). advantages (n,): of this rank's
    completions; old_logps, ref_logps: per micro-batch, the per-token log-probs of the policy as it sampled
    (None: one iteration, ratio 1) and of the reference (None: beta 0); totals: (sequences, completion
    tokens, max_new_tokens) of the whole batch over all ranks, which every normalisation divides by."""
    shares = {}
    for micro_step, batch in enumerate(batches):
        # only the last micro-batch reduces gradients across ranks
        with gradient_sync(model, raw_model, sync=micro_step == len(batches) - 1):
            with autocast:
                logps, logits = token_logps_and_logits(model, batch)
            token_advantages = advantages[batch.first + batch.owners]
            old = logps.detach() if old_logps is None else old_logps[micro_step]  # one iteration: ratio 1
            log_ratio = logps - old
            if importance_sampling_level == 'sequence':  # GSPO: one ratio, its tokens' mean, for a sequence
                log_ratio = sequence_log_ratio(log_ratio, batch.owners, batch.lengths)
            token_loss, clipped = clipped_token_loss(log_ratio, token_advantages, epsilon, clip_high)
            # TRL's: the ratio cut below 1 - epsilon (A < 0) or above 1 + epsilon_high (A > 0)
            metrics = {'clip_ratio/region_mean': clipped.float(),
                       'clip_ratio/low_mean': (clipped & (token_advantages < 0)).float(),
                       'clip_ratio/high_mean': (clipped & (token_advantages > 0)).float()}
            if beta > 0:
                kl = k3_kl(logps, ref_logps[micro_step])
                token_loss = token_loss + beta * kl
                metrics['kl'] = kl.detach()
            loss = normalized_loss(token_loss, batch.owners, batch.lengths, loss_type, totals)
            scaler.scale(loss * world_size).backward()  # DDP averages gradients over ranks: undo 1/world_size
        metrics['entropy'] = token_entropy(logits.detach())
        for k, v in metrics.items():  # token means over the whole batch
            shares[k] = shares.get(k, 0.0) + v.sum() / max(totals[1], 1)
        shares['loss'] = shares.get('loss', 0.0) + loss.detach()
    return shares


def halve_after_oom(error, where):
    """After a RuntimeError in a step or its scoring (where): re-raise it unless it is an out-of-memory error this
    process can retry; else halve the completions a micro-batch holds (every loss divides by the whole batch's
    counts, so the step is the same)."""
    global completions_per_micro_batch
    recover_from_oom(error, ddp, optimizer, local_device)
    if completions_per_micro_batch == 1:
        raise UserError("out of memory with one completion per micro-batch, so it cannot shrink further. Lower "
                        "max_new_tokens, use a smaller model, or use a device with more memory.")
    completions_per_micro_batch = (completions_per_micro_batch + 1) // 2
    log(f"{where}: out of memory, retrying with {completions_per_micro_batch} completions a micro-batch")


def fitting_batches(sequences, scored):
    """This rank's completions as micro-batches (completion_batches), with their fixed log-probs: the policy's as
    it sampled (None with one iteration) and the reference's (None with beta 0); halved while they do not fit."""
    while True:
        try:
            batches = completion_batches(sequences, scored, completions_per_micro_batch, local_device)
            return (batches, fixed_logps(batches, use_reference=False) if num_iterations > 1 else None,
                    fixed_logps(batches, use_reference=True) if beta > 0 else None)
        except RuntimeError as error:
            halve_after_oom(error, 'scoring')


def resplit(logps, batches):
    """Per-micro-batch log-probs (fixed_logps') split for other micro-batches of the same completions (None:
    None). The policy has moved since the old ones were computed: they are split again, not recomputed."""
    return None if logps is None else list(torch.cat(logps).split([len(batch.targets) for batch in batches]))


def gathered(tensor):
    """tensor (n,) of every rank, concatenated in rank order."""
    if not ddp:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def per_reward_metrics(rewards, per_reward):
    """rewards/<name>/mean and /std of each of rewards (Rewards) over a step's completions, per_reward (n, rewards)
    their values, NaN where one returned None: TRL's nanmean and nanstd (Bessel's) of the values it scored, left
    out where they do not exist (TRL logs NaN): the mean of a reward that scored none, the std of one that scored
    fewer than two. Also returns the names of the rewards that scored no completion."""
    metrics, scored_none = {}, []
    for r, values in zip(rewards, per_reward.T):
        scored = values[~values.isnan()]
        if len(scored) == 0:
            scored_none.append(r.name)
            continue
        metrics[f'rewards/{r.name}/mean'] = scored.mean().item()
        if len(scored) > 1:
            metrics[f'rewards/{r.name}/std'] = scored.std().item()
    return metrics, scored_none


@torch.no_grad()
def evaluate(iter_num):
    """pass@1 and pass@pass_k of the held-out prompts, each sampled pass_k times (in batches of prompts_per_step,
    each rank its share; the same samples at every eval and on any number of ranks), and their mean reward;
    logged and recorded at step iter_num. Returns pass@1."""
    sums = torch.zeros(4, device=local_device)  # pass@1, pass@k, reward, prompts
    for start in range(0, len(held_out_prompts), prompts_per_step):
        batch = held_out_prompts[start:start + prompts_per_step]
        part = batch[slice(*my_share(len(batch)))]
        if not part:
            continue
        _, rewards, _, _ = rollouts(batch, pass_k, draws(1, start))
        counts = [(pass_k, int(c)) for c in (rewards.view(-1, pass_k) >= correct_reward).sum(1).tolist()]
        sums += torch.tensor([mean_pass_at_k(counts, 1) * len(part), mean_pass_at_k(counts, pass_k) * len(part),
                              rewards.sum().item() / pass_k, len(part)], device=local_device)
    if ddp:
        dist.all_reduce(sums)
    pass1, passk, mean_reward = (sums[:3] / sums[3]).tolist()
    log(f"step {iter_num}: eval pass@1 {pass1:.3f}, pass@{pass_k} {passk:.3f}, reward {mean_reward:.3f} "
        f"({int(sums[3])} held-out prompts x {pass_k})")
    record({'step': iter_num, 'eval/pass@1': pass1, f'eval/pass@{pass_k}': passk, 'eval/reward': mean_reward})
    return pass1


def save(path, iter_num, best_pass_at_1, evals_without_improvement):
    """A checkpoint of the run at path (write_checkpoint) at step iter_num, with the eval counters: collective
    under DDP, every rank must call it."""
    weights = raw_model.state_dict(keep_vars=True)
    # best_val_loss, the field every script's checkpoint has, holds -pass@1: lower is better
    state = dict(training_state(this_run, dict(config, training_type='rl'), optimizer, scaler, iter_num,
                                -best_pass_at_1, evals_without_improvement),
                 kind='gpt', model=weights, model_args=model_args, tokenizer=tokenizer.identity(),
                 data_dir=os.path.abspath(corpus_dir), train_sampler=train_sampler.state_dict(),
                 prompts_per_step=prompts_per_step, num_generations=num_generations,
                 completions_per_micro_batch=completions_per_micro_batch, prompts_per_sampling=prompts_per_sampling,
                 reference_checkpoint=os.path.abspath(reference_path), reference_hash=reference_hash,
                 train_data_hash=train_data_hash, train_prompts_hash=train_prompts_hash,
                 wandb_run_id=tracker and tracker.id, **hf_files)
    if use_lora:  # adapters only: the base is the reference checkpoint, named by path and hash
        state.update(kind='lora', model=lora_state_dict(raw_model, weights),
                     base_checkpoint=state['reference_checkpoint'], base_hash=reference_hash)
    write_checkpoint(path, state, False, master)


# an eval_only run appends to the log; a continued run drops what it logged past its checkpoint
record, writer = run_log(out_dir, master, tensorboard, math.inf if eval_only else iter_num if resuming else -1,
                         tracker)

if eval_only or iter_num == 0:
    evaluate(iter_num)
    report_heldout(raw_model, held_out, autocast, iter_num, record)
if eval_only:
    compute_cleanup(ddp)
    sys.exit(0)
stop = StopSignal()
bad_steps = 0
window = defaultdict(list)  # each metric's values since the last log line, logged as their mean (as TRL)
said_scored_none = set()  # the rewards whose warning that they scored no completion of a step was given
progress = tqdm(total=max_iters, initial=iter_num, disable=not master, dynamic_ncols=True, desc='rl')
while iter_num < max_iters:
    lr = get_lr(iter_num)
    set_lr(optimizer, lr)

    # rollouts: this rank's slice of the step's prompts, G completions each, scored by the reward
    t0 = time.time()
    batch = [train_prompts[i] for i in train_sampler.sample(prompts_per_step)]
    prompts = batch[slice(*my_share(len(batch)))]
    completions, rewards, stopped, per_reward = rollouts(batch, num_generations, draws(0, iter_num))
    all_rewards = gathered(rewards)  # a group is on one rank, but the 'batch' std is over all
    all_per_reward = gathered(per_reward)
    advantages = group_advantages(all_rewards, num_generations, scale_rewards).view(world_size, -1)[rank]
    sequences = [(prompts[i // num_generations][0], c) for i, c in enumerate(completions)]
    scored = [bool(s) or not mask_truncated_completions for s in stopped.tolist()]  # DAPO's mask: truncated ones out
    t1 = time.time()
    batches, old_logps, ref_logps = fitting_batches(sequences, scored)
    lengths = torch.tensor([len(c) for c in completions], device=local_device, dtype=torch.float)
    counts = gathered(torch.stack([lengths.sum(), sum(b.lengths.sum() for b in batches).float(),
                                   stopped.sum().to(local_device, torch.float)]).view(1, 3)).sum(0)
    generated_tokens, scored_tokens, n_stopped = counts.tolist()
    totals = (prompts_per_step * num_generations, scored_tokens, max_new_tokens)

    # num_iterations optimizer steps on the batch: the first at ratio 1, the later ones clipped
    for iteration in range(num_iterations):
        while True:
            try:
                shares = train_step(batches, advantages, old_logps, ref_logps, totals)
                break
            # CUDA raises torch.OutOfMemoryError, MPS and the CPU a plain RuntimeError
            except RuntimeError as error:
                halve_after_oom(error, f'step {iter_num}')
                batches = completion_batches(sequences, scored, completions_per_micro_batch, local_device)
                old_logps, ref_logps = resplit(old_logps, batches), resplit(ref_logps, batches)
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(raw_model.parameters(), grad_clip)
        metrics, (stop_requested,) = all_reduce_metrics(shares, [stop.requested is not None], ddp)
        loss = metrics['loss']
        for k, v in metrics.items():
            window[k].append(v)
        # fp16: a non-finite grad norm is an overflow, which scaler.step skips (update backs off)
        if math.isfinite(loss) and (math.isfinite(grad_norm) or scaler.is_enabled()):
            scaler.step(optimizer)
            bad_steps = 0
        else:
            bad_steps = bad_step(bad_steps, config, iter_num, loss, grad_norm)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    merge_seconds = 0.0
    if policy is not raw_model:  # the next rollouts sample from the adapters as they are now
        t_merge = time.time()
        refresh_merged_copy(policy, raw_model)
        merge_seconds = time.time() - t_merge
    iter_num += 1
    progress.update(1)
    t2 = time.time()

    groups = all_rewards.view(-1, num_generations)
    # TRL's: std ~ 0 of the rewards as scale_rewards groups them (with 'batch', the whole step's)
    reward_stds = groups.std(1) if scale_rewards != 'batch' else all_rewards.std().expand(len(groups))
    n_completions = len(all_rewards)
    step_metrics = {'reward': all_rewards.mean().item(), 'reward_std': all_rewards.std().item(),
                    'accuracy': (all_rewards >= correct_reward).float().mean().item(),
                    'frac_reward_zero_std': reward_stds.isclose(torch.zeros_like(reward_stds)).float().mean().item(),
                    'completions/mean_length': generated_tokens / n_completions,
                    'completions/clipped_ratio': 1 - n_stopped / n_completions,
                    'time/generation_s': t1 - t0, 'time/training_s': t2 - t1, 'time/merge_s': merge_seconds,
                    'generation/tokens_per_sec': generated_tokens / (t1 - t0)}
    reward_metrics, scored_none = per_reward_metrics(reward_fns, all_per_reward)
    step_metrics.update(reward_metrics)
    for name in sorted(set(scored_none) - said_scored_none):  # once a reward: a run may go on for days
        log(f"step {iter_num}: warning: reward {name} scored none of the {n_completions} completions (it returned None "
            f"for each), so it added 0 to their rewards; None is for a completion a reward cannot score. Said once.")
        said_scored_none.add(name)
    for k, v in step_metrics.items():
        window[k].append(v)

    if iter_num % log_interval == 0 or iter_num == max_iters:
        means = {k: sum(v) / len(v) for k, v in window.items()}
        window.clear()
        record(dict(step=iter_num, lr=lr, grad_norm=grad_norm,
                    peak_memory_mb=(peak_memory_bytes(local_device) or 0) / 2**20, **means))
        progress.set_postfix(reward=f"{means['reward']:.3f}")
        no_signal = means['frac_reward_zero_std'] == 1
        # no rewards/<name>/mean in the window: every reward returned None for every completion
        why = "no reward scored any completion" if not any(f'rewards/{r.name}/mean' in means for r in reward_fns) \
            else "too hard or too easy prompts, or a constant reward"
        log(f"step {iter_num}: reward {means['reward']:.3f} (std {means['reward_std']:.3f}), loss {means['loss']:.4f}, "
            f"length {means['completions/mean_length']:.1f}, lr {lr:.2e}, grad norm {grad_norm:.3f}, generation "
            f"{means['time/generation_s']:.2f}s, training {means['time/training_s']:.2f}s" + (
                f"; warning: every group's {num_generations} rewards were equal, so every advantage was 0 and "
                f"nothing was learned ({why})" if no_signal else ''))

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        pass_at_1 = evaluate(iter_num)
        improved = pass_at_1 > best_pass_at_1
        if improved:
            best_pass_at_1, evals_without_improvement = pass_at_1, 0
            save(os.path.join(out_dir, 'best.pt'), iter_num, best_pass_at_1, evals_without_improvement)
        else:
            evals_without_improvement += 1
        if improved or always_save_checkpoint:
            save(ckpt_path, iter_num, best_pass_at_1, evals_without_improvement)

    if stop_requested:
        save(ckpt_path, iter_num, best_pass_at_1, evals_without_improvement)
        progress.close()
        stop.exit(ckpt_path, iter_num, ddp)
progress.close()
save(ckpt_path, iter_num, best_pass_at_1, evals_without_improvement)
report_heldout(raw_model, held_out, autocast, iter_num, record)
if use_lora:
    save_merged(out_dir, raw_model, master, model_args=model_args, config=dict(config, training_type='rl'),
                iter_num=iter_num, tokenizer=tokenizer.identity(), data_dir=os.path.abspath(corpus_dir), **hf_files)
compute_cleanup(ddp)
