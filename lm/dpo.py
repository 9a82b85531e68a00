"""
Log-probs of a DPO batch's completions (train_dpo.py): under the policy, under the reference (a frozen
copy, or the policy itself with its LoRA adapters disabled), and the reference's precomputed once over
every train and val pair, cached in out_dir, so that training needs no reference in memory.
"""
import torch
import torch.distributed as dist

from configurator import UserError
from lm.lora import disable_adapters
from losses import sequence_logps
from memory import free_memory, is_oom
from run.run_folder import cached_tensors
from run.runtime import log, rank_batches


def sequence_logps_and_logits(net, batch, n):
    """Log-probs of the completions of a batch of n pairs (PreferenceBatches.get) under net:
    per-sequence sums (2n,), per-token (N,), and the logits (N, V) of the N scored positions (the
    only ones whose logits are computed: prompts and padding never reach the output layer)."""
    logits, _ = net(batch['x'], positions=batch['positions'], mask=batch['mask'],
                    logits_at=(batch['rows'], batch['cols']))
    sums, token_logps = sequence_logps(logits, batch['targets'], batch['owners'], 2 * n)
    return sums, token_logps, logits


@torch.no_grad()
def reference_logps(reference, batch, n, autocast):
    """The reference's (per-sequence sums, logits at the completion positions) for a batch of n pairs under
    autocast. reference: the frozen copy, or the policy itself, scored in eval mode with its LoRA adapters
    disabled (a model without adapters is scored as it is)."""
    training = reference.training
    reference.eval()
    try:
        with disable_adapters(reference), autocast:
            sums, _, logits = sequence_logps_and_logits(reference, batch, n)
    finally:  # an out-of-memory error the step retries must not leave the policy in eval mode
        reference.train(training)
    return sums, logits


def precomputed_reference_logps(config, depends_on, batches, load_reference, autocast, compute):
    """{'train', 'val'}: every pair's reference log-probs ((n_pairs, 2): chosen, rejected) of batches (the same
    keys), read from out_dir's cache when it holds those of depends_on (everything they depend on), else
    computed in one pass under autocast, each rank its share (compute: runtime.Compute), and cached. config:
    the run's config keys; load_reference(): the model the pass scores with, as in reference_logps (the policy
    while it is the reference: untrained, or LoRA's, its adapters disabled; else the frozen reference read
    again), called only when the cache misses."""
    rank, world_size, lockstep = compute.rank, compute.world_size, config['parallel'] == 'fsdp'

    def scored(reference, pairs, size):
        logps = torch.zeros(pairs.n_pairs, 2, device=compute.device)
        for indices, counted in rank_batches(torch.arange(pairs.n_pairs), size, rank, world_size, lockstep):
            sums, _ = reference_logps(reference, pairs.get(indices, compute.device), len(indices), autocast)
            if counted:
                logps[indices] = sums.view(2, -1).T
        if compute.ddp:
            dist.all_reduce(logps)  # each rank filled its share
        return logps.cpu()

    def reference_pass():
        reference = load_reference()
        cache, size = {}, config['batch_size']
        for name, pairs in batches.items():
            while name not in cache:
                try:
                    cache[name] = scored(reference, pairs, size)
                except RuntimeError as error:
                    # no gradients: fewer pairs at a time give the same log-probs (the ranks would disagree)
                    if not is_oom(error) or compute.ddp:
                        raise
                    if size == 1:
                        raise UserError("out of memory scoring the reference's log-probs one pair at a time. "
                                        "Lower max_length, use a smaller model, or use a device with more "
                                        "memory.") from None
                    free_memory(compute.device)
                    size //= 2
                    log(f"reference log-probs: out of memory, retrying {size} pairs at a time")
        return cache

    shapes = {name: (pairs.n_pairs, 2) for name, pairs in batches.items()}
    return cached_tensors(config['out_dir'], 'ref_logps', depends_on, shapes, reference_pass, rank == 0,
                          'reference log-probs')
