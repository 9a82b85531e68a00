"""
The maths of online RL with verifiable rewards (train_rl.py), the GRPO family as TRL's GRPOTrainer names it:
group-relative advantages, the clipped per-token policy-gradient loss with the k3 KL penalty, and the three
ways of normalising its sum (loss_type); and the rollouts laid out as training micro-batches. Completion
tokens are flattened: token j belongs to sequence owners[j], so a micro-batch is N tokens of n sequences,
without padding. Formulas: docs/rl.md.
"""
from dataclasses import dataclass

import torch

from lm.shared_prompts import SharedPrompts

LOSS_TYPES = ('grpo', 'dapo', 'dr_grpo')
IMPORTANCE_LEVELS = ('token', 'sequence')
SCALE_REWARDS = ('group', 'batch', 'none')
STD_EPS = 1e-4  # TRL's: a group of equal rewards has advantage 0, not 0/0


def group_advantages(rewards, group_size, scale_rewards):
    """Advantages (n,) of rewards (n,), n = prompts * G, each prompt's G completions consecutive:
        A_i = (r_i - mean_g(r)) / (std + 1e-4)
    mean_g over the completion's group (its prompt's G); std the group's ('group', GRPO), the whole batch's
    ('batch': group mean, batch std, as LitePPO (Liu et al. 2025, "Tricks or Traps?") advises and TRL offers)
    or 1 with no 1e-4 ('none': Dr. GRPO, which drops the std for its bias towards easy and hard questions).
    std is the unbiased (Bessel's) standard deviation, as torch.std and TRL; G must be at least 2."""
    groups = rewards.view(-1, group_size)
    centred = (groups - groups.mean(1, keepdim=True)).flatten()
    if scale_rewards == 'none':
        return centred
    std = groups.std(1).repeat_interleave(group_size) if scale_rewards == 'group' else rewards.std()
    return centred / (std + STD_EPS)


def clipped_token_loss(log_ratio, advantages, epsilon, epsilon_high):
    """Per-token PPO-clipped policy-gradient loss and where the clip is active (both (N,)):
        r = exp(log_ratio),  loss = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
    log_ratio: each token's logp - logp_old, or its sequence's mean of them (sequence_log_ratio: GSPO);
    advantages: each token's sequence's A. With logp_old = logp.detach() (one iteration per batch) r = 1
    and the gradient is the plain policy gradient -A grad logp."""
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    unclipped, clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.min(unclipped, clipped), (clipped < unclipped).detach()


def sequence_log_ratio(log_ratio, owners, lengths):
    """GSPO's (Zheng et al. 2025; TRL's importance_sampling_level='sequence') importance weight, in log: each
    token's (N,) the mean of its sequence's log-ratios, s_i = (1/|o_i|) sum_t (logp_it - logp_old_it), so that
    one ratio exp(s_i) weights and clips the whole sequence. owners (N,), lengths (n,) as in normalized_loss."""
    sums = torch.zeros(len(lengths), dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, owners, log_ratio)
    return (sums / lengths.clamp(min=1))[owners]


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


@dataclass
class CompletionBatch:
    """One training micro-batch of rollouts (completion_batches): a flat row of N tokens without
    padding holding n sequences, N' of whose completion tokens are scored."""
    x: torch.Tensor  # (1, N) the row: each prompt once, then its scored completions
    positions: torch.Tensor  # (1, N) positions in each sequence, a completion's after its prompt's
    mask: SharedPrompts  # the layout: a completion attends to its prompt and itself only
    rows: torch.Tensor  # (N',) the row (0) of the positions whose logits predict the scored tokens
    cols: torch.Tensor  # (N',) their columns, sequence by sequence
    targets: torch.Tensor  # (N',) the completion tokens scored
    owners: torch.Tensor  # (N',) each scored token's sequence, 0..n-1 in the micro-batch
    lengths: torch.Tensor  # (n,) each sequence's tokens scored (0: a masked truncated one)
    first: int  # the index of the micro-batch's first sequence among all the rollouts


def completion_batches(sequences, scored, micro_batch_size, device='cpu'):
    """Rollouts as training micro-batches (CompletionBatch) of micro_batch_size sequences each. sequences:
    (prompt ids, completion ids) pairs; scored: per sequence, False to leave its completion out of the loss (a
    masked truncated one). A micro-batch is one flat row of tokens without padding: each prompt once, followed
    by its scored completions (consecutive sequences with the same prompt: a group's G), laid out by
    SharedPrompts so that each completion attends to its prompt and to itself only and continues the prompt's
    positions: every completion token sees what it would alone, and the prompt, most of the tokens when answers
    are short, is computed once instead of G times (train_dpo.py's shared prompt, G-fold)."""
    batches = []
    for first in range(0, len(sequences), micro_batch_size):
        part = sequences[first:first + micro_batch_size]
        tokens, positions, score = [], [], []  # score: (column, target, owner) of each scored token
        prompts, completions, prompt_of = [], [], []  # the columns of each prompt's and completion's tokens
        for owner, (prompt, completion) in enumerate(part):
            if owner == 0 or part[owner - 1][0] != prompt:
                prompts.append(range(len(tokens), len(tokens) + len(prompt)))
                tokens += prompt
                positions += range(len(prompt))
            if scored[first + owner]:  # the prompt's last token predicts the first; the last predicts nothing
                fed = completion[:-1]
                score += [(prompts[-1][-1], completion[0], owner)] + [
                    (len(tokens) + t, target, owner) for t, target in enumerate(completion[1:])]
                if fed:
                    completions.append(range(len(tokens), len(tokens) + len(fed)))
                    prompt_of.append(len(prompts) - 1)
                tokens += fed
                positions += range(len(prompt), len(prompt) + len(fed))
        cols, targets, owners = torch.tensor(score, dtype=torch.long).view(-1, 3).T.to(device)
        batches.append(CompletionBatch(
            x=torch.tensor([tokens], device=device), positions=torch.tensor([positions], device=device),
            mask=SharedPrompts(prompts, completions, prompt_of, device), rows=torch.zeros_like(cols), cols=cols,
            targets=targets, owners=owners, lengths=torch.bincount(owners, minlength=len(part)), first=first))
    return batches
