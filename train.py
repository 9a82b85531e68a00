"""
Train a GPT. `python train.py` trains a small model on the Python standard library's own
sources (prepared once under data/stdlib); `python train.py config/shakespeare_char.py` trains on
another prepared corpus; `torchrun --nproc_per_node=8 train.py ...` runs data-parallel.
Every config key below can be overridden by a config file or --key=value (`--help` lists them).
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from checkpoint import StopSignal, check_compatible, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from configurator import UserError, configure
from data import TokenBatches, eval_offsets, load_tokenizer, prepare_default
from memory import (GradScaler, MemoryMonitor, StepProfiler, autocast_context, fault_at, free_memory,
                    halve_micro_batch, is_oom, peak_memory_bytes, pick_device, pick_dtype)
from model import GPT, GPTConfig
from muon import Muon, muon_param_groups
from scheduler import get_lr

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out'              # checkpoints (ckpt.pt latest, best.pt best val), log.jsonl, tensorboard
data_dir = ''                # a folder made by data.py; '' = the embedded default (stdlib sources, data/stdlib)
init_from = 'auto'           # 'scratch' | 'resume' (out_dir/ckpt.pt must exist) | 'auto' (resume if it exists) | path to a checkpoint whose weights start a new run
eval_interval = 100          # steps between evals (and checkpoint saves)
eval_iters = 20              # val batches per eval
log_interval = 10            # steps between train-loss log lines
eval_only = False            # evaluate the checkpoint and exit
always_save_checkpoint = True  # save ckpt.pt at every eval, not only when val loss improves
early_stopping_patience = 0  # stop after this many evals without val improvement; 0 = never
max_bad_steps = 5            # abort after this many consecutive steps with non-finite loss/grad norm
tensorboard = True           # write TensorBoard logs to out_dir/tb
profile = False              # time data/forward/backward/optimizer per step (adds syncs on GPU)
sample_tokens = 200          # tokens generated at the end of training
seed = 1337
# data
batch_size = 16              # micro-batch size per process
block_size = 128             # context length
gradient_accumulation_steps = 1  # micro-batches per optimizer step per process
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
zero_init_proj = False       # residual output projections start at zero (each block starts as the identity)
activation_checkpointing = False  # recompute activations in backward to save memory
# optimizer
learning_rate = 3e-3
max_iters = 600
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0              # 0 = no clipping (grad norm is still logged)
optimizer_type = 'adamw'     # 'adamw' | 'muon' (muon.py: Muon for the blocks' matrices, AdamW for the rest)
muon_lr = 0.02               # Muon's peak lr; it follows the lr schedule in proportion (muon_lr / learning_rate)
muon_momentum = 0.95
# learning-rate schedule (scheduler.py)
lr_schedule = 'cosine'       # 'cosine' | 'cosine_restarts' | 'noam' | 'constant' | 'linear' | 'wsd'
warmup_iters = 50
lr_decay_iters = 600         # where the decay ends (usually = max_iters)
min_lr = 3e-4
# system
device = 'auto'              # 'auto' | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' (bf16 where supported, else fp16 + loss scaling) | 'bfloat16' | 'float16' | 'float32'
compile = False              # torch.compile the model
num_threads = 0              # CPU threads for torch ops (torch.set_num_threads); 0 = torch's default
# -----------------------------------------------------------------------------
config = configure(globals())

# DDP: torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; nccl on CUDA, gloo elsewhere
ddp = int(os.environ.get('RANK', -1)) != -1
device = pick_device(device)
if ddp:
    rank, local_rank, world_size = int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), int(os.environ['WORLD_SIZE'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
else:
    rank, local_rank, world_size = 0, 0, 1
master = rank == 0
device_type = device.split(':')[0]
ptdtype = pick_dtype(device, dtype)
if num_threads:
    torch.set_num_threads(num_threads)
autocast = autocast_context(device, ptdtype)
torch.manual_seed(seed + rank)  # per-rank seed: different dropout masks on each rank
if device_type == 'cuda':
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def log(msg):
    if master:
        tqdm.write(msg)


# data: rank 0 prepares the default corpus once, the others wait for it
if not data_dir:
    if master:
        prepare_default()
    if ddp:
        dist.barrier()
    data_dir = os.path.join('data', 'stdlib')
tokenizer = load_tokenizer(data_dir)
train_batches = TokenBatches(os.path.join(data_dir, 'train.bin'), block_size, seed)
val_batches = TokenBatches(os.path.join(data_dir, 'val.bin'), block_size, seed)
val_offsets = eval_offsets(val_batches.n_tokens, block_size, eval_iters * batch_size)

# model, from scratch or from a checkpoint (shape and tokenizer must match the config)
model_args = dict(block_size=block_size, vocab_size=tokenizer.vocab_size, n_layer=n_layer, n_head=n_head,
                  n_embd=n_embd, dropout=dropout, bias=bias, pos_emb=pos_emb, norm=norm, mlp=mlp,
                  tie_embeddings=tie_embeddings, qk_norm=qk_norm, logit_softcap=logit_softcap,
                  zero_init_proj=zero_init_proj)
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
if init_from == 'auto':
    init_from = 'resume' if os.path.exists(ckpt_path) else 'scratch'
if init_from == 'resume' and not os.path.exists(ckpt_path):
    raise UserError(f"init_from='resume' but {ckpt_path} does not exist. Use --init_from=auto to start fresh "
                    f"when there is no checkpoint, or point --out_dir at the run to resume.")
ckpt = None
if init_from != 'scratch':
    ckpt_source = ckpt_path if init_from == 'resume' else init_from
    ckpt = load_checkpoint(ckpt_source)
    shape = lambda args: {k: v for k, v in args.items() if k != 'dropout'}  # dropout may change between runs
    check_compatible(shape(ckpt['model_args']), shape(model_args), 'model shape', ckpt_source)
    check_compatible(ckpt['tokenizer'], tokenizer.identity(), 'tokenizer', ckpt_source)
model = GPT(GPTConfig(**model_args))
if ckpt is not None:
    model.load_state_dict(ckpt['model'])
model.activation_checkpointing = activation_checkpointing
model.to(device)
raw_model = model  # what we save and sample from: never compiled or DDP-wrapped

if optimizer_type == 'muon':
    optimizer = Muon(muon_param_groups(raw_model, learning_rate, weight_decay, (beta1, beta2), muon_lr, muon_momentum))
elif optimizer_type == 'adamw':
    optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
else:
    raise UserError(f"optimizer_type={optimizer_type!r} is not supported; use 'adamw' or 'muon'.")
scaler = GradScaler(enabled=ptdtype == torch.float16)
iter_num, best_val_loss, evals_without_improvement = 0, float('inf'), 0
if init_from == 'resume':
    check_compatible({'optimizer_type': ckpt['config'].get('optimizer_type', 'adamw')},
                     {'optimizer_type': optimizer_type}, 'optimizer', ckpt_path)
    optimizer.load_state_dict(ckpt['optimizer'])
    scaler.load_state_dict(ckpt['scaler'])
    train_batches.load_state_dict(ckpt['train_batches'])
    iter_num, best_val_loss = ckpt['iter_num'], ckpt['best_val_loss']
    evals_without_improvement = ckpt['evals_without_improvement']
    # an earlier OOM may have shrunk the micro-batch; keep that split if the global batch is unchanged
    if ckpt['batch_size'] * ckpt['gradient_accumulation_steps'] == batch_size * gradient_accumulation_steps:
        batch_size, gradient_accumulation_steps = ckpt['batch_size'], ckpt['gradient_accumulation_steps']
    if len(ckpt['rng']) == world_size:
        set_rng_state(ckpt['rng'][rank])
    else:
        log(f"note: checkpoint was written by {len(ckpt['rng'])} processes, now {world_size}: random streams restart")
    log(f"resuming from {ckpt_path} at step {iter_num}")
ckpt = None  # free memory

if compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)

device_name = torch.cuda.get_device_name(device) if device_type == 'cuda' else device_type
tokens_per_step = batch_size * block_size * gradient_accumulation_steps * world_size
log(f"device {device}, dtype {ptdtype}, {world_size} process(es), {raw_model.get_num_params() / 1e6:.2f}M params, "
    f"{tokens_per_step:,} tokens per step")


@torch.no_grad()
def evaluate():
    """Mean val loss over a fixed set of windows, split across ranks."""
    model.eval()
    mine = val_offsets.tensor_split(world_size)[rank].split(batch_size)
    total = torch.zeros(2, device=device)  # loss sum, count
    for offsets in mine:
        x, y = val_batches.get(offsets, device)
        with autocast:
            _, loss = model(x, y)
        total += torch.stack([loss.float() * len(offsets), torch.tensor(float(len(offsets)), device=device)])
    if ddp:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def checkpoint_state():
    rngs = [None] * world_size
    if ddp:
        dist.all_gather_object(rngs, rng_state())
    else:
        rngs = [rng_state()]
    return dict(kind='gpt', model=raw_model.state_dict(), model_args=model_args, optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), iter_num=iter_num, best_val_loss=best_val_loss,
                evals_without_improvement=evals_without_improvement, config=config,
                tokenizer=tokenizer.identity(), data_dir=os.path.abspath(data_dir), rng=rngs,
                train_batches=train_batches.state_dict(), batch_size=batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps)


def save(path):
    state = checkpoint_state()  # collective under DDP: every rank must call it
    if master:
        save_checkpoint(path, state)


def train_step(offsets):
    """Forward/backward over this rank's share of the global batch; returns the mean micro-batch loss."""
    micro_batches = offsets.view(gradient_accumulation_steps, batch_size)
    loss_sum = torch.zeros((), device=device)
    for micro_step, micro_offsets in enumerate(micro_batches):
        with profiler.section('data'):
            x, y = train_batches.get(micro_offsets, device)
        last = micro_step == gradient_accumulation_steps - 1
        # only the last micro-batch all-reduces gradients
        with model.no_sync() if ddp and not last else nullcontext():
            with profiler.section('forward'), autocast:
                _, loss = model(x, y)
            if fault_at('oom', iter_num):
                raise torch.OutOfMemoryError('injected OOM (NANOTRAIN_FAULT)')
            if fault_at('nan', iter_num):
                loss = loss * float('nan')
            with profiler.section('backward'):
                scaler.scale(loss / gradient_accumulation_steps).backward()
        loss_sum += loss.detach().float()
    return loss_sum / gradient_accumulation_steps


os.makedirs(out_dir, exist_ok=True)
log_file = open(os.path.join(out_dir, 'log.jsonl'), 'a') if master else None
writer = None
if master and tensorboard:
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(out_dir, 'tb'), purge_step=iter_num)


def record(event):
    """One log/eval event to log.jsonl and TensorBoard."""
    if not master:
        return
    log_file.write(json.dumps(event) + '\n')
    log_file.flush()
    if writer:
        for k, v in event.items():
            if k != 'step' and isinstance(v, (int, float)) and v is not None:
                writer.add_scalar(k, v, event['step'])


if eval_only:
    val_loss = evaluate()
    log(f"step {iter_num}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}")
    record(dict(step=iter_num, val_loss=val_loss, val_ppl=math.exp(val_loss)))
    sys.exit(0)

stop = StopSignal()
monitor = MemoryMonitor(device)
profiler = StepProfiler(device, enabled=profile)
if iter_num == 0:
    val_loss = evaluate()
    log(f"step 0: val loss {val_loss:.4f}")
    record(dict(step=0, val_loss=val_loss, val_ppl=math.exp(val_loss), lr=0.0))
bad_steps = 0
window_start, window_tokens = time.time(), 0
progress = tqdm(total=max_iters, initial=iter_num, disable=not master, dynamic_ncols=True, desc='train')
while iter_num < max_iters:
    lr = get_lr(iter_num, lr_schedule, learning_rate, min_lr, warmup_iters, lr_decay_iters, d_model=n_embd)
    for group in optimizer.param_groups:
        group['lr'] = lr * group.get('lr_scale', 1.0)  # Muon's groups run at muon_lr / learning_rate times lr

    # the whole global batch is drawn on every rank; each rank trains on its slice
    global_offsets = train_batches.sample_offsets(batch_size * gradient_accumulation_steps * world_size)
    while True:
        try:
            offsets = global_offsets.tensor_split(world_size)[rank]
            loss = train_step(offsets)
            break
        except RuntimeError as e:  # CUDA raises torch.OutOfMemoryError, MPS a plain RuntimeError
            if not is_oom(e) or ddp:  # ranks would disagree on the new split; let torchrun restart us
                raise
            optimizer.zero_grad(set_to_none=True)
            free_memory(device)
            batch_size, gradient_accumulation_steps = halve_micro_batch(batch_size, gradient_accumulation_steps)
            log(f"step {iter_num}: out of memory, retrying with micro-batch {batch_size} x {gradient_accumulation_steps} accumulation")

    with profiler.section('optimizer'):
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else float('inf'))
        # one all-reduce: global mean loss, and whether any rank was asked to stop
        stats = torch.stack([loss, torch.tensor(float(stop.requested is not None), device=device)])
        if ddp:
            dist.all_reduce(stats)
        loss, stop_requested = stats[0].item() / world_size, stats[1].item() > 0
        grad_norm = grad_norm.item()
        # fp16 overflow is the scaler's business (it skips and backs off); anything else non-finite is ours
        if math.isfinite(loss) and (math.isfinite(grad_norm) or scaler.is_enabled()):
            scaler.step(optimizer)
            bad_steps = 0
        else:
            bad_steps += 1
            log(f"step {iter_num}: non-finite loss {loss} / grad norm {grad_norm}, step skipped ({bad_steps}/{max_bad_steps})")
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    if bad_steps >= max_bad_steps:
        raise SystemExit(f"error: {bad_steps} consecutive steps had a non-finite loss or gradient norm (last at step "
                         f"{iter_num}); training is diverging. Lower learning_rate, raise warmup_iters, or use "
                         f"dtype='float32'. The last good checkpoint in {out_dir} was left untouched.")
    iter_num += 1
    progress.update(1)
    window_tokens += tokens_per_step

    if iter_num % log_interval == 0 or iter_num == max_iters:
        elapsed = time.time() - window_start
        tokens_per_sec = window_tokens / elapsed
        mfu = raw_model.estimate_mfu(tokens_per_sec / world_size, device_name)
        level = monitor.check()
        event = dict(step=iter_num, train_loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_sec=tokens_per_sec,
                     mfu=mfu, memory_level=level, peak_memory_mb=(peak_memory_bytes(device) or 0) / 2**20,
                     loss_scale=scaler.get_scale())
        event.update({f'time_ms/{k}': v for k, v in profiler.summary().items()})
        record(event)
        progress.set_postfix(loss=f'{loss:.4f}', tok_s=f'{tokens_per_sec:,.0f}')
        log(f"step {iter_num}: loss {loss:.4f}, lr {lr:.2e}, grad norm {grad_norm:.3f}, {tokens_per_sec:,.0f} tok/s, "
            + (f"MFU {mfu * 100:.1f}%" if mfu is not None else "MFU unknown"))
        window_start, window_tokens = time.time(), 0

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        val_loss = evaluate()
        improved = val_loss < best_val_loss
        if improved:
            best_val_loss, evals_without_improvement = val_loss, 0
        else:
            evals_without_improvement += 1
        log(f"step {iter_num}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}"
            + (" (best)" if improved else f" (no improvement for {evals_without_improvement} evals)"))
        record(dict(step=iter_num, val_loss=val_loss, val_ppl=math.exp(val_loss), lr=lr))
        if improved:
            save(os.path.join(out_dir, 'best.pt'))
        if improved or always_save_checkpoint:
            save(ckpt_path)
        if early_stopping_patience and evals_without_improvement >= early_stopping_patience:
            log(f"early stopping: val loss has not improved for {evals_without_improvement} evals")
            break

    if stop_requested:
        save(ckpt_path)
        log(f"stop signal received: saved {ckpt_path} at step {iter_num}")
        progress.close()
        if ddp:
            dist.destroy_process_group()
        sys.exit(stop.exit_code if stop.requested else 143)
progress.close()
save(ckpt_path)

if master and sample_tokens > 0:
    raw_model.eval()
    prompt = torch.tensor([tokenizer.encode('\n')], device=device)
    sample = raw_model.generate(prompt, sample_tokens, temperature=0.8, top_k=50,
                                generator=torch.Generator(device=device).manual_seed(seed))
    print(f"--- sample (step {iter_num}, best val loss {best_val_loss:.4f}) ---")
    print(tokenizer.decode(sample[0].tolist()))
if ddp:
    dist.destroy_process_group()
