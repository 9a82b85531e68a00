"""
QLoRA's frozen base (Dettmers et al. 2023): a Linear weight stored as 4-bit NormalFloat. Each block of 64
values keeps the index of its nearest NF4 level (two to a byte) and the block's absmax; the absmaxes, less
their mean, are quantized again to 8 bits in blocks of 256 (double quantization): 4.127 bits a weight.
The layout is bitsandbytes' (`quantize_4bit(..., quant_type='nf4', compress_statistics=True)`), so its
4-bit tensors are ours as they are; written here in plain PyTorch, as its CPU path is (no kernel to gain
from a dependency: a forward dequantizes one layer's weight and multiplies, as bitsandbytes does off CUDA).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memory import page_out

BLOCK, SCALE_BLOCK = 64, 256
# the 16 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact 0 (the paper's appendix)
NF4_LEVELS = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                           -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                           0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                           0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
# a byte's two values, the high nibble's first: byte b holds levels b >> 4 and b & 15
NF4_PAIRS = torch.stack([NF4_LEVELS.repeat_interleave(16), NF4_LEVELS.repeat(16)], 1)
CHUNK = 1 << 20  # values quantized at once: a bounded scratch (int64 indices) for any weight's size
# values dequantized at once, eagerly (whole blocks): on a CPU 1 MB of float32 scratch, so that the passes over
# a chunk stay in cache; elsewhere (an eager GPU run) 64 MB, a few kernels a chunk. Compiled: the whole weight
CPU_DEQUANTIZE_CHUNK, DEQUANTIZE_CHUNK = 1 << 18, 1 << 24


def linspace_as_on_x86(start, end, intervals):
    """torch.linspace(start, end, intervals + 1) in float32 as its vectorized x86 kernel computes it, which
    bitsandbytes' maps were made with, on any CPU: each point start + step * i (end - step * (intervals - i)
    in the upper half) rounded once, as a fused multiply-add rounds it; here exactly in float64 (at most 32
    significant bits), then rounded. torch's scalar kernel rounds twice: some levels 1 ulp apart."""
    start, end = torch.tensor(start, dtype=torch.float32), torch.tensor(end, dtype=torch.float32)
    step = ((end - start) / intervals).double()
    i = torch.arange(intervals + 1, dtype=torch.float64)
    lower, upper = start.double() + step * i, end.double() - step * (intervals - i)
    return torch.where(i < (intervals + 1) // 2, lower, upper).float()


def dynamic_levels(signed=True):
    """256 levels, ascending: bitsandbytes' dynamic 8-bit map (Dettmers 2015), an exponent 10^0 .. 10^-6 and a
    fraction with fewer bits as the exponent grows, and a sign (signed) or one more fraction bit. The signed
    map quantizes NF4's absmaxes (and the 8-bit AdamW's first moment: lm/adamw8bit.py)."""
    levels = []
    for i in range(7):
        edges = linspace_as_on_x86(0.1, 1.0, 2 ** (i if signed else i + 1))
        means = ((edges[:-1] + edges[1:]) / 2 * 10 ** (i - 6)).tolist()
        levels += means + ([-m for m in means] if signed else [])
    return torch.tensor(levels + [0.0, 1.0]).sort().values


DYNAMIC_LEVELS = dynamic_levels()


def nearest_level(values, levels):
    """The index in levels (any order) of each value's nearest level, as uint8, a chunk at a time."""
    order = levels.argsort()
    ordered = levels[order]
    midpoints = (ordered[1:] + ordered[:-1]) / 2
    out = torch.empty(values.numel(), dtype=torch.uint8, device=values.device)
    flat = values.reshape(-1)
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start:start + CHUNK].float()
        out[start:start + CHUNK] = order.to(values.device)[torch.bucketize(chunk, midpoints.to(values.device))]
    return out


def blockwise_absmax(values, block):
    """The absmax of each block of block values (the last block may be short)."""
    pad = -values.numel() % block
    return F.pad(values.abs(), (0, pad)).view(-1, block).amax(1)


def scale_blocks(values, absmax, block):
    """Flat float32 values times their block's absmax, in place: by a view of whole blocks where the blocks
    are whole (no per-value copy of the absmaxes), else each absmax repeated for its block's values."""
    if len(values) % block == 0:
        values.view(-1, block).mul_(absmax[:, None])
    else:
        values.mul_(absmax.repeat_interleave(block)[:len(values)])
    return values


def blocks_absmax(codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor,
                  levels: torch.Tensor) -> torch.Tensor:
    """Each block's absmax as double quantization keeps it: its 8-bit code's level times its group's scale, plus
    the offset, two roundings as bitsandbytes rounds them."""
    return scale_blocks(levels.index_select(0, codes.int()), scales, SCALE_BLOCK).add_(offset)


# the same as an op of its own, which torch.compile runs as it is: fused into one kernel, the multiply and the add
# would become one fused multiply-add on a GPU (one rounding)
compiled_blocks_absmax = torch.library.custom_op('nanotrain::nf4_absmax', blocks_absmax, mutates_args=())


@compiled_blocks_absmax.register_fake
def _(codes, scales, offset, levels):
    return codes.new_empty(codes.shape, dtype=torch.float32)


def spread(per_block, block, n):
    """Each block's value repeated for its n values; 0 (a block of zeros) as 1, so its values stay 0."""
    return torch.where(per_block == 0, 1.0, per_block).repeat_interleave(block)[:n]


class NF4Weight(nn.Module):
    """A frozen weight in NF4 with double quantization; dequantize() gives it back in dtype, the dtype it
    came in (a published model's bf16), which is what merging and exporting fold the adapters into."""

    def __init__(self, weight):
        super().__init__()
        self.shape, self.dtype = tuple(weight.shape), weight.dtype
        flat = weight.detach().reshape(-1)
        if flat.numel() % 2:
            raise ValueError(f"NF4 packs two values a byte: a weight of {flat.numel()} values does not split")
        packed, absmax = [], []
        for start in range(0, flat.numel(), CHUNK):  # CHUNK is whole blocks: a bounded scratch
            values = flat[start:start + CHUNK].float()
            block_absmax = blockwise_absmax(values, BLOCK)
            indices = nearest_level(values / spread(block_absmax, BLOCK, len(values)), NF4_LEVELS)
            packed.append(indices[::2] << 4 | indices[1::2])  # the first of a pair in the high nibble
            absmax.append(block_absmax)
        absmax = torch.cat(absmax)
        offset = absmax.mean()
        scales = blockwise_absmax(absmax - offset, SCALE_BLOCK)
        self.register_buffer('packed', torch.cat(packed))
        self.register_buffer('absmax_codes', nearest_level((absmax - offset) / spread(scales, SCALE_BLOCK, len(absmax)),
                                                           DYNAMIC_LEVELS))
        self.register_buffer('absmax_scales', scales)
        self.register_buffer('absmax_offset', offset)
        self.register_tables()

    def register_tables(self):
        """The lookup tables, as buffers that move with the model (not saved): on a GPU a dequantization reads
        them there, no copy from the host (a synchronization) each time."""
        self.register_buffer('pairs', NF4_PAIRS.to(self.packed.device), persistent=False)
        self.register_buffer('absmax_levels', DYNAMIC_LEVELS.to(self.packed.device), persistent=False)

    @classmethod
    def stored(cls, shape, dtype, packed, absmax_codes, absmax_scales, absmax_offset):
        """The NF4Weight of bits quantized before, in this layout (a Hugging Face folder bitsandbytes saved:
        hf/checkpoint.py reads its tensors), as they are."""
        weight = cls.__new__(cls)
        nn.Module.__init__(weight)
        weight.shape, weight.dtype = tuple(shape), dtype
        for name, value in (('packed', packed), ('absmax_codes', absmax_codes), ('absmax_scales', absmax_scales),
                            ('absmax_offset', absmax_offset)):
            weight.register_buffer(name, value)
        weight.register_tables()
        return weight

    def absmax(self):
        """The blocks' absmaxes as double quantization keeps them."""
        absmax = compiled_blocks_absmax if torch.compiler.is_compiling() else blocks_absmax
        return absmax(self.absmax_codes, self.absmax_scales, self.absmax_offset, self.absmax_levels)

    def dequantize(self, dtype=None):
        """The weight in dtype (its own by default): each value its level times its block's absmax in float32,
        rounded once to dtype (so float32 or its own dtype give its values; the others round them again).
        Compiled, one expression over the whole weight, which torch.compile makes one kernel that writes only the
        result. Eagerly a chunk at a time: each byte's two values looked up at once, as one 8-byte word (a 1-D
        gather: 3x the speed of 2-value rows on a CPU), each block times its absmax in place, in the result itself
        in float32, else in a scratch of the chunk's float32 values that the copy into the result rounds (with the
        int32 byte indices, 1.5 MB on a CPU; an int64 index a value, all at once, took 10x the result: 1.1 GB for an
        8B MLP's)."""
        dtype = dtype or self.dtype
        absmax = self.absmax()
        if torch.compiler.is_compiling():
            values = self.pairs[self.packed.long()].view(-1)
            return (values * absmax.repeat_interleave(BLOCK)[:len(values)]).to(dtype).view(self.shape)
        out = torch.empty(self.packed.numel() * 2, dtype=dtype, device=self.packed.device)
        words = self.pairs.view(torch.int64).view(-1)
        chunk = CPU_DEQUANTIZE_CHUNK if out.is_cpu else DEQUANTIZE_CHUNK
        for start in range(0, len(out), chunk):  # whole blocks; only the last may be short
            part = out[start:start + chunk]
            values = part if dtype == torch.float32 else torch.empty(len(part), device=out.device)
            torch.index_select(words, 0, self.packed[start // 2:(start + chunk) // 2].int(),
                               out=values.view(torch.int64))
            scale_blocks(values, absmax[start // BLOCK:(start + len(values) + BLOCK - 1) // BLOCK], BLOCK)
            if values is not part:
                part.copy_(values)
        return out.view(self.shape)


def matmul_weight(nf4, x):
    """nf4's weight as F.linear with x computes with it: dequantized straight to the run's dtype (autocast's, else
    x's), as the float32 weight cast to it would be; a weight stored in another 16-bit dtype keeps that rounding
    first (then autocast casts it, or here to x's dtype)."""
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    run = torch.get_autocast_dtype(device) if autocast else x.dtype
    w = nf4.dequantize(run if nf4.dtype in (torch.float32, run) else nf4.dtype)
    return w if autocast else w.to(x.dtype)


class NF4Matmul(torch.autograd.Function):
    """x @ W.T for a frozen NF4 weight W, eagerly: dequantized in the forward and again in the backward, so that
    no dequantized weight waits in memory between the two (the input's gradient only: W does not train)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight
        return F.linear(x, matmul_weight(weight, x))

    @staticmethod
    def backward(ctx, grad):
        return grad @ matmul_weight(ctx.weight, grad), None


class NF4Linear(nn.Linear):
    """A frozen nn.Linear whose weight is an NF4Weight (weight is None; nf4 holds it: base's weight quantized,
    or stored, the same weight quantized before); the bias as it was."""

    def __init__(self, base, stored=None):
        super().__init__(base.in_features, base.out_features, bias=False, device='meta')
        self.weight, self.bias = None, base.bias
        self.nf4 = stored if stored is not None else NF4Weight(base.weight)

    def forward(self, x):
        return nf4_linear(x, self.nf4, self.bias)


def nf4_linear(x, nf4, bias=None):
    if torch.compiler.is_compiling():
        # one fused kernel dequantizes; as a checkpointed region it runs again in the backward: without it, the
        # compiled graph would keep each dequantized weight from the forward for the backward
        y = F.linear(x, checkpoint(matmul_weight, nf4, x, use_reentrant=False))
    else:
        y = NF4Matmul.apply(x, nf4)
    return y if bias is None else y + bias


@torch.no_grad()
def quantize_blocks(model, stored=None):
    """Every Linear of model's blocks becomes an NF4Linear (before apply_lora, which adapts them), one
    weight at a time: built around a checkpoint's memory-mapped tensors, memory then holds the 4-bit
    model and one weight as stored, never the whole model (each weight's pages are let go once read).
    stored: {parameter name: NF4Weight} of weights already in NF4 (a bitsandbytes folder), taken as they are."""
    stored = stored or {}
    for name, module in list(model.transformer.h.named_modules()):
        if type(module) is nn.Linear:
            parent, _, child = name.rpartition('.')
            nf4 = stored.get(f'transformer.h.{name}.weight')
            setattr(model.transformer.h.get_submodule(parent), child, NF4Linear(module, nf4))
            page_out(module.weight)
