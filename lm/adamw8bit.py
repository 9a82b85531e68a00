"""
AdamW with its two moments stored in 8 bits (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"): each moment is cut into blocks of 256 values, each block keeps its absmax in float32 and
every value as the index of the nearest of 256 levels of the dynamic map (lm/nf4.py's, signed for the first
moment, unsigned for the second), 1 byte instead of 4: the optimizer state of a full fine-tune is a quarter.
A step dequantizes a parameter's moments, updates them and the parameter in float32 as torch's AdamW does,
and quantizes them again. Tensors under 4,096 values keep float32 moments (as bitsandbytes does: their
state is small, and norms and biases are sensitive). Written by hand in plain PyTorch (bitsandbytes' 8-bit
optimizers need its compiled library; the arithmetic is a few lines).
"""
import math

import torch

from lm.nf4 import blockwise_absmax, dynamic_levels, nearest_level, scale_blocks, spread

BLOCK = 256
MIN_8BIT_SIZE = 4096
SIGNED, UNSIGNED = dynamic_levels(signed=True), dynamic_levels(signed=False)


def quantize(values, levels, zero=True):
    """(uint8 codes, float32 absmax per block of BLOCK) of a float32 tensor; zero=False: a value nearest level 0
    takes the smallest level above it instead (levels ascending)."""
    flat = values.reshape(-1)
    absmax = blockwise_absmax(flat, BLOCK)
    codes = nearest_level(flat / spread(absmax, BLOCK, flat.numel()), levels.to(flat.device))
    return (codes if zero else codes.clamp_(min=1)), absmax


def dequantize(codes, absmax, levels, shape):
    # int32 indices through index_select and the absmaxes by block: each step's scratch is the moment itself
    values = levels.to(codes.device).index_select(0, codes.reshape(-1).int())
    return scale_blocks(values, absmax, BLOCK).view(shape)


class AdamW8bit(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction) with 8-bit moments. Param groups
    as AdamW's: lr, betas, eps, weight_decay (and lr_scale, which the training loop reads)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group['betas']
            for p in group['params']:
                if p.grad is None:
                    continue
                state = self.state[p]
                small = p.numel() < MIN_8BIT_SIZE
                if not state:
                    state['step'] = torch.tensor(0.0)
                    if small:
                        state['exp_avg'] = torch.zeros_like(p, dtype=torch.float32)
                        state['exp_avg_sq'] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        blocks = math.ceil(p.numel() / BLOCK)
                        for name in ('exp_avg', 'exp_avg_sq'):
                            # an absmax of 0: every value of the block is 0, whatever its code
                            state[name + '_codes'] = torch.zeros(p.numel(), dtype=torch.uint8, device=p.device)
                            state[name + '_absmax'] = torch.zeros(blocks, device=p.device)
                state['step'] += 1
                step = state['step'].item()
                if small:
                    exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
                else:
                    exp_avg = dequantize(state['exp_avg_codes'], state['exp_avg_absmax'], SIGNED, p.shape)
                    exp_avg_sq = dequantize(state['exp_avg_sq_codes'], state['exp_avg_sq_absmax'], UNSIGNED, p.shape)
                grad = p.grad.float()
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(group['eps'])
                weight = p.float()
                weight.mul_(1 - group['lr'] * group['weight_decay'])
                weight.addcdiv_(exp_avg, denom, value=-group['lr'] / (1 - beta1 ** step))
                p.copy_(weight)
                if not small:
                    state['exp_avg_codes'], state['exp_avg_absmax'] = quantize(exp_avg, SIGNED)
                    # a second moment stored as 0 where the first is not would make a step m / eps (~1e6 x
                    # AdamW's): the zero-point problem (Li et al. 2023, 4-bit optimizers), as the second moment
                    # spans twice the first's orders of magnitude; its smallest level instead bounds the step
                    state['exp_avg_sq_codes'], state['exp_avg_sq_absmax'] = quantize(exp_avg_sq, UNSIGNED, zero=False)


def in_8_bits(optimizer):
    """An AdamW8bit over a torch AdamW's param groups (GPT.configure_optimizers', lora.lora_optimizer's): the same
    parameters, lr, betas, eps, weight decay and lr_scale, the moments in 8 bits."""
    keys = ('params', 'lr', 'betas', 'eps', 'weight_decay', 'lr_scale')
    return AdamW8bit([{k: group[k] for k in keys if k in group} for group in optimizer.param_groups])
