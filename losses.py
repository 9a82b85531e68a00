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


# -----------------------------------------------------------------------------
# the output layer and its loss in one, chunk by chunk of positions (model.py's forward with targets)

IGNORE_INDEX = -100
CHUNK_LOGITS = 2**27  # logits a chunk computes at once (512 MiB in float32): all the loss ever holds of them


def linear_cross_entropy(h, weight, targets, ce_weights, z_weights=None, softcap=0.0, chunk_logits=None):
    """(sum(ce_weights * CE), sum(z_weights * logsumexp^2)) of logits = softcap(h @ weight.T), the second None
    without z_weights: weighted_cross_entropy's and z_loss's terms, their normalizers folded into the
    per-position weights. h (N, C), targets (N,) (IGNORE_INDEX: no loss there), weights (N,). The logits are
    computed chunk_logits at a time (CHUNK_LOGITS), never all (N, V), and each chunk's gradient while they exist
    (LinearCrossEntropy): the output layer costs the plain path's three matmuls and holds no (N, V) buffer."""
    rows = max(1, (chunk_logits or CHUNK_LOGITS) // weight.size(0))  # a chunk's
    n_chunks = max(1, -(-h.size(0) // rows))
    grads = (h.requires_grad, weight.requires_grad) if torch.is_grad_enabled() else (False, False)
    ce, z = LinearCrossEntropy.apply(h, weight, targets, ce_weights, z_weights, softcap, n_chunks, grads)
    return ce, (z if z_weights is not None else None)


def cross_entropy_terms(logits, targets, ce_weights, z_weights=None):
    """linear_cross_entropy's two sums from logits (N, V) themselves (an output layer that is no plain matrix)."""
    keep = targets != IGNORE_INDEX
    logits = logits.float()
    ce = (torch.where(keep, ce_weights, 0.0) * F.cross_entropy(logits, targets, reduction='none')).sum()
    if z_weights is None:
        return ce, None
    return ce, (torch.where(keep, z_weights, 0.0) * torch.logsumexp(logits, dim=-1).square()).sum()


class LinearCrossEntropy(torch.autograd.Function):
    """linear_cross_entropy's two sums. Per chunk of rows, with P the softmax of the logits, a the CE weights
    and c = 2 * z_weights * logsumexp, the gradient of g_ce * ce + g_z * z in the logits is
    g_ce * a * (P - onehot(target)) + g_z * c * P (times the soft cap's slope 1 - tanh^2). The forward computes
    (P - onehot) @ weight and P @ weight (N, C), and (a * (P - onehot)).T @ h and (c * P).T @ h (V, C), while
    the chunk's logits exist; the backward only scales them by g_ce and g_z. So each matmul of the plain path
    runs once, on the same operands rounded to the same dtype (autocast's), and nothing is recomputed (Liger's
    fused linear cross-entropy does the same in Triton). The z-loss doubles the gradient matmuls."""

    @staticmethod
    def forward(ctx, h, weight, targets, ce_weights, z_weights, softcap, n_chunks, grads):
        autocast = torch.is_autocast_enabled(h.device.type)
        dtype = torch.get_autocast_dtype(h.device.type) if autocast else weight.dtype  # the matmuls'
        exact = torch.promote_types(dtype, torch.float32)  # the softmax's and the sums'
        keep = targets != IGNORE_INDEX
        a = torch.where(keep, ce_weights, 0.0).to(exact)
        b = None if z_weights is None else torch.where(keep, z_weights, 0.0).to(exact)
        w = weight.to(dtype)  # once, not once a chunk
        safe_targets = targets.clamp(min=0)
        ce = z = torch.zeros((), device=h.device, dtype=exact)
        lse_rows, h_grads, weight_grads = [], ([], []), ([], [])  # per chunk: the ce term's, the z term's
        for hc, tc, ac, bc in zip(h.tensor_split(n_chunks), safe_targets[:, None].tensor_split(n_chunks),
                                  a.tensor_split(n_chunks), (a if b is None else b).tensor_split(n_chunks)):
            logits = F.linear(hc.to(dtype), w).to(exact)
            if softcap:
                capped = torch.tanh(logits / softcap)
                logits = softcap * capped
            # in place from here on (nothing else holds these): eagerly, a chunk's (R, V) buffers are two or three
            logp = torch.log_softmax(logits, dim=-1)
            ce = ce - (ac * logp.gather(1, tc).squeeze(1)).sum()
            if b is not None:
                lse = torch.logsumexp(logits, dim=-1)
                z = z + (bc * lse.square()).sum()
                lse_rows.append(lse)
            if not any(grads):
                continue
            p = logp.exp_()
            if softcap:  # the cap's slope, 1 - tanh^2
                slope = capped.square_().neg_().add_(1)
                p.mul_(slope)
            # each term's gradient in the logits without its per-row weights (a, c), which scale h instead (the
            # weight's gradient) or the result (h's, in the backward): (R, C) products, not (R, V)
            if b is not None:  # the z term's first: it is P itself
                d = p.to(dtype)
                if grads[0]:
                    h_grads[1].append(d @ w)
                if grads[1]:
                    weight_grads[1].append(d.t() @ (hc * (2 * bc * lse)[:, None]).to(dtype))
            # P - onehot(target) (times the slope at the target), in place of P
            p.scatter_add_(1, tc, -(slope.gather(1, tc) if softcap else torch.ones_like(tc, dtype=p.dtype)))
            d = p.to(dtype)
            if grads[0]:
                h_grads[0].append(d @ w)
            if grads[1]:
                weight_grads[0].append(d.t() @ (hc * ac[:, None]).to(dtype))
        if any(grads):
            c = 2 * b * torch.cat(lse_rows) if b is not None else None
            # the chunks' weight gradients summed in float32 at the end: compiled, one pass over them all
            ctx.save_for_backward(a, c, *(torch.cat(g) if g else None for g in h_grads),
                                  *(sum(g.to(exact) for g in parts) if parts else None for parts in weight_grads))
            ctx.h_dtype, ctx.weight_dtype = h.dtype, weight.dtype
        return ce, z

    @staticmethod
    def backward(ctx, g_ce, g_z):
        a, c, h_ce, h_z, weight_ce, weight_z = ctx.saved_tensors
        grad_h = grad_weight = None
        if h_ce is not None:
            grad_h = (g_ce * a)[:, None] * h_ce.to(a.dtype)
            if h_z is not None:
                grad_h = grad_h + (g_z * c)[:, None] * h_z.to(a.dtype)
            grad_h = grad_h.to(ctx.h_dtype)
        if weight_ce is not None:
            grad_weight = g_ce * weight_ce if weight_z is None else g_ce * weight_ce + g_z * weight_z
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_h, grad_weight, None, None, None, None, None, None


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
