"""
Flow-matching text-to-speech (Matcha-TTS in miniature): a transformer text encoder with RoPE
predicts per-token mel means mu and log durations; Monotonic Alignment Search aligns tokens to
mel frames during training; a 1D U-Net learns the flow-matching velocity that carries Gaussian
noise to the mel, conditioned on the aligned mu.
"""
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import UserError
from tts.data import BLANK_ID, IPA_MARKS, MEL_SETTINGS, MelExtractor, encode_text, reads_phonemes
from tts.losses import duration_loss, flow_matching_loss, flow_matching_path, prior_loss
from tts.phonemes import phonemize


@dataclass
class TTSConfig:
    symbols: str = ''              # character vocabulary (ids 0 = pad, 1 = blank, then these)
    text_frontend: str = 'characters'  # what it reads: 'characters' | 'phonemes' (tts/phonemes.py)
    speakers: tuple = ()           # the voices of a multi-speaker model (their names); () = one voice
    spk_channels: int = 64         # width of a voice's learned vector
    voice_clips: bool = False      # a multi-speaker model's clip encoder: a few seconds of mel -> a voice vector
    add_blank: bool = True         # blank token between characters
    n_mels: int = 80
    enc_channels: int = 192
    enc_layers: int = 4
    enc_heads: int = 2
    enc_ff_channels: int = 768
    enc_kernel: int = 3            # kernel of the encoder's convolutional feed-forward
    dp_channels: int = 256         # duration predictor width
    dropout: float = 0.1           # encoder and duration predictor
    dec_channels: int = 256        # U-Net width (the same at full and half resolution)
    dec_blocks: int = 2            # residual blocks per U-Net level
    dec_heads: int = 4             # attention heads in the U-Net bottleneck; 0 = none
    sigma_min: float = 1e-4
    cfg_drop: float = 0.0          # share trained without condition (classifier-free guidance)


def sequence_mask(lengths, max_length=None):
    max_length = max_length or int(lengths.max())
    return torch.arange(max_length, device=lengths.device)[None, :] < lengths[:, None]


def pad_to_even(y):
    # the U-Net halves the time axis once
    return F.pad(y, (0, y.shape[2] % 2))

# -----------------------------------------------------------------------------
# Monotonic Alignment Search (Glow-TTS): the most likely monotonic, surjective path of text
# tokens through mel frames. Dynamic programming over frames, vectorised over batch and tokens.


@torch.no_grad()
def monotonic_alignment_search(log_likelihood, mask):
    """log_likelihood (B, Tx, Ty) of frame j under token i; mask (B, Tx, Ty) bool of real pairs.
    Returns the 0/1 path (B, Tx, Ty): every frame has one token, tokens advance by at most one
    per frame, the path runs from (0, 0) to (Tx_b - 1, Ty_b - 1). The forward pass is one tensor
    step per frame over all utterances and tokens; the backtrack only follows the stored choices."""
    B, Tx, Ty = log_likelihood.shape
    neg = -1e9
    device = log_likelihood.device
    token, frame = torch.arange(Tx, device=device), torch.arange(Ty, device=device)
    # (Ty, B, Tx): one frame's scores are contiguous; token i cannot be reached before frame i
    value = log_likelihood.permute(2, 0, 1).masked_fill((token[None, :] > frame[:, None])[:, None, :], neg)
    advanced = torch.empty(Ty, B, Tx, dtype=torch.bool, device=device)
    best = torch.full((B, Tx), neg, dtype=value.dtype, device=device)
    best[:, 0] = 0.0  # before frame 0 only token 0 is reachable
    for j in range(Ty):
        # best score ending at (i, j): stay on token i, or advance from token i - 1
        from_previous = F.pad(best[:, :-1], (1, 0), value=neg)
        torch.gt(from_previous, best, out=advanced[j])
        best = value[j] + torch.maximum(best, from_previous)
    # backtrack from the last token at the last frame of every utterance
    advanced = advanced.cpu().numpy()
    x_lengths, y_lengths = mask[:, :, 0].sum(1).tolist(), mask[:, 0, :].sum(1).tolist()
    path = np.zeros((B, Tx, Ty), dtype=np.float32)
    for b in range(B):
        index = x_lengths[b] - 1
        for j in range(y_lengths[b] - 1, -1, -1):
            path[b, index, j] = 1.0
            if index != 0 and (index == j or advanced[j, b, index]):
                index -= 1
    return torch.from_numpy(path).to(device=device, dtype=log_likelihood.dtype)


def maximum_path_reference(log_likelihood, mask):
    """Plain-loop MAS for one batch, a transcription of Glow-TTS's Cython maximum_path_c.
    The reference the vectorised version is tested and benchmarked against."""
    B = log_likelihood.shape[0]
    path = torch.zeros_like(log_likelihood)
    for b in range(B):
        t_x, t_y = int(mask[b, :, 0].sum()), int(mask[b, 0, :].sum())
        value = log_likelihood[b, :t_x, :t_y].tolist()
        for y in range(t_y):
            for x in range(max(0, t_x + y - t_y), min(t_x, y + 1)):
                v_cur = -1e9 if x == y else value[x][y - 1]
                if x == 0:
                    v_prev = 0.0 if y == 0 else -1e9
                else:
                    v_prev = value[x - 1][y - 1]
                value[x][y] += max(v_prev, v_cur)
        index = t_x - 1
        for y in range(t_y - 1, -1, -1):
            path[b, index, y] = 1
            if index != 0 and (index == y or value[index][y - 1] < value[index - 1][y - 1]):
                index -= 1
    return path


def log_beta_binomial_prior(x_lengths, y_lengths, max_tokens, max_frames):
    """(B, Tx, Ty) log P(token i | frame j) of the static alignment prior of RAD-TTS (Badlani et al. 2021,
    "One TTS Alignment To Rule Them All"): the token of frame j of an utterance of Ty_b frames and Tx_b
    tokens is BetaBinomial(Tx_b - 1, j + 1, Ty_b - j), a band around the diagonal that widens in the
    middle. Zero outside each utterance."""
    n = (x_lengths - 1).double()[:, None, None]
    frames = y_lengths.double()[:, None, None]
    k = torch.arange(max_tokens, device=x_lengths.device, dtype=torch.float64)[None, :, None]
    j = torch.arange(max_frames, device=x_lengths.device, dtype=torch.float64)[None, None, :]
    inside = (k <= n) & (j < frames)
    a, b = j + 1, (frames - j).clamp(min=1)
    rest = (n - k).clamp(min=0)

    def log_beta(p, q):
        return torch.lgamma(p) + torch.lgamma(q) - torch.lgamma(p + q)

    log_choose = torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(rest + 1)
    return torch.where(inside, log_choose + log_beta(k + a, rest + b) - log_beta(a, b), 0.0).float()


def gaussian_log_likelihood(mu, y):
    """(B, Tx, Ty) log N(y_j; mu_i, I) up to a constant: -0.5 |y_j - mu_i|^2, expanded into matrix products.
    mu (B, n_mels, Tx), y (B, n_mels, Ty)."""
    return -0.5 * (mu ** 2).sum(1)[:, :, None] + mu.transpose(1, 2) @ y - 0.5 * (y ** 2).sum(1)[:, None, :]


def durations_to_path(durations, mask):
    """Integer durations (B, Tx) -> 0/1 alignment (B, Tx, Ty): token i covers the frames
    [sum(d[:i]), sum(d[:i+1])). mask (B, Tx, Ty)."""
    ends = torch.cumsum(durations, dim=1)
    frame = torch.arange(mask.shape[2], device=durations.device)[None, None, :]
    starts = ends - durations
    return ((frame >= starts[:, :, None]) & (frame < ends[:, :, None])).to(mask.dtype) * mask

# -----------------------------------------------------------------------------
# text encoder: embedding, conv prenet, transformer layers with RoPE, mu projection


class ChannelLayerNorm(nn.Module):
    """LayerNorm over channels of a (B, C, T) tensor."""

    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def text_rope(x):
    """Rotary position embedding over the time axis of (B, H, T, D) queries or keys."""
    T, D = x.shape[2], x.shape[3]
    freqs = 10000.0 ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


@torch.compiler.disable  # compiled, its backward fixes the length (torch 2.11): a compile per length
def attention(q, k, v, keep, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)


class SequenceSelfAttention(nn.Module):
    """Bidirectional multi-head self-attention over (B, C, T) with a key padding mask."""

    def __init__(self, channels, n_heads, dropout):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.proj = nn.Conv1d(channels, channels, 1)

    def forward(self, x, mask):
        B, C, T = x.shape
        q, k, v = self.qkv(x).view(B, 3, self.n_heads, C // self.n_heads, T).transpose(3, 4).unbind(1)
        q, k = text_rope(q), text_rope(k)
        keep = mask.bool()[:, None, :, :]  # (B, 1, 1, T): padded keys get no attention
        y = attention(q, k, v, keep, self.dropout if self.training else 0.0)
        return self.proj(y.transpose(2, 3).reshape(B, C, T))


class TextEncoderLayer(nn.Module):
    """Post-norm transformer layer (as Glow-TTS/Matcha) with a convolutional feed-forward."""

    def __init__(self, channels, n_heads, ff_channels, kernel, dropout):
        super().__init__()
        self.attn = SequenceSelfAttention(channels, n_heads, dropout)
        self.norm1, self.norm2 = ChannelLayerNorm(channels), ChannelLayerNorm(channels)
        self.ff1 = nn.Conv1d(channels, ff_channels, kernel, padding=kernel // 2)
        self.ff2 = nn.Conv1d(ff_channels, channels, kernel, padding=kernel // 2)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = self.norm1(x + self.drop(self.attn(x, mask)))
        h = self.drop(torch.relu(self.ff1(x * mask)))
        return self.norm2(x + self.drop(self.ff2(h * mask))) * mask


class TextEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.enc_channels
        self.embed = nn.Embedding(len(config.symbols) + 2, C)
        nn.init.normal_(self.embed.weight, 0.0, C ** -0.5)
        # conv prenet: local character context before attention
        self.prenet = nn.ModuleList(nn.Conv1d(C, C, 5, padding=2) for _ in range(3))
        self.prenet_norms = nn.ModuleList(ChannelLayerNorm(C) for _ in range(3))
        self.layers = nn.ModuleList(
            TextEncoderLayer(C, config.enc_heads, config.enc_ff_channels, config.enc_kernel, config.dropout)
            for _ in range(config.enc_layers))
        self.proj_mu = nn.Conv1d(C, config.n_mels, 1)
        self.drop = nn.Dropout(config.dropout)
        self.speaker = nn.Linear(config.spk_channels, C) if config.speakers else None

    def forward(self, x, x_mask, spk=None):
        """ids (B, Tx), mask (B, 1, Tx), voice vectors (B, spk_channels) of a multi-speaker model -> hidden
        (B, C, Tx), mu (B, n_mels, Tx). The voice is added to every token, so means and durations are its."""
        h = self.embed(x).transpose(1, 2) * math.sqrt(self.embed.embedding_dim) * x_mask
        if self.speaker is not None:
            h = h + self.speaker(spk)[:, :, None] * x_mask
        for conv, norm in zip(self.prenet, self.prenet_norms):
            h = h + self.drop(torch.relu(norm(conv(h * x_mask))))
        for layer in self.layers:
            h = layer(h, x_mask)
        return h, self.proj_mu(h) * x_mask


class DurationPredictor(nn.Module):
    """Log frames per token from the (detached) encoder output: two conv layers."""

    def __init__(self, in_channels, channels, dropout, kernel=3):
        super().__init__()
        self.conv1 = nn.Conv1d(in_channels, channels, kernel, padding=kernel // 2)
        self.conv2 = nn.Conv1d(channels, channels, kernel, padding=kernel // 2)
        self.norm1, self.norm2 = ChannelLayerNorm(channels), ChannelLayerNorm(channels)
        self.proj = nn.Conv1d(channels, 1, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, h, x_mask):
        h = self.drop(self.norm1(torch.relu(self.conv1(h * x_mask))))
        h = self.drop(self.norm2(torch.relu(self.conv2(h * x_mask))))
        return self.proj(h * x_mask) * x_mask

# -----------------------------------------------------------------------------
# flow-matching decoder: a 1D U-Net (two resolutions) over [x_t, mu], time-conditioned


def timestep_embedding(t, dim):
    """Sinusoidal embedding of flow time t in [0, 1] (scaled by 1000 as in diffusion models)."""
    freqs = torch.exp(-math.log(10000) * torch.arange(dim // 2, device=t.device) / (dim // 2 - 1))
    angles = 1000.0 * t[:, None].float() * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class UNetResBlock(nn.Module):
    """conv-GroupNorm-Mish twice, the time embedding added in between, residual 1x1."""

    def __init__(self, in_channels, channels, time_channels):
        super().__init__()
        self.conv1 = nn.Conv1d(in_channels, channels, 3, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, padding=1)
        self.norm1, self.norm2 = nn.GroupNorm(8, channels), nn.GroupNorm(8, channels)
        self.time = nn.Linear(time_channels, channels)
        self.skip = nn.Conv1d(in_channels, channels, 1) if in_channels != channels else nn.Identity()

    def forward(self, x, mask, t_emb):
        h = F.mish(self.norm1(self.conv1(x * mask)))
        h = h + self.time(t_emb)[:, :, None]
        h = F.mish(self.norm2(self.conv2(h * mask)))
        return (h + self.skip(x)) * mask


class UNetAttention(nn.Module):
    """Pre-norm self-attention + MLP over the bottleneck frames: long-range context (phrase
    level) that the convolutions' receptive field does not reach."""

    def __init__(self, channels, n_heads):
        super().__init__()
        self.norm1, self.norm2 = ChannelLayerNorm(channels), ChannelLayerNorm(channels)
        self.attn = SequenceSelfAttention(channels, n_heads, 0.0)
        self.mlp = nn.Sequential(nn.Conv1d(channels, 4 * channels, 1), nn.GELU(),
                                 nn.Conv1d(4 * channels, channels, 1))

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), mask)
        return (x + self.mlp(self.norm2(x))) * mask


class FlowMatchingDecoder(nn.Module):
    """Predicts the velocity v(x_t, t | mu) of the flow from noise to mel. Lengths must be even
    (one 2x downsampling); TTSModel pads to that."""

    def __init__(self, config):
        super().__init__()
        C, n_mels, n_blocks = config.dec_channels, config.n_mels, config.dec_blocks
        time_channels = 4 * C
        self.time_mlp = nn.Sequential(nn.Linear(C, time_channels), nn.Mish(),
                                      nn.Linear(time_channels, time_channels))
        self.down = nn.ModuleList(UNetResBlock(2 * n_mels if i == 0 else C, C, time_channels)
                                  for i in range(n_blocks))
        self.downsample = nn.Conv1d(C, C, 3, stride=2, padding=1)
        self.mid = nn.ModuleList(UNetResBlock(C, C, time_channels) for _ in range(n_blocks))
        self.mid_attn = UNetAttention(C, config.dec_heads) if config.dec_heads else None
        self.upsample = nn.ConvTranspose1d(C, C, 4, stride=2, padding=1)
        self.up = nn.ModuleList(UNetResBlock(2 * C if i == 0 else C, C, time_channels)
                                for i in range(n_blocks))
        self.out = nn.Conv1d(C, n_mels, 1)
        nn.init.zeros_(self.out.weight)  # start by predicting zero velocity
        nn.init.zeros_(self.out.bias)
        self.embed_dim = C
        self.speaker = nn.Linear(config.spk_channels, time_channels) if config.speakers else None

    def forward(self, x_t, mask, mu, t, spk=None):
        t_emb = self.time_mlp(timestep_embedding(t, self.embed_dim))
        if self.speaker is not None:  # the voice joins the time embedding that every block adds
            t_emb = t_emb + self.speaker(spk)
        h = torch.cat([x_t, mu], dim=1)
        for block in self.down:
            h = block(h, mask, t_emb)
        skip = h
        half_mask = mask[:, :, ::2]
        h = self.downsample(h * mask) * half_mask
        for block in self.mid:
            h = block(h, half_mask, t_emb)
        if self.mid_attn is not None:
            h = self.mid_attn(h, half_mask)
        h = self.upsample(h * half_mask) * mask
        h = torch.cat([h, skip], dim=1)
        for block in self.up:
            h = block(h, mask, t_emb)
        return self.out(h) * mask


class VoiceEncoder(nn.Module):
    """A clip of speech (normalised mel) -> a voice vector: three convolutions over time, a mean over the clip's
    frames, a projection. Trained to give each training speaker's learned vector from any utterance of theirs,
    so a clip of another voice lands among the voices the model knows."""

    def __init__(self, config, channels=128):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(config.n_mels if i == 0 else channels, channels, 5, padding=2)
                                   for i in range(3))
        self.proj = nn.Linear(channels, config.spk_channels)

    def forward(self, mel, mask):
        h = mel
        for conv in self.convs:
            h = torch.relu(conv(h * mask))
        return self.proj((h * mask).sum(2) / mask.sum(2).clamp(min=1))


class TTSModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = TextEncoder(config)
        self.duration_predictor = DurationPredictor(config.enc_channels, config.dp_channels, config.dropout)
        self.decoder = FlowMatchingDecoder(config)
        # a learned vector per voice (Matcha-TTS's n_spks), conditioning encoder, durations and decoder
        self.speaker_embed = nn.Embedding(len(config.speakers), config.spk_channels) if config.speakers else None
        self.voice_encoder = VoiceEncoder(config) if config.voice_clips else None
        # log-mel normalisation of the training data; travels with the weights
        self.register_buffer('mel_mean', torch.tensor(0.0))
        self.register_buffer('mel_std', torch.tensor(1.0))

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())

    def configure_optimizers(self, weight_decay, learning_rate, betas, decoder_lr_scale, device_type):
        """AdamW; the decoder's groups run at decoder_lr_scale times the lr (scheduler.set_lr reads lr_scale),
        and norms and biases get no weight decay."""
        decoder_params = set(self.decoder.parameters())
        param_groups = []
        for params, lr_scale in (([p for p in self.parameters() if p not in decoder_params], 1.0),
                                 (list(self.decoder.parameters()), decoder_lr_scale)):
            param_groups += [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay,
                                  lr_scale=lr_scale),
                             dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0, lr_scale=lr_scale)]
        return torch.optim.AdamW(param_groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')

    def voice(self, speakers):
        """Speaker indices (B,) -> voice vectors (B, spk_channels); None for a one-voice model."""
        return self.speaker_embed(speakers) if self.speaker_embed is not None else None

    def encode(self, x, x_lengths, spk=None):
        x_mask = sequence_mask(x_lengths, x.shape[1])[:, None, :].float()
        h, mu_x = self.encoder(x, x_mask, spk)
        # durations are predicted from the detached encoder
        # output: their loss does not shape the encoder
        log_durations = self.duration_predictor(h.detach(), x_mask)
        return mu_x, log_durations, x_mask

    def align(self, mu_x, x_mask, y, y_mask, prior_weight=0.0):
        """MAS path (B, Tx, Ty) maximising the likelihood of y under N(mu_x[token], I), plus prior_weight
        times the log of the diagonal alignment prior (log_beta_binomial_prior) when it is > 0."""
        # in float32 even under autocast: the path depends on small differences of large sums
        with torch.no_grad(), torch.autocast(mu_x.device.type, enabled=False):
            mu, target = mu_x.float(), y.float()
            log_likelihood = gaussian_log_likelihood(mu, target)
            if prior_weight > 0:
                x_lengths, y_lengths = x_mask.sum((1, 2)).long(), y_mask.sum((1, 2)).long()
                log_likelihood += prior_weight * log_beta_binomial_prior(x_lengths, y_lengths, mu.shape[2],
                                                                         target.shape[2])
            mask = (x_mask.transpose(1, 2) * y_mask).bool()
            return monotonic_alignment_search(log_likelihood, mask)

    def forward(self, x, x_lengths, y, y_lengths, speakers=None, align_prior=0.0):
        """Training losses for a batch: ids (B, Tx), normalised mels (B, n_mels, Ty), speaker indices (B,)
        (ignored by a one-voice model). align_prior: weight of the diagonal alignment prior in MAS (train_tts.py
        fades it out over the first steps). Returns dict(prior, duration, flow) of per-batch means."""
        y = pad_to_even(y)
        spk = self.voice(speakers)
        mu_x, log_durations, x_mask = self.encode(x, x_lengths, spk)
        y_mask = sequence_mask(y_lengths, y.shape[2])[:, None, :].float()
        # Early on the encoder's mu are nearly alike, so plain MAS chooses among almost equal paths
        # by rounding: it gives most tokens one frame and a few tokens long stretches, and the
        # encoder can learn that path for good (the prior loss stalls, issue 18). The prior breaks
        # those near-ties towards the diagonal.
        path = self.align(mu_x, x_mask, y, y_mask, align_prior)
        durations = path.sum(2)[:, None, :]
        # (B, n_mels, Ty): each frame gets its token's mu
        mu_y = (mu_x.float() @ path).to(mu_x.dtype)
        # flow matching from noise to mel conditioned on mu_y (dropped for some utterances: CFG).
        # The condition is detached: the encoder learns from the prior loss alone. Letting the
        # decoder's gradient in too (as Matcha-TTS does) stalled the alignment in our short runs
        # (prior loss stuck at 1.05 after 300 steps on the espeak corpus, 1.02 detached).
        t = torch.rand(y.shape[0], device=y.device)
        x0 = torch.randn_like(y)
        x_t, target = flow_matching_path(x0, y, t, self.config.sigma_min)
        cond = mu_y.detach()
        if self.config.cfg_drop > 0:
            keep = (torch.rand(y.shape[0], device=y.device) >= self.config.cfg_drop).to(mu_y.dtype)
            cond = cond * keep[:, None, None]
        velocity = self.decoder(x_t, y_mask, cond, t, spk)
        losses = dict(prior=prior_loss(y, mu_y.float(), y_mask),
                      duration=duration_loss(log_durations.float(), durations, x_mask),
                      flow=flow_matching_loss(velocity.float(), target, y_mask))
        if self.voice_encoder is not None:  # the clip encoder learns the table's voices, which it leaves alone
            losses['voice'] = F.mse_loss(self.voice_encoder(y, y_mask).float(), spk.detach().float())
        return losses

    @torch.no_grad()
    def decode(self, mu_y, y_mask, spk=None, n_timesteps=10, temperature=1.0, guidance=0.0, generator=None):
        """Euler ODE from noise (scaled by temperature) at t=0 to a normalised mel at t=1, in the voice spk.
        With guidance w > 0: v = v(mu) + w (v(mu) - v(no condition)). The state stays float32 under
        autocast."""
        x = torch.randn(mu_y.shape, generator=generator, device=mu_y.device) * temperature
        dt = 1.0 / n_timesteps
        for i in range(n_timesteps):
            t = torch.full((x.shape[0],), i * dt, device=x.device)
            v = self.decoder(x, y_mask, mu_y, t, spk).float()
            if guidance:
                v = v + guidance * (v - self.decoder(x, y_mask, torch.zeros_like(mu_y), t, spk).float())
            x = x + dt * v
        return x * y_mask

    @torch.no_grad()
    def teacher_forced(self, x, x_lengths, y, y_lengths, speakers=None, **decode_args):
        """Decode with the ground-truth durations (MAS against the target mel)."""
        y = pad_to_even(y)
        spk = self.voice(speakers)
        mu_x, _, x_mask = self.encode(x, x_lengths, spk)
        y_mask = sequence_mask(y_lengths, y.shape[2])[:, None, :].float()
        mu_y = mu_x @ self.align(mu_x, x_mask, y, y_mask).to(mu_x.dtype)
        return self.decode(mu_y, y_mask, spk, **decode_args), y_mask

    @torch.no_grad()
    def infer(self, x, x_lengths, speakers=None, length_scale=1.0, voice=None, **decode_args):
        """ids -> (normalised mel (B, n_mels, Ty), mel lengths) with predicted durations, in the voices of
        speaker indices (B,) or of voice vectors (B, spk_channels) (a multi-speaker model); length_scale > 1
        speaks slower."""
        spk = voice if voice is not None else self.voice(speakers)
        mu_x, log_durations, x_mask = self.encode(x, x_lengths, spk)
        durations = torch.ceil(torch.exp(log_durations) * x_mask * length_scale)[:, 0].long()
        y_lengths = durations.sum(1).clamp(min=1)
        y_max = int(y_lengths.max()) + int(y_lengths.max()) % 2
        y_mask = sequence_mask(y_lengths, y_max)[:, None, :].float()
        path = durations_to_path(durations, (x_mask.transpose(1, 2) * y_mask)).to(mu_x.dtype)
        mu_y = mu_x @ path
        return self.decode(mu_y, y_mask, spk, **decode_args), y_lengths

    def denormalize(self, mel):
        return mel * self.mel_std + self.mel_mean



@torch.no_grad()
def speaker_index(config, speaker):
    """A multi-speaker model's index of the voice named speaker (None for a one-voice model, which has none)."""
    if not config.speakers:
        if speaker:
            raise UserError(f"speaker={speaker!r}: this model knows one voice (it was trained without "
                            f"multi_speaker); leave speaker out.")
        return None
    if speaker not in config.speakers:
        names = ', '.join(config.speakers[:20]) + (f", ... ({len(config.speakers)} in all)"
                                                   if len(config.speakers) > 20 else '')
        raise UserError(f"speaker={speaker!r}: " + ("give " if not speaker else "not one of ")
                        + f"the model's voices: {names}. Pick one with --speaker=NAME.")
    return config.speakers.index(speaker)


@torch.no_grad()
def clip_voice(model, audio):
    """A clip of speech (1-D waveform at MEL_SETTINGS' rate) -> its voice vector (1, spk_channels), by the
    model's clip encoder."""
    if not model.config.speakers:  # no voice to pick by name either
        raise UserError("this model knows one voice (it was trained without multi_speaker), so it speaks in no "
                        "other: leave --voice_clip out, or train a multi-speaker model that learns voices from clips "
                        "(--multi_speaker=True --voice_clips=True, docs/tts.md).")
    if model.voice_encoder is None:
        raise UserError("this model has no clip encoder: train it with --multi_speaker=True --voice_clips=True, or "
                        "pick one of its voices with --speaker=NAME.")
    if len(audio) < MEL_SETTINGS['sample_rate'] // 4:
        raise UserError(f"the voice clip is {len(audio) / MEL_SETTINGS['sample_rate']:.2f} s long: give a few "
                        f"seconds of the voice's speech.")
    mel = (MelExtractor(**MEL_SETTINGS)(audio.float().cpu()) - model.mel_mean.cpu()) / model.mel_std.cpu()
    mel = mel[None].to(model.mel_mean.device)
    return model.voice_encoder(mel, torch.ones_like(mel[:, :1]))


def synthesize(model, text, n_timesteps=10, temperature=0.667, length_scale=1.0, guidance=0.0,
               seed=0, vocode=None, speaker='', voice=None):
    """text -> (waveform (float32, 1D, in [-1, 1] roughly), log-mel (n_mels, T)) at
    MEL_SETTINGS['sample_rate'] Hz, with a model in eval mode, in the voice named speaker (a multi-speaker
    model's) or the voice vector voice (clip_voice's), through vocode (tts/vocoder.py's load_vocoder; None =
    Griffin-Lim). A model that reads phonemes gets the text's (IPA given is read as it is). Characters outside
    the model's vocabulary are skipped (with a note on stderr)."""
    config = model.config
    index = speaker_index(config, speaker) if voice is None else None
    given = text
    if (config.text_frontend == 'phonemes' or reads_phonemes(config.symbols)) and not IPA_MARKS & set(text):
        text = phonemize(text)
    ids, unknown = encode_text(text, config.symbols, config.add_blank)
    if unknown:
        print(f"note: skipped characters the model was not trained on: {''.join(unknown)!r}", file=sys.stderr)
    if not ''.join(config.symbols[i - 2] for i in ids if i != BLANK_ID).strip():  # spaces alone say nothing
        raise UserError(f"nothing to say in {given!r}" + (f" (its phonemes: {text!r})" if text != given else '')
                        + f": none of its characters but spaces are in the model's vocabulary {config.symbols!r}")
    device = model.mel_mean.device
    x = torch.tensor([ids], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    speakers = torch.tensor([index], device=device) if index is not None else None
    mel, lengths = model.infer(x, torch.tensor([len(ids)], device=device), speakers, length_scale, voice,
                               n_timesteps=n_timesteps, temperature=temperature, guidance=guidance,
                               generator=generator)
    log_mel = model.denormalize(mel[0, :, :lengths[0]]).float().cpu()
    return (vocode or MelExtractor(**MEL_SETTINGS).to_waveform)(log_mel), log_mel


def load_tts(ckpt, device='cpu'):
    """A TTSModel in eval mode from a train_tts.py checkpoint dict (ckpt['kind'] == 'tts')."""
    model = TTSModel(TTSConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    return model.eval().to(device)
