"""
The language model's loss functions, as plain functions of tensors: token-weighted cross-entropy,
z-loss and loss weighting (train.py), and preference optimization (DPO, train_dpo.py). The
text-to-speech losses are in tts/losses.py.
"""
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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
            if isinstance(token, int) and not 0 <= token < vocab_size:
                raise UserError(f"token_weights[{name!r}]: {token} is no token id of this model (its ids are 0 to "
                                f"{vocab_size - 1}); list a token id in that range or a text that is a single token.")
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


def linear_cross_entropy(h, weight, targets, ce_weights, z_weights=None, softcap=0.0, chunk_logits=None,
                         values=False):
    """(sum(ce_weights * CE), sum(z_weights * logsumexp^2)) of logits = softcap(h @ weight.T), the second None
    without z_weights: weighted_cross_entropy's and z_loss's terms, their normalizers folded into the
    per-position weights. h (N, C), targets (N,) (IGNORE_INDEX: no loss there), weights (N,). The logits are
    computed chunk_logits at a time (CHUNK_LOGITS), never all (N, V), and each chunk's gradient while they exist
    (LinearCrossEntropy): the output layer costs the plain path's three matmuls and holds no (N, V) buffer.
    values=True adds each position's CE and logsumexp^2 (N,) (the latter None without z_weights), detached."""
    rows = max(1, (chunk_logits or CHUNK_LOGITS) // weight.size(0))  # a chunk's
    n_chunks = max(1, -(-h.size(0) // rows))
    grads = (h.requires_grad, weight.requires_grad) if torch.is_grad_enabled() else (False, False)
    ce, z, ce_rows, z_rows = LinearCrossEntropy.apply(h, weight, targets, ce_weights, z_weights, softcap, n_chunks,
                                                      grads)
    terms = ce, (z if z_weights is not None else None)
    return (*terms, (ce_rows, z_rows if z_weights is not None else None)) if values else terms


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
        ce_rows, lse_rows, h_grads, weight_grads = [], [], ([], []), ([], [])  # per chunk: the ce term's, the z's
        for hc, tc, ac, bc in zip(h.tensor_split(n_chunks), safe_targets[:, None].tensor_split(n_chunks),
                                  a.tensor_split(n_chunks), (a if b is None else b).tensor_split(n_chunks)):
            logits = F.linear(hc.to(dtype), w).to(exact)
            if softcap:
                capped = torch.tanh(logits / softcap)
                logits = softcap * capped
            # in place from here on (nothing else holds these): eagerly, a chunk's (R, V) buffers are two or three
            logp = torch.log_softmax(logits, dim=-1)
            ce_rows.append(-logp.gather(1, tc).squeeze(1))
            ce = ce + (ac * ce_rows[-1]).sum()
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
            # P - onehot(target) (times the slope at the target)
            if torch.compiler.is_compiling():  # one expression, fused into the pass that writes d: no float32 P
                at_target = torch.arange(p.size(1), device=p.device) == tc
                p = torch.where(at_target, p - (slope if softcap else 1.0), p)
            else:  # in place of P
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
        # each position's values, for the logs (no gradient)
        ce_rows = torch.cat(ce_rows) if ce_rows else a.new_zeros(0)
        z_rows = torch.cat(lse_rows).square() if lse_rows else a.new_zeros(0)
        ctx.mark_non_differentiable(ce_rows, z_rows)
        return ce, z, ce_rows, z_rows

    @staticmethod
    def backward(ctx, g_ce, g_z, _ce_rows, _z_rows):
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


def cross_entropy(logits, targets):
    """Each position's cross-entropy -log p(target), (N,): logits (N, V), targets (N,)."""
    return F.cross_entropy(logits, targets, reduction='none')


def log_z_squared(logits, targets):
    """Each position's z-loss log(Z)^2 (PaLM's; Z = sum of exp(logits)), (N,)."""
    return torch.logsumexp(logits, dim=-1).square()


# The loss terms train.py's step adds up, by their loss_weights name: (values, weighted). values(logits (N, V), in
# float32 or wider, targets (N,)) is the term at each labelled position, (N,); the step's term is their mean over the whole global
# batch, each position counted by its loss weight (weighted: its token's weight in token_weights times its source's in
# sft_data) or all alike (the z-loss: it is about the softmax normalizer, not about which predictions matter). A new
# term is a function and an entry here, and its weight in loss_weights: the check, the step and the logs (train_<name>)
# take it from here (docs/configuration.md). Every term is a sum over positions, so head_loss_terms adds up values()
# chunk by chunk of positions and never holds all the logits at once.
LOSS_TERMS = {'ce': (cross_entropy, True), 'z_loss': (log_z_squared, False)}
FUSED = ('ce', 'z_loss')  # the two linear_cross_entropy computes without their logits (the others: through them)


def term_weights(weights, totals, loss_weights):
    """{name: each position's weight in the term} of the terms loss_weights weighs (> 0): weights (2, ...), each
    position's loss weight and 1 (0 where unlabelled), over the total (totals (2, S): per source, summed over the whole
    global batch, all micro-batches and ranks) of the one the term counts by. A micro-batch's terms, sums of these
    times values, add up over micro-batches and ranks to the global batch's weighted means however it is split."""
    # a batch whose labelled tokens all weigh 0 (token_weights) is a term of 0, not 0 / 0
    return {name: weights[0 if weighted else 1] / totals[0 if weighted else 1].sum().clamp(min=1e-30)
            for name, (_, weighted) in LOSS_TERMS.items() if loss_weights.get(name)}


def source_shares(terms, weights, sources, totals):
    """{name: (S,)} each source's share of its own mean of each term (0 for a source not in the batch; the shares add
    up over micro-batches and ranks as the terms do), for the logs: terms {name: (sum, values (N,))} as
    head_loss_terms gives them, weights (2, N) and sources (N,) at the same positions, totals as term_weights'."""
    shares = {}
    for name, (_, values) in terms.items():
        k = 0 if LOSS_TERMS[name][1] else 1
        weighted = (values * weights[k]).to(totals.dtype)
        shares[name] = torch.zeros_like(totals[k]).index_add_(0, sources, weighted) / totals[k].clamp(min=1e-30)
    return shares


def head_loss_terms(h, targets, weights, logits, vocab_size, head_weight=None, softcap=0.0):
    """{name: (sum(weights[name] * values), values (N,) detached)} of the LOSS_TERMS named in weights ({name: (N,)
    each position's weight}) at hidden states h (N, C) and targets (N,) (IGNORE_INDEX: no loss there). 'ce' and
    'z_loss' of a plain output matrix (head_weight, its soft cap softcap) go through linear_cross_entropy; any other
    term, and every term of a head that is no plain matrix, through logits(h) (model.py's output layer) one chunk of
    CHUNK_LOGITS logits at a time, each chunk's logits recomputed for the backward (torch.utils.checkpoint) rather
    than kept: no term ever holds (N, V) logits."""
    keep = targets != IGNORE_INDEX
    terms = {}
    if head_weight is not None and any(name in weights for name in FUSED):
        no_ce = torch.zeros_like(targets, dtype=h.dtype)  # the ce term is computed anyway
        ce, z, (ce_values, z_values) = linear_cross_entropy(h, head_weight, targets, weights.get('ce', no_ce),
                                                            weights.get('z_loss'), softcap, values=True)
        terms.update({name: (term, torch.where(keep, values, 0.0)) for name, term, values
                      in (('ce', ce, ce_values), ('z_loss', z, z_values)) if name in weights})
    rest = [name for name in weights if name not in terms]
    if not rest:
        return terms

    def chunk_values(hc, tc):  # (len(rest), R): each term's values at a chunk of positions
        chunk_logits = logits(hc)
        chunk_logits = chunk_logits.to(torch.promote_types(chunk_logits.dtype, torch.float32))
        return torch.stack([LOSS_TERMS[name][0](chunk_logits, tc) for name in rest])

    rows = max(1, CHUNK_LOGITS // vocab_size)
    recompute = torch.is_grad_enabled() and h.requires_grad
    values = torch.cat([checkpoint(chunk_values, hc, tc, use_reentrant=False) if recompute else chunk_values(hc, tc)
                        for hc, tc in zip(h.split(rows), targets.split(rows))], dim=1)
    values = torch.where(keep, values, 0.0)  # whatever a term says where there is no label
    for name, v in zip(rest, values):
        terms[name] = (torch.where(keep, weights[name], 0.0) * v).sum(), v.detach()
    return terms


def check_loss_weights(weights, terms=None):
    """A UserError unless weights ({term: weight}) names only known terms (terms, by default LOSS_TERMS'), with
    finite weights >= 0, one positive."""
    terms = LOSS_TERMS if terms is None else terms
    if set(weights) - set(terms):
        raise UserError(f"loss_weights has unknown terms {sorted(set(weights) - set(terms))}; the loss terms "
                        f"are {', '.join(map(repr, terms))} (losses.LOSS_TERMS), e.g. loss_weights={{'ce': 1.0, "
                        f"'z_loss': 1e-4}}.")
    if 'ce' in terms and 'ce' not in weights:  # a term left out weighs 0: no language modelling, unless said
        raise UserError(f"loss_weights={weights} has no 'ce' (cross-entropy): a term left out weighs 0, so the "
                        f"model would not learn its data. Add 'ce': 1.0 (or 'ce': 0.0 to train on the others alone).")
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
