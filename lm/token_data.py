"""
Pretraining batches: random block_size windows of the token files `python data.py` prepares (train.bin,
val.bin), and the fixed windows an eval scores. Fine-tuning's chat and preference batches are in
lm/chat_data.py.
"""
import os

import numpy as np
import torch

from configurator import UserError
from lm.tokenizer import dataset_file, read_meta
from run.device import to_device


class TokenBatches:
    """Random block_size windows of a token .bin file, drawn from a seeded generator.

    DDP: every rank builds this with the same seed and calls sample_offsets for the whole global
    batch (world_size * grad_accum * micro_batch offsets), so all ranks draw the same offsets and
    the generator state is the same everywhere (any rank's state_dict resumes all). Rank r takes
    the contiguous slice offsets.tensor_split(world_size)[r] and splits it into grad_accum
    micro-batches: its micro-step k is global micro-batch r * grad_accum + k, so 2 ranks x
    grad_accum A train on exactly the samples of 1 process x grad_accum 2A."""

    def __init__(self, bin_path, block_size, seed):
        self.bin_path = bin_path
        self.block_size = block_size
        self.dtype = np.dtype(read_meta(os.path.dirname(bin_path) or '.')['dtype'])
        self.n_tokens = os.path.getsize(dataset_file(*os.path.split(bin_path))) // self.dtype.itemsize
        if self.n_tokens < block_size + 1:
            raise UserError(f"{bin_path} has {self.n_tokens} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}. Use a smaller --block_size or a bigger corpus.")
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def sample_offsets(self, n):
        self.batches_drawn += 1
        return torch.randint(self.n_tokens - self.block_size, (n,), generator=self.generator)

    def get(self, offsets, device='cpu'):
        """(x, y) int64 (len(offsets), block_size); y[:, t] is the token after x[:, t]."""
        # a fresh memmap per call: a long-lived one keeps growing in memory (nanoGPT's note)
        data = np.memmap(self.bin_path, dtype=self.dtype, mode='r')
        windows = np.stack([data[i:i + self.block_size + 1] for i in offsets.tolist()])
        windows = torch.from_numpy(windows.astype(np.int64))
        x, y = to_device([windows[:, :-1].contiguous(), windows[:, 1:].contiguous()], device)
        return x, y

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])
        self.batches_drawn = state['batches_drawn']


def eval_offsets(n_tokens, block_size, n, seed=1234):
    """The same n window starts at every evaluation, so successive val losses compare."""
    if n_tokens < block_size + 1:
        raise UserError(f"the eval split has {n_tokens} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}. Use a smaller --block_size or a bigger corpus.")
    return torch.randint(n_tokens - block_size, (n,), generator=torch.Generator().manual_seed(seed))
