"""
FSDP2 (torch.distributed.fsdp.fully_shard): the weights, gradients and optimizer state of a GPT sharded
over the ranks of a torchrun job (parallel='fsdp'), for models that DDP, which gives every rank all of
them, cannot hold. Each transformer block is one shard group, the rest (embeddings, final norm, head)
another: a block's weights are gathered whole just before it runs and freed after.

Checkpoints stay the same file whoever writes them: pieces_on_rank0 brings each sharded tensor to rank 0 a
shard at a time, which run/checkpoint.py's save_gathered writes into the file an unsharded run's torch.save
writes (full_state_dict gathers the same, whole), and shard_optimizer_state cuts a saved optimizer state to
this rank's shards, so a ckpt.pt moves freely between one process, DDP and FSDP and across world sizes.
(checkpoint_format='sharded' has every rank write its own shards instead: run/sharded_checkpoint.py.)

torch.distributed.fsdp and DTensor are imported only by shard_model: importing them takes 0.4 s (sympy and
more), which every launch of every script would pay; no model is sharded and no tensor is a DTensor before.
"""
import math
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

from configurator import UserError
from memory import return_freed_buffers

PARALLEL = ('ddp', 'fsdp')


def check_parallel(parallel, distributed, device, dtype, optimizer_type, cpu_offload):
    """A UserError for settings FSDP cannot run with (parallel='ddp' takes any)."""
    if parallel != 'fsdp':
        return
    if dtype == torch.float16:
        raise UserError("parallel='fsdp' runs in bfloat16 or float32; float16's loss scaling is not supported on sharded "
                        "gradients. Set --dtype=bfloat16 (or float32).")
    if optimizer_type != 'adamw':
        raise UserError(f"parallel='fsdp' trains with AdamW (optimizer_type={optimizer_type!r} works on whole tensors, "
                        f"not on each rank's shards); set optimizer_type='adamw' or parallel='ddp'.")
    if cpu_offload and not device.startswith('cuda'):
        raise UserError(f"fsdp_cpu_offload=True keeps GPU shards in CPU memory; on device {device!r} they are there "
                        f"already. Drop --fsdp_cpu_offload.")
    if not distributed:
        raise UserError("parallel='fsdp' shards the model over the processes of a torchrun job; launch with "
                        "`torchrun --nproc_per_node=N` (N=1 also works, e.g. for fsdp_cpu_offload), or drop --parallel.")


def shard_model(model, device, param_dtype, cpu_offload, frozen=False):
    """Shard model (a GPT on the CPU) over every rank, block by block, moving each block's shards to this
    rank's device: no rank's device holds more than its shards and one block whole. Each block is made
    float32 just before (a model built around a checkpoint's memory-mapped tensors, in their stored dtype,
    holds no float32 copy of the whole at once; but every rank reads every block whole, each page of the
    file, before keeping its shard). param_dtype: what the
    gathered weights compute in (bf16 halves the all-gathers); gradients are reduced in fp32 and the sharded
    weights and AdamW's moments stay fp32. cpu_offload keeps the shards and optimizer state in CPU memory,
    copied to the GPU as each block runs. frozen (DPO's reference: no gradients, no optimizer): the
    shards are kept in param_dtype, which every gathered weight (the embedding's too) is cast to
    anyway, so the same log-probs from half the shard memory in a bf16 run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    if device == 'cpu':
        return_freed_buffers()  # the blocks gathered and freed each step leave the process (0.68x, not 1.30x)
    mesh = init_device_mesh(device.split(':')[0], (dist.get_world_size(),))
    settings = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
                    offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    for module in (*model.transformer.h, model):  # each block, then the rest
        fully_shard(parameters_in(module, param_dtype) if frozen else module.float(), **settings)
    # built on the meta device: a sharded checkpoint's placeholders (load_checkpoint), whose shards
    # restore_training_state fills, or a new model (init_seed), whose shards each rank draws now
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device='cpu' if cpu_offload else device)
        if model.config.pos_emb == 'rope':
            model.set_rope_tables(device)  # to_empty left the tables empty too
        if model.init_seed is not None:
            init_shards(model)


@torch.no_grad()
def init_shards(model):
    """Draw a new GPT sharded on the meta device and allocated (to_empty): this rank's shard of each weight,
    the values model.init_weights(model.init_seed) gives the whole model in one process, whatever the number
    of ranks. Each parameter is drawn whole (GPT.initial_value: its own stream, not the shard's part alone),
    one at a time, then cut to this rank's shard: beyond its shards a rank holds at most the largest
    parameter (the embedding), never the model."""
    for name, p in model.named_parameters():
        # fully_shard cuts dim 0 into torch.chunk's pieces, one a rank (a rank past them has none)
        pieces = model.initial_value(name, model.init_seed).chunk(p.device_mesh.size())
        rank = p.device_mesh.get_local_rank()
        if rank < len(pieces):
            p.to_local().copy_(pieces[rank])


def parameters_in(module, dtype):
    """module with its parameters not yet sharded in dtype; buffers (RoPE's tables) stay float32."""
    for p in module.parameters():
        if not is_dtensor(p) and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return module


def place_model(model, parallel, device, param_dtype, cpu_offload, frozen=False):
    """Move model to device, or with parallel='fsdp' shard it over the ranks (shard_model, frozen:
    as there)."""
    if parallel == 'fsdp':
        shard_model(model, device, param_dtype, cpu_offload, frozen)
    else:
        model.to(device)


def is_sharded(model):
    # not imported: nothing was sharded (see above)
    fsdp = sys.modules.get('torch.distributed.fsdp')
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def is_dtensor(value):
    """isinstance(value, DTensor): a tensor sharded over the ranks (a parameter, gradient or optimizer state
    of a sharded model)."""
    # not imported: no DTensor exists (see above)
    tensor = sys.modules.get('torch.distributed.tensor')
    return tensor is not None and isinstance(value, tensor.DTensor)


@contextmanager
def same_init_on_every_rank(seed, enabled):
    """DDP copies rank 0's weights to every rank; FSDP does not, so under it the new weights a run draws
    (a model from scratch, LoRA adapters, added token rows) come from one stream, seeded with seed, on
    every rank. Each rank's own stream continues afterwards as if nothing was drawn."""
    with torch.random.fork_rng(devices=[], enabled=enabled):
        if enabled:
            torch.manual_seed(seed)
        yield


@torch.no_grad()
def full_state_dict(state):
    """state (a model's state_dict(keep_vars=True) or an optimizer's state_dict()) as an unsharded run holds
    it: every sharded tensor (DTensor) gathered whole, one at a time, onto the CPU of rank 0 (other ranks get
    None in its place, and hold no more than one gathered tensor at once), as get_model_state_dict with
    StateDictOptions(full_state_dict=True, cpu_offload=True) does, but with the optimizer state by parameter
    position, as optimizer.state_dict() has it; a tensor under two names (tied embeddings) stays one tensor.
    Plain tensors pass through (detached). Collective under FSDP: every rank must call it. (Rank 0 then holds
    the whole state: run/checkpoint.py's save_gathered writes a checkpoint without ever holding it.)"""
    keep = not dist.is_initialized() or dist.get_rank() == 0

    def whole(tensor):
        if not is_dtensor(tensor):
            return tensor.detach()
        gathered = tensor.full_tensor()  # collective
        return gathered.cpu() if keep else None
    return map_tensors(state, whole)


def map_tensors(state, fn):
    """state (dicts and lists of tensors and plain values) with each tensor t replaced by fn(t), called once
    a tensor (one under two names, tied embeddings, stays one) in the order torch.save stores them."""
    done = {}  # id -> fn(tensor)

    def walk(value):
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, torch.Tensor):
            if id(value) not in done:
                done[id(value)] = fn(value)
            return done[id(value)]
        return value
    return walk(state)


def tensors_in(state):
    """The tensors of state, each once, in the order torch.save stores them (map_tensors')."""
    found = []
    map_tensors(state, found.append)
    return found


@torch.no_grad()
def pieces_on_rank0(tensor):
    """tensor whole on rank 0's CPU, in pieces: (byte offset in the tensor, piece) in order, each piece let go
    before the next comes; the other ranks get (offset, None). A tensor FSDP sharded (along dim 0, into
    torch.chunk's pieces, one a rank) comes a rank's shard at a time, sent to rank 0 alone: no rank ever holds
    it whole. Collective: every rank must take every piece."""
    if not is_dtensor(tensor):
        yield 0, tensor.detach()
        return
    from torch.distributed.tensor import Shard
    mesh = tensor.device_mesh
    rank = mesh.get_local_rank()
    if tensor.placements != (Shard(0),):  # not fully_shard's layout: gathered whole, on every rank
        whole = tensor.full_tensor()
        yield 0, whole.cpu() if rank == 0 else None
        return
    # sent from the mesh's device (NCCL's are GPU tensors; CPU offload keeps shards on the CPU)
    local = tensor.to_local().to(mesh.device_type).contiguous()
    rows = [len(c) for c in torch.empty(tensor.shape[0], device='meta').chunk(mesh.size())]
    offset, row_bytes = 0, math.prod(tensor.shape[1:]) * tensor.element_size()
    for source, n in enumerate(rows):  # (a rank past them, of a tensor with fewer rows, holds none)
        piece = None
        if rank == 0:
            piece = local if source == 0 else local.new_empty((n, *tensor.shape[1:]))
            if source != 0:
                dist.recv(piece, group_src=source, group=mesh.get_group())
            piece = piece.cpu()
        elif rank == source:
            dist.send(local, group_dst=0, group=mesh.get_group())
        yield offset, piece
        offset += n * row_bytes


def model_state_dict(model):
    """model.state_dict(), whole (full_state_dict), whether or not model is sharded."""
    return full_state_dict(model.state_dict(keep_vars=True))


def shard_optimizer_state(optimizer, state):
    """A saved (whole) optimizer state_dict cut to this rank's shards of the optimizer's parameters, for
    optimizer.load_state_dict; unchanged when they are not sharded. Nothing returned is a view of state's
    tensors: one of a memory-mapped checkpoint (AdamW's step, kept as it is) would keep the whole file
    mapped, and every page a rank read of it resident, for the rest of the run."""
    params = [p for group in optimizer.param_groups for p in group['params']]

    def shard_like(value, param):
        if not (is_dtensor(param) and isinstance(value, torch.Tensor)):
            return value
        if value.shape == param.shape:
            from torch.distributed.tensor import distribute_tensor
            return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        return value.clone()
    return dict(state, state={i: {k: shard_like(v, params[i]) for k, v in per_param.items()}
                              for i, per_param in state['state'].items()})


@contextmanager
def whole_root(model):
    """The weights outside the blocks (embeddings, final norm, head) gathered whole for the block's length:
    generate() calls the model's parts directly, past the root's own gathering. Under FSDP every rank must
    generate the same tokens together (each block's all-gather is collective)."""
    if not is_sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
