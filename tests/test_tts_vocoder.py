"""tts/vocoder.py: HiFi-GAN's generator against the original code's output on tiny generators in the published
checkpoint layout (tests/fixtures/make_hifigan_fixtures.py), weight-norm folding against torch's own weight norm,
and the clear errors for vocoder files that cannot work."""

import argparse
import dataclasses
import json
import os
import random
import shutil
import warnings

import pytest
import torch

from configurator import UserError
from tts.data import MEL_SETTINGS, write_wav
from tts.vocoder import HiFiGAN, HiFiGANConfig, fold_weight_norm, load_hifigan, load_vocoder

FIXTURES = os.path.join(os.path.dirname(__file__), 'fixtures', 'hifigan')
# The fixture's audio comes from the release's code with weight norm applied on every call (float32 g * v / |v|);
# ours folds it once in float64 and rounds, so weights differ by ~1 ulp and the ~40 layers' outputs by what
# that and another summation order give: measured 1.6e-6 (v1) and 3.9e-7 (v3) here. A wrong activation slope,
# padding or residual moves the samples (mean |audio| 0.2-0.3) by 1e-2 and more.
AUDIO_TOL = 1e-4


@pytest.mark.comparison
@pytest.mark.parametrize('version', ['v1', 'v3'])
def test_generator_matches_the_original_code(version):
    """V1's layout (resblock '1') and V3's (resblock '2'), loaded from the published key layout with weight norm,
    vocode a log-mel as HiFi-GAN's own models.py did."""
    model = load_hifigan(os.path.join(FIXTURES, version, 'generator.pth.tar'))
    expected = torch.load(os.path.join(FIXTURES, version, 'expected.pt'))
    audio = model.vocode(expected['mel'])
    assert audio.shape == expected['audio'].shape == (expected['mel'].shape[1] * MEL_SETTINGS['hop_length'],)
    torch.testing.assert_close(audio, expected['audio'], atol=AUDIO_TOL, rtol=0)
    assert not any('weight_g' in k or 'weight_v' in k for k in model.state_dict())


def test_weight_norm_folding_equals_torchs_weight_norm():
    """Folded weights equal what torch's weight norm computes (both its old `weight_g/_v` keys and the
    parametrization's `original0/1`), for convolutions and transposed convolutions (norm over all but dim 0)."""
    torch.manual_seed(0)
    for layer in (torch.nn.Conv1d(6, 5, 3), torch.nn.ConvTranspose1d(6, 5, 4, 2)):
        with warnings.catch_warnings():  # the old API on purpose: the release's checkpoints were saved with it
            warnings.simplefilter('ignore', FutureWarning)
            old = torch.nn.utils.weight_norm(layer)
        with torch.no_grad():
            old.weight_g.uniform_(0.5, 2.0)
            old(torch.randn(1, 6, 8))  # the hook recomputes .weight from g and v
        state = {k: v.detach().clone() for k, v in old.state_dict().items()}
        folded = fold_weight_norm(state)
        assert sorted(folded) == ['bias', 'weight']
        torch.testing.assert_close(folded['weight'], old.weight.detach(), atol=0, rtol=4e-7)
        new = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(6, 5, 3))
        folded = fold_weight_norm(dict(new.state_dict()))
        assert sorted(folded) == ['bias', 'weight']
        torch.testing.assert_close(folded['weight'], new.weight.detach(), atol=0, rtol=4e-7)


def test_folding_changes_nothing_in_the_output():
    """The same generator with weight norm (torch's parametrization) and folded gives the same audio."""
    torch.manual_seed(0)
    with open(os.path.join(FIXTURES, 'v3', 'config.json')) as f:
        raw = json.load(f)
    config = HiFiGANConfig(**{k: raw[k] for k in HiFiGANConfig.__dataclass_fields__ if k in raw})
    normed = HiFiGAN(config)
    for module in normed.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            torch.nn.utils.parametrizations.weight_norm(module)
    plain = HiFiGAN(config)
    plain.load_state_dict(fold_weight_norm(dict(normed.state_dict())))
    mel = torch.randn(1, 80, 6) - 4
    with torch.no_grad():
        torch.testing.assert_close(plain(mel), normed(mel), atol=AUDIO_TOL, rtol=0)


def copy_fixture(tmp_path, version='v1'):
    folder = tmp_path / version
    shutil.copytree(os.path.join(FIXTURES, version), folder)
    return folder


def test_vocoder_files_that_cannot_work_are_clear_errors(tmp_path):
    folder = copy_fixture(tmp_path)
    generator = folder / 'generator.pth.tar'
    with pytest.raises(UserError, match='no such file.*Griffin-Lim'):
        load_hifigan(str(folder / 'missing.pth.tar'))
    with pytest.raises(UserError, match=r'is a folder: give the generator file in it \(it holds expected.pt, generator.pth.tar'):
        load_hifigan(str(folder))
    config = json.loads((folder / 'config.json').read_text())
    for change, named in (({'sampling_rate': 24000}, 'sampling_rate 24000'), ({'fmax': None}, 'fmax None'),
                          ({'hop_size': 300, 'upsample_rates': [10, 6, 5]}, 'upsample_rates'),
                          ({'num_mels': 100}, 'num_mels 100')):
        (folder / 'config.json').write_text(json.dumps(dict(config, **change)))
        with pytest.raises(UserError, match=f'other mels than nanotrain makes.*{named}'):
            load_hifigan(str(generator))
    (folder / 'config.json').write_text(json.dumps(dict(config, resblock='2')))  # V1 weights, V3's block
    with pytest.raises(UserError, match="not a HiFi-GAN generator of the shape its config.json gives.*convs"):
        load_hifigan(str(generator))
    (folder / 'config.json').write_text(json.dumps(dict(config, upsample_initial_channel=32)))
    with pytest.raises(UserError, match=r"conv_pre.weight \(16, 80, 7\) \(config.json's shape: \(32, 80, 7\)\)"):
        load_hifigan(str(generator))
    for corrupt in ('{"resblock": ', '{"x": ' + '[' * 100_000 + ']' * 100_000 + '}'):  # cut short; nested deep
        (folder / 'config.json').write_text(corrupt)
        with pytest.raises(UserError, match='not a HiFi-GAN config.json'):
            load_hifigan(str(generator))
    os.remove(folder / 'config.json')
    with pytest.raises(UserError, match="no config.json beside it .* not of V1's shape"):
        load_hifigan(str(generator))
    folder = copy_fixture(tmp_path / 'b')
    (folder / 'generator.pth.tar').write_bytes(b'PK\x03\x04 cut short')
    with pytest.raises(UserError, match='not a readable PyTorch checkpoint'):
        load_hifigan(str(folder / 'generator.pth.tar'))
    # random bytes, and a file of objects weights_only refuses: torch's advice to load with weights_only=False
    # (running the file's code) is not passed on
    (folder / 'random.pth.tar').write_bytes(random.Random(0).randbytes(5000))
    torch.save({'args': argparse.Namespace(lr=1)}, folder / 'objects.pth.tar')
    for name, says in (('random', 'Unsupported operand'), ('objects', 'Unsupported global')):
        with pytest.raises(UserError, match=f"{name}.pth.tar: not a readable PyTorch checkpoint \\({says}") as e:
            load_hifigan(str(folder / f'{name}.pth.tar'))
        assert 'loading them can run code' in str(e.value) and 'weights_only' not in str(e.value)
    torch.save({'mpd': {'x': torch.zeros(1)}, 'steps': 3}, folder / 'do_00000003')  # a training checkpoint
    shutil.copy(os.path.join(FIXTURES, 'v1', 'config.json'), folder / 'config.json')
    with pytest.raises(UserError, match="not a HiFi-GAN generator checkpoint.*discriminators"):
        load_hifigan(str(folder / 'do_00000003'))
    # what the file is, named: nanotrain's own checkpoints (a TTS model, a GPT), audio, text
    torch.save({'kind': 'tts', 'model': {}, 'model_args': {}}, folder / 'ckpt.pt')
    torch.save({'kind': 'gpt', 'model': {}, 'model_args': {}}, folder / 'gpt.pt')
    write_wav(folder / 'clip.wav', torch.zeros(100), 22050)
    (folder / 'notes.txt').write_text('the vocoder is in models/hifigan\n')
    for name, says in (('ckpt.pt', r'is a nanotrain checkpoint \(a train_tts.py text-to-speech model'),
                       ('gpt.pt', r'is a nanotrain checkpoint \(a train.py language model\)'),
                       ('clip.wav', r'is a WAV file \(audio\), not a HiFi-GAN generator'),
                       ('notes.txt', 'is a text file, not a HiFi-GAN generator'),
                       ('config.json', 'is a JSON file, not a HiFi-GAN generator')):
        with pytest.raises(UserError, match=f"vocoder=.*{name} {says}") as e:
            load_hifigan(str(folder / name))
        assert 'discriminators' not in str(e.value) and 'download it again' not in str(e.value)


def test_a_v1_generator_without_config_is_taken_as_v1(tmp_path, monkeypatch, capsys):
    """Matcha-TTS's downloads of the published V1 generators come without config.json: a file of V1's shape
    loads as V1 (saying so). V1 here is the release's config_v1.json (the fixture's v1 config but for width)."""
    import tts.vocoder
    with open(os.path.join(FIXTURES, 'v1', 'config.json')) as f:
        release = json.load(f)
    release = {k: release[k] for k in HiFiGANConfig.__dataclass_fields__}
    assert tts.vocoder.V1 == HiFiGANConfig(**dict(release, upsample_initial_channel=512))
    monkeypatch.setattr(tts.vocoder, 'V1', dataclasses.replace(tts.vocoder.V1, upsample_initial_channel=16))
    folder = copy_fixture(tmp_path)
    os.remove(folder / 'config.json')
    model = load_hifigan(str(folder / 'generator.pth.tar'))
    assert "its shape is HiFi-GAN V1's, so V1's settings are assumed" in capsys.readouterr().err
    expected = torch.load(os.path.join(FIXTURES, 'v1', 'expected.pt'))
    torch.testing.assert_close(model.vocode(expected['mel']), expected['audio'], atol=AUDIO_TOL, rtol=0)


def test_griffin_lim_is_the_default():
    mel = torch.full((80, 4), -5.0)
    assert load_vocoder('')(mel).shape == (3 * MEL_SETTINGS['hop_length'],)  # Griffin-Lim's centred frames
    assert load_vocoder(os.path.join(FIXTURES, 'v1', 'generator.pth.tar'))(mel).shape == (4 * 256,)
