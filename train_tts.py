"""
Train a flow-matching text-to-speech model (Matcha-TTS in miniature) on an LJSpeech-layout
corpus: `python train_tts.py config/tts_ljspeech.py --data_dir=PATH`. Relaunching the same
command resumes; `--eval_only=True` evaluates the checkpoint (val losses, MCD-DTW, RTF);
`python sample_tts.py --out_dir=out-tts --text="..." --wav=out.wav` speaks. A run is max_iters steps, or
num_train_epochs passes over the training utterances (run/epochs.py).
Every config key below can be overridden by a config file or --key=value (`--help` lists them).
"""

import dataclasses
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from configurator import (EMPTY_OR_FOLDER, FOLDER, SEED, UserError, at_least, check_values, configure,
                          dataclass_args, interval, one_of, require_writable_folder)
from memory import MemoryMonitor, peak_memory_bytes, recover_from_oom, split_micro_batches
from run.checkpoint import (NEW_RUN, check_compatible, load_checkpoint, restore_training_state, rng_state,
                            set_rng_state, training_state, write_checkpoint)
from run.device import autocast_context, pick_dtype, to_device
from run.epochs import by_epochs_checked, plan_epochs
from run.run_folder import open_run, require_starting_weights, run_log, run_origin
from run.runtime import (StepProfiler, StopSignal, all_reduce_metrics, bad_step, clip_grad_norm, compute_cleanup,
                         compute_init, gradient_sync, log, wrap_model)
from run.tracker import require_wandb, start_wandb
from scheduler import SCHEDULES, LRSchedule, set_lr
from tts import data as tts_data
from tts.data import (FrameBudgetSampler, LJSpeechDataset, build_symbols, check_same_corpus, corpus_hash, eval_batches,
                      read_metadata, read_speakers, split_ids)
from tts.eval import SynthesisEval, evaluate_synthesis, print_synthesis_report, record_media
from tts.model import TTSConfig, TTSModel
from tts.phonemes import TEXT_FRONTENDS, phonemize_corpus
from tts.vocoder import load_vocoder

_start_time = time.time()
# -----------------------------------------------------------------------------
# I/O
out_dir = 'out-tts'          # checkpoints (ckpt.pt, best.pt), log.jsonl, tensorboard, samples/
data_dir = ''                # LJSpeech-layout folder: metadata.csv + wavs/<id>.wav (docs/tts.md)
cache_dir = ''               # log-mel feature (and phoneme) cache; '' = <out_dir>/mel_cache
init_from = 'scratch'        # where a new run's weights start: 'scratch' | path to a TTS checkpoint
resume = True                # continue out_dir's run if any; False = start a new one, replacing it
eval_interval = 200          # steps between evals (and checkpoint saves)
eval_every_epochs = 0        # with num_train_epochs: also eval (and save) at the end of every this many epochs
log_interval = 10            # steps between train-loss log lines
eval_only = False            # evaluate the checkpoint (val losses, MCD-DTW, RTF) and exit
always_save_checkpoint = True  # save ckpt.pt at every eval, not only when val loss improves
early_stopping_patience = 0  # stop after this many evals without val improvement; 0 = never
max_bad_steps = 5            # abort after this many non-finite steps (loss/grad norm) in a row
max_minutes = 0.0            # minutes until a clean stop (checkpoint, final eval); 0 = no limit
tensorboard = True           # write TensorBoard logs (losses, mel images, audio) to out_dir/tb
wandb_log = False            # also log the losses to Weights & Biases (`pip install wandb`; run/tracker.py)
wandb_project = 'nanotrain'  # the W&B project
wandb_run_name = ''          # the W&B run's name; '' = out_dir's folder name
profile = False              # time data/forward/backward/optimizer per step (adds syncs on GPU)
seed = 1337                  # random seed
# data
val_fraction = 0.05          # held-out share, chosen by a hash of the utterance id
frame_budget = 6000          # padded mel frames per micro-batch (utterances x longest utterance)
gradient_accumulation_steps = 1  # micro-batches per optimizer step per process
add_blank = True             # blank token between characters (helps alignment)
text_frontend = 'characters'  # what the model reads: 'characters' of the text | its 'phonemes' (espeak-ng, inside)
multi_speaker = False        # metadata.csv rows are id|speaker|text: a learned voice per speaker (docs/tts.md)
# model (tts/model.py's TTSConfig)
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
spk_channels = 64            # width of a voice's learned vector (multi_speaker)
voice_clips = False          # multi_speaker: also learn a voice from a clip (sample_tts.py --voice_clip)
sigma_min = 1e-4             # flow matching: noise left at t=1
cfg_drop = 0.0               # CFG: share of utterances trained without condition (e.g. 0.2)
align_prior_iters = 1000     # steps for the diagonal alignment prior in MAS to fade out; 0 = none
# losses
prior_weight = 1.0
duration_weight = 1.0
flow_weight = 1.0
voice_weight = 1.0           # the clip encoder's loss (voice_clips)
# optimizer
learning_rate = 1e-4         # peak lr of every lr_schedule
decoder_lr_scale = 1.0       # the flow decoder's lr / learning_rate (docs/tts.md)
max_iters = 100000           # optimizer steps in the run
num_train_epochs = 0.0       # passes over the training utterances, for max_iters; 0 = off
weight_decay = 0.0           # decoupled weight decay; 0 = none
beta1 = 0.9                  # AdamW's momentum (first-moment decay)
beta2 = 0.99                 # AdamW's second-moment decay
grad_clip = 1.0              # 0 = no clipping (grad norm is still logged)
# learning-rate schedule (scheduler.py)
lr_schedule = 'cosine_restarts'  # cosine | cosine_restarts | noam | constant | linear | wsd
warmup_iters = 500           # linear rise to learning_rate, reached at this step (every schedule)
lr_decay_iters = 100000      # where the decay to min_lr ends (cosine, linear, wsd; not noam)
min_lr = 1e-5                # the lr decays to this (noam: its floor; constant: unused)
restart_iters = 10000        # 'cosine_restarts': steps of the first cycle after warmup
restart_mult = 1             # 'cosine_restarts': each cycle this many times longer than the last
decay_frac = 0.2             # 'wsd': the last fraction of lr_decay_iters, a linear decay to min_lr
# inference and evaluation
n_timesteps = 10             # Euler steps of the flow ODE
temperature = 0.667          # scale of the starting noise
length_scale = 1.0           # > 1 speaks slower
guidance = 0.0               # classifier-free guidance weight at inference (needs cfg_drop > 0)
eval_utterances = 0          # held-out utterances for the final MCD-DTW; 0 = all
audio_samples = 2            # held-out sentences written to out_dir/samples and TensorBoard
vocoder = ''                 # the evaluation's audio: a HiFi-GAN generator file (docs/tts.md); '' = Griffin-Lim
# system
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16 + loss scaling; fp32 on CPU
compile = False              # torch.compile the encoder and decoder (no gain on a CPU: docs/tts.md)
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('gradient_accumulation_steps', 'max_iters', 'eval_interval', 'log_interval', 'max_bad_steps',
                   'restart_iters', 'restart_mult', 'n_timesteps', 'enc_channels', 'enc_layers', 'enc_heads',
                   'enc_ff_channels', 'enc_kernel', 'dp_channels', 'dec_channels', 'dec_blocks', 'frame_budget',
                   'spk_channels')),
    (at_least(0), ('dec_heads', 'early_stopping_patience', 'warmup_iters', 'lr_decay_iters', 'learning_rate',
                   'decoder_lr_scale', 'min_lr', 'weight_decay', 'grad_clip', 'max_minutes', 'eval_utterances',
                   'audio_samples', 'prior_weight', 'duration_weight', 'flow_weight',
                   'align_prior_iters', 'voice_weight', 'num_train_epochs', 'eval_every_epochs')),
    (interval('[0, 1)'), ('dropout', 'beta1', 'beta2', 'cfg_drop', 'sigma_min')),
    (interval('(0, 1)'), ('val_fraction',)),
    (interval('[0, 1]'), ('decay_frac',)),
    # the evaluation's synthesis: bounds far past any use, as sample_tts.py's (beyond them the audio overflows)
    (interval('[0, 10]'), ('temperature',)),
    (interval('(0, 10]'), ('length_scale',)),
    (interval('[0, 100]'), ('guidance',)),
    (one_of(SCHEDULES), ('lr_schedule',)),
    (one_of(TEXT_FRONTENDS), ('text_frontend',)),
    (FOLDER, ('out_dir',)),
    (EMPTY_OR_FOLDER, ('cache_dir',)),
])
by_epochs = by_epochs_checked(config)  # else max_iters counts the run
require_wandb(wandb_log)
if guidance and not cfg_drop:  # guidance steers away from the unconditional flow, which only cfg_drop trains
    raise UserError(f"guidance={guidance} needs a model that learned to speak without its condition too: add "
                    f"--cfg_drop=0.2 (a share of utterances trained so), or leave guidance at 0.")
if voice_clips and not multi_speaker:
    raise UserError("voice_clips=True learns to tell the voices of a multi-speaker corpus from a clip: add "
                    "--multi_speaker=True (rows id|speaker|text), or drop voice_clips.")
misfits = []  # the model's shape, before any work (a big corpus's features take minutes)
if enc_channels % enc_heads:
    misfits.append(f"enc_channels={enc_channels} must divide by enc_heads={enc_heads}")
if dec_heads and dec_channels % dec_heads:
    misfits.append(f"dec_channels={dec_channels} must divide by dec_heads={dec_heads} (or dec_heads=0: no attention)")
if dec_channels % 8:
    misfits.append(f"dec_channels={dec_channels} must divide by 8 (GroupNorm's groups)")
if enc_kernel % 2 == 0:
    misfits.append(f"enc_kernel={enc_kernel} must be odd (same-length convolutions)")
if misfits:
    raise UserError(f"the model shape does not fit together: {'; '.join(misfits)}.")

# fixed feature settings (not config keys: set after configure)
mel_settings = tts_data.MEL_SETTINGS
sample_rate = mel_settings['sample_rate']

# processes and device (run/runtime.py: one process per GPU under torchrun), precision
ddp, rank, local_rank, world_size, local_device = compute_init(device, seed)  # resolved for this process
master, device_type = rank == 0, local_device.split(':')[0]
ptdtype = pick_dtype(local_device, dtype)
autocast = autocast_context(local_device, ptdtype)
vocode = load_vocoder(vocoder, local_device)  # a vocoder file that cannot work stops the run before it starts

# out_dir: written and locked before any work; a checkpoint there is this run's, never another's
# nanoGPT's init_from='resume' starts where out_dir's run started
this_run = dict(script='train_tts.py', init_from=run_origin(init_from, out_dir, resume))
out_dir_lock, ckpt_path, ckpt = open_run(config, this_run, master)
resuming = ckpt is not None
require_starting_weights(ckpt, init_from, eval_only, ckpt_path)


# data: held-out split by id; rank 0 computes and caches the mel features, the others then read them
if not data_dir:
    raise UserError("data_dir is not set: pass --data_dir=PATH to an LJSpeech-layout folder (metadata.csv with "
                    "id|raw text|normalized text rows and wavs/<id>.wav), e.g. LJSpeech-1.1.")
rows = read_metadata(data_dir, multi_speaker)
corpus_digest = corpus_hash(data_dir, [utt_id for utt_id, _ in rows])
check_same_corpus(ckpt, corpus_digest, data_dir, out_dir)  # a relaunch on another corpus is not its run
words = dict(rows)  # what evaluation says, as sample_tts.py is given it
train_ids, val_ids = split_ids([utt_id for utt_id, _ in rows], val_fraction)
features_dir = cache_dir or os.path.join(out_dir, 'mel_cache')
if cache_dir:  # a folder no file can be made in (/proc/x, a read-only disk) is said now, not mid-way
    require_writable_folder(cache_dir, 'cache_dir', keep=False)
texts = phonemize_corpus(words, features_dir) if text_frontend == 'phonemes' else words  # what the model reads
symbols = build_symbols(texts.values())
utterance_speakers = read_speakers(data_dir) if multi_speaker else {}  # id -> speaker name
speakers = tuple(sorted(set(utterance_speakers.values())))
speaker_of = {utt_id: speakers.index(name) for utt_id, name in utterance_speakers.items()}
untrained = sorted(set(speakers) - {utterance_speakers.get(utt_id) for utt_id in train_ids})
if untrained:  # its vector would never learn: a voice sample_tts.py would speak in untrained
    raise UserError(f"speaker(s) {', '.join(untrained)} have no utterance in the training split (val_fraction's "
                    f"held-out split took them all): give each speaker more utterances, or lower val_fraction.")
if master:
    train_set = LJSpeechDataset(data_dir, train_ids, texts, symbols, features_dir, add_blank, progress=True,
                                speakers=speaker_of)
    val_set = LJSpeechDataset(data_dir, val_ids, texts, symbols, features_dir, add_blank, speakers=speaker_of)
if ddp:
    dist.barrier()
if not master:  # read what rank 0 cached
    train_set = LJSpeechDataset(data_dir, train_ids, texts, symbols, features_dir, add_blank, speakers=speaker_of)
    val_set = LJSpeechDataset(data_dir, val_ids, texts, symbols, features_dir, add_blank, speakers=speaker_of)
longest = max(range(len(train_set)), key=train_set.lengths.__getitem__)
if train_set.lengths[longest] > frame_budget:  # named here: the sampler knows lengths only
    frames, utt_id = train_set.lengths[longest], train_set.ids[longest]
    raise UserError(f"utterance {utt_id!r} ({os.path.join(data_dir, 'wavs', utt_id + '.wav')}) has {frames} mel "
                    f"frames ({frames * mel_settings['hop_length'] / sample_rate:.1f} s), more than frame_budget="
                    f"{frame_budget}: raise --frame_budget to {frames} or more, or remove its row from metadata.csv.")
sampler = FrameBudgetSampler(train_set.lengths, frame_budget, seed, rank, world_size)
train_minutes = sum(train_set.lengths) * mel_settings['hop_length'] / sample_rate / 60
log(f"{len(train_set)} train / {len(val_set)} held-out utterances, {train_minutes:.1f} min of training audio, "
    f"{len(symbols)} symbols, {len(sampler)} batches per epoch per process")

# model, from scratch or from a checkpoint (shape and vocabulary must match the config)
model_args = dataclass_args(TTSConfig, config, symbols=symbols, n_mels=mel_settings['n_mels'], speakers=speakers)
if resuming or init_from != 'scratch':
    ckpt_source = ckpt_path if resuming else init_from
    ckpt = ckpt if resuming else load_checkpoint(init_from)
    # a run in out_dir is continued whatever init_from says: a new run takes another out_dir or resume=False
    new_run = NEW_RUN if resuming else "or point --init_from at another TTS checkpoint, or use --init_from=scratch"
    if ckpt.get('kind') != 'tts':
        raise UserError(f"{ckpt_source} is not a train_tts.py checkpoint (kind={ckpt.get('kind')!r}); "
                        f"{new_run.removeprefix('or ')}.")
    saved_args = dataclasses.asdict(TTSConfig(**ckpt['model_args']))  # keys newer than the checkpoint: defaults
    check_compatible(saved_args, model_args, 'model shape or vocabulary', ckpt_source,
                     fix=f"Set the model keys to the checkpoint's values (symbols come from the transcripts and "
                         f"text_frontend, speakers from a corpus read with multi_speaker=True: use the run's data_dir "
                         f"and settings), {new_run}.",
                     may_differ=('dropout', 'cfg_drop'))
model = TTSModel(TTSConfig(**model_args))
if ckpt is not None:
    model.load_state_dict(ckpt['model'])  # includes the mel normalisation it was trained with
else:
    mel_mean, mel_std = train_set.mel_stats()
    model.mel_mean.fill_(mel_mean)
    model.mel_std.fill_(mel_std)
model.to(local_device)
raw_model = model  # what we save and synthesize with: never compiled or DDP-wrapped
mel_mean, mel_std = raw_model.mel_mean.item(), raw_model.mel_std.item()

optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), decoder_lr_scale, device_type)
scaler = torch.amp.GradScaler(device_type, enabled=ptdtype == torch.float16)
iter_num, best_val_loss, evals_without_improvement, batch_splits = 0, float('inf'), 0, 1
if resuming:
    sampler.load_state_dict(ckpt['sampler'])
    batch_splits = ckpt['batch_splits']
    iter_num, best_val_loss, evals_without_improvement = restore_training_state(ckpt, ckpt_path, optimizer, scaler,
                                                                                rank, world_size)
# the run's steps: max_iters, or an epoch-counted run's (run/epochs.py); its lr decays to min_lr over all of them
epoch_plan = plan_epochs(sampler.epoch_steps(gradient_accumulation_steps, math.ceil(num_train_epochs)), config,
                         ckpt if resuming else None, ckpt_path) if by_epochs else None
run_iters = epoch_plan.steps if epoch_plan else max_iters
get_lr = LRSchedule.from_config(config, epoch_plan.steps if epoch_plan else None)
# rank 0 logs to Weights & Biases too, a continued run to its W&B run
tracker = start_wandb(config, ckpt and ckpt.get('wandb_run_id'), master)
ckpt = None  # free memory

if compile:  # in place, so state dict keys stay clean; MAS (a Python loop) and attention stay eager
    raw_model.encoder.compile(dynamic=True)
    raw_model.decoder.compile(dynamic=True)
model = wrap_model(model, False, ddp, local_rank, device_type)  # compiled in place above
log(f"device {local_device}, dtype {ptdtype}, {world_size} process(es), "
    f"{raw_model.get_num_params() / 1e6:.2f}M params, frame budget {frame_budget} x {gradient_accumulation_steps} "
    f"accumulation")
if epoch_plan:
    log(epoch_plan.describe(f"{gradient_accumulation_steps} batch(es) of {frame_budget} frames per process",
                            lr_schedule))


def weighted_loss(losses):
    return (prior_weight * losses['prior'] + duration_weight * losses['duration'] + flow_weight * losses['flow']
            + voice_weight * losses.get('voice', 0.0))


@torch.no_grad()
def evaluate():
    """Held-out losses (fixed noise, so evals compare) and teacher-forced mel L1 in log-mel units,
    split across ranks; the training random streams are left untouched."""
    saved_rng = rng_state()
    torch.manual_seed(seed)
    raw_model.eval()
    # prior, duration, flow (x frames), mel L1 sum, frames, tokens
    sums = torch.zeros(6, device=local_device)
    batches = eval_batches(val_set.lengths, frame_budget)
    for indices in batches[rank::world_size]:
        x, x_lengths, y, y_lengths, spk = to_device(val_set.collate(indices, mel_mean, mel_std), local_device)
        with autocast:
            losses = raw_model(x, x_lengths, y, y_lengths, spk)
            mel, mask = raw_model.teacher_forced(x, x_lengths, y, y_lengths, spk, n_timesteps=n_timesteps,
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


def save(path, iter_num, best_val_loss, evals_without_improvement):
    """A checkpoint of the run at path (write_checkpoint) at step iter_num, with the eval counters: everything
    a continued run needs. Collective under DDP: every rank must call it."""
    state = dict(training_state(this_run, config, optimizer, scaler, iter_num, best_val_loss,
                                evals_without_improvement),
                 kind='tts', model=raw_model.state_dict(), model_args=model_args, data_dir=os.path.abspath(data_dir),
                 corpus_hash=corpus_digest,
                 sampler=sampler.state_dict(), batch_splits=batch_splits, mel_settings=mel_settings,
                 epoch_steps=epoch_plan and epoch_plan.epoch_steps, wandb_run_id=tracker and tracker.id)
    write_checkpoint(path, state, False, master)


profiler = StepProfiler(local_device, enabled=profile)


def train_step(batches, align_prior, batch_splits):
    """Forward/backward over this rank's micro-batches; after an OOM each is split into batch_splits
    chunks whose losses are weighted by their share of frames/tokens, so the sum is the batch loss.
    Returns this rank's shares of the mean micro-batch losses (shares add up over ranks)."""
    names = ('prior', 'duration', 'flow') + ('voice',) * voice_clips
    shares = {k: torch.zeros((), device=local_device) for k in names}
    for micro_step, indices in enumerate(batches):
        n = len(indices)
        chunks = [indices[i * n // batch_splits:(i + 1) * n // batch_splits] for i in range(batch_splits)]
        chunks = [c for c in chunks if c]
        frames = sum(train_set.lengths[i] for i in indices)
        tokens = sum(len(train_set.text_ids[i]) for i in indices)
        for chunk_index, chunk in enumerate(chunks):
            with profiler.section('data'):
                x, x_lengths, y, y_lengths, spk = to_device(train_set.collate(chunk, mel_mean, mel_std), local_device)
            frame_share = sum(train_set.lengths[i] for i in chunk) / frames
            token_share = sum(len(train_set.text_ids[i]) for i in chunk) / tokens
            last = micro_step == len(batches) - 1 and chunk_index == len(chunks) - 1
            # only the last chunk of the last micro-batch all-reduces gradients
            with gradient_sync(model, raw_model, sync=last):
                with profiler.section('forward'), autocast:
                    losses = model(x, x_lengths, y, y_lengths, spk, align_prior)
                losses = {k: v * (token_share if k == 'duration' else frame_share) for k, v in losses.items()}
                with profiler.section('backward'):
                    scaler.scale(weighted_loss(losses) / len(batches)).backward()
            for k in shares:
                shares[k] += losses[k].detach().float() / (len(batches) * world_size)
    return shares


# an eval_only run appends to the log; a continued run drops what it logged past its checkpoint
record, writer = run_log(out_dir, master, tensorboard, math.inf if eval_only else iter_num if resuming else -1,
                         tracker)
# speech from held-out text
synthesis = SynthesisEval(**dataclass_args(SynthesisEval, config, texts=words, vocode=vocode,
                                           speakers=utterance_speakers))


def final_report(step):
    if not master:
        return
    ids = val_ids[:eval_utterances or len(val_ids)]
    result = evaluate_synthesis(raw_model, val_set, train_set, ids, synthesis)
    record(dict(step=step, **result))
    print_synthesis_report(result, synthesis)


def log_eval(step, result, note=''):
    log(f"step {step}: val loss {result['loss']:.4f} (prior {result['prior']:.4f}, duration {result['duration']:.4f}, "
        f"flow {result['flow']:.4f}), teacher-forced mel L1 {result['mel_l1']:.4f}{note}")
    record(dict(step=step, **({'epoch': epoch_plan.epoch(step)} if epoch_plan else {}), val_loss=result['loss'],
                val_prior_loss=result['prior'], val_duration_loss=result['duration'], val_flow_loss=result['flow'],
                val_mel_l1=result['mel_l1']))


if eval_only:
    log_eval(iter_num, evaluate())
    final_report(iter_num)
    compute_cleanup(ddp)
    sys.exit(0)

stop = StopSignal()
monitor = MemoryMonitor(local_device)
if iter_num == 0:
    log_eval(0, evaluate())
bad_steps = 0
window_start, window_frames = time.time(), 0
progress = tqdm(total=run_iters, initial=iter_num, disable=not master, dynamic_ncols=True, desc='train')
while iter_num < run_iters:
    lr = get_lr(iter_num)
    set_lr(optimizer, lr)
    align_prior = max(0.0, 1.0 - iter_num / align_prior_iters) if align_prior_iters else 0.0

    batches = sampler.next_batches(gradient_accumulation_steps, within_epoch=by_epochs)
    while True:
        try:
            shares = train_step(batches, align_prior, batch_splits)
            break
        # CUDA raises torch.OutOfMemoryError, MPS a plain RuntimeError
        except RuntimeError as error:
            recover_from_oom(error, ddp, optimizer, local_device)
            batch_splits = split_micro_batches(batch_splits, max(len(b) for b in batches), iter_num)
            log(f"step {iter_num}: out of memory, retrying with each batch split into {batch_splits} micro-batches")

    with profiler.section('optimizer'):
        out_of_time = max_minutes > 0 and time.time() - _start_time > max_minutes * 60
        scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(raw_model.parameters(), grad_clip)
        losses, (stop_requested, out_of_time) = all_reduce_metrics(shares, [stop.requested is not None, out_of_time],
                                                                   ddp)
        prior, duration, flow = losses['prior'], losses['duration'], losses['flow']
        loss = weighted_loss(losses)
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
    window_frames += sum(train_set.lengths[i] for b in batches for i in b) * world_size
    # the epochs done: an epoch-counted run's fractional (Trainer's), else the sampler's whole ones; and the epoch
    # this step ended, if any
    epoch = epoch_plan.epoch(iter_num) if epoch_plan else sampler.epoch
    epoch_end = epoch_plan.ending(iter_num) if epoch_plan else 0
    if epoch_plan:
        progress.set_description(f'epoch {epoch_plan.under_way(iter_num)}/{len(epoch_plan.epoch_steps)}',
                                 refresh=False)

    if iter_num % log_interval == 0 or iter_num == run_iters:
        frames_per_sec = window_frames / (time.time() - window_start)
        level = monitor.check()
        event = dict(step=iter_num, train_loss=loss, prior_loss=prior, duration_loss=duration, flow_loss=flow, lr=lr,
                     **({'voice_loss': losses['voice']} if voice_clips else {}),
                     grad_norm=grad_norm, frames_per_sec=frames_per_sec, epoch=epoch, memory_level=level,
                     peak_memory_mb=(peak_memory_bytes(local_device) or 0) / 2**20, loss_scale=scaler.get_scale())
        event.update({f'time_ms/{k}': v for k, v in profiler.summary().items()})
        record(event)
        progress.set_postfix(loss=f'{loss:.4f}', frames_s=f'{frames_per_sec:,.0f}')
        log(f"step {iter_num}: loss {loss:.4f} (prior {prior:.4f}, duration {duration:.4f}, flow {flow:.4f}), "
            f"lr {lr:.2e}, grad norm {grad_norm:.3f}, {frames_per_sec:,.0f} frames/s, "
            + (f"epoch {epoch:.2f}" if epoch_plan else f"epoch {epoch}"))
        window_start, window_frames = time.time(), 0

    if (iter_num % eval_interval == 0 or iter_num == run_iters or out_of_time
            or eval_every_epochs and epoch_end and epoch_end % eval_every_epochs == 0):
        result = evaluate()
        improved = result['loss'] < best_val_loss
        if improved:
            best_val_loss, evals_without_improvement = result['loss'], 0
        else:
            evals_without_improvement += 1
        log_eval(iter_num, result,
                 " (best)" if improved else f" (no improvement for {evals_without_improvement} evals)")
        if master:
            record_media(writer, raw_model, val_set, iter_num, synthesis)
        if improved:
            save(os.path.join(out_dir, 'best.pt'), iter_num, best_val_loss, evals_without_improvement)
        if improved or always_save_checkpoint:
            save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
        if early_stopping_patience and evals_without_improvement >= early_stopping_patience:
            log(f"early stopping: no improvement for {evals_without_improvement} evals")
            break
        if out_of_time:
            log(f"max_minutes={max_minutes} reached at step {iter_num}: stopping")
            break
        window_start, window_frames = time.time(), 0  # throughput excludes eval time

    if stop_requested:
        save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
        progress.close()
        stop.exit(ckpt_path, iter_num, ddp)
progress.close()
save(ckpt_path, iter_num, best_val_loss, evals_without_improvement)
log(f"training ended at step {iter_num} after {(time.time() - _start_time) / 60:.1f} min, "
    f"best val loss {best_val_loss:.4f}")
final_report(iter_num)  # rank 0; the others wait in compute_cleanup
compute_cleanup(ddp)
