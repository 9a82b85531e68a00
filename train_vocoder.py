"""
Fine-tune a published HiFi-GAN generator on a text-to-speech model's own mels, as FastSpeech 2 and Matcha-TTS
users do: the model's mels of its training recordings, teacher-forced (each token held for the frames Monotonic
Alignment Search finds in the recording, so mel frame i is audio frame i), are the generator's input and the
recordings its target, with HiFi-GAN's discriminators and losses (tts/discriminators.py). Relaunching the same
command continues the run; `--eval_only=True` prints the held-out mel error of the generator.

    python train_vocoder.py --tts_ckpt=out-tts-natural/ckpt.pt --init_from=models/hifigan/generator_LJSpeech.pth.tar
    python sample_tts.py --out_dir=out-tts-natural --text="..." --vocoder=out-vocoder/generator.pth.tar

out_dir/generator.pth.tar (config.json beside it) is a generator file like the published ones, written at every
eval; out_dir/ckpt.pt also holds the discriminators and both optimizers. Without --tts_ckpt the generator is
fine-tuned on the recordings' own mels (a new voice). docs/tts.md says what it costs and gives.
"""

import dataclasses
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from configurator import FOLDER, SEED, UserError, at_least, check_values, configure, interval
from memory import recover_from_oom
from run.checkpoint import file_sha256, load_checkpoint, rng_state, set_rng_state, write_checkpoint
from run.run_folder import cached_tensors, open_run, require_init_from, run_log
from run.runtime import StopSignal, compute_init, log
from run.tracker import finish_wandb, require_wandb, start_wandb
from tts.data import (MEL_SETTINGS, LJSpeechDataset, MelExtractor, check_same_corpus, corpus_hash, encode_text,
                      eval_batches, read_metadata, read_speakers, read_wav, split_ids)
from tts.discriminators import (MultiPeriodDiscriminator, MultiScaleDiscriminator, discriminator_loss,
                                feature_loss, generator_loss, loss_mel)
from tts.model import load_tts
from tts.phonemes import phonemize_corpus
from tts.vocoder import load_hifigan, save_hifigan, with_weight_norm

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out-vocoder'      # ckpt.pt, generator.pth.tar + config.json, log.jsonl, aligned-mel cache
init_from = ''               # the generator to start from: a HiFi-GAN generator file, its config.json beside it
tts_ckpt = ''                # a train_tts.py checkpoint: its teacher-forced mels are the input; '' = the recordings'
data_dir = ''                # the recordings (LJSpeech layout); '' = the TTS checkpoint's corpus
resume = True                # continue out_dir's run if any; False = start a new one, replacing it
eval_only = False            # print the held-out mel error of out_dir's generator (or init_from's) and exit
eval_interval = 100          # steps between evals (and saves)
log_interval = 10            # steps between train-loss log lines
eval_utterances = 16         # held-out utterances (the TTS model's held-out split) whose mel error is evaluated
seed = 1337                  # random seed (segments, the TTS model's noise)
wandb_log = False            # also log to Weights & Biases (`pip install wandb`; run/tracker.py)
wandb_project = 'nanotrain'  # the W&B project
wandb_run_name = ''          # the W&B run's name; '' = out_dir's folder name
# data
segment_frames = 32          # mel frames per training segment (x 256 = 8192 samples, the release's segment_size)
batch_size = 4               # segments per step (the release: 16)
val_fraction = 0.05          # held-out share without tts_ckpt (with one, its split is used)
n_timesteps = 10             # the TTS model's ODE steps for its mels (its synthesis setting)
temperature = 0.667          # the TTS model's starting noise (its synthesis setting)
# losses and optimizer (the release's)
discriminators = True        # HiFi-GAN's adversarial and feature-matching losses; False = the mel L1 alone (~5x faster)
discriminator_divisor = 1    # the discriminators' widths and groups divided by this (1: the release's; 4: ~3x faster)
mel_weight = 45.0            # weight of the mel L1 against the adversarial and feature-matching losses
# the generator's AdamW lr: the release's 2e-4 had decayed to ~1e-5 (x 0.999 an epoch, ~3,000 epochs) when the
# published generators were saved; a fresh AdamW at 2e-4 tripled the held-out mel error in one step
learning_rate = 2e-5
discriminator_learning_rate = 2e-4  # the fresh discriminators' (the release's)
beta1 = 0.8
beta2 = 0.99
warmup_iters = 100           # both learning rates rise linearly over these steps (a fresh AdamW's first steps are big)
lr_decay = 0.999             # both learning rates are multiplied by this every epoch of the training utterances
max_iters = 1000             # optimizer steps (one of the discriminators, one of the generator)
max_bad_steps = 5            # abort after this many steps in a row with a non-finite loss
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('eval_interval', 'log_interval', 'eval_utterances', 'segment_frames', 'batch_size', 'n_timesteps',
                   'max_iters', 'max_bad_steps', 'discriminator_divisor')),
    (at_least(0), ('temperature', 'mel_weight', 'learning_rate', 'discriminator_learning_rate', 'warmup_iters')),
    (interval('(0, 1)'), ('val_fraction', 'beta1', 'beta2')),
    (interval('(0, 1]'), ('lr_decay',)),
    (FOLDER, ('out_dir',)),
])
require_wandb(wandb_log)
if not init_from:
    raise UserError("init_from is not set: give the published generator to fine-tune, e.g. --init_from="
                    "models/hifigan/generator_LJSpeech.pth.tar (with its config.json beside it; docs/tts.md says where "
                    "to get one).")
require_init_from(init_from)
if 32 % discriminator_divisor:
    raise UserError(f"discriminator_divisor={discriminator_divisor}: the discriminators' widths (32 to 1024) must "
                    f"divide by it; use 1, 2, 4, 8, 16 or 32.")
sample_rate, hop = MEL_SETTINGS['sample_rate'], MEL_SETTINGS['hop_length']
segment_samples = segment_frames * hop
local_device = compute_init(device, seed).device
# the generator, with weight norm as the release trains it; read first: a wrong file is refused before the
# TTS model's mels are made
generator = with_weight_norm(load_hifigan(init_from, local_device, 'init_from')).train()
this_run = dict(script='train_vocoder.py', init_from=os.path.abspath(init_from),
                tts_ckpt=os.path.abspath(tts_ckpt) if tts_ckpt else '')
out_dir_lock, ckpt_path, ckpt = open_run(config, this_run, True)

# the recordings and the mels the generator hears: the TTS model's, teacher-forced, or the recordings' own
tts = None
if tts_ckpt:
    tts_state = load_checkpoint(tts_ckpt, fix="point --tts_ckpt at a train_tts.py checkpoint")
    if tts_state.get('kind') != 'tts':
        raise UserError(f"tts_ckpt={tts_ckpt} is not a train_tts.py checkpoint (kind={tts_state.get('kind')!r}); "
                        f"point it at the text-to-speech model whose mels the generator should learn.")
    tts = load_tts(tts_state, local_device)
corpus = data_dir or (tts_state['data_dir'] if tts else '')
if not corpus:
    raise UserError("data_dir is not set: give the recordings (--data_dir, LJSpeech layout), or --tts_ckpt, whose "
                    "corpus is used.")
rows = read_metadata(corpus)
corpus_digest = corpus_hash(corpus, [utt_id for utt_id, _ in rows])
check_same_corpus(ckpt, corpus_digest, corpus, out_dir)  # a relaunch on other recordings is not its run
split_fraction = tts_state['config']['val_fraction'] if tts else val_fraction
train_ids, val_ids = split_ids([utt_id for utt_id, _ in rows], split_fraction)
val_ids = val_ids[:eval_utterances]
log(f"{len(train_ids)} training / {len(val_ids)} evaluated held-out recordings in {corpus}")


@torch.no_grad()
def aligned_mels(ids):
    """{id: (n_mels, T) log-mel}: the TTS model's mels of these recordings, decoded (n_timesteps, temperature) from
    its means held for the durations MAS finds against each recording (tts.model.teacher_forced), so they have the
    recording's frames; the noise is drawn from seed."""
    words = dict(rows)
    features_dir = os.path.join(out_dir, 'mel_cache')
    texts = phonemize_corpus(words, features_dir) if tts.config.text_frontend == 'phonemes' else words
    encoded = {i: encode_text(texts[i], tts.config.symbols, add_blank=False) for i in ids}  # (ids, unknown)
    lost = [i for i in ids if not encoded[i][0]]
    unknown = {i: characters for i, (_, characters) in encoded.items()}
    if lost:  # the model would read nothing of it: no mel of this recording to learn from
        raise UserError(f"utterance {lost[0]!r} of {corpus} ({len(lost)} such) holds no character the TTS model "
                        f"knows ({texts[lost[0]][:40]!r}): its corpus is in another alphabet. Use the corpus the "
                        f"model was trained on (--data_dir), or one in its alphabet.")
    if any(unknown.values()):
        log(f"{sum(map(bool, unknown.values()))} of {len(ids)} transcripts hold characters the TTS model does not "
            f"know, left out of its mels: {''.join(sorted(set().union(*unknown.values())))[:40]!r}")
    speakers = read_speakers(corpus) if tts.config.speakers else {}
    dataset = LJSpeechDataset(corpus, ids, texts, tts.config.symbols, features_dir, tts.config.add_blank,
                              progress=True, speakers={i: tts.config.speakers.index(s) for i, s in speakers.items()})
    noise = torch.Generator(device=local_device).manual_seed(seed)
    mels = {}
    for indices in tqdm(eval_batches(dataset.lengths, 3000), desc='teacher-forced mels', dynamic_ncols=True):
        x, x_lengths, y, y_lengths, spk = [t.to(local_device) for t in dataset.collate(
            indices, tts.mel_mean.item(), tts.mel_std.item())]
        mel, _ = tts.teacher_forced(x, x_lengths, y, y_lengths, spk, n_timesteps=n_timesteps,
                                    temperature=temperature, generator=noise)
        for b, i in enumerate(indices):
            mels[dataset.ids[i]] = tts.denormalize(mel[b, :, :y_lengths[b]]).float().cpu()
    return mels


def recording(utt_id):
    return read_wav(os.path.join(corpus, 'wavs', utt_id + '.wav'), sample_rate)[0]


if tts:  # computed once per run (a few minutes on a CPU), then read from out_dir
    frames = {i: recording(i).shape[0] // hop + 1 for i in train_ids + val_ids}  # MelExtractor's frame count
    key = dict(tts_ckpt=file_sha256(tts_ckpt), corpus=os.path.abspath(corpus), ids=train_ids + val_ids,
               n_timesteps=n_timesteps, temperature=temperature, seed=seed, mel=sorted(MEL_SETTINGS.items()))
    inputs = cached_tensors(out_dir, 'aligned_mels', key, {i: (MEL_SETTINGS['n_mels'], n) for i, n in frames.items()},
                            lambda: aligned_mels(train_ids + val_ids), True, "the TTS model's teacher-forced mels")
else:
    extractor = MelExtractor(**MEL_SETTINGS)
    inputs = {i: extractor(recording(i)) for i in train_ids + val_ids}


def segments(step):
    """The step's batch: (mels (B, n_mels, segment_frames), the recordings' samples under them (B, segment_samples)).
    Each epoch visits the training utterances in an order drawn from (seed, epoch); where a segment starts comes
    from torch's random stream (saved in checkpoints)."""
    mels, audio = [], []
    for n in range(step * batch_size, (step + 1) * batch_size):
        epoch, position = divmod(n, len(train_ids))
        utt_id = train_ids[random.Random(seed * 100003 + epoch).sample(range(len(train_ids)), len(train_ids))[position]]
        mel, wav = inputs[utt_id], recording(utt_id)
        start = int(torch.randint(0, max(1, mel.shape[1] - segment_frames + 1), ()))
        mel = mel[:, start:start + segment_frames]
        wav = wav[start * hop:(start + segment_frames) * hop]
        # an utterance shorter than a segment: silence after it
        mels.append(F.pad(mel, (0, segment_frames - mel.shape[1]), value=math.log(1e-5)))
        audio.append(F.pad(wav, (0, segment_samples - wav.shape[0])))
    return torch.stack(mels).to(local_device), torch.stack(audio).to(local_device)


# fresh discriminators (a generator file comes without the discriminators it was trained against)
mpd = MultiPeriodDiscriminator(discriminator_divisor).to(local_device)
msd = MultiScaleDiscriminator(discriminator_divisor).to(local_device)
optimizer_g = torch.optim.AdamW(generator.parameters(), learning_rate, betas=(beta1, beta2))
optimizer_d = torch.optim.AdamW([*mpd.parameters(), *msd.parameters()], discriminator_learning_rate,
                                betas=(beta1, beta2))
# the spectral norm's power-iteration vectors (msd's), which every forward advances: parts() rewinds them
power_vectors = [b for name, b in msd.named_buffers() if name.endswith(('._u', '._v'))]
# the parts each step's segments are taken in: 1, doubled by every out-of-memory error (split_after_oom)
iter_num, best_val_loss, batch_splits, resuming = 0, float('inf'), 1, ckpt is not None
if resuming:
    generator.load_state_dict(ckpt['generator'])
    mpd.load_state_dict(ckpt['mpd'])
    msd.load_state_dict(ckpt['msd'])
    optimizer_g.load_state_dict(ckpt['optimizer_g'])
    optimizer_d.load_state_dict(ckpt['optimizer_d'])
    iter_num, best_val_loss, batch_splits = ckpt['iter_num'], ckpt['best_val_loss'], ckpt.get('batch_splits', 1)
    set_rng_state(ckpt['rng'])
    log(f"resuming from {ckpt_path} at step {iter_num}" + (
        f", continuing with each step's segments in {batch_splits} parts (out of memory before)" * (batch_splits > 1)))
# logs to Weights & Biases too, a continued run to its W&B run
tracker = start_wandb(config, ckpt and ckpt.get('wandb_run_id'), True)
ckpt = None
log(f"device {local_device}: generator {sum(p.numel() for p in generator.parameters()) / 1e6:.1f}M parameters"
    + (f", discriminators {sum(p.numel() for p in [*mpd.parameters(), *msd.parameters()]) / 1e6:.1f}M"
       if discriminators else ", mel loss alone"))


@torch.no_grad()
def evaluate():
    """The release's validation error: mean L1 between the loss mels (loss_mel) of the held-out recordings and of
    the generator's speech from their mels, over whole utterances."""
    generator.eval()
    total = 0.0
    for utt_id in val_ids:
        wav = recording(utt_id).to(local_device)
        spoken = generator(inputs[utt_id][None].to(local_device))[:, :wav.shape[0]]
        total += F.l1_loss(loss_mel(spoken), loss_mel(wav[None])).item()
    generator.train()
    return total / len(val_ids)


def save(path, iter_num, best_val_loss):
    state = dict(kind='vocoder', run=this_run, config=config, iter_num=iter_num, best_val_loss=best_val_loss,
                 generator=generator.state_dict(), generator_config=dataclasses.asdict(generator.config),
                 mpd=mpd.state_dict(), msd=msd.state_dict(), optimizer_g=optimizer_g.state_dict(),
                 optimizer_d=optimizer_d.state_dict(), batch_splits=batch_splits, rng=rng_state(),
                 corpus_hash=corpus_digest, wandb_run_id=tracker and tracker.id)
    write_checkpoint(path, state, False, True)
    save_hifigan(generator, os.path.join(out_dir, 'generator.pth.tar'))


def parts(batch_splits, vectors):
    """The step's segments in batch_splits parts (more than one after an out-of-memory error), each a slice of
    the batch with its share of it: the losses are means over segments, so the shares' sums are the batch's.
    Each part starts from vectors, the power-iteration vectors as the pass started (a pass in parts, or tried
    again, uses and leaves what the batch's pass would)."""
    bounds = [i * batch_size // batch_splits for i in range(batch_splits + 1)]
    for a, b in zip(bounds, bounds[1:]):
        with torch.no_grad():
            for vector, start in zip(power_vectors, vectors):
                vector.copy_(start)
        if b > a:
            yield slice(a, b), (b - a) / batch_size


def discriminators_pass(mel, audio, batch_splits, vectors):
    """The discriminators' loss on the step's segments (real -> 1, the generator's -> 0, least squares) and its
    gradients. Returns (loss, the generator's speech of the whole batch with its graph, for generator_pass); in
    parts, each part's speech is made here without a graph and again, with one, in generator_pass."""
    if not discriminators:
        return 0.0, None
    total, fake = 0.0, None
    for rows, share in parts(batch_splits, vectors):
        with torch.set_grad_enabled(batch_splits == 1):
            fake = generator(mel[rows])[:, None]  # (B, 1, segment_samples)
        loss = share * sum(discriminator_loss(d(audio[rows, None])[0], d(fake.detach())[0]) for d in (mpd, msd))
        loss.backward()
        total += loss.item()
    return total, fake if batch_splits == 1 else None


def generator_losses(mel, audio, fake):
    """The generator's losses on these segments: the mel L1 and, with discriminators, their scores of its speech
    (fake, or made here if None) and their features of it against the recording's. A function of its own, so the
    discriminators' activations are let go before the next part's."""
    fake = generator(mel)[:, None] if fake is None else fake
    mel_loss = F.l1_loss(loss_mel(fake[:, 0]), loss_mel(audio))
    adversarial = features = torch.zeros((), device=local_device)
    for d in (mpd, msd) if discriminators else ():
        d.requires_grad_(False)  # the discriminators held fixed: gradients reach the generator alone
        with torch.no_grad():
            _, real_features = d(audio[:, None])
        fake_scores, fake_features = d(fake)
        adversarial = adversarial + generator_loss(fake_scores)
        features = features + feature_loss(real_features, fake_features)
        d.requires_grad_(True)
    return mel_loss, adversarial, features


def generator_pass(mel, audio, batch_splits, vectors, fake):
    """generator_losses on the step's segments and their gradients. fake: discriminators_pass's speech of the
    batch, or None. Returns the losses."""
    totals = [0.0, 0.0, 0.0]
    for rows, share in parts(batch_splits, vectors):
        losses = generator_losses(mel[rows], audio[rows], fake)
        (share * (mel_weight * losses[0] + losses[1] + losses[2])).backward()
        for i, loss in enumerate(losses):
            totals[i] += share * loss.item()
    return totals


def split_after_oom(error, where, batch_splits):
    """After a RuntimeError in a step's pass (where): re-raise it unless it is an out-of-memory error; else drop
    the pass's gradients and return twice as many parts (the same segments, so the same step)."""
    optimizer_d.zero_grad(set_to_none=True)
    recover_from_oom(error, False, optimizer_g, local_device)
    if batch_splits >= batch_size:
        raise UserError(f"out of memory with one segment at a time ({where}); lower segment_frames, set "
                        f"discriminator_divisor=2 or 4 (smaller discriminators), or use a device with more memory.")
    log(f"{where}: out of memory, retrying with the step's {batch_size} segments in {batch_splits * 2} parts")
    return batch_splits * 2


# an eval_only run appends to the log; a continued run drops what it logged past its checkpoint
record, _ = run_log(out_dir, True, False, math.inf if eval_only else iter_num if resuming else -1, tracker)
if eval_only or iter_num == 0:
    val_loss = evaluate()
    log(f"step {iter_num}: held-out mel error {val_loss:.4f}")
    record(dict(step=iter_num, val_mel_error=val_loss))
    if eval_only:
        finish_wandb()
        sys.exit(0)

stop = StopSignal()
bad_steps, t0 = 0, time.time()
while iter_num < max_iters:
    warmup = min(1.0, (iter_num + 1) / warmup_iters) if warmup_iters else 1.0
    lr_scale = warmup * lr_decay ** (iter_num * batch_size // len(train_ids))  # x lr_decay an epoch
    for optimizer, lr in ((optimizer_g, learning_rate), (optimizer_d, discriminator_learning_rate)):
        for group in optimizer.param_groups:
            group['lr'] = lr * lr_scale
    mel, audio = segments(iter_num)
    vectors = [v.clone() for v in power_vectors]
    while True:
        try:
            d_loss, fake = discriminators_pass(mel, audio, batch_splits, vectors)
            break
        except RuntimeError as error:  # CUDA raises torch.OutOfMemoryError, MPS and the CPU a plain RuntimeError
            batch_splits = split_after_oom(error, f'step {iter_num}', batch_splits)
    finite = math.isfinite(d_loss)
    if discriminators and finite:
        optimizer_d.step()
    optimizer_d.zero_grad(set_to_none=True)
    vectors = [v.clone() for v in power_vectors]
    while True:  # a retry here leaves the discriminators' step taken
        try:
            mel_loss, adversarial, features = generator_pass(mel, audio, batch_splits, vectors, fake)
            break
        except RuntimeError as error:
            fake = None  # and its graph: the parts generate their own
            batch_splits = split_after_oom(error, f'step {iter_num}', batch_splits)
    g_loss = mel_weight * mel_loss + adversarial + features
    finite = finite and math.isfinite(g_loss)
    if finite:
        optimizer_g.step()
        bad_steps = 0
    else:
        bad_steps += 1
        log(f"step {iter_num}: non-finite loss (generator {g_loss}, discriminators {d_loss}), step skipped "
            f"({bad_steps}/{max_bad_steps})")
        if bad_steps >= max_bad_steps:
            raise SystemExit(f"error: {bad_steps} steps in a row had a non-finite loss; lower learning_rate. The last "
                             f"good checkpoint in {out_dir} was left as it was.")
    optimizer_g.zero_grad(set_to_none=True)
    iter_num += 1

    if iter_num % log_interval == 0 or iter_num == max_iters:
        seconds = (time.time() - t0) / log_interval
        record(dict(step=iter_num, mel_loss=mel_loss, adversarial_loss=adversarial, feature_loss=features,
                    discriminator_loss=d_loss, lr=learning_rate * lr_scale, s_per_step=seconds))
        log(f"step {iter_num}: mel L1 {mel_loss:.4f}, adversarial {adversarial:.3f}, features {features:.3f}, "
            f"discriminators {d_loss:.3f}, lr {learning_rate * lr_scale:.2e}, {seconds:.2f} s/step")
        t0 = time.time()
    if iter_num % eval_interval == 0 or iter_num == max_iters:
        val_loss = evaluate()
        best_val_loss = min(best_val_loss, val_loss)
        log(f"step {iter_num}: held-out mel error {val_loss:.4f} (best {best_val_loss:.4f})")
        record(dict(step=iter_num, val_mel_error=val_loss))
        save(ckpt_path, iter_num, best_val_loss)
        t0 = time.time()
    if stop.requested:
        save(ckpt_path, iter_num, best_val_loss)
        stop.exit(ckpt_path, iter_num, False)  # finishes the W&B run too
log(f"training ended at step {iter_num}: {os.path.join(out_dir, 'generator.pth.tar')} is the fine-tuned generator "
    f"(--vocoder=...)")
finish_wandb()
