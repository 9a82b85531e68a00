"""
Loss functions, as plain functions of tensors.
"""
import math

import torch
import torchaudio

# -----------------------------------------------------------------------------
# text-to-speech (train_tts.py). Mels are (B, n_mels, T), masks (B, 1, T) with 1 on real frames.


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


def dtw_mean_cost(cost):
    """Dynamic time warping over a (N, M) frame distance matrix with steps (1,0), (0,1), (1,1):
    the mean distance along the cheapest path from (0, 0) to (N-1, M-1) (total cost / path
    length, ties broken towards the shorter path)."""
    cost = cost.tolist()
    N, M = len(cost), len(cost[0])
    inf = float('inf')
    total = [[inf] * (M + 1) for _ in range(N + 1)]  # total[i][j]: best cost ending at frame pair (i-1, j-1)
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
