"""
The maths of online RL with verifiable rewards (train_rl.py), the GRPO family as TRL's GRPOTrainer names it:
group-relative advantages, the clipped per-token policy-gradient loss with the k3 KL penalty, and the three
ways of normalising its sum (loss_type); and the rollouts laid out as training micro-batches. Completion
tokens are flattened: token j belongs to sequence owners[j], so a micro-batch is N tokens of n sequences,
without padding. Formulas: docs/rl.md.
"""
import torch

from lm.chat_data import branched_rows

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
    ids) pairs; scored: per sequence, False to leave its completion out of the loss (a masked truncated one).
    Consecutive sequences with the same prompt (a group's G completions) share one row: the prompt once, then
    each scored completion, which attends to the prompt and to itself only and continues the prompt's positions
    (train_dpo.py's padding-free pairs, G-fold). The prompt, most of the tokens when answers are short, is
    computed once per group instead of G times, and every completion token sees what it would alone.
    Each micro-batch is a dict: x (R, T) those rows, right-padded with pad_id; positions (R, T) and mask
    (R, 1, T, T) their layout (lm/chat_data.branched_rows); rows, cols (N,) the positions that predict the N
    completion tokens scored; targets (N,) those tokens; owners (N,) the sequence (0..n-1 in the micro-batch)
    each belongs to; lengths (n,) the tokens scored of each sequence; first: the index of its first sequence in
    sequences."""
    batches = []
    for first in range(0, len(sequences), micro_batch_size):
        units = []  # a row each: tokens, positions, branch (0 the prompt, k + 1 sequence k), scored
        for owner, ((prompt, completion), keep) in enumerate(zip(sequences[first:first + micro_batch_size],
                                                                 scored[first:first + micro_batch_size])):
            if owner == 0 or sequences[first + owner - 1][0] != prompt:
                units.append((list(prompt), list(range(len(prompt))), [0] * len(prompt), []))
            tokens, positions, branch, score = units[-1]
            if keep:  # the prompt's last position predicts the first token; the last token predicts nothing
                p, start = len(prompt), len(tokens)
                score += [(p - 1, completion[0], owner)] + [(start + t, target, owner)
                                                            for t, target in enumerate(completion[1:])]
                tokens += completion[:-1]
                positions += range(p, p + len(completion) - 1)
                branch += [owner + 1] * (len(completion) - 1)
        batch = branched_rows(units, [[u] for u in range(len(units))], pad_id, device)
        n = min(micro_batch_size, len(sequences) - first)
        batches.append(dict(batch, lengths=torch.bincount(batch['owners'], minlength=n), first=first))
    return batches
