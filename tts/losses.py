"""
The text-to-speech losses (train_tts.py), as plain functions of tensors: flow matching, the prior and
durations. Mels are (B, n_mels, T), masks (B, 1, T) with 1 on real frames. The evaluation metric,
MCD-DTW, is in tts/eval.py.
"""
import math

import torch



def flow_matching_path(x0, x1, t, sigma_min=1e-4):
    """Conditional flow matching with the optimal-transport path (Lipman et al. 2023):
    x_t = (1 - (1 - sigma_min) t) x0 + t x1 moves noise x0 to data x1 along a straight line;
    its velocity, the regression target, is x1 - (1 - sigma_min) x0. t has shape (B,)."""
    t = t.view(-1, 1, 1)
    x_t = (1 - (1 - sigma_min) * t) * x0 + t * x1
    return x_t, x1 - (1 - sigma_min) * x0


def flow_matching_loss(velocity, target, mask):
    """MSE between predicted and target velocity over real frames only: both are masked, so
    padding contributes neither error nor count."""
    squared = (velocity * mask - target * mask) ** 2
    return squared.sum() / (mask.sum() * velocity.shape[1])


def prior_loss(y, mu_y, mask):
    """Negative log-likelihood of the mel y under N(mu_y, I) per value (Glow-TTS/Matcha prior):
    pulls the encoder's aligned output towards the target mel."""
    nll = 0.5 * ((y - mu_y) ** 2 + math.log(2 * math.pi))
    return (nll * mask).sum() / (mask.sum() * y.shape[1])


def duration_loss(log_durations_pred, durations, x_mask):
    """MSE on log durations (frames per text token) over real tokens; durations come from
    monotonic alignment search. log_durations_pred and durations are (B, 1, Tx)."""
    target = torch.log(1e-8 + durations) * x_mask
    return ((log_durations_pred - target) ** 2 * x_mask).sum() / x_mask.sum()
