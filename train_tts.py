"""
Train a flow-matching text-to-speech model (Matcha-TTS in miniature) on an LJSpeech-layout
corpus: `python train_tts.py config/tts_ljspeech.py --data_dir=PATH`. Relaunching the same
command resumes; `--eval_only=True` evaluates the checkpoint (val losses, MCD-DTW, RTF);
`python sample.py --out_dir=out-tts --text="..." --wav=out.wav` speaks.
Every config key below can be overridden by a config file or --key=value (`--help` lists them).
"""

import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from checkpoint import (StopSignal, all_rng_states, check_compatible, claim_out_dir, load_checkpoint,
                        require_init_from, rng_state, run_log, run_origin, run_to_continue, save_checkpoint,
                        set_rng_state)
from configurator import UserError, configure
from losses import mel_cepstral_distortion
from memory import (GradScaler, MemoryMonitor, StepProfiler, autocast_context, fault_at, free_memory, is_oom,
                    peak_memory_bytes, pick_device, pick_dtype, step_unless_nonfinite)
from scheduler import get_lr
import tts_data
from tts_data import (FrameBudgetSampler, LJSpeechDataset, MelExtractor, build_symbols, eval_batches, read_metadata,
                      split_ids, write_wav)
from tts_model import TTSConfig, TTSModel, synthesize

_start_time = time.time()
# -----------------------------------------------------------------------------
# I/O
out_dir = 'out-tts'          # checkpoints (ckpt.pt latest, best.pt best val), log.jsonl, tensorboard, samples/
data_dir = ''                # LJSpeech-layout folder: metadata.csv (id|raw text|normalized text) + wavs/<id>.wav
cache_dir = ''               # log-mel feature cache; '' = <out_dir>/mel_cache
init_from = 'scratch'        # where a new run's weights start: 'scratch' | path to a TTS checkpoint
resume = True                # continue the run in out_dir when it holds one (relaunching a killed command continues it); False = start a new run there, replacing it
eval_interval = 200          # steps between evals (and checkpoint saves)
log_interval = 10            # steps between train-loss log lines
eval_only = False            # evaluate the checkpoint (val losses, MCD-DTW, RTF) and exit
always_save_checkpoint = True  # save ckpt.pt at every eval, not only when val loss improves
early_stopping_patience = 0  # stop after this many evals without val improvement; 0 = never
max_bad_steps = 5            # abort after this many consecutive steps with non-finite loss/grad norm
max_minutes = 0.0            # end training cleanly (checkpoint, final eval) after this many minutes since start; 0 = no limit
tensorboard = True           # write TensorBoard logs (losses, mel images, audio) to out_dir/tb
profile = False              # time data/forward/backward/optimizer per step (adds syncs on GPU)
seed = 1337
# data
val_fraction = 0.05          # held-out share, chosen by a hash of the utterance id
frame_budget = 6000          # padded mel frames per micro-batch (utterances x longest utterance)
gradient_accumulation_steps = 1  # micro-batches per optimizer step per process
add_blank = True             # blank token between characters (helps alignment)
# model (tts_model.TTSConfig)
enc_channels = 192
enc_layers = 4
enc_heads = 2
enc_ff_channels = 768
enc_kernel = 3
dp_channels = 256            # duration predictor width
dropout = 0.1                # encoder and duration predictor
dec_channels = 256           # U-Net width
dec_blocks = 2               # residual blocks per U-Net level
dec_heads = 4                # attention heads in the U-Net bottleneck; 0 = none
sigma_min = 1e-4             # flow matching: noise left at t=1
cfg_drop = 0.0               # classifier-free guidance: share of utterances trained without condition (e.g. 0.2)
# losses
prior_weight = 1.0
duration_weight = 1.0
flow_weight = 1.0
# optimizer
learning_rate = 1e-4
max_iters = 100000
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0              # 0 = no clipping (grad norm is still logged)
# learning-rate schedule (scheduler.py)
lr_schedule = 'cosine_restarts'  # 'cosine' | 'cosine_restarts' | 'noam' | 'constant' | 'linear' | 'wsd'; each peaks at learning_rate
warmup_iters = 500           # linear rise to learning_rate, reached at this step (every schedule)
lr_decay_iters = 100000      # where the decay to min_lr ends (cosine, linear, wsd; not noam)
min_lr = 1e-5                # the lr decays to this (noam: its floor; constant: unused)
restart_iters = 10000        # 'cosine_restarts': steps of the first cycle after warmup
restart_mult = 1             # 'cosine_restarts': each cycle this many times longer than the last
decay_frac = 0.2             # 'wsd': the last fraction of lr_decay_iters, decaying linearly to min_lr
# inference and evaluation
n_timesteps = 10             # Euler steps of the flow ODE
temperature = 0.667          # scale of the starting noise
length_scale = 1.0           # > 1 speaks slower
guidance = 0.0               # classifier-free guidance weight at inference (needs cfg_drop > 0 in training)
eval_utterances = 0          # held-out utterances for the final MCD-DTW; 0 = all
audio_samples = 2            # held-out sentences written to out_dir/samples and TensorBoard
# system
device = 'auto'              # 'auto' | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' (bf16 where supported, else fp16 + loss scaling) | 'bfloat16' | 'float16' | 'float32'
compile = False              # torch.compile the encoder and decoder
# -----------------------------------------------------------------------------
config = configure(globals())
mel_settings = tts_data.MEL_SETTINGS  # fixed feature settings (not config keys: set after configure)
sample_rate = mel_settings['sample_rate']

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
autocast = autocast_context(device, ptdtype)
torch.manual_seed(seed + rank)  # per-rank seed: different noise and dropout on each rank
if device_type == 'cuda':
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def log(msg):
    if master:
        tqdm.write(msg)


# out_dir: written and locked before any work; a checkpoint there is this run's to continue, never another's
if master:
    out_dir_lock = claim_out_dir(out_dir)
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
this_run = dict(script='train_tts.py', init_from=run_origin(init_from))
ckpt = run_to_continue(out_dir, resume, this_run, eval_only)
resuming = ckpt is not None
if not resuming and init_from != 'scratch':
    require_init_from(init_from)
if eval_only and not resuming and init_from == 'scratch':
    raise UserError(f"eval_only=True needs a trained model, but {ckpt_path} does not exist; point --out_dir at a run "
                    f"or --init_from at a TTS checkpoint.")


# data: held-out split by id; rank 0 computes and caches the mel features, the others then read them
if not data_dir:
    raise UserError("data_dir is not set: pass --data_dir=PATH to an LJSpeech-layout folder (metadata.csv with "
                    "id|raw text|normalized text rows and wavs/<id>.wav), e.g. LJSpeech-1.1.")
rows = read_metadata(data_dir)
texts = dict(rows)
train_ids, val_ids = split_ids([utt_id for utt_id, _ in rows], val_fraction)
symbols = build_symbols(texts.values())
cache_dir = cache_dir or os.path.join(out_dir, 'mel_cache')
if master:
    train_set = LJSpeechDataset(data_dir, train_ids, texts, symbols, cache_dir, add_blank, progress=True)
    val_set = LJSpeechDataset(data_dir, val_ids, texts, symbols, cache_dir, add_blank)
if ddp:
    dist.barrier()
if not master:  # read what rank 0 cached
    train_set = LJSpeechDataset(data_dir, train_ids, texts, symbols, cache_dir, add_blank)
    val_set = LJSpeechDataset(data_dir, val_ids, texts, symbols, cache_dir, add_blank)
sampler = FrameBudgetSampler(train_set.lengths, frame_budget, seed, rank, world_size)
train_minutes = sum(train_set.lengths) * mel_settings['hop_length'] / sample_rate / 60
log(f"{len(train_set)} train / {len(val_set)} held-out utterances, {train_minutes:.1f} min of training audio, "
    f"{len(symbols)} symbols, {len(sampler)} batches per epoch per process")

# model, from scratch or from a checkpoint (shape and vocabulary must match the config)
if enc_channels % enc_heads or dec_channels % dec_heads or dec_channels % 8 or enc_kernel % 2 == 0:
    raise UserError(f"the model shape does not fit together: enc_channels={enc_channels} must divide by enc_heads="
                    f"{enc_heads}, dec_channels={dec_channels} by dec_heads={dec_heads} and by 8 (GroupNorm groups), "
                    f"and enc_kernel={enc_kernel} must be odd (same-length convolutions).")
model_args = dict(symbols=symbols, add_blank=add_blank, n_mels=mel_settings['n_mels'], enc_channels=enc_channels,
                  enc_layers=enc_layers, enc_heads=enc_heads, enc_ff_channels=enc_ff_channels, enc_kernel=enc_kernel,
                  dp_channels=dp_channels, dropout=dropout, dec_channels=dec_channels, dec_blocks=dec_blocks,
                  dec_heads=dec_heads, sigma_min=sigma_min, cfg_drop=cfg_drop)
if resuming or init_from != 'scratch':
    ckpt_source = ckpt_path if resuming else init_from
    ckpt = ckpt if resuming else load_checkpoint(init_from)
    if ckpt.get('kind') != 'tts':
        raise UserError(f"{ckpt_source} is not a train_tts.py checkpoint (kind={ckpt.get('kind')!r}); point "
                        f"--init_from at a TTS checkpoint or use --init_from=scratch.")
    shape = lambda args: {k: v for k, v in args.items() if k not in ('dropout', 'cfg_drop')}  # may change between runs
    check_compatible(shape(ckpt['model_args']), shape(model_args), 'model shape or vocabulary', ckpt_source,
                     fix="Set the model keys to the checkpoint's values (symbols come from the transcripts: use its "
                         "data_dir), or use a different out_dir / --init_from=scratch to train a new model.")
model = TTSModel(TTSConfig(**model_args))
if ckpt is not None:
    model.load_state_dict(ckpt['model'])  # includes the mel normalisation it was trained with
else:
    mel_mean, mel_std = train_set.mel_stats()
    model.mel_mean.fill_(mel_mean)
    model.mel_std.fill_(mel_std)
model.to(device)
raw_model = model  # what we save and synthesize with: never compiled or DDP-wrapped
mel_mean, mel_std = raw_model.mel_mean.item(), raw_model.mel_std.item()

decay = [p for p in model.parameters() if p.dim() >= 2]  # no weight decay on norms and biases
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)],
                              lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
scaler = GradScaler(enabled=ptdtype == torch.float16)
iter_num, best_val_loss, evals_without_improvement, batch_splits = 0, float('inf'), 0, 1
if resuming:
    optimizer.load_state_dict(ckpt['optimizer'])
    scaler.load_state_dict(ckpt['scaler'])
    sampler.load_state_dict(ckpt['sampler'])
    iter_num, best_val_loss = ckpt['iter_num'], ckpt['best_val_loss']
    evals_without_improvement, batch_splits = ckpt['evals_without_improvement'], ckpt['batch_splits']
    if len(ckpt['rng']) == world_size:
        set_rng_state(ckpt['rng'][rank])
    else:
        log(f"note: checkpoint was written by {len(ckpt['rng'])} processes, now {world_size}: random streams restart")
    log(f"resuming from {ckpt_path} at step {iter_num}")
ckpt = None  # free memory

if compile:  # in place, so state dict keys stay clean; MAS (a Python loop) stays eager
    raw_model.encoder.compile(dynamic=True)
    raw_model.decoder.compile(dynamic=True)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)
log(f"device {device}, dtype {ptdtype}, {world_size} process(es), {raw_model.get_num_params() / 1e6:.2f}M params, "
    f"frame budget {frame_budget} x {gradient_accumulation_steps} accumulation")


def to_device(batch):
    if device_type == 'cuda':
        return [t.pin_memory().to(device, non_blocking=True) for t in batch]
    return [t.to(device) for t in batch]


def weighted_loss(losses):
    return prior_weight * losses['prior'] + duration_weight * losses['duration'] + flow_weight * losses['flow']


@torch.no_grad()
def evaluate():
    """Held-out losses (fixed noise, so evals compare) and teacher-forced mel L1 in log-mel units,
    split across ranks; the training random streams are left untouched."""
    saved_rng = rng_state()
    torch.manual_seed(seed)
    raw_model.eval()
    sums = torch.zeros(6, device=device)  # prior, duration, flow (x frames), mel L1 sum, frames, tokens
    batches = eval_batches(val_set.lengths, frame_budget)
    for indices in batches[rank::world_size]:
        x, x_lengths, y, y_lengths = to_device(val_set.collate(indices, mel_mean, mel_std))
        with autocast:
            losses = raw_model(x, x_lengths, y, y_lengths)
            mel, mask = raw_model.teacher_forced(x, x_lengths, y, y_lengths, n_timesteps=n_timesteps,
                                                 temperature=temperature)
        frames, tokens = y_lengths.sum().float(), x_lengths.sum().float()
        l1 = ((mel.float()[:, :, :y.shape[2]] - y).abs() * mask[:, :, :y.shape[2]]).sum() * mel_std / y.shape[1]
        sums += torch.stack([losses['prior'] * frames, losses['duration'] * tokens, losses['flow'] * frames,
                             l1, frames, tokens])
    if ddp:
        dist.all_reduce(sums)
    raw_model.train()
    set_rng_state(saved_rng)
    result = dict(prior=(sums[0] / sums[4]).item(), duration=(sums[1] / sums[5]).item(),
                  flow=(sums[2] / sums[4]).item())
    result['loss'] = weighted_loss(result)
    result['mel_l1'] = (sums[3] / sums[4]).item()
    return result


def checkpoint_state():
    rngs = all_rng_states()  # collective under DDP
    return dict(kind='tts', run=this_run, model=raw_model.state_dict(), model_args=model_args,
                optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), iter_num=iter_num, best_val_loss=best_val_loss,
                evals_without_improvement=evals_without_improvement, config=config,
                data_dir=os.path.abspath(data_dir), rng=rngs, sampler=sampler.state_dict(),
                batch_splits=batch_splits, mel_settings=mel_settings)


def save(path):
    state = checkpoint_state()  # collective under DDP: every rank must call it
    if master:
        save_checkpoint(path, state)


def train_step(batches):
    """Forward/backward over this rank's micro-batches; after an OOM each is split into batch_splits
    chunks whose losses are weighted by their share of frames/tokens, so the sum is the batch loss.
    Returns the mean micro-batch losses."""
    totals = {k: torch.zeros((), device=device) for k in ('prior', 'duration', 'flow')}
    for micro_step, indices in enumerate(batches):
        n = len(indices)
        chunks = [indices[i * n // batch_splits:(i + 1) * n // batch_splits] for i in range(batch_splits)]
        chunks = [c for c in chunks if c]
        frames = sum(train_set.lengths[i] for i in indices)
        tokens = sum(len(train_set.text_ids[i]) for i in indices)
        for chunk_index, chunk in enumerate(chunks):
            with profiler.section('data'):
                x, x_lengths, y, y_lengths = to_device(train_set.collate(chunk, mel_mean, mel_std))
            frame_share = sum(train_set.lengths[i] for i in chunk) / frames
            token_share = sum(len(train_set.text_ids[i]) for i in chunk) / tokens
            last = micro_step == len(batches) - 1 and chunk_index == len(chunks) - 1
            # only the last chunk of the last micro-batch all-reduces gradients
            with model.no_sync() if ddp and not last else nullcontext():
                with profiler.section('forward'), autocast:
                    losses = model(x, x_lengths, y, y_lengths)
                if fault_at('oom', iter_num):
                    raise torch.OutOfMemoryError('injected OOM (NANOTRAIN_FAULT)')
                if fault_at('nan', iter_num):
                    losses['flow'] = losses['flow'] * float('nan')
                losses = {k: v * (token_share if k == 'duration' else frame_share) for k, v in losses.items()}
                with profiler.section('backward'):
                    scaler.scale(weighted_loss(losses) / len(batches)).backward()
            for k in totals:
                totals[k] += losses[k].detach().float() / len(batches)
    return totals


record, writer = run_log(out_dir, master, tensorboard,
                         keep_until=math.inf if eval_only else iter_num if resuming else -1)


def mel_image(mel):
    """(n_mels, T) log-mel -> (1, n_mels, T) grey image in [0, 1], low frequencies at the bottom."""
    return ((mel.float().cpu() - math.log(1e-5)) / (mel.max().item() - math.log(1e-5))).clamp(0, 1).flip(0)[None]


def record_media(step):
    """TensorBoard: teacher-forced vs target mel of the first held-out utterance, and speech
    synthesized from text (predicted durations) for the first audio_samples utterances."""
    if not writer:
        return
    raw_model.eval()
    x, x_lengths, y, y_lengths = to_device(val_set.collate([0], mel_mean, mel_std))
    mel, _ = raw_model.teacher_forced(x, x_lengths, y, y_lengths, n_timesteps=n_timesteps, temperature=temperature,
                                      generator=torch.Generator(device=device).manual_seed(seed))
    pred, target = raw_model.denormalize(mel[0, :, :y.shape[2]]), raw_model.denormalize(y[0])
    writer.add_image('mel/teacher_forced_over_target', torch.cat([mel_image(pred), mel_image(target)], dim=1), step)
    for utt_id in val_ids[:audio_samples]:
        audio, log_mel = synthesize(raw_model, texts[utt_id], n_timesteps, temperature, length_scale, guidance, seed)
        writer.add_audio(f'audio/{utt_id}', audio.clamp(-1, 1)[None], step, sample_rate=sample_rate)
        writer.add_image(f'mel/synthesized_{utt_id}', mel_image(log_mel), step)
    raw_model.train()


def evaluate_synthesis():
    """Held-out speech from text alone: MCD-DTW of the synthesized mel against the reference, of the
    mel re-analysed from its Griffin-Lim audio, of the reference itself through Griffin-Lim (the
    vocoder's floor) and of a trivial baseline (the training set's mean mel frame repeated for the
    reference's length); real-time factor. Writes audio_samples WAVs to out_dir/samples."""
    raw_model.eval()
    extractor = MelExtractor(**mel_settings)
    mean_frame = train_set.mean_mel()
    ids = val_ids[:eval_utterances or len(val_ids)]
    os.makedirs(os.path.join(out_dir, 'samples'), exist_ok=True)
    scores = {k: [] for k in ('model', 'model_audio', 'reference_audio', 'baseline')}
    model_seconds = audio_seconds = duration_ratio = 0.0
    for n, utt_id in enumerate(tqdm(ids, desc='synthesis eval', dynamic_ncols=True, leave=False)):
        reference = val_set.mels[val_set.ids.index(utt_id)]
        t0 = time.perf_counter()
        audio, log_mel = synthesize(raw_model, texts[utt_id], n_timesteps, temperature, length_scale, guidance, seed)
        model_seconds += time.perf_counter() - t0
        audio_seconds += len(audio) / sample_rate
        duration_ratio += log_mel.shape[1] / reference.shape[1] / len(ids)
        scores['model'].append(mel_cepstral_distortion(log_mel, reference))
        scores['model_audio'].append(mel_cepstral_distortion(extractor(audio), reference))
        scores['reference_audio'].append(mel_cepstral_distortion(extractor(extractor.to_waveform(reference)), reference))
        scores['baseline'].append(mel_cepstral_distortion(mean_frame[:, None].expand_as(reference), reference))
        if n < audio_samples:
            write_wav(os.path.join(out_dir, 'samples', f'{utt_id}.wav'), audio, sample_rate)
    raw_model.train()
    result = {f'mcd_{k}': sum(v) / len(v) for k, v in scores.items()}
    result.update(rtf=model_seconds / audio_seconds, duration_ratio=duration_ratio, eval_utterances=len(ids))
    return result


def final_report(step):
    if not master:
        return
    result = evaluate_synthesis()
    record(dict(step=step, **result))
    print(f"held-out synthesis ({result['eval_utterances']} utterances, {n_timesteps} ODE steps, Griffin-Lim audio):\n"
          f"  MCD-DTW model mel            {result['mcd_model']:.2f} dB\n"
          f"  MCD-DTW model audio          {result['mcd_model_audio']:.2f} dB  (mel re-analysed from the WAV)\n"
          f"  MCD-DTW reference audio      {result['mcd_reference_audio']:.2f} dB  (reference mel through Griffin-Lim: vocoder floor)\n"
          f"  MCD-DTW mean-mel baseline    {result['mcd_baseline']:.2f} dB\n"
          f"  length synthesized/reference {result['duration_ratio']:.2f}\n"
          f"  real-time factor             {result['rtf']:.3f} (synthesis time / audio time, Griffin-Lim included)\n"
          f"  samples in {os.path.join(out_dir, 'samples')}")


def log_eval(step, result, note=''):
    log(f"step {step}: val loss {result['loss']:.4f} (prior {result['prior']:.4f}, duration {result['duration']:.4f}, "
        f"flow {result['flow']:.4f}), teacher-forced mel L1 {result['mel_l1']:.4f}{note}")
    record(dict(step=step, val_loss=result['loss'], val_prior_loss=result['prior'],
                val_duration_loss=result['duration'], val_flow_loss=result['flow'], val_mel_l1=result['mel_l1']))


if eval_only:
    log_eval(iter_num, evaluate())
    if ddp:
        dist.barrier()
        dist.destroy_process_group()
    final_report(iter_num)
    sys.exit(0)

stop = StopSignal()
monitor = MemoryMonitor(device)
profiler = StepProfiler(device, enabled=profile)
if iter_num == 0:
    log_eval(0, evaluate())
bad_steps = 0
window_start, window_frames = time.time(), 0
progress = tqdm(total=max_iters, initial=iter_num, disable=not master, dynamic_ncols=True, desc='train')
while iter_num < max_iters:
    lr = get_lr(iter_num, lr_schedule, learning_rate, min_lr, warmup_iters, lr_decay_iters, restart_iters,
                restart_mult, decay_frac)
    for group in optimizer.param_groups:
        group['lr'] = lr

    batches = [sampler.next_batch() for _ in range(gradient_accumulation_steps)]
    while True:
        try:
            losses = train_step(batches)
            break
        except torch.OutOfMemoryError as e:
            if not is_oom(e) or ddp:  # ranks would disagree on the new split; let torchrun restart us
                raise
            optimizer.zero_grad(set_to_none=True)
            free_memory(device)
            if batch_splits >= max(len(b) for b in batches):
                raise UserError(f"out of memory with one utterance per micro-batch (step {iter_num}); lower "
                                f"frame_budget, use a smaller model, or use a device with more memory.")
            batch_splits *= 2
            log(f"step {iter_num}: out of memory, retrying with each batch split into {batch_splits} micro-batches")

    with profiler.section('optimizer'):
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip if grad_clip > 0 else float('inf'))
        # one all-reduce: global mean losses, and whether any rank was asked to stop or ran out of time
        out_of_time = max_minutes > 0 and time.time() - _start_time > max_minutes * 60
        stats = torch.stack([losses['prior'], losses['duration'], losses['flow'],
                             torch.tensor(float(stop.requested is not None), device=device),
                             torch.tensor(float(out_of_time), device=device)])
        if ddp:
            dist.all_reduce(stats)
        prior, duration, flow = (stats[:3] / world_size).tolist()
        stop_requested, out_of_time = stats[3].item() > 0, stats[4].item() > 0
        loss = weighted_loss(dict(prior=prior, duration=duration, flow=flow))
        grad_norm = grad_norm.item()
        if step_unless_nonfinite(optimizer, scaler, loss, grad_norm):
            bad_steps = 0
        else:
            bad_steps += 1
            log(f"step {iter_num}: non-finite loss {loss} / grad norm {grad_norm}, step skipped ({bad_steps}/{max_bad_steps})")
    if bad_steps >= max_bad_steps:
        raise SystemExit(f"error: {bad_steps} consecutive steps had a non-finite loss or gradient norm (last at step "
                         f"{iter_num}); training is diverging. Lower learning_rate, raise warmup_iters, or use "
                         f"dtype='float32'. The last good checkpoint in {out_dir} was left untouched.")
    iter_num += 1
    progress.update(1)
    window_frames += sum(train_set.lengths[i] for b in batches for i in b) * world_size

    if iter_num % log_interval == 0 or iter_num == max_iters:
        frames_per_sec = window_frames / (time.time() - window_start)
        level = monitor.check()
        event = dict(step=iter_num, train_loss=loss, prior_loss=prior, duration_loss=duration, flow_loss=flow, lr=lr,
                     grad_norm=grad_norm, frames_per_sec=frames_per_sec, epoch=sampler.epoch, memory_level=level,
                     peak_memory_mb=(peak_memory_bytes(device) or 0) / 2**20, loss_scale=scaler.get_scale())
        event.update({f'time_ms/{k}': v for k, v in profiler.summary().items()})
        record(event)
        progress.set_postfix(loss=f'{loss:.4f}', frames_s=f'{frames_per_sec:,.0f}')
        log(f"step {iter_num}: loss {loss:.4f} (prior {prior:.4f}, duration {duration:.4f}, flow {flow:.4f}), "
            f"lr {lr:.2e}, grad norm {grad_norm:.3f}, {frames_per_sec:,.0f} frames/s, epoch {sampler.epoch}")
        window_start, window_frames = time.time(), 0

    if iter_num % eval_interval == 0 or iter_num == max_iters or out_of_time:
        result = evaluate()
        improved = result['loss'] < best_val_loss
        if improved:
            best_val_loss, evals_without_improvement = result['loss'], 0
        else:
            evals_without_improvement += 1
        log_eval(iter_num, result, " (best)" if improved else f" (no improvement for {evals_without_improvement} evals)")
        if master:
            record_media(iter_num)
        if improved:
            save(os.path.join(out_dir, 'best.pt'))
        if improved or always_save_checkpoint:
            save(ckpt_path)
        if early_stopping_patience and evals_without_improvement >= early_stopping_patience:
            log(f"early stopping: val loss has not improved for {evals_without_improvement} evals")
            break
        if out_of_time:
            log(f"max_minutes={max_minutes} reached at step {iter_num}: stopping")
            break
        window_start, window_frames = time.time(), 0  # throughput excludes eval time

    if stop_requested:
        save(ckpt_path)
        log(f"stop signal received: saved {ckpt_path} at step {iter_num}")
        progress.close()
        if ddp:
            dist.barrier()
            dist.destroy_process_group()
        sys.exit(stop.exit_code if stop.requested else 143)
progress.close()
save(ckpt_path)
log(f"training ended at step {iter_num} after {(time.time() - _start_time) / 60:.1f} min, best val loss {best_val_loss:.4f}")
if ddp:
    dist.barrier()  # leave together: a rank tearing down while another still works can abort gloo
    dist.destroy_process_group()
final_report(iter_num)
