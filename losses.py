"""
The language model's loss functions, as plain functions of tensors: token-weighted cross-entropy,
z-loss and loss weighting (train.py), and preference optimization (DPO, train_dpo.py). The
text-to-speech losses are in tts/losses.py.
"""
import math

import torch
import torch.nn.functional as F

from configurator import UserError

# -----------------------------------------------------------------------------
# language modelling (train.py): token-weighted cross-entropy and multi-objective weighting


def token_weight_table(vocab_size, groups, tokenizer):
    """Loss weight of every token id, (vocab_size,): 1 unless a group names the token. groups is
    {name: (weight, [token, ...])} where a token is an id or a text that encodes to exactly one token,
    e.g. {'reasoning': (1.5, ['because', 'therefore']), 'tool': (1.3, ['<tool>'])}."""
    table = torch.ones(vocab_size)
    owner = {}
    for name, group in groups.items():
        if not (isinstance(group, (tuple, list)) and len(group) == 2 and isinstance(group[0], (int, float))
                and math.isfinite(group[0]) and group[0] >= 0 and isinstance(group[1], (tuple, list))):
            raise UserError(f"token_weights[{name!r}] = {group!r}: each group must be (weight, [token, ...]) with a "
                            f"finite weight >= 0, e.g. {{'reasoning': (1.5, ['because', 'therefore'])}}.")
        weight, tokens = group
        for token in tokens:
            try:
                ids = [token] if isinstance(token, int) else tokenizer.encode(token)
            except UserError as e:
                raise UserError(f"token_weights[{name!r}]: {token!r}: {e}") from None
            if len(ids) != 1 or not 0 <= ids[0] < vocab_size:
                raise UserError(f"token_weights[{name!r}]: {token!r} is not one token of this tokenizer (it encodes "
                                f"to {ids}); list a token id or a text that is a single token, e.g. each piece.")
            if ids[0] in owner and owner[ids[0]] != name:
                raise UserError(f"token_weights: token {token!r} (id {ids[0]}) is in both {owner[ids[0]]!r} and "
                                f"{name!r}; give each token one weight.")
            owner[ids[0]] = name
            table[ids[0]] = weight
    return table


def target_weights(targets, weight_table=None, ignore_index=-100):
    """Per-position loss weights (B, T): weight_table[target], 1 without a table, 0 where ignored."""
    keep = targets != ignore_index
    if weight_table is None:
        return keep.float()
    return torch.where(keep, weight_table[targets.clamp(min=0)], 0.0)


def weighted_cross_entropy(logits, targets, weight_table=None, normalizer=None, ignore_index=-100):
    """sum(w * CE) / normalizer with w = target_weights(targets, weight_table). normalizer defaults to
    sum(w), the weighted mean; without a table that is exactly F.cross_entropy's mean. For gradient
    accumulation and DDP pass the total weight of the whole global batch (all micro-batches, all
    ranks): the micro-batch losses then add up to the global batch's weighted mean, however it is split."""
    w = target_weights(targets, weight_table, ignore_index)
    per_token = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
                                reduction='none')
    return (per_token * w.flatten()).sum() / (w.sum() if normalizer is None else normalizer)


def z_loss(logits, targets, normalizer=None, ignore_index=-100):
    """PaLM's auxiliary loss log(Z)^2 (Z = sum of exp(logits)): keeps the softmax normalizer near 1 and
    the logits from drifting. Every labelled position counts alike (token weights are about which
    predictions matter, not about the normalizer): sum over positions with a target / normalizer,
    by default their number (the mean). For gradient accumulation and DDP pass the number of labelled
    positions of the whole global batch, as weighted_cross_entropy takes its total weight."""
    keep = targets != ignore_index
    squared = torch.logsumexp(logits.float(), dim=-1).square()
    return squared[keep].sum() / (keep.sum() if normalizer is None else normalizer)


def check_loss_weights(weights, terms=('ce', 'z_loss')):
    """A UserError unless weights ({term: weight}) names only known terms, with finite weights >= 0, one positive."""
    if set(weights) - set(terms):
        raise UserError(f"loss_weights has unknown terms {sorted(set(weights) - set(terms))}; the loss terms "
                        f"are 'ce' (cross-entropy) and 'z_loss', e.g. loss_weights={{'ce': 1.0, 'z_loss': 1e-4}}.")
    if not all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in weights.values()) \
            or not any(weights.values()):
        raise UserError(f"loss_weights={weights}: weights must be finite numbers >= 0, and one of them positive, "
                        f"e.g. {{'ce': 1.0, 'z_loss': 1e-4}}.")


def combine_losses(terms, weights):
    """Multi-objective loss: sum of weights[name] * terms[name] over the named loss terms (tensors).
    Every term needs a weight, so a misspelt name is an error instead of a silently dropped term.
    The caller logs the terms separately."""
    missing = sorted(set(terms) - set(weights))
    if missing:
        raise UserError(f"loss terms {', '.join(missing)} have no weight in {weights}; add them, e.g. "
                        f"{{{', '.join(f'{t!r}: 1.0' for t in terms)}}}.")
    return sum(weights[name] * value for name, value in terms.items())


# -----------------------------------------------------------------------------
# preference optimization (train_dpo.py)

DPO_LOSS_TYPES = ('sigmoid', 'robust', 'ipo', 'hinge')


def sequence_logps(logits, targets, seq, n_sequences):
    """Per-sequence sums of log p(target token), in fp32. logits (N, V) and targets (N,) are the
    completion positions only; seq (N,) says which of n_sequences sequences each belongs to.
    Returns (sums (n_sequences,), per-token log-probs (N,))."""
    token_logps = -F.cross_entropy(logits.float(), targets, reduction='none')
    return torch.zeros(n_sequences, device=logits.device).index_add(0, seq, token_logps), token_logps


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, loss_type='sigmoid',
             label_smoothing=0.0):
    """Per-pair preference losses and implicit rewards beta * (log pi - log pi_ref) of each completion.
    With h = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected)) and eps the
    label smoothing (the probability that a label is flipped):
      sigmoid  DPO (Rafailov et al. 2023): -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
               (eps > 0: conservative DPO)
      robust   rDPO (Chowdhury et al. 2024), unbiased under flip noise eps:
               (-(1-eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)
      ipo      IPO (Azar et al. 2023): (h - 1/(2 beta))^2; pass per-token mean log-probs for the
               length-normalised form
      hinge    SLiC (Zhao et al. 2023): max(0, 1 - beta h)
    Reference-free DPO passes zeros as the reference log-probs."""
    h = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == 'sigmoid':
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == 'robust':
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) \
            / (1 - 2 * label_smoothing)
    elif loss_type == 'ipo':
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == 'hinge':
        losses = torch.relu(1 - beta * h)
    else:
        raise UserError(f"loss_type={loss_type!r} is not supported; use one of {', '.join(DPO_LOSS_TYPES)}.")
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards
