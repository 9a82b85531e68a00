"""Tests of the text-to-speech stack (tts/data.py, tts/model.py, losses.py, train_tts.py) on tiny
generated corpora: a few short sine/noise WAVs and a metadata.csv made in tmp_path."""

import dataclasses
import itertools
import json
import math
import os
import random
import resource
import re
import shlex
import shutil
import stat
import sys
import wave

import numpy as np
import pytest
import torch

from configurator import UserError
from conftest import (INDUCTOR_ON_THIS_CPU, assert_logged_to_wandb, assert_user_error, kill_and_relaunch, launch, load,
                      read_log, run, wandb_env)
from tts.data import (MEL_SETTINGS, FrameBudgetSampler, LJSpeechDataset, MelExtractor, encode_text,
                      make_espeak_corpus, read_metadata, read_speakers, read_voice_clip, read_wav, reads_phonemes,
                      split_ids, wav_software, write_wav)
from tts.eval import alignment_stats, dtw_mean_cost, mel_cepstral_distortion
from tts.losses import duration_loss, flow_matching_loss, flow_matching_path, prior_loss
from tts.phonemes import phonemize
from tts.model import (TTSConfig, TTSModel, durations_to_path, load_tts, log_beta_binomial_prior,
                       maximum_path_reference, monotonic_alignment_search, sequence_mask, synthesize)

SR = MEL_SETTINGS['sample_rate']
# a tiny HiFi-GAN generator in the published layout (tests/fixtures/make_hifigan_fixtures.py)
VOCODER = os.path.join(os.path.dirname(__file__), 'fixtures', 'hifigan', 'v1', 'generator.pth.tar')
TINY = ['--enc_channels=32', '--enc_layers=1', '--enc_heads=2', '--enc_ff_channels=64', '--dp_channels=32',
        '--dec_channels=32', '--dec_blocks=1', '--dec_heads=2', '--frame_budget=400', '--val_fraction=0.2',
        '--learning_rate=1e-3', '--warmup_iters=2', '--log_interval=1', '--n_timesteps=2', '--tensorboard=False',
        '--device=cpu', '--dtype=float32']


def write_pcm(path, samples, sample_rate=SR, channels=1):
    """Independent of tts.data.write_wav: int16 samples (frames x channels) straight to `wave`."""
    with wave.open(str(path), 'wb') as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(np.asarray(samples, dtype='<i2').tobytes())


def make_corpus(root, n=10, seed=0):
    """Utterances of 1-3 'words'; each word a tone (or noise for 's') of its own pitch."""
    rng = np.random.RandomState(seed)
    os.makedirs(root / 'wavs', exist_ok=True)
    pitch = {'a': 300, 'e': 500, 'o': 200, 'm': 120, 's': 0}
    rows = []
    for k in range(n):
        words = [['aa', 'ee', 'oo', 'sss', 'mm'][i] for i in rng.randint(0, 5, rng.randint(1, 4))]
        parts = []
        for w in words:
            t = np.arange(int(SR * 0.05 * len(w))) / SR
            f = pitch[w[0]]
            parts += [0.3 * np.sin(2 * math.pi * f * t) if f else 0.1 * rng.randn(len(t)), np.zeros(SR // 40)]
        write_pcm(root / 'wavs' / f'U{k:03d}.wav', np.concatenate(parts) * 32767)
        rows.append(f"U{k:03d}|{' '.join(words).upper()}|{' '.join(words)}")
    (root / 'metadata.csv').write_text('\n'.join(rows) + '\n')
    return root


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp('tts_corpus'))


def untrained_run(out_dir, **config):
    """A train_tts.py run's folder holding a ckpt.pt of an untrained tiny model (config: TTSConfig fields): what
    sample_tts.py reads of a checkpoint, made in milliseconds."""
    config = TTSConfig(**{**dict(symbols='abcdefghijklmnopqrstuvwxyz .', enc_channels=16, enc_layers=1,
                                 enc_heads=2, enc_ff_channels=16, dp_channels=8, dec_channels=16, dec_blocks=1,
                                 dec_heads=2), **config})
    os.makedirs(out_dir, exist_ok=True)
    torch.save({'kind': 'tts', 'model_args': dataclasses.asdict(config), 'model': TTSModel(config).state_dict()},
               os.path.join(out_dir, 'ckpt.pt'))
    return out_dir


@pytest.fixture(scope='module')
def untrained(tmp_path_factory):
    return untrained_run(tmp_path_factory.mktemp('tts_untrained') / 'run')


def train(out_dir, data_dir, *extra, **kw):
    """train_tts.py on the tiny model (conftest.launch's keywords: faults, check...)."""
    return launch('train_tts.py', out_dir, data_dir, *TINY, *extra, **kw)

# ----------------------------------------------------------------------------- alignment


def random_alignment_problem(seed, B=5, max_tx=6, max_ty=14):
    g = torch.Generator().manual_seed(seed)
    x_lengths = torch.randint(1, max_tx + 1, (B,), generator=g)
    y_lengths = torch.stack([torch.randint(int(n), max_ty + 1, (1,), generator=g)[0] for n in x_lengths])
    value = torch.randn(B, max_tx, max_ty, generator=g, dtype=torch.float64)
    mask = (torch.arange(max_tx)[None, :, None] < x_lengths[:, None, None]) & \
           (torch.arange(max_ty)[None, None, :] < y_lengths[:, None, None])
    return value, mask


def brute_force_path(value, t_x, t_y):
    """Try every split of t_y frames into t_x non-empty runs; return the best path."""
    best, best_path = -math.inf, None
    for cuts in itertools.combinations(range(1, t_y), t_x - 1):
        bounds = (0, *cuts, t_y)
        score = sum(value[i, bounds[i]:bounds[i + 1]].sum().item() for i in range(t_x))
        if score > best:
            best, best_path = score, bounds
    path = torch.zeros(t_x, t_y, dtype=value.dtype)
    for i in range(t_x):
        path[i, best_path[i]:best_path[i + 1]] = 1
    return path


@pytest.mark.comparison
def test_mas_matches_plain_loop_reference_and_brute_force():
    for seed in range(6):
        value, mask = random_alignment_problem(seed)
        path = monotonic_alignment_search(value, mask)
        assert torch.equal(path, maximum_path_reference(value, mask))
        for b in range(value.shape[0]):
            t_x, t_y = int(mask[b, :, 0].sum()), int(mask[b, 0, :].sum())
            assert torch.equal(path[b, :t_x, :t_y], brute_force_path(value[b], t_x, t_y))
            assert path[b].sum() == t_y  # one token per real frame, nothing in the padding


def test_durations_to_path():
    durations = torch.tensor([[2, 0, 3]])
    mask = torch.ones(1, 3, 6)
    expected = torch.tensor([[[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]]]).float()
    assert torch.equal(durations_to_path(durations, mask), expected)


def test_alignment_prior_breaks_ties_towards_the_diagonal():
    x_lengths, y_lengths = torch.tensor([10, 7]), torch.tensor([40, 30])
    prior = log_beta_binomial_prior(x_lengths, y_lengths, 10, 40)
    # every real frame: a distribution over its utterance's tokens; zero outside the utterance
    assert torch.allclose(prior[0].exp().sum(0), torch.ones(40), atol=1e-5)
    assert torch.allclose(prior[1, :7, :30].exp().sum(0), torch.ones(30), atol=1e-5)
    assert not prior[1, 7:].any() and not prior[1, :, 30:].any()
    n, k, a, b = 6, 2, 5 + 1, 30 - 5  # utterance 1, token 2, frame 5: BetaBinomial(n, a, b) at k
    log_beta = lambda p, q: math.lgamma(p) + math.lgamma(q) - math.lgamma(p + q)
    expected = math.log(math.comb(n, k)) + log_beta(k + a, n - k + b) - log_beta(a, b)
    assert math.isclose(prior[1, 2, 5].item(), expected, rel_tol=1e-5)
    # tokens the encoder cannot tell apart yet (an untrained encoder's mu are nearly alike): plain MAS keeps
    # the last token as long as it can, giving every other token one frame, the path the encoder then
    # learns (the stalled alignment of issue 18); with the prior the frames are shared out evenly
    model = TTSModel(TTSConfig(symbols='ab', n_mels=4, enc_channels=8, enc_layers=1, enc_heads=2, enc_ff_channels=8,
                               dp_channels=8, dec_channels=8, dec_blocks=1, dec_heads=2))
    x_mask = (torch.arange(10)[None, :] < x_lengths[:, None])[:, None, :].float()
    y_mask = (torch.arange(40)[None, :] < y_lengths[:, None])[:, None, :].float()
    # quarters: every product and sum in the log-likelihood is exact, so the tokens tie on any CPU
    mu = torch.full((2, 4, 10), 0.5) * x_mask
    y = torch.randint(-8, 9, (2, 4, 40), generator=torch.Generator().manual_seed(0)) / 4
    plain = model.align(mu, x_mask, y, y_mask).sum(2)
    assert plain[0].tolist() == [1] * 9 + [31] and plain[1, :7].tolist() == [1] * 6 + [24]
    even = model.align(mu, x_mask, y, y_mask, prior_weight=1.0).sum(2)
    assert even[0].min() >= 3 and even[0].max() <= 5 and even[1, :7].min() >= 3 and even[1, :7].max() <= 5
    assert even[0].sum() == 40 and even[1].sum() == 30

# ----------------------------------------------------------------------------- losses and metrics


@pytest.mark.comparison
def test_flow_matching_path_and_masked_loss():
    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(3, 4, 7, generator=g), torch.randn(3, 4, 7, generator=g)
    t = torch.tensor([0.0, 0.3, 1.0])
    x_t, target = flow_matching_path(x0, x1, t, sigma_min=1e-4)
    for b in range(3):
        assert torch.allclose(x_t[b], (1 - (1 - 1e-4) * t[b]) * x0[b] + t[b] * x1[b])
    assert torch.allclose(x_t[0], x0[0]) and torch.allclose(x_t[2], x1[2] + 1e-4 * x0[2])
    assert torch.allclose(target, x1 - (1 - 1e-4) * x0)
    lengths = [7, 4, 2]
    mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).float()[:, None, :]
    pred = torch.randn(3, 4, 7, generator=g)
    expected = sum(((pred[b, :, :n] - target[b, :, :n]) ** 2).sum() for b, n in enumerate(lengths)) / (4 * sum(lengths))
    assert torch.allclose(flow_matching_loss(pred, target, mask), expected)
    garbage = pred.clone()
    garbage[mask.expand_as(pred) == 0] = 1e6  # padding must not count, in prediction or target
    target_garbage = target.clone()
    target_garbage[mask.expand_as(pred) == 0] = -1e6
    assert torch.allclose(flow_matching_loss(garbage, target_garbage, mask), expected)


def test_prior_and_duration_losses():
    g = torch.Generator().manual_seed(1)
    y, mu = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    mask = torch.tensor([[[1, 1, 1, 1, 1]], [[1, 1, 0, 0, 0]]]).float()
    nll = -torch.distributions.Normal(mu, 1.0).log_prob(y)
    expected = (nll[0].sum() + nll[1, :, :2].sum()) / (3 * 7)
    assert torch.allclose(prior_loss(y, mu, mask), expected)
    log_pred = torch.randn(2, 1, 4, generator=g)
    durations = torch.tensor([[[2., 1., 3., 1.]], [[4., 2., 0., 0.]]])
    x_mask = torch.tensor([[[1, 1, 1, 1]], [[1, 1, 0, 0]]]).float()
    errors = [(log_pred[0, 0, i] - math.log(durations[0, 0, i])) ** 2 for i in range(4)] + \
             [(log_pred[1, 0, i] - math.log(durations[1, 0, i])) ** 2 for i in range(2)]
    assert torch.allclose(duration_loss(log_pred, durations, x_mask), sum(errors) / 6)


def brute_force_dtw(cost):
    """All monotonic paths by recursion: the cheapest total (ties: fewer steps), as total / steps."""
    N, M = cost.shape

    def best(i, j):  # (total, steps) of the best path from (0, 0) to (i, j)
        if i == 0 and j == 0:
            return cost[0, 0].item(), 1
        options = [best(a, b) for a, b in ((i - 1, j - 1), (i - 1, j), (i, j - 1)) if a >= 0 and b >= 0]
        total, steps = min(options)
        return total + cost[i, j].item(), steps + 1

    total, steps = best(N - 1, M - 1)
    return total / steps


def test_dtw_and_mcd():
    g = torch.Generator().manual_seed(2)
    for shape in [(1, 1), (3, 5), (5, 4), (4, 4)]:
        cost = torch.rand(*shape, generator=g, dtype=torch.float64)
        assert math.isclose(dtw_mean_cost(cost), brute_force_dtw(cost), rel_tol=1e-12)
    mel = torch.randn(80, 30, generator=g)
    assert mel_cepstral_distortion(mel, mel) == 0.0
    assert mel_cepstral_distortion(mel.repeat_interleave(2, dim=1), mel) < 1e-12  # DTW absorbs a slower tempo
    assert mel_cepstral_distortion(mel + 3.0, mel) < 1e-4  # loudness (c0) is left out
    # one frame pair against the SPTK-style formula with an explicit cosine sum
    a, b = torch.randn(80, 1, generator=g), torch.randn(80, 1, generator=g)
    k = torch.arange(80).double()
    cep = lambda x: torch.stack([(x[:, 0].double() * torch.cos(math.pi * m * (k + 0.5) / 80)).sum() / 80
                                 for m in range(1, 14)])
    expected = 10 / math.log(10) * math.sqrt(2 * ((cep(a) - cep(b)) ** 2).sum().item())
    assert math.isclose(mel_cepstral_distortion(a, b), expected, rel_tol=1e-6)

@pytest.mark.parametrize('cfg_drop', [0.0, 0.5])
def test_flow_loss_does_not_train_the_encoder(cfg_drop):
    # the decoder's condition is detached (tts/model.py's TTSModel.forward), also when guidance
    # dropout rebuilds it: the encoder learns from the prior loss alone
    torch.manual_seed(0)
    model = TTSModel(TTSConfig(symbols='abcdef', n_mels=8, enc_channels=16, enc_layers=1, enc_heads=2,
                               enc_ff_channels=32, dp_channels=16, dec_channels=16, dec_blocks=1, dec_heads=2,
                               dropout=0.0, cfg_drop=cfg_drop))
    torch.nn.init.normal_(model.decoder.out.weight, std=0.1)  # trained-like: its zero init passes no gradient back
    x, x_lengths = torch.randint(2, 8, (8, 5)), torch.tensor([5, 4, 5, 3, 5, 5, 4, 5])
    y, y_lengths = torch.randn(8, 8, 12), torch.tensor([12, 10, 12, 9, 12, 11, 12, 8])
    losses = model(x, x_lengths, y, y_lengths)
    encoder = list(model.encoder.parameters())
    flow_grads = torch.autograd.grad(losses['flow'], encoder, allow_unused=True, retain_graph=True)
    assert all(g is None or not g.any() for g in flow_grads)
    prior_grads = torch.autograd.grad(losses['prior'], encoder, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in prior_grads)


@pytest.mark.comparison
@pytest.mark.slow
@INDUCTOR_ON_THIS_CPU
def test_compiled_encoder_and_decoder_compile_once_for_every_length():
    """train_tts.py --compile=True compiles the encoder and the decoder with dynamic shapes. Over batches of other
    sizes and lengths (odd and even tokens, as the data gives them), training and no-grad, they give eager's
    outputs and gradients, and the first batch's graphs serve every later one (attention compiled inside them
    fixed the length: a compile per batch, minutes each on the wide config). Inductor reorders float32 sums of
    up to a few hundred terms (GroupNorm over C/8 x T, a gradient over B x T): within 1e-4 of each scale."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = TTSModel(TTSConfig(symbols='abcdef', n_mels=8, enc_channels=16, enc_layers=1, enc_heads=2,
                               enc_ff_channels=16, dp_channels=8, dec_channels=16, dec_blocks=1, dec_heads=2,
                               dropout=0.0))
    torch.nn.init.normal_(eager.decoder.out.weight, std=0.1)  # trained-like: zero init passes no gradient back
    compiled = TTSModel(eager.config)
    compiled.load_state_dict(eager.state_dict())
    compiled.encoder.compile(dynamic=True)  # as train_tts.py does
    compiled.decoder.compile(dynamic=True)

    def outputs_and_grads(model, x, x_mask, x_t, y_mask, t, probe):
        model.zero_grad()
        _, mu = model.encoder(x, x_mask)
        velocity = model.decoder(x_t, y_mask, probe[1], t)
        ((mu * probe[0]).sum() + (velocity * probe[2]).sum()).backward()
        with torch.no_grad():  # evaluation and synthesis
            velocity_no_grad = model.decoder(x_t, y_mask, probe[1], t)
        return [mu, velocity, velocity_no_grad] + [p.grad for p in model.parameters() if p.grad is not None]

    graphs = []
    # (a batch of one, or sizes equal to another by chance in the first batch, compile once more: the compiler
    # specializes sizes 0 and 1 and ties equal sizes together; frame counts are even, as TTSModel pads them)
    for b, tokens, frames in [(3, 7, 22), (4, 10, 34), (5, 13, 46), (3, 9, 28)]:
        x = torch.randint(2, 8, (b, tokens))
        x_mask = sequence_mask(torch.tensor([tokens] + [tokens - 2] * (b - 1)))[:, None].float()
        y_mask = sequence_mask(torch.tensor([frames] + [frames - 3] * (b - 1)))[:, None].float()
        x_t, t = torch.randn(b, 8, frames), torch.rand(b)
        probe = (torch.randn(b, 8, tokens), torch.randn(b, 8, frames), torch.randn(b, 8, frames))
        want = outputs_and_grads(eager, x, x_mask, x_t, y_mask, t, probe)
        got = outputs_and_grads(compiled, x, x_mask, x_t, y_mask, t, probe)
        assert len(got) == len(want) == 3 + len([*eager.encoder.parameters(), *eager.decoder.parameters()])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())
        graphs.append(counters['stats']['unique_graphs'])
    assert graphs[0] > 0 and graphs == graphs[:1] * 4, graphs


def test_synthesis_eval_leaves_the_first_synthesis_out_of_the_real_time_factor(tmp_path):
    """train_tts.py's held-out synthesis times a warm model: a compiled one spends minutes compiling at its first
    utterance. A synthesize that takes half a second the first time and nothing after, over two 1 s utterances:
    an RTF near 0 (0.25 if the first call were timed), with the same speech scored."""
    import time
    from types import SimpleNamespace
    from tts.eval import evaluate_synthesis
    mels = [torch.randn(80, 87), torch.randn(80, 87)]  # 87 frames of 256 samples: ~1 s
    calls = []

    def synthesize(model, utt_id):
        if not calls:
            time.sleep(0.5)
        calls.append(utt_id)
        return torch.zeros(SR), mels[int(utt_id)]

    setup = SimpleNamespace(synthesize=synthesize, vocode=lambda mel: torch.zeros(SR), audio_samples=0,
                            out_dir=str(tmp_path))
    val_set = SimpleNamespace(ids=['0', '1'], mels=mels)
    train_set = SimpleNamespace(mean_mel=lambda: torch.zeros(80))
    result = evaluate_synthesis(torch.nn.Linear(1, 1), val_set, train_set, ['0', '1'], setup)
    assert calls == ['0', '0', '1'] and result['rtf'] < 0.05 and result['mcd_model'] == 0.0


# ----------------------------------------------------------------------------- audio and data


@pytest.mark.comparison
def test_mel_extraction_settings():
    n = SR // 2
    t = torch.arange(n) / SR
    mel = MelExtractor(**MEL_SETTINGS)(0.5 * torch.sin(2 * math.pi * 1000 * t))
    assert mel.shape == (80, n // 256 + 1)
    # independent: centered (reflect-padded) periodic-Hann STFT magnitude in numpy, slaney filterbank
    import torchaudio
    x = np.pad(0.5 * np.sin(2 * np.pi * 1000 * t.double().numpy()), 512, mode='reflect')
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(1024) / 1024)
    frames = np.stack([x[i * 256:i * 256 + 1024] * window for i in range(n // 256 + 1)])
    magnitude = np.abs(np.fft.rfft(frames, axis=1))  # power=1
    fbank = torchaudio.functional.melscale_fbanks(513, 0.0, 8000.0, 80, SR, norm='slaney', mel_scale='slaney')
    expected = np.log(np.maximum(magnitude @ fbank.double().numpy(), 1e-5)).T
    # compared as magnitudes: float32 rounding near the 1e-5 floor is large in log units only
    assert np.allclose(np.exp(mel.double().numpy()), np.exp(expected), rtol=1e-3, atol=1e-4)
    assert 20 < int(mel[:, 10].argmax()) < 30  # 1 kHz lands in a low-middle band (slaney: linear below 1 kHz)
    high = MelExtractor(**MEL_SETTINGS)(0.5 * torch.sin(2 * math.pi * 9500 * t))
    assert high[:, 5:-5].max() < math.log(1e-3)  # above fmax = 8 kHz: (almost) nothing


def test_wav_round_trip_stereo_resample_and_errors(tmp_path):
    audio = torch.sin(torch.arange(2000) / 10.0) * 0.8
    write_wav(tmp_path / 'a.wav', audio, SR)
    back, rate = read_wav(str(tmp_path / 'a.wav'))
    assert rate == SR and back.shape == audio.shape and (back - audio).abs().max() <= 0.5 / 32768
    with wave.open(str(tmp_path / 'a.wav')) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SR)
    stereo = np.stack([np.full(100, 1000), np.full(100, 3000)], axis=1)
    write_pcm(tmp_path / 'stereo.wav', stereo, channels=2)
    mono, _ = read_wav(str(tmp_path / 'stereo.wav'))
    assert torch.allclose(mono, torch.full((100,), 2000 / 32768))
    write_pcm(tmp_path / 'slow.wav', np.zeros(16000), sample_rate=16000)
    resampled, rate = read_wav(str(tmp_path / 'slow.wav'), SR)
    assert rate == SR and len(resampled) == SR
    with wave.open(str(tmp_path / 'eight.wav'), 'wb') as w:
        w.setnchannels(1), w.setsampwidth(1), w.setframerate(SR), w.writeframes(bytes(100))
    with pytest.raises(UserError, match='eight.wav.*16-bit'):
        read_wav(str(tmp_path / 'eight.wav'))
    (tmp_path / 'junk.wav').write_bytes(b'not a wav file at all')
    with pytest.raises(UserError, match='junk.wav.*unreadable'):
        read_wav(str(tmp_path / 'junk.wav'))


def test_text_front_end():
    symbols = ' abc'
    ids, unknown = encode_text('  AB  c!', symbols, add_blank=False)
    assert ids == [3, 4, 2, 5] and unknown == ['!']
    with_blanks, _ = encode_text('ab', symbols)
    assert with_blanks == [1, 3, 1, 4, 1]


def test_split_is_deterministic_by_id():
    ids = [f'U{k:03d}' for k in range(100)]
    train_ids, val_ids = split_ids(ids, 0.1)
    assert len(val_ids) == 10 and not set(train_ids) & set(val_ids)
    assert split_ids(list(reversed(ids)), 0.1)[1] == list(reversed(val_ids))  # order of rows does not matter
    grown = split_ids(ids + [f'V{k:03d}' for k in range(10)], 0.1)[1]
    assert len(set(val_ids) & set(grown)) >= 8  # adding utterances moves few


def test_sampler_equal_batches_per_rank_and_resume():
    rng = random.Random(0)
    lengths = [rng.randint(20, 200) for _ in range(101)]
    for world_size in (1, 2, 3):
        samplers = [FrameBudgetSampler(lengths, 600, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
        for epoch in range(3):
            per_rank = [s.epoch_batches(epoch) for s in samplers]
            assert len({len(b) for b in per_rank}) == 1  # same count everywhere, or DDP hangs
            seen = [i for batches in per_rank for batch in batches for i in batch]
            assert len(seen) == len(set(seen))  # no utterance twice in an epoch
            assert all(max(lengths[i] for i in b) * len(b) <= 600 for batches in per_rank for b in batches)
    a = FrameBudgetSampler(lengths, 600, seed=5)
    b = FrameBudgetSampler(lengths, 600, seed=5)
    drawn = [a.next_batch() for _ in range(len(a) + 3)]  # crosses into epoch 1
    assert a.epoch == 1 and drawn[:len(a) - 1] != FrameBudgetSampler(lengths, 600, seed=6).batches[:len(a) - 1]
    b.load_state_dict(a.state_dict())
    assert [a.next_batch() for _ in range(5)] == [b.next_batch() for _ in range(5)]
    for other in (FrameBudgetSampler(lengths, 900, seed=5), FrameBudgetSampler(lengths[:-1], 600, seed=5)):
        with pytest.raises(UserError, match='resume with its frame_budget and data'):  # its position may not exist
            other.load_state_dict(a.state_dict())
    with pytest.raises(UserError, match='frame_budget'):
        FrameBudgetSampler(lengths, 100)


@pytest.mark.slow
def test_bad_dataset_rows_give_clear_errors(tmp_path):
    data = make_corpus(tmp_path / 'data', n=3)
    meta = data / 'metadata.csv'
    good = meta.read_text()
    meta.write_text(good + 'U404|Missing|missing\n')
    with pytest.raises(UserError, match=r"metadata.csv:4: utterance 'U404' has no audio file .*U404.wav"):
        read_metadata(str(data))
    meta.write_text(good + 'U009|Empty|  \n')
    with pytest.raises(UserError, match=r"metadata.csv:4: utterance 'U009' has an empty transcript"):
        read_metadata(str(data))
    meta.write_text(good + 'no separator here\n')
    with pytest.raises(UserError, match=r"metadata.csv:4: expected 'id\|raw text\|normalized text'"):
        read_metadata(str(data))
    with pytest.raises(UserError, match='metadata.csv: not found'):
        read_metadata(str(tmp_path))
    bad_rows = {'U001|AA|aa\n': "metadata.csv:4: utterance 'U001' is listed again \\(first on line 2\\)",
                'U009|A|B|extra\n': 'metadata.csv:4: .* 4 fields',
                '../U000|AA|aa\n': "metadata.csv:4: utterance id '../U000' must name a file in wavs/"}
    for row, message in bad_rows.items():
        meta.write_text(good + row)
        with pytest.raises(UserError, match=message):
            read_metadata(str(data))
    meta.write_bytes(good.encode() + 'U009|caf\u00e9|caf\u00e9\n'.encode('latin-1'))
    with pytest.raises(UserError, match='metadata.csv:4: not UTF-8'):
        read_metadata(str(data))
    meta.write_bytes(b'\xef\xbb\xbf' + good.encode())  # a BOM, as spreadsheets write it
    assert [utt_id for utt_id, _ in read_metadata(str(data))] == ['U000', 'U001', 'U002']
    # audio that cannot be an utterance: cut mid-sample, shorter than an STFT frame, fewer frames than tokens
    wav = data / 'wavs' / 'U001.wav'
    wav.write_bytes(wav.read_bytes()[:-1])  # the data chunk promises one byte more
    with pytest.raises(UserError, match='U001.wav: the WAV is cut short'):
        read_wav(wav)
    for size in (0, 30, 40):  # an empty file, headers cut short: no conversion advice, which cannot help
        (tmp_path / 'short.wav').write_bytes(wav.read_bytes()[:size])
        with pytest.raises(UserError, match=re.escape(f'short.wav: the WAV is empty or cut short ({size} bytes')):
            read_wav(tmp_path / 'short.wav')
    with pytest.raises(UserError, match='cannot be read .Is a directory'):
        read_wav(tmp_path)
    # another format, or 8-bit samples: a conversion that replaces the file under its own name (metadata.csv's)
    (tmp_path / 'my clip.wav').write_bytes(b'ID3' + bytes(64))  # an MP3 named .wav
    with wave.open(str(tmp_path / 'u8.wav'), 'wb') as w:
        w.setnchannels(1), w.setsampwidth(1), w.setframerate(SR), w.writeframes(bytes(2000))
    for name, says in (('my clip.wav', 'unreadable WAV (file does not start with RIFF id)'), ('u8.wav', '8-bit')):
        path = str(tmp_path / name)
        converted = shlex.quote(path[:-4] + '.pcm16.wav')
        with pytest.raises(UserError, match=re.escape(f"{says}")) as e:
            read_wav(path)
        assert f"`ffmpeg -i {shlex.quote(path)} -acodec pcm_s16le {converted} && mv {converted} {shlex.quote(path)}`" \
            in str(e.value)
    texts = dict(read_metadata(str(data)))
    for samples, message in ((100, 'only 100 samples'), (SR // 10, 'text tokens but only'),
                             (-SR, 'every sample is 0, a recording with nothing in it')):  # silence (was taken)
        write_pcm(wav, np.zeros(-samples) if samples < 0 else 3000 * np.sin(np.arange(samples) / 3))
        with pytest.raises(UserError, match=message):
            LJSpeechDataset(str(data), ['U001'], dict(texts, U001='a long transcript ' * 3), 'a longtrscip',
                            str(tmp_path / f'cache{samples}'))
    # through the script: exit status 2, one paragraph, no traceback
    meta.write_text(good)
    (data / 'wavs' / 'U001.wav').write_bytes(b'RIFF garbage')
    p = train(tmp_path / 'out', data, '--max_iters=1', check=False)
    assert_user_error(p, 'U001.wav: unreadable WAV')


def fake_espeak(tmp_path, monkeypatch):
    """An espeak-ng on PATH (tmp_path/bin) that writes 0.1 s of silence a character of the text, 22,050 Hz."""
    fake = tmp_path / 'bin' / 'espeak-ng'
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport sys, wave\n"
                    "out = sys.argv[sys.argv.index('-w') + 1]\n"
                    "w = wave.open(out, 'wb'); w.setnchannels(1); w.setsampwidth(2); w.setframerate(22050)\n"
                    "w.writeframes(bytes(2 * 2205 * len(sys.argv[-1]))); w.close()\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv('PATH', f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return fake


def test_espeak_corpus_command_with_a_fake_espeak(tmp_path, monkeypatch):
    fake = fake_espeak(tmp_path, monkeypatch)
    (tmp_path / 'lines.txt').write_text('Hello there.\n\nSecond   LINE\n')
    out = make_espeak_corpus(str(tmp_path / 'lines.txt'), str(tmp_path / 'corpus'))
    rows = read_metadata(out)
    assert rows == [('ES0000', 'Hello there.'), ('ES0001', 'Second LINE')]
    assert len(read_wav(os.path.join(out, 'wavs', 'ES0001.wav'))[0]) == 2205 * len('Second LINE')
    # a corpus there is never written over (its recordings were replaced before); a missing text file is named
    before = {f: (tmp_path / 'corpus' / 'wavs' / f).read_bytes() for f in os.listdir(tmp_path / 'corpus' / 'wavs')}
    (tmp_path / 'other.txt').write_text('Another voice.\n')
    with pytest.raises(UserError, match=r"corpus exists and is not an empty folder"):
        make_espeak_corpus(str(tmp_path / 'other.txt'), out)
    assert {f: (tmp_path / 'corpus' / 'wavs' / f).read_bytes() for f in before} == before and read_metadata(out) == rows
    with pytest.raises(UserError, match=r"missing.txt cannot be read"):
        make_espeak_corpus(str(tmp_path / 'missing.txt'), str(tmp_path / 'new'))
    # espeak-ng failing on a line: nothing left behind, not even the folder made for it
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('unknown voice')\n")
    with pytest.raises(UserError, match=r"espeak-ng could not speak line 1 .*unknown voice.*nothing was written"):
        make_espeak_corpus(str(tmp_path / 'other.txt'), str(tmp_path / 'new'))
    assert sorted(os.listdir(tmp_path)) == ['bin', 'corpus', 'lines.txt', 'other.txt']

def test_espeak_corpus_refuses_what_would_not_make_a_corpus_before_any_work(tmp_path, monkeypatch):
    """The corpus maker strips a UTF-8 byte order mark (it was the first transcript's start) and refuses, before
    speaking a line: a line holding '|' (metadata.csv's separator: a corpus train_tts.py refused), named by its
    line; max_utterances below 1 (-1 dropped the last line, 0 said 'holds no text'); an out_dir of '' (renamed
    into at the end: a traceback after all the work) or one that cannot be made (/proc/foo: a traceback)."""
    fake = fake_espeak(tmp_path, monkeypatch)
    (tmp_path / 'bom.txt').write_bytes('\ufeffHello there.\nOther line\n'.encode('utf-8'))
    out = make_espeak_corpus(str(tmp_path / 'bom.txt'), str(tmp_path / 'corpus'))
    assert read_metadata(out) == [('ES0000', 'Hello there.'), ('ES0001', 'Other line')]
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('spoke')\n")  # any line spoken: a failure said
    (tmp_path / 'bar.txt').write_text('Fine.\n\nA | B\n')
    new = str(tmp_path / 'new')
    for text_file, out_dir, kw, says in (
            ('bar.txt', new, {}, r"bar.txt:3: the line holds '\|', which separates the fields of the corpus's "
                                 r"metadata.csv \(id\|text\|text\), so train_tts.py would refuse it"),
            ('bom.txt', new, dict(max_utterances=-1), r'--max_utterances=-1 must be at least 1; leave it out'),
            ('bom.txt', new, dict(max_utterances=0), r'--max_utterances=0 must be at least 1'),
            ('bom.txt', '', {}, r"--out_dir='' names no folder"),
            ('bom.txt', '/proc/foo', {}, r"--out_dir='/proc/foo' cannot be created or written")):
        with pytest.raises(UserError, match=says):
            make_espeak_corpus(str(tmp_path / text_file), out_dir, **kw)
    assert sorted(os.listdir(tmp_path)) == ['bar.txt', 'bin', 'bom.txt', 'corpus']
    p = run(['-m', 'tts.data', f'--text_file={tmp_path / "bom.txt"}', '--out_dir=/proc/foo'], check=False)
    assert_user_error(p, "--out_dir='/proc/foo' cannot be created or written")

# ----------------------------------------------------------------------------- training end to end


# one straight run serves the smoke test and the resume test: 4 steps with dropout, classifier-free
# guidance dropout and gradient accumulation; a NaN injected at step 1 and an OOM at step 2
RUN = ['--dropout=0.1', '--cfg_drop=0.5', '--gradient_accumulation_steps=2', '--eval_interval=2']
FAULTS = 'nan@1,oom@2'


@pytest.fixture(scope='module')
def straight_run(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp('tts_straight') / 'out'
    p = train(out, corpus, '--max_iters=4', '--tensorboard=True', *RUN, faults=FAULTS)
    return out, p.stdout + p.stderr


@pytest.mark.slow
def test_train_smoke_faults_and_synthesis(tmp_path, straight_run):
    out, output = straight_run
    events = read_log(out)
    train_events = [e for e in events if 'train_loss' in e]
    assert [e['step'] for e in train_events] == [1, 2, 3, 4]
    assert all({'prior_loss', 'duration_loss', 'flow_loss', 'lr', 'grad_norm'} <= set(e) for e in train_events)
    val_events = [e for e in events if 'val_loss' in e]
    assert [e['step'] for e in val_events] == [0, 2, 4]
    assert all('val_mel_l1' in e and 'val_flow_loss' in e for e in val_events)
    assert 'step 1: non-finite loss' in output  # the NaN injected at step 1 was skipped
    assert 'split into 2 micro-batches' in output  # the injected OOM at step 2 split the batches
    final = [e for e in events if 'mcd_model' in e][-1]
    assert final['mcd_baseline'] > 0 and final['rtf'] > 0
    assert 'MCD-DTW mean-mel baseline' in output
    assert os.listdir(out / 'tb') and os.listdir(out / 'samples')
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['kind'] == 'tts' and ckpt['iter_num'] == 4 and ckpt['batch_splits'] == 2
    model = load_tts(ckpt)
    audio, log_mel = synthesize(model, 'aa mm', n_timesteps=2)
    write_wav(tmp_path / 'spoken.wav', audio, SR)
    back, rate = read_wav(str(tmp_path / 'spoken.wav'))
    assert rate == SR and len(back) == len(audio) == (log_mel.shape[1] - 1) * 256 and back.abs().max() > 0
    with pytest.raises(UserError, match='nothing to say'):
        synthesize(model, '123')  # digits are not in this corpus' vocabulary
    with pytest.raises(UserError, match="nothing to say in 'Привет мир': none of its characters but spaces"):
        synthesize(model, 'Привет мир')  # the space alone was spoken, 0.08 s


@pytest.mark.slow
def test_alignment_stats_agree_with_the_runs_held_out_prior(tmp_path, corpus, straight_run):
    # runs/tts_check.py's measures: the prior loss as train_tts.py's evaluation computes it, shares in [0, 1]
    out, _ = straight_run
    model = load_tts(load(out / 'ckpt.pt'))
    rows = read_metadata(str(corpus))
    _, val_ids = split_ids([utt_id for utt_id, _ in rows], 0.2)
    val_set = LJSpeechDataset(str(corpus), val_ids, dict(rows), model.config.symbols, str(tmp_path))
    for cached in tmp_path.glob('*/*.pt'):  # a cache file cut short is computed again (was a traceback)
        cached.write_bytes(cached.read_bytes()[:40])
    again = LJSpeechDataset(str(corpus), val_ids, dict(rows), model.config.symbols, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(again.mels, val_set.mels))
    stats = alignment_stats(model, val_set, 400)
    val_prior = [e['val_prior_loss'] for e in read_log(out) if e.get('step') == 4 and 'val_prior_loss' in e][-1]
    assert math.isclose(stats['prior'], val_prior, rel_tol=1e-5)
    assert 0 <= stats['one_frame'] <= 1 and 0 < stats['sharpness'] <= 1


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path, corpus, straight_run):
    straight, _ = straight_run
    split = tmp_path / 'split'
    quick = ['--audio_samples=0', '--eval_utterances=1']
    train(split, corpus, '--max_iters=2', *RUN, *quick, faults=FAULTS)
    p = train(split, corpus, '--max_iters=4', *RUN, *quick, faults=FAULTS)  # init_from='auto' resumes
    assert 'resuming' in p.stdout + p.stderr
    losses = lambda out: {e['step']: (e['prior_loss'], e['duration_loss'], e['flow_loss'])
                          for e in read_log(out) if 'train_loss' in e}
    a, b = losses(straight), losses(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert repr(a) == repr(b)  # repr: bit-equal floats, not approximately equal ones
    wa, wb = load(straight / 'ckpt.pt')['model'], load(split / 'ckpt.pt')['model']
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # a copy of the corpus elsewhere is the same corpus; one transcript changed makes another: refused, the run
    # untouched (it went on, mixing the two)
    moved = tmp_path / 'moved'
    shutil.copytree(corpus, moved)
    p = train(split, moved, '--max_iters=4', *RUN, *quick)
    assert 'resuming' in p.stdout + p.stderr
    rows = (moved / 'metadata.csv').read_text().splitlines()
    (moved / 'metadata.csv').write_text('\n'.join([rows[0] + ' again'] + rows[1:]) + '\n')
    saved = (split / 'ckpt.pt').read_bytes()
    p = train(split, moved, '--max_iters=6', *RUN, *quick, check=False)
    assert_user_error(p, f'{moved} is not the corpus the run in {split} began with')
    assert (split / 'ckpt.pt').read_bytes() == saved


@pytest.mark.slow
def test_decoder_lr_scale_zero_trains_all_but_the_decoder(tmp_path, corpus):
    out, quick = tmp_path / 'run', ['--audio_samples=0', '--eval_utterances=1', '--decoder_lr_scale=0']
    train(out, corpus, '--max_iters=2', *RUN, *quick)
    before = load(out / 'ckpt.pt')['model']
    train(out, corpus, '--max_iters=4', *RUN, *quick)
    after = load(out / 'ckpt.pt')['model']
    # AdamW at lr 0 leaves a weight bit for bit as it was
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith('decoder.'))
    assert not all(torch.equal(before[k], after[k]) for k in before if k.startswith('encoder.'))


@pytest.mark.slow
def test_settings_that_cannot_work_are_clear_errors(tmp_path, corpus, straight_run):
    """eval_only with nothing to evaluate, a model shape that does not fit together, a sample_tts.py wav path in
    no folder: exit 2 naming the keys, before any work, and no out_dir left behind (the refused runs made it, and
    a mel cache in it)."""
    cases = [(['--eval_only=True'], 'eval_only=True needs a trained model'),
             (['--enc_heads=3'], 'enc_heads=3'), (['--enc_kernel=4'], 'together: enc_kernel=4 must be odd'),
             (['--dec_channels=100', '--dec_heads=3'], 'dec_channels=100 must divide by dec_heads=3 (or dec_heads=0: '
                                                      "no attention); dec_channels=100 must divide by 8 (GroupNorm's "
                                                      "groups)."),
             ([f'--vocoder={tmp_path / "v.pth.tar"}'], 'no such file'),
             (['--val_fraction=0.99'], 'which leaves none to train on; lower val_fraction'),  # was a traceback
             *([(['--cache_dir=/proc/x'], "cache_dir='/proc/x' cannot be created or written")]  # a traceback too
               if os.path.isdir('/proc') else [])]
    for args, message in cases:
        p = train(tmp_path / 'out', corpus, *args, check=False)
        assert_user_error(p, message)
        assert not (tmp_path / 'out').exists()
        assert 'mel features' not in p.stdout + p.stderr  # refused before any work
    p = train(tmp_path / 'out', corpus, '--frame_budget=20', check=False)  # the utterance named, its file too
    assert_user_error(p, 'more than frame_budget=20: raise --frame_budget to')
    assert re.search(r"utterance '\w+' \(\S+\.wav\) has \d+ mel frames \([\d.]+ s\)", p.stderr), p.stderr
    assert not (tmp_path / 'out').exists()
    p = run(['sample_tts.py', f'--out_dir={straight_run[0]}', '--device=cpu',
             f'--wav={tmp_path / "nowhere" / "x.wav"}'], check=False)
    assert_user_error(p, 'must be a file path in an existing folder')
    # another format's name: a WAV under it would not play as what it says
    mp3 = tmp_path / 'speech.MP3'
    p = run(['sample_tts.py', f'--out_dir={straight_run[0]}', '--device=cpu', f'--wav={mp3}'], check=False)
    assert_user_error(p, f"wav='{mp3}' names an MP3 file, but sample_tts.py writes 16-bit PCM WAV: name it .wav "
                         f"(--wav={tmp_path / 'speech.wav'})")
    assert not mp3.exists()
    for empty in ('', '   '):  # nothing to say, whatever the model reads
        p = run(['sample_tts.py', f'--out_dir={straight_run[0]}', '--device=cpu', f'--text={empty}'], check=False)
        assert_user_error(p, f'text={empty!r} is empty')
    # --wav onto the checkpoint it speaks with, or a corpus's recording (any file but a WAV sample_tts.py wrote):
    # refused, kept
    ckpt = os.path.join(straight_run[0], 'ckpt.pt')
    recording = corpus / 'wavs' / 'U001.wav'
    for target, message in [(ckpt, 'which this command reads'), (recording, 'exists and is not a WAV of an earlier '
                                                                            "run of this command (a recording"),
                            (VOCODER, 'which this command reads')]:
        before = open(target, 'rb').read()
        p = run(['sample_tts.py', f'--out_dir={straight_run[0]}', '--device=cpu', f'--wav={target}',
                 f'--vocoder={VOCODER}'], check=False)
        assert_user_error(p, message)
        assert open(target, 'rb').read() == before


def test_a_silent_voice_clip_is_refused_naming_it(tmp_path):
    """sample_tts.py --voice_clip reads the clip with read_voice_clip: all zeros, or nothing above -60 dBFS (dither),
    is refused naming the file; a quiet recording of speech is read as read_wav reads it."""
    for name, samples, says in (('zeros.wav', np.zeros(SR), 'every sample is 0'),
                                ('dither.wav', np.resize([1, -1, 0], SR), 'its loudest sample is -90 dBFS')):
        write_pcm(tmp_path / name, samples)
        with pytest.raises(UserError, match=rf"voice_clip=.*{name} is silent \({says};"):
            read_voice_clip(str(tmp_path / name), SR)
    write_pcm(tmp_path / 'quiet.wav', np.sin(np.arange(SR) / 10) * 100)  # -50 dBFS
    assert torch.equal(read_voice_clip(str(tmp_path / 'quiet.wav'), SR), read_wav(str(tmp_path / 'quiet.wav'))[0])


def test_write_wav_marks_the_software_and_wav_software_reads_it_back(tmp_path):
    """write_wav's LIST/INFO chunk after the samples (the mark sample_tts.py replaces its own WAVs by) leaves the
    audio as it reads, and wav_software finds it; a WAV without one (a recording), or a file that is no WAV,
    has none."""
    audio = torch.linspace(-0.5, 0.5, 1001)
    for software in ('nanotrain sample_tts.py', 'odd'):  # an odd-length entry is padded to an even chunk
        write_wav(tmp_path / 'ours.wav', audio, SR, software=software)
        assert wav_software(tmp_path / 'ours.wav') == software
        assert torch.equal(read_wav(str(tmp_path / 'ours.wav'))[0], (audio * 32768).round() / 32768)
        assert os.path.getsize(tmp_path / 'ours.wav') % 2 == 0
    write_pcm(tmp_path / 'recording.wav', np.arange(-500, 500) * 30)
    write_wav(tmp_path / 'plain.wav', audio, SR)
    (tmp_path / 'notes.txt').write_text('RIFF....WAVE but text')
    assert [wav_software(tmp_path / f) for f in ('recording.wav', 'plain.wav', 'notes.txt', 'none.wav')] == [''] * 4


def test_a_wav_that_cannot_be_written_is_refused_leaving_the_file_as_it_was(tmp_path, untrained):
    """sample_tts.py writes --wav through a temporary beside it, renamed over it once whole: a write over the file
    size limit (ulimit -f) is a UserError naming the cause, and leaves no partial WAV (which the same command would
    then refuse to replace), no temporary, and an earlier WAV as it was."""
    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY))
    wav = tmp_path / 'x.wav'
    common = ['sample_tts.py', f'--out_dir={untrained}', '--device=cpu', f'--wav={wav}', '--n_timesteps=1']
    says = f"wav='{wav}' could not be written (File too large: it would be over the file size limit, `ulimit -f`); "
    p = run([*common, '--text=' + 'hello there ' * 20], check=False, preexec_fn=limited)
    assert_user_error(p, says + 'nothing was written')
    assert os.listdir(tmp_path) == []
    run([*common, '--text=hi'])
    earlier = wav.read_bytes()
    umask = os.umask(0o022)
    os.umask(umask)
    assert wav_software(wav) == 'nanotrain sample_tts.py' and stat.S_IMODE(os.stat(wav).st_mode) == 0o666 & ~umask
    p = run([*common, '--text=' + 'hello there ' * 20], check=False, preexec_fn=limited)
    assert_user_error(p, says + f'{wav} is as it was')
    assert wav.read_bytes() == earlier and os.listdir(tmp_path) == ['x.wav']


def test_settings_past_their_bounds_and_audio_that_is_not_finite_are_refused(tmp_path, untrained):
    """sample_tts.py refuses settings past their bounds before any work (1e20 was torch's internal assert, a
    length_scale of 1e4 a 961 GB allocation), and audio that is not finite, which it wrote as a silent WAV: a mel
    that overflows at a high tts_temperature, or a checkpoint whose weights are NaN."""
    wav = tmp_path / 'x.wav'
    common = ['sample_tts.py', '--device=cpu', f'--wav={wav}', '--n_timesteps=1', '--text=hello']
    for setting, says in (('tts_temperature=1e20', 'in [0, 10]'), ('tts_temperature=-1', 'in [0, 10]'),
                          ('guidance=1e40', 'in [0, 100]'), ('length_scale=1e4', 'in (0, 10]'),
                          ('length_scale=0', 'in (0, 10]')):
        p = run([*common, f'--out_dir={untrained}', f'--{setting}'], check=False)
        assert_user_error(p, f"{setting.split('=')[0]}=", f"must be {says}.")
    # train_tts.py's evaluation speaks with the same settings: refused before the run begins, not at its end
    for setting, says in (('temperature=1e20', 'in [0, 10]'), ('length_scale=1e4', 'in (0, 10]'),
                          ('guidance=1e40', 'in [0, 100]')):
        p = run(['train_tts.py', f'--out_dir={tmp_path / "train"}', f'--data_dir={tmp_path}', f'--{setting}'],
                check=False)
        assert_user_error(p, f"{setting.split('=')[0]}=", f"must be {says}.")
        assert not (tmp_path / 'train').exists()
    # guidance steers away from an unconditional flow, which only a model trained with cfg_drop > 0 has
    p = run([*common, f'--out_dir={untrained}', '--guidance=2'], check=False)
    assert_user_error(p, 'was trained with cfg_drop=0, never without its condition, so guidance has nothing')
    p = run(['train_tts.py', f'--out_dir={tmp_path / "train"}', f'--data_dir={tmp_path}', '--guidance=1'], check=False)
    assert_user_error(p, 'guidance=1.0 needs a model that learned to speak without its condition too: add '
                         '--cfg_drop=0.2')
    ckpt = torch.load(untrained / 'ckpt.pt', weights_only=True)
    ckpt['model']['mel_std'] = torch.tensor(10.0)  # a model of loud mels: finite at the default temperature
    ckpt['model_args']['cfg_drop'] = 0.2  # trained for guidance
    os.makedirs(tmp_path / 'loud')
    torch.save(ckpt, tmp_path / 'loud' / 'ckpt.pt')
    p = run([*common, f'--out_dir={tmp_path / "loud"}', '--tts_temperature=10', '--guidance=2'], check=False)
    assert_user_error(p, 'the synthesized audio is not finite (NaN or inf), so no WAV was written: the mel overflowed '
                         'at tts_temperature=10.0, guidance=2.0; lower tts_temperature (0.667 by default) and '
                         'guidance (0 by default).')
    run([*common, f'--out_dir={tmp_path / "loud"}'])
    wav.unlink()
    ckpt['model']['decoder.out.weight'].fill_(float('nan'))
    os.makedirs(tmp_path / 'nan')
    torch.save(ckpt, tmp_path / 'nan' / 'ckpt.pt')
    p = run([*common, f'--out_dir={tmp_path / "nan"}'], check=False)
    assert_user_error(p, f"the weights of {tmp_path / 'nan' / 'ckpt.pt'} are not finite (decoder.out.weight): it is "
                         f"the checkpoint of a run that diverged; speak with another (--ckpt_name=best.pt, say).")
    assert not wav.exists()


def test_sample_tts_names_what_its_paths_and_checkpoint_are(tmp_path, untrained):
    """sample_tts.py refuses, before any work and naming what is wrong: --wav='' (a traceback after synthesis), a
    --ckpt_name that is a folder (said not to exist), a checkpoint with no 'kind' (a KeyError), one whose
    model_args do not fit its weights (load_state_dict's size mismatch), and a train_vocoder.py run's folder, with
    the command that speaks through its generator (it advised sample.py, which sent the user back), as sample.py
    does."""
    common = ['sample_tts.py', '--device=cpu', '--n_timesteps=1', '--text=hi']
    wav = tmp_path / 'x.wav'
    p = run([*common, f'--out_dir={untrained}', '--wav='], check=False)
    assert_user_error(p, "wav='' names no file: point --wav at the file to write a WAV to (nothing was written).")
    (untrained / 'mel_cache').mkdir(exist_ok=True)
    p = run([*common, f'--out_dir={untrained}', '--ckpt_name=mel_cache', f'--wav={wav}'], check=False)
    assert_user_error(p, f"{untrained / 'mel_cache'} is a folder, not a checkpoint file. {untrained} holds ckpt.pt")
    ckpt = torch.load(untrained / 'ckpt.pt', weights_only=True)
    ckpt['model_args']['enc_channels'] = 32
    for name, state, says in (('none', {'a': 1}, "is not a text-to-speech checkpoint (it holds no 'kind';"),
                              ('edited', ckpt, 'its model_args and its weights do not fit together (size mismatch '
                                               'for'),
                              ('vocoder', {'kind': 'vocoder'}, "is a train_vocoder.py run's checkpoint (a HiFi-GAN "
                                                               "generator), not a text-to-speech model; speak through "
                                                               "it: `python sample_tts.py --vocoder=")):
        (tmp_path / name).mkdir()
        torch.save(state, tmp_path / name / 'ckpt.pt')
        p = run([*common, f'--out_dir={tmp_path / name}', f'--wav={wav}'], check=False)
        assert_user_error(p, f"{tmp_path / name / 'ckpt.pt'}", says)
    speak = f"--vocoder={tmp_path / 'vocoder' / 'generator.pth.tar'} --out_dir=<a train_tts.py run>`."
    assert speak in p.stderr
    p = run(['sample.py', f'--out_dir={tmp_path / "vocoder"}', '--device=cpu'], check=False)
    assert_user_error(p, speak)
    assert not wav.exists()


def test_a_voice_clip_for_a_one_voice_model_is_refused_without_a_speaker_to_pick(tmp_path, untrained):
    """--voice_clip for a model of one voice: the message says so (it advised --speaker=NAME, which such a model
    refuses)."""
    write_pcm(tmp_path / 'clip.wav', np.sin(np.arange(SR) / 10) * 5000)
    p = run(['sample_tts.py', f'--out_dir={untrained}', '--device=cpu', f'--wav={tmp_path / "x.wav"}', '--text=hi',
             f'--voice_clip={tmp_path / "clip.wav"}'], check=False)
    assert_user_error(p, 'this model knows one voice (it was trained without multi_speaker), so it speaks in no '
                         'other: leave --voice_clip out, or train a multi-speaker model')
    assert '--speaker' not in p.stderr and not (tmp_path / 'x.wav').exists()


@pytest.mark.slow
def test_a_decoder_without_attention_trains(tmp_path, corpus):
    """dec_heads=0, which --help calls 'none': a U-Net bottleneck without attention trains and speaks; the
    final evaluation speaks through --vocoder, and its floor is the reference mel through that vocoder. The run is
    counted in epochs: one pass over the 8 training utterances (3 batches of 100 frames: 2 steps of 2 batches, the
    last step's 1 left), its end evaluated; every number of log.jsonl went to W&B too (a stand-in wandb package)."""
    p = train(tmp_path / 'out', corpus, '--num_train_epochs=1', '--eval_every_epochs=1', '--frame_budget=100',
              '--gradient_accumulation_steps=2', '--warmup_iters=1', '--dec_heads=0', f'--vocoder={VOCODER}',
              '--audio_samples=1', '--wandb_log=True', env_extra=wandb_env())
    output = p.stdout + p.stderr
    assert 'num_train_epochs=1: 1 epoch(s) of 2 steps each' in output
    assert "lr_schedule='cosine_restarts' keeping its own shape" in output  # the TTS default: cycles, no end
    assert [(e['step'], e['epoch']) for e in read_log(tmp_path / 'out') if 'train_loss' in e] == [(1, 0.5), (2, 1.0)]
    assert [(e['step'], e.get('epoch')) for e in read_log(tmp_path / 'out') if 'val_loss' in e] == [(0, 0.0), (2, 1.0)]
    assert_logged_to_wandb(tmp_path / 'out')
    assert 'HiFi-GAN generator.pth.tar audio' in output and 'reference mel through HiFi-GAN' in output
    sample = read_wav(str(next((tmp_path / 'out' / 'samples').iterdir())))[0]
    assert len(sample) % 256 == 0  # the generator's frames; Griffin-Lim's would be one frame short
    model = load_tts(load(tmp_path / 'out' / 'ckpt.pt'))
    assert model.config.dec_heads == 0 and not any('mid_attn' in k for k in model.state_dict())
    assert len(synthesize(model, 'aa mm', n_timesteps=2)[0]) > 0


@pytest.mark.slow
def test_sample_tts_speaks_and_sample_points_to_it(tmp_path, straight_run):
    """sample_tts.py speaks a train_tts.py checkpoint into a WAV file; sample.py, which generates text, refuses
    one with the sample_tts.py command to run instead, and sample_tts.py refuses a GPT's keys."""
    wav = tmp_path / 'x.wav'
    p = run(['sample.py', f'--out_dir={straight_run[0]}', '--device=cpu'], check=False)
    assert_user_error(p, 'text-to-speech checkpoint', f'python sample_tts.py --out_dir={straight_run[0]}`')
    p = run(['sample_tts.py', f'--out_dir={straight_run[0]}', '--device=cpu', f'--wav={wav}', '--start=aa mm'],
            check=False)
    assert p.returncode == 2 and 'start' in p.stderr and not wav.exists()
    p = run(['sample_tts.py', f'--out_dir={straight_run[0]}', '--device=cpu', f'--wav={wav}', '--text=aa mm',
             '--n_timesteps=2'])
    assert wav.exists() and f'wrote {wav}' in p.stdout and 'through Griffin-Lim' in p.stdout


@pytest.mark.slow
def test_sample_tts_speaks_through_a_hifigan_vocoder(tmp_path, straight_run):
    """--vocoder: the model's mel through the HiFi-GAN generator, frame for frame (Griffin-Lim's centred
    frames give one frame's samples fewer); a vocoder file that cannot work is refused before any WAV is written."""
    wav, other = tmp_path / 'x.wav', tmp_path / 'gl.wav'
    common = [f'--out_dir={straight_run[0]}', '--device=cpu', '--text=aa mm', '--n_timesteps=2']
    p = run(['sample_tts.py', *common, f'--wav={wav}', f'--vocoder={VOCODER}'])
    assert 'through HiFi-GAN generator.pth.tar' in p.stdout
    run(['sample_tts.py', *common, f'--wav={other}'])
    audio, gl = read_wav(str(wav))[0], read_wav(str(other))[0]
    assert len(audio) == len(gl) + 256 and not torch.equal(audio[:len(gl)], gl)
    p = run(['sample_tts.py', *common, f'--wav={tmp_path / "y.wav"}', f'--vocoder={tmp_path / "none.pth.tar"}'],
            check=False)
    assert_user_error(p, 'no such file', "--vocoder='' for Griffin-Lim")
    assert not (tmp_path / 'y.wav').exists()


def test_a_model_of_a_corpus_spelled_in_phonemes_speaks_plain_text(tmp_path, straight_run):
    """A model whose vocabulary is espeak-ng phonemes (trained on a corpus spelled in them) is given plain text:
    sample_tts.py phonemizes it inside; IPA given is read as it is."""
    ckpt = torch.load(straight_run[0] / 'ckpt.pt', map_location='cpu', weights_only=False)
    symbols = ckpt['model_args']['symbols']
    assert not reads_phonemes(symbols)
    ipa = 'ˈɑːɛm'[:len(symbols) - 2] + symbols[-2:]  # the same size, so the weights fit; 'aa mm''s phonemes
    ckpt['model_args']['symbols'] = ckpt['config']['symbols'] = ipa
    assert reads_phonemes(ipa)
    (tmp_path / 'ipa').mkdir()
    torch.save(ckpt, tmp_path / 'ipa' / 'ckpt.pt')
    wav = tmp_path / 'x.wav'
    for text in ('aa mm', ipa[:4]):  # the second replaces the first: a WAV sample_tts.py wrote (its mark)
        p = run(['sample_tts.py', f'--out_dir={tmp_path / "ipa"}', '--device=cpu', f'--wav={wav}', f'--text={text}',
                 '--n_timesteps=2'])
        skipped = p.stderr.split('not trained on: ')[1] if 'not trained on' in p.stderr else ''
        assert f'wrote {wav}' in p.stdout and 'a' not in skipped  # phonemes the toy vocabulary lacks, never spelling
        assert wav_software(wav) == 'nanotrain sample_tts.py'


@pytest.mark.slow
def test_a_phoneme_front_end_model_trains_on_plain_text_and_speaks_it(tmp_path, corpus):
    """--text_frontend=phonemes: the transcripts phonemized once (cached beside the mels), the vocabulary their
    phonemes, the front end recorded in the checkpoint, and sample_tts.py speaking plain text; a relaunch with
    the other front end is refused, naming it."""
    out = tmp_path / 'out'
    p = train(out, corpus, '--max_iters=2', '--eval_interval=2', '--text_frontend=phonemes', '--audio_samples=1',
              '--add_blank=False')  # the tiny corpus's words are short for their phonemes
    args = load(out / 'ckpt.pt')['model_args']
    assert args['text_frontend'] == 'phonemes' and reads_phonemes(args['symbols'])
    assert set(args['symbols']) == set(''.join(phonemize(t) for _, t in read_metadata(corpus)))
    cached = [f for f in os.listdir(out / 'mel_cache') if f.startswith('phonemes-')]
    assert len(cached) == 1 and 'MCD-DTW model mel' in p.stdout + p.stderr
    wav = tmp_path / 'x.wav'
    p = run(['sample_tts.py', f'--out_dir={out}', '--device=cpu', f'--wav={wav}', '--text=Aa mm', '--n_timesteps=2'])
    assert wav.exists() and 'skipped characters' not in p.stderr
    p = train(out, corpus, '--max_iters=4', '--eval_interval=2', '--add_blank=False', check=False)
    assert_user_error(p, "text_frontend: checkpoint has 'phonemes', config has 'characters'",
                      'another --out_dir, or --resume=False')
    assert '--init_from' not in p.stderr  # the run in out_dir is continued whatever init_from says


@pytest.mark.slow
def test_relaunch_after_sigkill_continues_the_run(tmp_path, corpus):
    out = tmp_path / 'out'
    args = ['train_tts.py', f'--out_dir={out}', f'--data_dir={corpus}', *TINY, '--max_iters=40', '--eval_interval=4',
            '--audio_samples=0', '--eval_utterances=1']
    killed_at, output, steps = kill_and_relaunch(args, out)
    assert killed_at >= 4 and f'resuming from {out / "ckpt.pt"} at step {killed_at}\n' in output
    assert steps == list(range(1, 41)) and load(out / 'ckpt.pt')['iter_num'] == 40


@pytest.mark.slow
def test_asr_synthesis_writes_only_the_kinds_asked_for(tmp_path, corpus, straight_run):
    """runs/tts_asr.py synthesize: with --kinds=model only the checkpoint speaks (the recordings and Griffin-Lim
    do not depend on it, and runs/report.py scores them once per corpus); by default all three kinds."""
    ckpt = straight_run[0] / 'ckpt.pt'
    for kinds, expected in (('model', ['model']), ('', ['griffin_lim', 'model', 'reference', 'vocoder'])):
        wav_dir = tmp_path / (kinds or 'all')
        run(['runs/tts_asr.py', 'synthesize', f'--ckpt={ckpt}', f'--wav_dir={wav_dir}', '--utterances=1',
             f'--kinds={kinds}', f'--vocoder={VOCODER}'])
        assert sorted(json.loads((wav_dir / 'manifest.json').read_text())['kinds']) == expected
        assert sorted(d.name for d in wav_dir.iterdir() if d.is_dir()) == expected
        assert all(len(os.listdir(wav_dir / k)) == 1 for k in expected)
    name = os.listdir(tmp_path / 'model' / 'model')[0]
    assert (tmp_path / 'model' / 'model' / name).read_bytes() == (tmp_path / 'all' / 'model' / name).read_bytes()
    manifest = json.loads((tmp_path / 'all' / 'manifest.json').read_text())
    assert set(manifest['rtf']) == {'model', 'vocoder'} and min(manifest['rtf'].values()) > 0
    # and in CPU time, which on the one thread the tests give a script is at most the clock's
    assert set(manifest['cpu_rtf']) == {'model', 'vocoder'}
    assert all(0 < manifest['cpu_rtf'][k] <= 1.25 * manifest['rtf'][k] for k in manifest['rtf'])
    # the synthesis knobs override the checkpoint's, and the manifest says which were used
    run(['runs/tts_asr.py', 'synthesize', f'--ckpt={ckpt}', f'--wav_dir={tmp_path / "one_step"}', '--utterances=1',
         '--kinds=model', '--n_timesteps=1', '--temperature=0'])
    manifest = json.loads((tmp_path / 'one_step' / 'manifest.json').read_text())
    assert manifest['synthesis']['n_timesteps'] == 1 and manifest['synthesis']['temperature'] == 0
    assert (tmp_path / 'one_step' / 'model' / name).read_bytes() != (tmp_path / 'model' / 'model' / name).read_bytes()
    # the noise's seed is the checkpoint's unless given: another draws other speech from the same model
    seed = json.loads((tmp_path / 'model' / 'manifest.json').read_text())['synthesis']['seed']
    assert seed == load(ckpt)['config']['seed'] != 7
    run(['runs/tts_asr.py', 'synthesize', f'--ckpt={ckpt}', f'--wav_dir={tmp_path / "seed"}', '--utterances=1',
         '--kinds=model', f'--vocoder={VOCODER}', '--seed=7'])
    assert json.loads((tmp_path / 'seed' / 'manifest.json').read_text())['synthesis']['seed'] == 7
    assert (tmp_path / 'seed' / 'model' / name).read_bytes() != (tmp_path / 'model' / 'model' / name).read_bytes()
    p = run(['runs/tts_asr.py', 'synthesize', f'--wav_dir={tmp_path / "x"}', f'--data_dir={corpus}',
             '--kinds=model'], check=False)
    assert p.returncode != 0 and "'model' needs --ckpt" in p.stderr


@pytest.mark.slow
def test_vocoder_bench_times_a_model_over_the_audio_it_speaks(tmp_path, corpus, straight_run):
    """bench/bench_vocoder.py --tts_ckpt: a checkpoint's text to mel, alone and through the generator, each an RTF
    over the seconds the model speaks (its own mels' frames, not the recordings')."""
    ckpt, out = straight_run[0] / 'ckpt.pt', tmp_path / 'rtf.json'
    run(['bench/bench_vocoder.py', f'--vocoder={VOCODER}', f'--data_dir={corpus}', '--utterances=2', '--rounds=1',
         '--threads=1', '--compile=0', f'--tts_ckpt={ckpt}', f'--out={out}'])
    rtf = json.loads(out.read_text())['rtf']
    model = load_tts(load(ckpt))
    frames = sum(synthesize(model, text, vocode=lambda log_mel: log_mel)[1].shape[1]
                 for _, text in read_metadata(str(corpus))[:2])
    recorded = rtf['HiFi-GAN, eager']['audio_seconds']
    for variant in ('text to mel', '+ HiFi-GAN'):
        entry = rtf[f'{ckpt}: {variant}']
        assert entry['median'] > 0 and entry['audio_seconds'] != recorded
        assert entry['audio_seconds'] == pytest.approx(frames * MEL_SETTINGS['hop_length'] / SR)
    torch.save({'kind': 'gpt'}, tmp_path / 'gpt.pt')
    for bad, said in ((tmp_path / 'none.pt', 'does not exist'), (VOCODER, 'which nanotrain never writes'),
                      (tmp_path / 'gpt.pt', "a 'gpt' checkpoint, not a text-to-speech one")):
        p = run(['bench/bench_vocoder.py', f'--vocoder={VOCODER}', f'--data_dir={corpus}', '--compile=0',
                 f'--tts_ckpt={bad}', f'--out={tmp_path / "bad.json"}'], check=False)
        assert p.returncode == 2 and said in p.stderr and 'Traceback' not in p.stderr, p.stderr


def make_speaker_corpus(root, n=12):
    """Two voices saying the tiny corpus's words: 'lo' an octave below 'hi'; rows id|speaker|text."""
    base = make_corpus(root / 'one', n=n)
    os.makedirs(root / 'wavs', exist_ok=True)
    rows = []
    for k, line in enumerate((base / 'metadata.csv').read_text().split('\n')[:n]):
        utt_id, _, words = line.split('|')
        audio, _ = read_wav(str(base / 'wavs' / f'{utt_id}.wav'))
        speaker = 'hi' if k % 2 else 'lo'
        if speaker == 'lo':  # every other sample, twice: the same words an octave lower, twice as long
            audio = audio.repeat_interleave(2)
        write_pcm(root / 'wavs' / f'{utt_id}.wav', (audio * 32767).round().clamp(-32768, 32767).numpy())
        rows.append(f"{utt_id}|{speaker}|{words}")
    (root / 'metadata.csv').write_text('\n'.join(rows) + '\n')
    return root


@pytest.mark.slow
def test_a_multi_speaker_model_speaks_each_voice(tmp_path):
    """multi_speaker=True: id|speaker|text rows give each speaker a learned voice that conditions the
    encoder, the durations and the decoder; sample_tts.py --speaker picks one, a missing or unknown name lists
    them; a relaunch with one voice is refused."""
    corpus = make_speaker_corpus(tmp_path / 'corpus')
    out = tmp_path / 'out'
    p = train(out, corpus, '--max_iters=2', '--eval_interval=2', '--multi_speaker=True', '--spk_channels=8')
    assert 'MCD-DTW model mel' in p.stdout + p.stderr
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['model_args']['speakers'] == ('hi', 'lo')
    model = load_tts(ckpt)
    with torch.no_grad():
        torch.nn.init.normal_(model.decoder.out.weight, std=0.1)  # a 2-step decoder still outputs ~zero velocity
    mels = {s: synthesize(model, 'aa mm', n_timesteps=2, seed=0, speaker=s)[1] for s in ('hi', 'lo')}
    assert not torch.equal(mels['hi'][:, :min(m.shape[1] for m in mels.values())],
                           mels['lo'][:, :min(m.shape[1] for m in mels.values())])
    wav = tmp_path / 'x.wav'
    run(['sample_tts.py', f'--out_dir={out}', '--device=cpu', f'--wav={wav}', '--text=aa mm', '--speaker=lo',
         '--n_timesteps=2'])
    assert wav.exists()
    for extra, message in (([], "speaker='': give the model's voices: hi, lo"),
                           (['--speaker=mid'], "speaker='mid': not one of the model's voices: hi, lo")):
        p = run(['sample_tts.py', f'--out_dir={out}', '--device=cpu', f'--wav={tmp_path / "y.wav"}', '--text=aa',
                 *extra], check=False)
        assert_user_error(p, message)
    assert not (tmp_path / 'y.wav').exists()
    p = train(out, corpus, '--max_iters=4', '--eval_interval=2', '--spk_channels=8', check=False)
    assert_user_error(p, "speakers: checkpoint has ('hi', 'lo'), config has ()", '--resume=False to replace')
    assert '--init_from' not in p.stderr
    # a speaker whose only utterance is held out would be a voice never trained (it was, silently)
    rows = (corpus / 'metadata.csv').read_text().splitlines()
    _, held = split_ids([r.split('|')[0] for r in rows], 0.2)
    rows = [f"{r.split('|')[0]}|carol|{r.split('|')[2]}" if r.split('|')[0] == held[0] else r for r in rows]
    (corpus / 'metadata.csv').write_text('\n'.join(rows) + '\n')
    p = train(tmp_path / 'carol', corpus, '--multi_speaker=True', '--spk_channels=8', check=False)
    assert_user_error(p, 'speaker(s) carol have no utterance in the training split')


def test_speaker_rows_are_checked_and_one_voice_models_have_no_speaker_weights(tmp_path):
    """A row without its speaker, or with a '|' in its speaker's name, stops a multi-speaker run naming the line; a
    one-voice model's weights are those of before multi-speaker models (its checkpoints load as they were)."""
    data = make_corpus(tmp_path / 'c', n=3)
    lines = (data / 'metadata.csv').read_text().splitlines()
    for broken in (f"{lines[1].split('|')[0]}|aa mm", f"{lines[1].split('|')[0]}| |aa mm"):
        (data / 'metadata.csv').write_text('\n'.join([lines[0], broken, lines[2]]) + '\n')
        with pytest.raises(UserError, match=r"metadata.csv:2: multi_speaker=True reads rows 'id\|speaker\|text'"):
            read_speakers(str(data))
    # a speaker's name holding '|': said so, not blamed on the transcript under the one-voice layouts
    rows = [f"{line.split('|')[0]}|{speaker}|aa" for line, speaker in zip(lines, ('lo', 'hi|2', 'lo'))]
    (data / 'metadata.csv').write_text('\n'.join(rows) + '\n')
    with pytest.raises(UserError, match=r"metadata.csv:2: multi_speaker=True reads rows 'id\|speaker\|text', got 4 "
                                        r"fields in .*; a speaker's name and a transcript may not contain '\|'") as e:
        read_metadata(str(data), multi_speaker=True)
    assert 'raw text' not in str(e.value)
    # LJSpeech's id|text|normalized rows read as speakers: each sentence a voice of its own (it trained so)
    (data / 'metadata.csv').write_text('\n'.join(f"{line.split('|')[0]}|aa {k}|aa" for k, line in enumerate(lines))
                                       + '\n')
    with pytest.raises(UserError, match=r"every row names a speaker of its own \('aa 0', 'aa 1', ...\): "
                                        r"multi_speaker=True reads rows 'id\|speaker\|text'"):
        read_speakers(str(data))
    one_voice = TTSModel(TTSConfig(symbols='abc', enc_channels=16, enc_layers=1, enc_ff_channels=16, dp_channels=8,
                                   dec_channels=16, dec_blocks=1))
    assert not any('speaker' in k for k in one_voice.state_dict())


@pytest.mark.slow
def test_a_voice_from_a_clip(tmp_path):
    """voice_clips=True: a clip encoder learns each training speaker's voice vector from their utterances
    (its loss logged, its gradient kept off the table it learns from); sample_tts.py --voice_clip speaks in the
    voice of a clip; a clip and a name together, a clip for a model without the encoder, a clip of a fraction
    of a second, a silent clip, voice_clips without multi_speaker: clear errors."""
    corpus = make_speaker_corpus(tmp_path / 'corpus')
    out = tmp_path / 'out'
    train(out, corpus, '--max_iters=2', '--eval_interval=2', '--multi_speaker=True', '--voice_clips=True',
          '--spk_channels=8')
    assert all('voice_loss' in e for e in read_log(out) if 'train_loss' in e)
    model = load_tts(load(out / 'ckpt.pt'))
    x, x_lengths = torch.randint(2, 6, (2, 5)), torch.tensor([5, 4])
    y, y_lengths = torch.randn(2, 80, 12), torch.tensor([12, 10])
    losses = model.train()(x, x_lengths, y, y_lengths, torch.tensor([0, 1]))
    table_grad, = torch.autograd.grad(losses['voice'], model.speaker_embed.weight, allow_unused=True)
    assert table_grad is None and losses['voice'] > 0
    clip = corpus / 'wavs' / 'U001.wav'
    wav = tmp_path / 'x.wav'
    run(['sample_tts.py', f'--out_dir={out}', '--device=cpu', f'--wav={wav}', '--text=aa mm', f'--voice_clip={clip}',
         '--n_timesteps=2'])
    assert wav.exists()
    short, silent = tmp_path / 'short.wav', tmp_path / 'silent.wav'
    write_pcm(short, np.sin(np.arange(SR // 10) / 10) * 5000)
    write_pcm(silent, np.zeros(2 * SR))
    for extra, message in (([f'--voice_clip={clip}', '--speaker=hi'], 'give one voice, a name or a clip'),
                           ([f'--voice_clip={short}'], 'the voice clip is 0.10 s long'),
                           ([f'--voice_clip={silent}'], f'voice_clip={silent} is silent (every sample is 0'),
                           ([f'--voice_clip={clip}', f'--wav={clip}'], 'which this command reads')):
        before = clip.read_bytes()
        p = run(['sample_tts.py', f'--out_dir={out}', '--device=cpu', f'--wav={tmp_path / "y.wav"}', '--text=aa',
                 *extra], check=False)
        assert_user_error(p, message)
        assert clip.read_bytes() == before
    # runs/tts_voices.py synthesize: the recordings, each training voice by name and every voice from its first
    # utterance (the clip), an unseen one included; the clip itself is not scored
    held_out = tmp_path / 'held_out'
    shutil.copytree(corpus, held_out)
    rows = (held_out / 'metadata.csv').read_text().splitlines()
    unseen = [r.replace('|hi|', '|mid|') for r in rows if '|hi|' in r][:3]
    for r in unseen:
        shutil.copy(held_out / 'wavs' / f"{r.split('|')[0]}.wav", held_out / 'wavs' / f"M{r.split('|')[0]}.wav")
    (held_out / 'metadata.csv').write_text('\n'.join(rows + ['M' + r for r in unseen]) + '\n')
    wav_dir = tmp_path / 'voices'
    run(['runs/tts_voices.py', 'synthesize', f"--ckpt={out / 'ckpt.pt'}", f'--held_out_dir={held_out}',
         f'--wav_dir={wav_dir}', '--utterances=2'])
    manifest = json.loads((wav_dir / 'manifest.json').read_text())
    assert manifest['trained'] == ['hi', 'lo'] and set(manifest['scored']) == {'hi', 'lo', 'mid'}
    for voice, utt_ids in manifest['scored'].items():
        assert len(utt_ids) == 2 and manifest['clips'][voice] not in utt_ids
        for kind in ('reference', 'clip') + (('speaker',) if voice != 'mid' else ()):
            assert sorted(os.listdir(wav_dir / kind / voice)) == sorted(u + '.wav' for u in utt_ids)
    assert not (wav_dir / 'speaker' / 'mid').exists()
    one_voice = tmp_path / 'one'
    train(one_voice, corpus, '--max_iters=1', '--eval_interval=1', '--multi_speaker=True', '--spk_channels=8',
          '--audio_samples=0', '--eval_utterances=1')
    p = run(['sample_tts.py', f'--out_dir={one_voice}', '--device=cpu', f'--wav={tmp_path / "y.wav"}', '--text=aa',
             f'--voice_clip={clip}'], check=False)
    assert_user_error(p, 'this model has no clip encoder')
    p = train(tmp_path / 'none', corpus, '--voice_clips=True', check=False)
    assert_user_error(p, 'voice_clips=True learns to tell the voices of a multi-speaker corpus')


def test_training_samples_replace_no_file_of_the_users(tmp_path, corpus):
    """out_dir/samples/<id>.wav of a held-out sentence: a file the user put there is left as it is and said so
    (the sample replaced it); the samples train_tts.py writes carry its mark, and replace each other."""
    _, held = split_ids([utt_id for utt_id, _ in read_metadata(str(corpus))], 0.2)
    samples = tmp_path / 'out' / 'samples'
    samples.mkdir(parents=True)
    (samples / f'{held[0]}.wav').write_bytes(b'my recording')
    p = train(tmp_path / 'out', corpus, '--max_iters=2', '--eval_interval=2', '--audio_samples=2',
              '--eval_utterances=2')
    assert (samples / f'{held[0]}.wav').read_bytes() == b'my recording'
    assert 'as it is: a file this script did not write' in p.stdout + p.stderr
    assert wav_software(str(samples / f'{held[1]}.wav')) == 'nanotrain train_tts.py'


def test_another_runs_best_pt_alone_is_replaced_only_on_request(tmp_path, corpus, straight_run):
    """A best.pt of another run from scratch copied into a folder (its ckpt.pt left behind): both runs share the
    identity (train_tts.py, from scratch), not their settings; it was replaced silently, now only with
    --resume=False (docs/checkpoints.md)."""
    folder = tmp_path / 'kept'
    folder.mkdir()
    shutil.copy(straight_run[0] / 'best.pt', folder / 'best.pt')
    kept = (folder / 'best.pt').read_bytes()
    p = train(folder, corpus, '--max_iters=1', '--eval_interval=1', '--audio_samples=0', check=False)
    assert_user_error(p, 'holds best.pt of another run', '--resume=False')
    assert (folder / 'best.pt').read_bytes() == kept
