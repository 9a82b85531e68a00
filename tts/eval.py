"""
Evaluating a TTS model (train_tts.py): MCD-DTW (mel-cepstral distortion along a dynamic time
warping path), held-out synthesis from text (MCD-DTW against references and a mean-mel baseline,
real-time factor, sample WAVs), and TensorBoard media (mel images, synthesized audio).
"""
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torchaudio
from tqdm import tqdm

from tts.data import BLANK_ID, MEL_SETTINGS, MelExtractor, eval_batches, wav_software, write_wav
from tts.losses import prior_loss
from tts.model import gaussian_log_likelihood, pad_to_even, sequence_mask, synthesize
from tts.vocoder import vocoder_name

SAMPLE_SOFTWARE = 'nanotrain train_tts.py'  # the mark of its held-out samples: it replaces no other file there

# -----------------------------------------------------------------------------
# metrics


def dtw_mean_cost(cost):
    """Dynamic time warping over a (N, M) frame distance matrix with steps (1,0), (0,1), (1,1):
    the mean distance along the cheapest path from (0, 0) to (N-1, M-1) (total cost / path
    length, ties broken towards the shorter path)."""
    cost = cost.tolist()
    N, M = len(cost), len(cost[0])
    inf = float('inf')
    # total[i][j]: best cost ending at frame pair (i-1, j-1)
    total = [[inf] * (M + 1) for _ in range(N + 1)]
    steps = [[0] * (M + 1) for _ in range(N + 1)]
    total[0][0] = 0.0
    for i in range(1, N + 1):
        row, prev_row, costs = total[i], total[i - 1], cost[i - 1]
        for j in range(1, M + 1):
            best, n = min((prev_row[j - 1], steps[i - 1][j - 1]), (prev_row[j], steps[i - 1][j]),
                          (row[j - 1], steps[i][j - 1]))
            row[j] = best + costs[j - 1]
            steps[i][j] = n + 1
    return total[N][M] / steps[N][M]


def mel_cepstral_distortion(log_mel, reference_log_mel, n_cepstra=13):
    """MCD-DTW in dB between two natural-log mel spectrograms (n_mels, T1) and (n_mels, T2).
    Mel cepstra c1..c_n of each frame (c0, loudness, left out): the cepstrum of the log spectrum
    over mel frequency, c_m = (1/n_mels) sum_k log_mel_k cos(pi m (k + 1/2) / n_mels), i.e. the
    orthonormal DCT-II divided by sqrt(2 n_mels), so that log_mel = c0 + 2 sum_m c_m cos(...) as in
    SPTK's convention. Frame distance 10/ln(10) * sqrt(2 * sum_m (c_m - c'_m)^2) dB, averaged
    along the DTW path (the lengths may differ)."""
    n_mels = log_mel.shape[0]
    dct = torchaudio.functional.create_dct(n_cepstra + 1, n_mels, norm='ortho').double() / math.sqrt(2 * n_mels)
    a = (log_mel.double().T @ dct)[:, 1:]
    b = (reference_log_mel.double().T @ dct)[:, 1:]
    distances = 10 / math.log(10) * math.sqrt(2) * torch.cdist(a, b, compute_mode='donot_use_mm_for_euclid_dist')
    return dtw_mean_cost(distances)


@torch.no_grad()
def alignment_stats(model, dataset, frame_budget):
    """How well the text is aligned to the audio of dataset's utterances, with plain MAS as in evaluation:
      prior      the prior loss (per mel value; 0.919 would be a perfect mean, log(2 pi) / 2)
      one_frame  share of the characters (blanks left out) given a single frame: a failed alignment gives
                 most characters one frame and a few tokens long stretches of speech
      sharpness  mean over frames of the probability of the path's token among the utterance's tokens,
                 the softmax over tokens of each frame's log-likelihood under N(mu, I)
    A model that has learned the alignment has a low prior and one_frame and a high sharpness."""
    model.eval()
    device = model.mel_mean.device
    prior = frames = one_frame = characters = sharpness = 0.0
    for indices in eval_batches(dataset.lengths, frame_budget):
        x, x_lengths, y, y_lengths, speakers = [t.to(device) for t in dataset.collate(
            indices, model.mel_mean.item(), model.mel_std.item())]
        y = pad_to_even(y)
        mu, _, x_mask = model.encode(x, x_lengths, model.voice(speakers))
        mu, y_mask = mu.float(), sequence_mask(y_lengths, y.shape[2])[:, None, :].float()
        path = model.align(mu, x_mask, y, y_mask)
        prior += prior_loss(y, mu @ path, y_mask).item() * y_lengths.sum().item()
        frames += y_lengths.sum().item()
        is_character = (x != BLANK_ID) & x_mask[:, 0].bool()
        one_frame += ((path.sum(2) == 1) & is_character).sum().item()
        characters += is_character.sum().item()
        log_likelihood = gaussian_log_likelihood(mu, y)
        posterior = log_likelihood.masked_fill(~x_mask.transpose(1, 2).bool(), -math.inf).softmax(1)
        on_path = (posterior * path).sum(1)
        sharpness += (on_path * y_mask[:, 0]).sum().item()
    model.train()
    return dict(prior=prior / frames, one_frame=one_frame / characters, sharpness=sharpness / frames)

# -----------------------------------------------------------------------------
# TensorBoard media and held-out synthesis, with the
# model's inference settings (tts/model.py's synthesize)


def mel_image(mel):
    """(n_mels, T) log-mel -> (1, n_mels, T) grey image in [0, 1], low frequencies at the bottom."""
    return ((mel.float().cpu() - math.log(1e-5)) / (mel.max().item() - math.log(1e-5))).clamp(0, 1).flip(0)[None]


@dataclass(frozen=True)
class SynthesisEval:
    """How evaluation speaks held-out text (train_tts.py's config keys): tts/model.py synthesize's settings, the
    vocoder (its file, '' = Griffin-Lim, and vocode, what load_vocoder made of it), and where the first
    audio_samples held-out utterances go as WAVs (out_dir/samples) and to TensorBoard."""
    texts: dict  # utterance id -> text
    n_timesteps: int
    temperature: float
    length_scale: float
    guidance: float
    seed: int
    audio_samples: int
    out_dir: str
    vocoder: str
    vocode: Callable
    speakers: dict  # utterance id -> its speaker's name (a multi-speaker corpus; else empty)

    def synthesize(self, model, utt_id):
        return synthesize(model, self.texts[utt_id], self.n_timesteps, self.temperature, self.length_scale,
                          self.guidance, self.seed, self.vocode, self.speakers.get(utt_id, ''))


def record_media(writer, model, val_set, step, setup):
    """TensorBoard: teacher-forced vs target mel of the first held-out utterance, and speech
    synthesized from text (predicted durations) for the first setup.audio_samples held-out utterances."""
    if not writer:
        return
    model.eval()
    device = model.mel_mean.device
    collated = val_set.collate([0], model.mel_mean.item(), model.mel_std.item())
    x, x_lengths, y, y_lengths, speakers = [t.to(device) for t in collated]
    mel, _ = model.teacher_forced(x, x_lengths, y, y_lengths, speakers, n_timesteps=setup.n_timesteps,
                                  temperature=setup.temperature,
                                  generator=torch.Generator(device=device).manual_seed(setup.seed))
    pred, target = model.denormalize(mel[0, :, :y.shape[2]]), model.denormalize(y[0])
    writer.add_image('mel/teacher_forced_over_target', torch.cat([mel_image(pred), mel_image(target)], dim=1), step)
    for utt_id in val_set.ids[:setup.audio_samples]:
        audio, log_mel = setup.synthesize(model, utt_id)
        writer.add_audio(f'audio/{utt_id}', audio.clamp(-1, 1)[None], step, sample_rate=MEL_SETTINGS['sample_rate'])
        writer.add_image(f'mel/synthesized_{utt_id}', mel_image(log_mel), step)
    model.train()


def evaluate_synthesis(model, val_set, train_set, ids, setup):
    """Held-out speech from text alone: MCD-DTW of the synthesized mel against the reference, of the
    mel re-analysed from its audio, of the reference itself through the vocoder (its floor) and of a trivial
    baseline (the training set's mean mel frame repeated for the reference's length); real-time factor. Scores
    the held-out utterances ids; writes the first setup.audio_samples as WAVs to setup.out_dir/samples."""
    model.eval()
    sample_rate = MEL_SETTINGS['sample_rate']
    extractor = MelExtractor(**MEL_SETTINGS)
    mean_frame = train_set.mean_mel()
    samples_dir = os.path.join(setup.out_dir, 'samples')
    os.makedirs(samples_dir, exist_ok=True)
    scores = {k: [] for k in ('model', 'model_audio', 'reference_audio', 'baseline')}
    model_seconds = audio_seconds = duration_ratio = 0.0
    if ids:  # once untimed (its own seed, so the same speech): a compiled model compiles here, not in the RTF
        setup.synthesize(model, ids[0])
    for n, utt_id in enumerate(tqdm(ids, desc='synthesis eval', dynamic_ncols=True, leave=False)):
        reference = val_set.mels[val_set.ids.index(utt_id)]
        t0 = time.perf_counter()
        audio, log_mel = setup.synthesize(model, utt_id)
        model_seconds += time.perf_counter() - t0
        audio_seconds += len(audio) / sample_rate
        duration_ratio += log_mel.shape[1] / reference.shape[1] / len(ids)
        scores['model'].append(mel_cepstral_distortion(log_mel, reference))
        scores['model_audio'].append(mel_cepstral_distortion(extractor(audio), reference))
        scores['reference_audio'].append(mel_cepstral_distortion(extractor(setup.vocode(reference)), reference))
        scores['baseline'].append(mel_cepstral_distortion(mean_frame[:, None].expand_as(reference), reference))
        if n >= setup.audio_samples:
            continue
        path = os.path.join(samples_dir, f'{utt_id}.wav')
        if os.path.lexists(path) and wav_software(path) != SAMPLE_SOFTWARE:
            tqdm.write(f"left {path} as it is: a file this script did not write (move it to see the sample)")
        else:
            write_wav(path, audio, sample_rate, software=SAMPLE_SOFTWARE)
    model.train()
    result = {f'mcd_{k}': sum(v) / len(v) for k, v in scores.items()}
    result.update(rtf=model_seconds / audio_seconds, duration_ratio=duration_ratio, eval_utterances=len(ids))
    return result


def print_synthesis_report(result, setup):
    """The held-out synthesis scores of evaluate_synthesis, one per line."""
    vocoder = vocoder_name(setup.vocoder)
    print(f"held-out synthesis ({result['eval_utterances']} utterances, {setup.n_timesteps} ODE steps, "
          f"{vocoder} audio):\n"
          f"  MCD-DTW model mel            {result['mcd_model']:.2f} dB\n"
          f"  MCD-DTW model audio          {result['mcd_model_audio']:.2f} dB  (mel re-analysed from the WAV)\n"
          f"  MCD-DTW reference audio      {result['mcd_reference_audio']:.2f} dB  (reference mel through {vocoder}: "
          f"its floor)\n"
          f"  MCD-DTW mean-mel baseline    {result['mcd_baseline']:.2f} dB\n"
          f"  length synthesized/reference {result['duration_ratio']:.2f}\n"
          f"  real-time factor             {result['rtf']:.3f} (synthesis time / audio time, {vocoder} included)\n"
          f"  samples in {os.path.join(setup.out_dir, 'samples')}")
