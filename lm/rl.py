"""
The maths of online RL with verifiable rewards (train_rl.py), the GRPO family as TRL's GRPOTrainer names it:
group-relative advantages, the clipped per-token policy-gradient loss with the k3 KL penalty, and the three
ways of normalising its sum (loss_type); and the rollouts laid out as training micro-batches. Completion
tokens are flattened: token j belongs to sequence owners[j], so a micro-batch is N tokens of n sequences,
without padding. Formulas: docs/rl.md.
"""
import torch

LOSS_TYPES = ('grpo', 'dapo', 'dr_grpo')
SCALE_REWARDS = ('group', 'batch', 'none')
STD_EPS = 1e-4  # TRL's: a group of equal rewards has advantage 0, not 0/0


def group_advantages(rewards, group_size, scale_rewards):
    """Advantages (n,) of rewards (n,), n = prompts * G, each prompt's G completions consecutive:
        A_i = (r_i - mean_g(r)) / (std + 1e-4)
    mean_g over the completion's group (its prompt's G); std the group's ('group', GRPO), the whole batch's
    ('batch', as Dr. GRPO / LitePPO advise against the group's bias) or 1 with no 1e-4 ('none', Dr. GRPO).
    std is the unbiased (Bessel's) standard deviation, as torch.std and TRL; G must be at least 2."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).flatten()
    if scale_rewards == 'none':
        return centred
    std = groups.std(1).repeat_interleave(group_size) if scale_rewards == 'group' else rewards.std()
    return centred / (std + STD_EPS)


def clipped_token_loss(logps, old_logps, advantages, epsilon, epsilon_high):
    """Per-token PPO-clipped policy-gradient loss and where the clip is active (both (N,)):
        r = exp(logp - logp_old),  loss = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
    advantages: each token's sequence's A. With old_logps = logps.detach() (one iteration per batch) r = 1
    and the gradient is the plain policy gradient -A grad logp."""
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    unclipped, clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.min(unclipped, clipped), (clipped < unclipped).detach()


def k3_kl(logps, ref_logps):
    """Per-token k3 estimate of KL(policy || reference) (Schulman 2020), >= 0, unbiased under the policy's samples:
        kl = exp(ref_logp - logp) - (ref_logp - logp) - 1"""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def normalized_loss(token_loss, owners, lengths, loss_type, totals):
    """The batch loss's share of one micro-batch of one rank: its token losses (N,) summed with the weights of
    loss_type, so that the shares of all micro-batches and ranks add up to the loss of the whole batch:
        grpo     sum_i (1/|o_i|) sum_t l_it / S       (each sequence's mean, then the mean over sequences)
        dapo     sum_i sum_t l_it / T                 (token level over the global batch)
        dr_grpo  sum_i sum_t l_it / (S * max_new_tokens)
    owners (N,): each token's sequence in the micro-batch; lengths (n,): the sequences' token counts |o_i|
    (a sequence with none, a masked truncated completion, adds 0); totals: (S, T, max_new_tokens), the whole
    batch's sequences (masked ones included, as TRL counts them) and completion tokens (masked ones not)."""
    sequences, tokens, max_new_tokens = totals
    if loss_type == 'grpo':
        return (token_loss / lengths[owners].clamp(min=1)).sum() / sequences
    if loss_type == 'dapo':
        return token_loss.sum() / max(tokens, 1)
    return token_loss.sum() / (sequences * max_new_tokens)


def token_entropy(logits):
    """Per-token entropy (N,) of the distributions logits (N, V): -sum_v p_v log p_v, in float32."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def completion_batches(sequences, scored, micro_batch_size, pad_id, device='cpu'):
    """Rollouts as training micro-batches of micro_batch_size sequences each. sequences: (prompt ids, completion
    ids) pairs, the completions of one prompt consecutive (its G samples); scored: per sequence, False to leave
    its completion out of the loss (a masked truncated one). In a micro-batch each prompt is laid out once, in
    a row of its own, followed by its scored completions (each but its last token, which is only a target): a
    completion attends to the prompt and to itself only and continues the prompt's positions, and the prompt's
    last position predicts every completion's first token. So each completion token sees exactly what it would
    in a row of its own while the prompt is computed once for its G completions (train_dpo.py's packed pairs,
    with G branches). Each micro-batch is a dict: x (R, T) tokens, right-padded with pad_id; positions (R, T)
    and mask (R, 1, T, T) for the model; rows, cols (N,) the positions that predict the N completion tokens
    scored; targets (N,) those tokens; owners (N,) the sequence (0..B-1) each belongs to; lengths (B,) the
    tokens scored of each sequence; first: the index of its first sequence in sequences."""
    batches = []
    for first in range(0, len(sequences), micro_batch_size):
        rows = []  # per prompt: tokens, positions, branches (0: the prompt, k: its k-th completion)
        scores = []  # per scored token: (row, the column predicting it, the token, its sequence)
        for i in range(first, min(first + micro_batch_size, len(sequences))):
            prompt, completion = sequences[i]
            if i == first or prompt != sequences[i - 1][0]:
                rows.append((list(prompt), list(range(len(prompt))), [0] * len(prompt)))
            tokens, pos, br = rows[-1]
            if not scored[i] or not completion:
                continue
            p, start, k = len(prompt), len(tokens), br[-1] + 1
            tokens += completion[:-1]
            pos += range(p, p + len(completion) - 1)
            br += [k] * (len(completion) - 1)
            # token t is predicted at the prompt's last position (t = 0), else at token t - 1
            scores += [(len(rows) - 1, start + t - 1 if t else p - 1, target, i - first)
                       for t, target in enumerate(completion)]
        T = max(len(tokens) for tokens, _, _ in rows)
        x, positions, branch = (torch.full((len(rows), T), fill) for fill in (pad_id, 0, 0))
        real = torch.zeros(len(rows), T, dtype=torch.bool)
        for r, (tokens, pos, br) in enumerate(rows):
            x[r, :len(tokens)], positions[r, :len(tokens)] = torch.tensor(tokens), torch.tensor(pos)
            branch[r, :len(tokens)], real[r, :len(tokens)] = torch.tensor(br), True
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        # a query sees the prompt and its own completion; padding only padding (never an empty row)
        mask = (causal & ((branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None]))
                & (real[:, None, :] == real[:, :, None]))[:, None]
        row, cols, targets, owners = torch.tensor(scores, dtype=torch.long).view(-1, 4).T
        n = min(micro_batch_size, len(sequences) - first)
        tensors = dict(x=x, positions=positions, mask=mask, rows=row, cols=cols, targets=targets, owners=owners,
                       lengths=torch.bincount(owners, minlength=n))
        batches.append(dict(zip(tensors, (t.to(device) for t in tensors.values())), first=first))
    return batches
