"""
Log-probs of a DPO batch's completions (train_dpo.py): under the policy, under the reference (a frozen
copy, or the policy itself with its LoRA adapters disabled), and the reference's precomputed once over
every train and val pair, cached in out_dir, so that training needs no reference in memory.
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist

from lm.lora import disable_adapters
from losses import sequence_logps
from run.run_folder import cached_tensors
from run.runtime import rank_batches


def completion_logps(net, batch, n):
    """Log-probs of the completions of a batch of n pairs (PreferenceBatches.get) under net:
    per-sequence sums (2n,), per-token (N,), and the logits (N, V) of the N scored positions (the
    only ones whose logits are computed: prompts and padding never reach the output layer)."""
    logits, _ = net(batch['x'], positions=batch['positions'], mask=batch['mask'],
                    logits_at=(batch['rows'], batch['cols']))
    sums, token_logps = sequence_logps(logits, batch['targets'], batch['owners'], 2 * n)
    return sums, token_logps, logits


@torch.no_grad()
def reference_logps(policy, reference, batch, n, use_lora, autocast):
    """The reference's (per-sequence sums, logits at the completion positions) for a batch of n pairs:
    reference, the frozen copy, if there is one, else the policy (in eval mode, adapters disabled under LoRA)."""
    training = policy.training
    policy.eval()
    with disable_adapters(policy) if use_lora else nullcontext(), autocast:
        sums, _, logits = completion_logps(policy if reference is None else reference, batch, n)
    policy.train(training)
    return sums, logits


def precomputed_reference_logps(config, depends_on, policy, batches, load_reference, autocast, compute):
    """{'train', 'val'}: every pair's reference log-probs ((n_pairs, 2): chosen, rejected) of batches (the same
    keys), read from out_dir's cache when it holds those of depends_on (everything they depend on), else
    computed in one pass, each rank its share (compute: runtime.Compute), and cached. config: the run's config
    keys; load_reference: None while the policy is the reference (untrained, or LoRA with its adapters
    disabled), else a function that loads the frozen reference for the pass."""
    rank, world_size, lockstep = compute.rank, compute.world_size, config['parallel'] == 'fsdp'

    def reference_pass():
        reference = load_reference() if load_reference else None
        cache = {}
        for name, pairs in batches.items():
            logps = torch.zeros(pairs.n_pairs, 2, device=compute.device)
            for indices, counted in rank_batches(torch.arange(pairs.n_pairs), config['batch_size'], rank, world_size,
                                                 lockstep):
                sums, _ = reference_logps(policy, reference, pairs.get(indices, compute.device), len(indices),
                                          config['use_lora'], autocast)
                if counted:
                    logps[indices] = sums.view(2, -1).T
            if compute.ddp:
                dist.all_reduce(logps)  # each rank filled its share
            cache[name] = logps.cpu()
        return cache

    shapes = {name: (pairs.n_pairs, 2) for name, pairs in batches.items()}
    return cached_tensors(config['out_dir'], 'ref_logps', depends_on, shapes, reference_pass, rank == 0,
                          'reference log-probs')
