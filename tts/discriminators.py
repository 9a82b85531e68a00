"""
HiFi-GAN's discriminators and losses (Kong et al. 2020), for fine-tuning a published generator
(train_vocoder.py): the multi-period discriminator (the waveform folded into 2-D by periods 2, 3, 5, 7,
11), the multi-scale one (the waveform at 1x, 1/2x and 1/4x the rate), least-squares GAN losses, feature
matching and the mel L1 of the release. Key names and shapes are the release's models.py; the generator
is tts/vocoder.py's.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from tts.data import MEL_SETTINGS

LRELU_SLOPE = 0.1


def scores_and_features(convs, conv_post, x):
    """x through each convolution and leaky ReLU, then conv_post: (scores (B, N), every layer's output), the
    feature-matching loss's maps."""
    features = []
    for conv in convs:
        x = F.leaky_relu(conv(x), LRELU_SLOPE)
        features.append(x)
    x = conv_post(x)
    features.append(x)
    return x.flatten(1), features


class PeriodDiscriminator(nn.Module):
    """The waveform (B, 1, T) folded into (B, 1, T / period, period), so each column holds every period-th
    sample; 2-D convolutions of width 1 along the columns see periodic structure (pitch) at that period.
    divisor > 1 narrows every layer by it (1: the release's widths)."""

    def __init__(self, period, divisor=1, kernel_size=5, stride=3):
        super().__init__()
        self.period = period
        channels = [1] + [c // divisor for c in (32, 128, 512, 1024, 1024)]
        strides = [stride] * 4 + [1]
        self.convs = nn.ModuleList(weight_norm(nn.Conv2d(c_in, c_out, (kernel_size, 1), (s, 1), padding=(2, 0)))
                                   for c_in, c_out, s in zip(channels, channels[1:], strides))
        self.conv_post = weight_norm(nn.Conv2d(channels[-1], 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x):
        """(B, 1, T) -> (scores (B, N), the feature maps after each layer)."""
        if x.shape[2] % self.period:  # reflect-pad to whole periods
            x = F.pad(x, (0, self.period - x.shape[2] % self.period), 'reflect')
        x = x.view(x.shape[0], 1, x.shape[2] // self.period, self.period)
        return scores_and_features(self.convs, self.conv_post, x)


class ScaleDiscriminator(nn.Module):
    """Strided, grouped 1-D convolutions over the waveform (B, 1, T): MelGAN's discriminator. divisor > 1 narrows
    every layer, and divides its groups, by it."""

    def __init__(self, norm=weight_norm, divisor=1):
        super().__init__()
        # (in, out, kernel, stride, groups) of the release
        shapes = [(1, 128, 15, 1, 1), (128, 128, 41, 2, 4), (128, 256, 41, 2, 16), (256, 512, 41, 4, 16),
                  (512, 1024, 41, 4, 16), (1024, 1024, 41, 1, 16), (1024, 1024, 5, 1, 1)]
        self.convs = nn.ModuleList(
            norm(nn.Conv1d(max(1, c_in // divisor), c_out // divisor, k, s, groups=max(1, g // divisor),
                           padding=k // 2)) for c_in, c_out, k, s, g in shapes)
        self.conv_post = norm(nn.Conv1d(1024 // divisor, 1, 3, 1, padding=1))

    def forward(self, x):
        return scores_and_features(self.convs, self.conv_post, x)


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self, divisor=1, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discriminators = nn.ModuleList(PeriodDiscriminator(p, divisor) for p in periods)

    def forward(self, audio):
        """(B, 1, T) -> ([scores of each discriminator], [feature maps of each])."""
        return tuple(zip(*(d(audio) for d in self.discriminators)))


class MultiScaleDiscriminator(nn.Module):
    def __init__(self, divisor=1):
        super().__init__()
        # the first, at the full rate, with spectral norm (steadier on raw samples), the others weight norm
        self.discriminators = nn.ModuleList([ScaleDiscriminator(spectral_norm, divisor),
                                             ScaleDiscriminator(weight_norm, divisor),
                                             ScaleDiscriminator(weight_norm, divisor)])
        self.meanpools = nn.ModuleList([nn.AvgPool1d(4, 2, padding=2), nn.AvgPool1d(4, 2, padding=2)])

    def forward(self, audio):
        scores, features = [], []
        for i, d in enumerate(self.discriminators):
            if i:
                audio = self.meanpools[i - 1](audio)
            s, f = d(audio)
            scores.append(s)
            features.append(f)
        return scores, features

# -----------------------------------------------------------------------------
# losses: least-squares GAN (real -> 1, generated -> 0), feature matching, mel L1


def discriminator_loss(real_scores, fake_scores):
    """Sum over discriminators of mean (1 - D(real))^2 + mean D(generated)^2."""
    return sum(torch.mean((1 - r) ** 2) + torch.mean(g ** 2) for r, g in zip(real_scores, fake_scores))


def generator_loss(fake_scores):
    """Sum over discriminators of mean (1 - D(generated))^2."""
    return sum(torch.mean((1 - g) ** 2) for g in fake_scores)


def feature_loss(real_features, fake_features):
    """2 x the sum over discriminators and layers of the mean |feature(real) - feature(generated)|."""
    return 2 * sum(torch.mean(torch.abs(r - g)) for rs, gs in zip(real_features, fake_features)
                   for r, g in zip(rs, gs))


def loss_mel(audio, f_max=None):
    """(B, T) waveform -> (B, n_mels, T // hop) natural-log mel as HiFi-GAN computes it for its mel loss: reflect
    padding of (n_fft - hop) / 2 each side and no centring (so T // hop frames, frame i over the samples from
    i * hop - 384), magnitude sqrt(re^2 + im^2 + 1e-9) (a finite gradient at silence), slaney mel filters up to
    f_max (None: half the rate, the release's fmax_for_loss), log of clamp 1e-5."""
    s = MEL_SETTINGS
    pad = (s['n_fft'] - s['hop_length']) // 2
    x = F.pad(audio[:, None], (pad, pad), mode='reflect')[:, 0]
    window = torch.hann_window(s['win_length'], device=audio.device)
    spec = torch.view_as_real(torch.stft(x, s['n_fft'], s['hop_length'], s['win_length'], window, center=False,
                                         return_complex=True))
    magnitude = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
    filters = torchaudio.functional.melscale_fbanks(s['n_fft'] // 2 + 1, s['f_min'], f_max or s['sample_rate'] / 2,
                                                    s['n_mels'], s['sample_rate'], norm='slaney', mel_scale='slaney')
    return torch.log(torch.clamp(filters.T.to(audio.device) @ magnitude, min=1e-5))
