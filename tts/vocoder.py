"""
Vocoders: log-mel (n_mels, T) -> waveform. HiFi-GAN's generator (Kong et al. 2020, versions V1-V3) is written
out here and loads the published generator checkpoints as released (`{'generator': state_dict}` with weight
norm, and the config.json beside it); Griffin-Lim (tts/data.py) is the default that needs no download.
docs/tts.md says where the published generators come from.
"""
import dataclasses
import json
import math
import os
import pickle
import sys
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import UserError
from run.checkpoint import atomic_file, file_kind, unpickling_detail
from tts.data import MEL_SETTINGS, MelExtractor

LRELU_SLOPE = 0.1
# config.json's name for each of our mel settings: a generator hears only mels made the way it was trained on
CONFIG_MEL_KEYS = dict(sample_rate='sampling_rate', n_mels='num_mels', n_fft='n_fft', win_length='win_size',
                       hop_length='hop_size', f_min='fmin', f_max='fmax')


@dataclass
class HiFiGANConfig:
    """The generator's shape, as config.json gives it (V1: 512 channels, resblock '1'; V3: 256, resblock '2')."""
    upsample_rates: list
    upsample_kernel_sizes: list
    upsample_initial_channel: int
    resblock: str                # '1': pairs of dilated and plain convolutions (V1, V2); '2': dilated only (V3)
    resblock_kernel_sizes: list
    resblock_dilation_sizes: list
    num_mels: int = 80


# the published V1 generators' shape (config_v1.json of the release), for a file that comes without it
V1 = HiFiGANConfig(upsample_rates=[8, 8, 2, 2], upsample_kernel_sizes=[16, 16, 4, 4], upsample_initial_channel=512,
                   resblock='1', resblock_kernel_sizes=[3, 7, 11], resblock_dilation_sizes=[[1, 3, 5]] * 3)


class ResBlock1(nn.Module):
    """V1, V2: each dilated convolution followed by a plain one, each pair a residual step."""

    def __init__(self, channels, kernel_size, dilations):
        super().__init__()
        self.convs1 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                              padding=d * (kernel_size - 1) // 2) for d in dilations)
        self.convs2 = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2)
                                    for _ in dilations)

    def forward(self, x):
        for conv1, conv2 in zip(self.convs1, self.convs2):
            x = x + conv2(F.leaky_relu(conv1(F.leaky_relu(x, LRELU_SLOPE)), LRELU_SLOPE))
        return x


class ResBlock2(nn.Module):
    """V3: one dilated convolution a residual step."""

    def __init__(self, channels, kernel_size, dilations):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(channels, channels, kernel_size, dilation=d,
                                             padding=d * (kernel_size - 1) // 2) for d in dilations)

    def forward(self, x):
        for conv in self.convs:
            x = x + conv(F.leaky_relu(x, LRELU_SLOPE))
        return x


class HiFiGAN(nn.Module):
    """The generator: a mel frame becomes prod(upsample_rates) samples through transposed convolutions, each
    followed by the mean of residual blocks of several kernel sizes (the multi-receptive-field fusion)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        channels = config.upsample_initial_channel
        self.conv_pre = nn.Conv1d(config.num_mels, channels, 7, padding=3)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        block = ResBlock1 if str(config.resblock) == '1' else ResBlock2
        for i, (rate, kernel) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes)):
            self.ups.append(nn.ConvTranspose1d(channels // 2**i, channels // 2**(i + 1), kernel, rate,
                                               padding=(kernel - rate) // 2))
            for kernel_size, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes):
                self.resblocks.append(block(channels // 2**(i + 1), kernel_size, dilations))
        self.conv_post = nn.Conv1d(channels // 2**len(self.ups), 1, 7, padding=3)

    def forward(self, mel):
        """(B, num_mels, T) natural-log mel -> (B, T * prod(upsample_rates)) waveform in [-1, 1]."""
        x = self.conv_pre(mel)
        n = len(self.config.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, LRELU_SLOPE))
            x = sum(block(x) for block in self.resblocks[i * n:(i + 1) * n]) / n
        x = self.conv_post(F.leaky_relu(x))  # the release's last activation has torch's default slope, 0.01
        return torch.tanh(x).squeeze(1)

    @torch.inference_mode()
    def vocode(self, log_mel):
        """(n_mels, T) log-mel -> 1-D float32 waveform on the CPU."""
        device = self.conv_pre.weight.device
        return self(log_mel.float().to(device)[None])[0].cpu()


def fold_weight_norm(state):
    """A state dict with weight norm (`w = g * v / |v|`, norm over all but the first dimension: `*.weight_g`,
    `*.weight_v`, or torch's parametrization keys `*.parametrizations.weight.original0/1`) -> plain weights."""
    folded = {}
    for key, value in state.items():
        for g_name, v_name in (('weight_g', 'weight_v'), ('parametrizations.weight.original0',
                                                          'parametrizations.weight.original1')):
            prefix = key[:-len(g_name)]
            if key.endswith(v_name) and prefix[-1:] in ('', '.'):
                break
            if key.endswith(g_name) and prefix[-1:] in ('', '.'):
                v = state[prefix + v_name].double()
                norm = v.flatten(1).norm(dim=1).view(-1, *[1] * (v.dim() - 1))
                folded[prefix + 'weight'] = (value.double() * v / norm).to(value.dtype)
                break
        else:
            folded[key] = value
    return folded


def read_generator_config(config_path, generator_path, key='vocoder'):
    """config.json -> HiFiGANConfig, refusing other mel settings than ours (MEL_SETTINGS); key: the setting that
    named the generator, for the messages."""
    try:
        with open(config_path) as f:
            raw = json.load(f)
        config = HiFiGANConfig(**{f.name: raw[f.name] for f in fields(HiFiGANConfig) if f.name in raw})
        hop = math.prod(config.upsample_rates)
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        raise UserError(f"{config_path}: not a HiFi-GAN config.json ({e}); use the one released with the generator.")
    wrong = [f"{name} {raw.get(name)!r} (ours: {MEL_SETTINGS[ours]!r})" for ours, name in CONFIG_MEL_KEYS.items()
             if not isinstance(raw.get(name), (int, float)) or not math.isclose(raw[name], MEL_SETTINGS[ours])]
    if hop != MEL_SETTINGS['hop_length']:
        wrong.append(f"upsample_rates {config.upsample_rates} (a frame becomes their product in samples: "
                     f"ours is {MEL_SETTINGS['hop_length']})")
    if wrong:
        raise UserError(f"{key}={generator_path}: its config.json was trained on other mels than nanotrain makes: "
                        f"{'; '.join(wrong)}. Use a generator trained on 22,050 Hz, 80-band mels with n_fft 1024, "
                        f"hop 256, fmax 8000 (HiFi-GAN's universal or LJSpeech V1-V3)"
                        + (", or the default Griffin-Lim (--vocoder='')." if key == 'vocoder' else '.'))
    return config


def shape_problems(model, state):
    """How a state dict does not fit a model: missing and unexpected keys, other shapes ([] = it fits)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} (config.json's shape: {tuple(v.shape)})"
              for k, v in expected.items() if k in state and state[k].shape != v.shape]
    return ([f"missing {', '.join(missing[:3])}"] if missing else []) + (
        [f"unexpected {', '.join(unexpected[:3])}"] if unexpected else []) + shapes[:3]


def load_hifigan(path, device='cpu', key='vocoder'):
    """A HiFi-GAN generator file of the original release (config.json beside it; without one, a file of V1's
    shape is taken as V1, as Matcha-TTS takes its downloads) -> HiFiGAN in eval mode, weight norm folded. key:
    the setting that named the file, for the messages (only --vocoder has Griffin-Lim to fall back on)."""
    griffin_lim = ", or --vocoder='' for Griffin-Lim" if key == 'vocoder' else ''
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if not f.endswith('.json') and not f.startswith('.'))
        raise UserError(f"{key}={path} is a folder: give the generator file in it"
                        + (f" (it holds {', '.join(found[:5])})" if found else '')
                        + ", with its config.json beside it.")
    if not os.path.isfile(path):
        raise UserError(f"{key}={path}: no such file. Give the path of a HiFi-GAN generator checkpoint (e.g. "
                        f"models/hifigan/generator_universal.pth.tar, with its config.json beside it; docs/tts.md "
                        f"says where to get them){griffin_lim}.")
    config_path = os.path.join(os.path.dirname(path), 'config.json')
    config = read_generator_config(config_path, path, key) if os.path.isfile(config_path) else None
    kind = file_kind(path)
    if kind:
        raise UserError(f"{key}={path} is {kind}, not a HiFi-GAN generator; give the generator file (e.g. "
                        f"models/hifigan/generator_universal.pth.tar, config.json beside it){griffin_lim}.")
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only's refusal, as run/checkpoint.py words it
        detail = unpickling_detail(e) or 'not a checkpoint'
        raise UserError(f"{key}={path}: not a readable PyTorch checkpoint ({detail}): "
                        f"it is corrupt, or it holds objects other than tensors and plain values, which are not loaded "
                        f"because loading them can run code. Download it again{griffin_lim}.") from None
    except Exception as e:  # torch raises several kinds for a file that is not its own
        raise UserError(f"{key}={path}: not a readable PyTorch checkpoint ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no detail'}); download it again.")
    if isinstance(ckpt, dict) and 'kind' in ckpt and 'model_args' in ckpt:  # nanotrain's own (run/checkpoint.py)
        made_by = {'tts': "a train_tts.py text-to-speech model, which " + (
                       "train_vocoder.py takes as --tts_ckpt" if key == 'init_from' else
                       "sample_tts.py takes as its run folder, --out_dir"),
                   'gpt': "a train.py language model", 'lora': "a train.py run's LoRA adapters"}
        raise UserError(f"{key}={path} is a nanotrain checkpoint ({made_by.get(ckpt['kind'], repr(ckpt['kind']))}), "
                        f"not a vocoder; give a HiFi-GAN generator file{griffin_lim}.")
    state = ckpt.get('generator', ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        if isinstance(ckpt, dict) and {'mpd', 'msd'} & set(ckpt):
            held = "the discriminators (mpd, msd): a training checkpoint (do_*), whose generator is its g_* file"
        else:
            held = (', '.join(map(str, list(ckpt)[:4])) or 'nothing') if isinstance(ckpt, dict) else \
                f"a {type(ckpt).__name__}"
        raise UserError(f"{key}={path}: not a HiFi-GAN generator checkpoint (expected {{'generator': state_dict}}, "
                        f"as the release saves it, or a state dict); it holds {held}.")
    state = fold_weight_norm(state)
    if config is None:
        if shape_problems(HiFiGAN(V1), state):
            raise UserError(f"{key}={path}: no config.json beside it ({config_path}), and it is not of V1's shape. "
                            f"HiFi-GAN's generators come with the config.json of their release (docs/tts.md, a "
                            f"neural vocoder); put it in the same folder.")
        print(f"note: no config.json beside {path}: its shape is HiFi-GAN V1's, so V1's settings are assumed "
              f"(22,050 Hz, 80 mels, hop 256, fmax 8000), as Matcha-TTS does", file=sys.stderr)
        config = V1
    model = HiFiGAN(config)
    problems = shape_problems(model, state)
    if problems:
        raise UserError(f"{key}={path}: not a HiFi-GAN generator of the shape its config.json gives "
                        f"(resblock {config.resblock!r}, {config.upsample_initial_channel} channels): "
                        f"{'; '.join(problems)}. Use the config.json released with this generator.")
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval().to(device)


def with_weight_norm(generator):
    """The generator as the release trains it: every convolution's weight reparametrized as g * v / |v| (weight
    norm, norm over all but the first dimension), starting from its plain weights (train_vocoder.py). In place."""
    for module in generator.modules():
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d)):
            nn.utils.parametrizations.weight_norm(module)
    return generator


def save_hifigan(generator, path):
    """A generator (with or without weight norm) as a file load_hifigan reads: `{'generator': state_dict}` with the
    weight norm folded, and the config.json of its shape and of our mel settings beside it."""
    with atomic_file(path) as f:
        torch.save({'generator': fold_weight_norm(generator.state_dict())}, f)
    config = dict(dataclasses.asdict(generator.config),
                  **{name: MEL_SETTINGS[ours] for ours, name in CONFIG_MEL_KEYS.items()})
    with atomic_file(os.path.join(os.path.dirname(path), 'config.json')) as f:
        f.write(json.dumps(config, indent=1).encode())


def load_vocoder(path, device='cpu'):
    """'' -> Griffin-Lim; a HiFi-GAN generator file -> its generator. Either way a function (n_mels, T) log-mel
    -> 1-D float32 waveform on the CPU."""
    if not path:
        return MelExtractor(**MEL_SETTINGS).to_waveform
    return load_hifigan(path, device).vocode


def vocoder_name(path):
    return f"HiFi-GAN {os.path.basename(path)}" if path else 'Griffin-Lim'
