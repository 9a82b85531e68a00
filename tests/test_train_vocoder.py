"""train_vocoder.py and tts/discriminators.py: HiFi-GAN's discriminators against the release's code
(tests/fixtures/make_discriminator_fixtures.py), its losses against their formulas, the loss mel against a plain
numpy STFT, and fine-tuning runs on a tiny generator (tests/fixtures/hifigan/v1) and a tiny TTS model: the mels it
learns from are the model's teacher-forced ones, the generator file it writes is a vocoder, a continued run is
the run made straight."""

import dataclasses
import math
import os
import shutil
import wave
import zlib

import numpy as np
import pytest
import torch

from conftest import assert_logged_to_wandb, assert_user_error, launch, load, read_log, run, wandb_env
from tts.data import MEL_SETTINGS, LJSpeechDataset, eval_batches, read_metadata, split_ids
from tts.discriminators import (MultiPeriodDiscriminator, MultiScaleDiscriminator, PeriodDiscriminator,
                                discriminator_loss, feature_loss, generator_loss, loss_mel)
from tts.model import TTSConfig, TTSModel, load_tts
from tts.vocoder import HiFiGAN, load_hifigan

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures', 'hifigan')
VOCODER = os.path.join(FIXTURES, 'v1', 'generator.pth.tar')  # 16 channels instead of V1's 512
SR, HOP = MEL_SETTINGS['sample_rate'], MEL_SETTINGS['hop_length']


def draw(key, shape):
    """tests/fixtures/make_discriminator_fixtures.py's draw: a parameter's values from its key in the release's
    layout."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    values = torch.randn(shape, generator=g)
    if key.endswith('weight_g'):
        return 0.5 + torch.rand(shape, generator=g)
    if key.endswith('bias'):
        return 0.1 * values
    return values


def release_key(key):
    """Our key -> the release's: weight norm's g and v, spectral norm's raw weight and power-iteration vectors."""
    for ours, theirs in (('parametrizations.weight.original0', 'weight_g'),
                         ('parametrizations.weight.original1', 'weight_v'),
                         ('parametrizations.weight.original', 'weight_orig'),
                         ('parametrizations.weight.0._u', 'weight_u'), ('parametrizations.weight.0._v', 'weight_v')):
        if key.endswith(ours):
            return key[:-len(ours)] + theirs
    return key


def with_release_weights(module, spectral=()):
    state = {}
    for key, value in module.state_dict().items():
        drawn = draw(release_key(key), value.shape)
        if any(key.startswith(p) for p in spectral) and key.endswith(('_u', '_v')):
            drawn = drawn / drawn.norm()
        state[key] = drawn
    module.load_state_dict(state)
    return module.eval()


def assert_like_release(scores, features, expected):
    # float32 sums over up to ~1e5 values of layers 1024 channels wide: a different summation order moves the
    # feature maps' sums by ~5e-6 relative and a score, the last sum of terms that cancel, by ~2e-4 of itself
    # (measured: 1.3e-4 on AVX2 and AVX512 kernels, 1.7e-4 on the scalar ones); a wrong stride, padding, group
    # count or slope changes shapes or sums by far more
    assert [list(f.shape) for f in features] == expected['shapes']
    torch.testing.assert_close(scores, expected['scores'], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(torch.tensor([f.double().sum().item() for f in features]), expected['sums'],
                               rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(torch.tensor([f.double().abs().sum().item() for f in features]),
                               expected['abs_sums'], rtol=1e-4, atol=1e-2)

# ----------------------------------------------------------------------------- discriminators and losses


@pytest.mark.comparison
def test_discriminators_compute_what_the_releases_do():
    """Full-width period (2, 11) and multi-scale discriminators with the same weights in the release's layout score
    a waveform (padded to whole periods) as HiFi-GAN's models.py does, feature map for feature map."""
    expected = load(os.path.join(FIXTURES, 'discriminators.pt'))
    with torch.no_grad():
        for period in (2, 11):
            d = with_release_weights(PeriodDiscriminator(period))
            assert_like_release(*d(expected['audio']), expected[f'period_{period}'])
        msd = with_release_weights(MultiScaleDiscriminator(), spectral=('discriminators.0.',))
        for scores, features, want in zip(*msd(expected['audio']), expected['scale']):
            assert_like_release(scores, features, want)


def test_discriminator_shapes_and_narrower_ones():
    """Five period discriminators of six feature maps each and three scale ones of eight; the release's widths
    (41.1M and 29.6M parameters), and a divisor that narrows every layer (its groups too) into the same shapes of
    scores."""
    audio = torch.randn(2, 1, 1001)
    with torch.device('meta'):
        full = MultiPeriodDiscriminator(), MultiScaleDiscriminator()
    assert [round(sum(p.numel() for p in d.parameters()) / 1e5) for d in full] == [411, 296]
    mpd, msd = MultiPeriodDiscriminator(divisor=32), MultiScaleDiscriminator(divisor=32)
    scores, features = mpd(audio)
    assert [len(f) for f in features] == [6] * 5 and all(s.shape[0] == 2 for s in scores)
    for period, f in zip((2, 3, 5, 7, 11), features):
        assert f[0].shape[1:] == (1, math.ceil(math.ceil(1001 / period) / 3), period)  # folded by its period
    scores, features = msd(audio)
    assert [len(f) for f in features] == [8] * 3
    assert [f[-1].shape[2] for f in features] == [1001 // 64 + 1, 501 // 64 + 1, 251 // 64 + 1]  # 1x, 1/2, 1/4 rate


def test_gan_losses_are_the_formulas():
    """Least squares: real scores towards 1 and generated ones towards 0 for the discriminators, generated ones
    towards 1 for the generator; feature matching 2 x mean |difference|, summed over discriminators and layers."""
    torch.manual_seed(0)
    real, fake = [torch.randn(2, 7), torch.randn(2, 3)], [torch.randn(2, 7), torch.randn(2, 3)]
    expected = sum(((1 - r.double()) ** 2).sum().item() / r.numel() + (g.double() ** 2).sum().item() / g.numel()
                   for r, g in zip(real, fake))
    assert math.isclose(discriminator_loss(real, fake).item(), expected, rel_tol=1e-6)
    assert math.isclose(generator_loss(fake).item(),
                        sum(((1 - g.double()) ** 2).sum().item() / g.numel() for g in fake), rel_tol=1e-6)
    a = [[torch.randn(2, 4, 5), torch.randn(2, 1, 3)], [torch.randn(2, 6)]]
    b = [[torch.randn(2, 4, 5), torch.randn(2, 1, 3)], [torch.randn(2, 6)]]
    expected = 2 * sum(np.abs(x.numpy() - y.numpy()).mean() for xs, ys in zip(a, b) for x, y in zip(xs, ys))
    assert math.isclose(feature_loss(a, b).item(), expected, rel_tol=1e-6)
    assert discriminator_loss([torch.ones(3)], [torch.zeros(3)]).item() == 0 == generator_loss([torch.ones(3)]).item()


@pytest.mark.comparison
def test_loss_mel_is_the_releases_mel():
    """HiFi-GAN's loss mel: (n_fft - hop) / 2 reflect padding each side, frames not centred (T // hop of them, so a
    segment's mel has its frames), magnitude sqrt(|X|^2 + 1e-9), slaney filters to half the rate, log of clamp 1e-5;
    checked against a numpy STFT with the same filters."""
    import torchaudio
    n = 8 * HOP
    t = torch.arange(n, dtype=torch.float64) / SR
    noise = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    audio = (0.5 * torch.sin(2 * math.pi * 1000 * t) + 0.01 * noise).float()
    mel = loss_mel(audio[None])[0]
    assert mel.shape == (80, n // HOP)
    x = np.pad(audio.double().numpy(), 384, mode='reflect')
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(1024) / 1024)
    frames = np.stack([x[i * HOP:i * HOP + 1024] * window for i in range(n // HOP)])
    magnitude = np.sqrt(np.abs(np.fft.rfft(frames, axis=1)) ** 2 + 1e-9)
    filters = torchaudio.functional.melscale_fbanks(513, 0.0, SR / 2, 80, SR, norm='slaney', mel_scale='slaney')
    expected = np.log(np.maximum(magnitude @ filters.double().numpy(), 1e-5)).T
    assert np.allclose(np.exp(mel.double().numpy()), np.exp(expected), rtol=1e-3, atol=1e-4)
    high = (0.5 * torch.sin(2 * math.pi * 10000 * t)).float()[None]  # above our features' 8 kHz: the loss hears it
    # (the frames at the ends, padded by reflection, leak: the middle ones are compared)
    assert loss_mel(high)[0, :, 2:-2].mean(1).argmax() > 75
    assert loss_mel(high, f_max=8000.0)[0, :, 2:-2].max() < math.log(1e-3)

# ----------------------------------------------------------------------------- fine-tuning runs


def write_corpus(root):
    """Six utterances of a tone each (0.3-0.55 s), transcripts of two letters' words."""
    os.makedirs(root / 'wavs')
    rows = []
    for k in range(6):
        t = np.arange(int(SR * (0.3 + 0.05 * k))) / SR
        samples = (0.3 * np.sin(2 * math.pi * (200, 300, 500)[k % 3] * t) * 32767).astype('<i2')
        with wave.open(str(root / 'wavs' / f'U{k}.wav'), 'wb') as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SR)
            w.writeframes(samples.tobytes())
        text = 'aa ee' if k % 2 else 'ee aa'
        rows.append(f"U{k}|{text}|{text}")
    (root / 'metadata.csv').write_text('\n'.join(rows) + '\n')
    return root


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """A corpus and an (untrained) TTS checkpoint of it, as train_tts.py saves one."""
    root = tmp_path_factory.mktemp('vocoder')
    corpus = write_corpus(root / 'corpus')
    config = TTSConfig(symbols=' ae', enc_channels=16, enc_layers=1, enc_heads=2, enc_ff_channels=32, dp_channels=16,
                       dec_channels=16, dec_blocks=1, dec_heads=2)
    torch.manual_seed(0)
    model = TTSModel(config)
    model.mel_mean.fill_(-5.0)
    model.mel_std.fill_(2.0)
    torch.save(dict(kind='tts', model_args=dataclasses.asdict(config), model=model.state_dict(),
                    data_dir=str(corpus), config=dict(val_fraction=0.34)), root / 'tts.pt')
    return corpus, root / 'tts.pt'


QUICK = ['--batch_size=2', '--segment_frames=4', '--discriminator_divisor=32', '--eval_utterances=1',
         '--eval_interval=2', '--log_interval=1', '--device=cpu']


def fine_tune(out_dir, tts_ckpt, *extra, **kw):
    return launch('train_vocoder.py', out_dir, '', f'--tts_ckpt={tts_ckpt}', f'--init_from={VOCODER}', *QUICK,
                  *extra, **kw)


@pytest.fixture(scope='module')
def straight(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp('straight')
    fine_tune(out, tiny[1], '--max_iters=4')
    return out


@pytest.mark.slow
def test_the_generator_learns_the_models_teacher_forced_mels(tiny, straight):
    """The mels the generator learns from are the TTS model's, decoded with the durations MAS finds against each
    recording (so with its frames), not the recordings' own; every loss is logged; the generator file it writes
    loads as a vocoder and differs from the one it started from."""
    corpus, tts_ckpt = tiny
    ckpt = load(tts_ckpt)
    model = load_tts(ckpt)
    rows = read_metadata(str(corpus))
    train_ids, val_ids = split_ids([i for i, _ in rows], 0.34)
    ids = train_ids + val_ids[:1]
    dataset = LJSpeechDataset(str(corpus), ids, dict(rows), ' ae', str(straight / 'check'))
    noise = torch.Generator().manual_seed(1337)
    cached = load(next(straight.glob('aligned_mels_*.pt')))
    assert sorted(cached) == sorted(ids)
    for indices in eval_batches(dataset.lengths, 3000):
        x, x_lengths, y, y_lengths, spk = dataset.collate(indices, -5.0, 2.0)
        mel, _ = model.teacher_forced(x, x_lengths, y, y_lengths, spk, n_timesteps=10, temperature=0.667,
                                      generator=noise)
        for b, i in enumerate(indices):
            expected = model.denormalize(mel[b, :, :y_lengths[b]])
            torch.testing.assert_close(cached[dataset.ids[i]], expected, rtol=0, atol=1e-5)
            assert cached[dataset.ids[i]].shape == dataset.mels[i].shape
            assert not torch.allclose(cached[dataset.ids[i]], dataset.mels[i], atol=0.5)
    events = read_log(straight)
    assert [e['step'] for e in events if 'val_mel_error' in e] == [0, 2, 4]
    assert all(e['adversarial_loss'] > 0 and e['feature_loss'] > 0 and e['discriminator_loss'] > 0
               for e in events if 'mel_loss' in e)
    # the generator's learning rate rises over warmup_iters (100) from the first step, x 0.999 an epoch (4 training
    # utterances: 2 steps of 2)
    expected = [2e-5 * step / 100 * 0.999 ** ((step - 1) // 2) for step in (1, 2, 3, 4)]
    assert [e['lr'] for e in events if 'mel_loss' in e] == pytest.approx(expected, rel=1e-9)
    tuned, start = load_hifigan(str(straight / 'generator.pth.tar')), load_hifigan(VOCODER)
    assert isinstance(tuned, HiFiGAN) and tuned.config == start.config
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), start.state_dict().values()))


@pytest.mark.slow
def test_a_continued_run_is_the_run_made_straight(tiny, straight, tmp_path):
    """Stopped after 2 steps and relaunched to 4: the same generator, discriminators and losses, bit for bit (the
    segments, their starts and the cached mels all come back); a relaunch of a finished run changes nothing. With
    --wandb_log=True (a stand-in wandb package) every number of log.jsonl went to W&B, in one W&B run."""
    split = tmp_path / 'split'
    fine_tune(split, tiny[1], '--max_iters=2', '--wandb_log=True', env_extra=wandb_env())
    p = fine_tune(split, tiny[1], '--max_iters=4', '--wandb_log=True', env_extra=wandb_env())
    assert 'resuming from' in p.stdout + p.stderr and "teacher-forced mels from" in p.stdout + p.stderr
    losses = lambda out: {e['step']: (e['mel_loss'], e['adversarial_loss'], e['feature_loss'],
                                      e['discriminator_loss']) for e in read_log(out) if 'mel_loss' in e}
    assert sorted(losses(split)) == [1, 2, 3, 4] and repr(losses(split)) == repr(losses(straight))
    a, b = load(straight / 'ckpt.pt'), load(split / 'ckpt.pt')
    for part in ('generator', 'mpd', 'msd'):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert_logged_to_wandb(split, launches=2)
    # relaunched on other recordings (one transcript changed): refused, the run untouched (it went on, mixing them)
    other = tmp_path / 'other'
    shutil.copytree(tiny[0], other)
    rows = (other / 'metadata.csv').read_text().splitlines()
    (other / 'metadata.csv').write_text('\n'.join([rows[0] + ' aa'] + rows[1:]) + '\n')
    saved = (split / 'ckpt.pt').read_bytes()
    p = fine_tune(split, tiny[1], '--max_iters=6', f'--data_dir={other}', check=False)
    assert_user_error(p, f'{other} is not the corpus the run in {split} began with')
    assert (split / 'ckpt.pt').read_bytes() == saved


@pytest.mark.slow
@pytest.mark.comparison
@pytest.mark.parametrize('fault', ['genroom@1', 'melroom@1'])
def test_out_of_memory_takes_the_steps_segments_in_parts(tiny, straight, tmp_path, fault):
    """On a device with room for one of a step's two segments (tests/faults.py: the generator's forward in the
    discriminators' pass, or the mel loss in the generator's pass, after the discriminators' step) the step is
    taken in two parts and is the step that fit: the same losses and weights (the discriminators stepped once).
    The checkpoint keeps the split, and a relaunch continues with it; a segment that does not fit alone is a clear
    error that leaves the checkpoint as it was. 1e-6: the same float32 work on one segment at a time, the parts' gradients summed instead of the batch's
    (~1e-7 relative each); an Adam step is continuous in its gradient. A second discriminators' step moves their
    weights by ~2e-6 (lr 2e-4 x warmup 1/100)."""
    out = tmp_path / fault.partition('@')[0]
    p = fine_tune(out, tiny[1], '--max_iters=2', faults=fault)
    assert 'step 0: out of memory, retrying with the step\'s 2 segments in 2 parts' in p.stdout + p.stderr
    assert load(out / 'ckpt.pt')['batch_splits'] == 2
    p = fine_tune(out, tiny[1], '--max_iters=4')
    assert "continuing with each step's segments in 2 parts" in p.stdout + p.stderr
    losses = lambda out: [e[k] for e in read_log(out) if 'mel_loss' in e
                          for k in ('mel_loss', 'adversarial_loss', 'feature_loss', 'discriminator_loss')]
    assert len(losses(out)) == 16 and losses(out) == pytest.approx(losses(straight), rel=1e-6)
    a, b = load(straight / 'ckpt.pt'), load(out / 'ckpt.pt')
    for part in ('generator', 'mpd', 'msd'):
        for k in a[part]:
            torch.testing.assert_close(b[part][k], a[part][k], rtol=1e-6, atol=1e-7, msg=f'{part} {k}')
    if fault.startswith('genroom'):
        before = (out / 'ckpt.pt').read_bytes()
        p = fine_tune(out, tiny[1], '--max_iters=6', faults='genroom@0', check=False)
        assert_user_error(p, 'out of memory with one segment at a time (step 4)', 'lower segment_frames')
        assert (out / 'ckpt.pt').read_bytes() == before


@pytest.mark.slow
def test_recordings_mels_without_a_tts_model_and_bad_settings(tiny, tmp_path):
    """Without --tts_ckpt the generator learns the recordings' own mels (a new voice), with the mel loss alone when
    discriminators=False; a missing generator, a checkpoint that is no TTS model or the TTS model given as the
    generator stops before any work."""
    corpus, tts_ckpt = tiny
    out = tmp_path / 'own'
    launch('train_vocoder.py', out, corpus, f'--init_from={VOCODER}', *QUICK, '--max_iters=2', '--discriminators=False')
    events = [e for e in read_log(out) if 'mel_loss' in e]
    assert len(events) == 2 and all(e['adversarial_loss'] == 0 == e['discriminator_loss'] for e in events)
    assert not list(out.glob('aligned_mels_*.pt')) and os.path.exists(out / 'generator.pth.tar')
    p = fine_tune(tmp_path / 'none', tts_ckpt, f'--init_from={tmp_path / "none.pth.tar"}', check=False)
    assert_user_error(p, 'init_from=', 'not a checkpoint file')
    torch.save(dict(kind='gpt'), tmp_path / 'gpt.pt')
    p = fine_tune(tmp_path / 'gpt', tmp_path / 'gpt.pt', check=False)
    assert_user_error(p, 'not a train_tts.py checkpoint')
    # the two files swapped: the message names this script's keys (it has no --vocoder='' to fall back on)
    p = fine_tune(tmp_path / 'swapped', tts_ckpt, f'--init_from={tts_ckpt}', check=False)
    assert_user_error(p, f'init_from={tts_ckpt} is a nanotrain checkpoint', 'train_vocoder.py takes as --tts_ckpt')
    assert '--vocoder' not in p.stderr
    assert 'teacher-forced mels' not in p.stdout + p.stderr  # refused before the TTS model's mels were made


def test_sample_and_eval_name_a_generator_run_given_as_a_language_model(straight):
    """A train_vocoder.py checkpoint given to sample.py or eval.py stops with what it is and the command that
    speaks through it (it fell through to the language-model branch: a KeyError)."""
    for script in ('sample.py', 'eval.py'):
        p = run([script, f'--init_from={straight / "ckpt.pt"}'], check=False)
        assert_user_error(p, "is a train_vocoder.py run's checkpoint",
                          f'python sample_tts.py --vocoder={straight / "generator.pth.tar"}')


def test_a_corpus_in_another_alphabet_is_refused(tiny, tmp_path):
    """Recordings whose transcripts hold no character the TTS model knows: it would read nothing of them (their
    mels were made of empty texts, silently)."""
    other = tmp_path / 'other'
    shutil.copytree(tiny[0], other)
    rows = (other / 'metadata.csv').read_text().splitlines()
    (other / 'metadata.csv').write_text(''.join(f"{row.split('|')[0]}|xyz|xyz\n" for row in rows))
    p = fine_tune(tmp_path / 'out', tiny[1], f'--data_dir={other}', '--max_iters=1', check=False)
    assert_user_error(p, "holds no character the TTS model knows ('xyz'): its corpus is in another alphabet")
    assert not (tmp_path / 'out').exists()
