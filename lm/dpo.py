"""
Log-probs of a DPO batch's completions (train_dpo.py): under the policy, under the reference (a frozen
copy, or the policy itself with its LoRA adapters disabled), and the reference's precomputed once over
every train and val pair, cached in out_dir, so that training needs no reference in memory.
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist

from run.checkpoint import cached_tensors
from losses import sequence_logps
from lm.lora import disable_adapters
from model import GPTConfig
from run.runtime import rank_batches
from run.starting_model import frozen_model, load_model


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


def precomputed_reference_logps(config, depends_on, policy, started, reference_path, model_args, batches, device,
                                param_dtype, autocast, rank, world_size, ddp):
    """{'train', 'val'}: every pair's reference log-probs ((n_pairs, 2): chosen, rejected) of batches (the same
    keys), read from out_dir's cache when it holds those of depends_on (everything they depend on), else
    computed in one pass, each rank its share, and cached. config: the run's config keys; started: the policy
    has trained, so it is no longer the reference, which is then loaded from reference_path for the pass."""
    lockstep = config['parallel'] == 'fsdp'

    def reference_pass():
        reference = None
        if not config['use_lora'] and started:
            state = load_model(reference_path, as_stored=lockstep)['model']
            reference = frozen_model(GPTConfig(**model_args), state, config['parallel'], device, param_dtype,
                                     config['fsdp_cpu_offload'])
        cache = {}
        for name, pairs in batches.items():
            logps = torch.zeros(pairs.n_pairs, 2, device=device)
            for indices, counted in rank_batches(torch.arange(pairs.n_pairs), config['batch_size'], rank, world_size,
                                                 lockstep):
                sums, _ = reference_logps(policy, reference, pairs.get(indices, device), len(indices),
                                          config['use_lora'], autocast)
                if counted:
                    logps[indices] = sums.view(2, -1).T
            if ddp:
                dist.all_reduce(logps)  # each rank filled its share
            cache[name] = logps.cpu()
        return cache

    shapes = {name: (pairs.n_pairs, 2) for name, pairs in batches.items()}
    return cached_tensors(config['out_dir'], 'ref_logps', depends_on, shapes, reference_pass, rank == 0,
                          'reference log-probs')
