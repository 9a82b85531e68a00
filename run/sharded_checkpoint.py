"""
Sharded checkpoints (checkpoint_format='sharded'), for models whose whole state does not fit in one
host's memory: every rank writes its own shards of the weights and optimizer state with
torch.distributed.checkpoint (DCP) into a folder next to ckpt.pt, ckpt-<step>.dcp/, and ckpt.pt keeps
the rest (config, step counters, data position, random streams) and names that folder. ckpt.pt is
replaced (atomically) only once the folder is complete, and older folders are removed only after, so a
kill at any moment leaves the previous checkpoint whole. On a cluster out_dir must be a shared file
system.

Reading one: an FSDP run continuing its own run reads only its shards, on any number of ranks
(read_shards); everything else (one process, DDP, sample.py, export.py, a new run's init_from) reads
the folder whole through checkpoint.load_checkpoint, as one file. `python -m run.sharded_checkpoint
out/ckpt.pt out/whole.pt` writes that one file.

The optimizer state is kept as optimizer.state_dict() has it, by parameter position, as in a one-file
checkpoint; a weight under two names (tied embeddings) is written once.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

if __name__ == '__main__' and not __package__:  # run by path: the modules are a folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configurator import UserError  # noqa: E402


def without_aliases(weights):
    """(weights, detached, with each tensor under its first name only; {other name: first name})."""
    first, unique, aliases = {}, {}, {}
    for name, tensor in weights.items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)], unique[name] = name, tensor.detach()
    return unique, aliases


def write_shards(path, state, taken):
    """Write the weights and optimizer state of state (a training script's checkpoint, its 'model' and
    'optimizer' state dicts as the run holds them: sharded under FSDP), each rank its shards, into a new
    folder next to path, named as none of taken (the folders of earlier saves: checkpoint.shard_folders);
    returns what path then holds: the rest of state and the folder's name. Collective."""
    name = None
    # a new folder even if this step was saved before
    if not dist.is_initialized() or dist.get_rank() == 0:
        used = {os.path.basename(f) for f in taken}
        stem = f"{os.path.splitext(os.path.basename(path))[0]}-{state['iter_num']:06d}"
        name = next(n for n in [f'{stem}.dcp'] + [f'{stem}.{i}.dcp' for i in range(1, len(used) + 1)] if n not in used)
    if dist.is_initialized():
        names = [name]
        dist.broadcast_object_list(names, src=0)
        name = names[0]
    weights, aliases = without_aliases(state['model'])
    dcp.save({'model': weights, 'optimizer': state['optimizer']['state']},
             checkpoint_id=os.path.join(os.path.dirname(os.path.abspath(path)), name))
    rest = {k: v for k, v in state.items() if k not in ('model', 'optimizer')}
    return dict(rest, shards=name, aliases=aliases, optimizer={'param_groups': state['optimizer']['param_groups']})


def shard_folder(ckpt, path, fix):
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), ckpt['shards'])
    if not os.path.isfile(os.path.join(folder, '.metadata')):
        raise UserError(f"{path} names the folder of its weights and optimizer state, {folder}, which is missing or "
                        f"incomplete (no .metadata). Put it back, or {fix}.")
    return folder


def unreadable(folder, error, fix, what='could not be read'):
    # fix: what the calling script's user can do instead (load_checkpoint's)
    # (error, traceback) of each rank that failed: the first one's
    if isinstance(error, CheckpointException):
        error = next(iter(error.failures.values()))[0]
    # may be empty: a file cut short can raise a bare EOFError
    first_line = str(error).split('\n')[0][:200]
    return UserError(f"the shards in {folder} {what} ({type(error).__name__}: {first_line}): "
                     f"a file there is corrupt or cut short, or it was written for another model. Restore the folder "
                     f"from a backup, or {fix}.")


def read_whole(ckpt):
    """A sharded checkpoint (ckpt: placeholders') made whole: the weights and optimizer state read into memory,
    as a one-file checkpoint holds them."""
    shards = {}
    try:
        _load_state_dict(shards, storage_reader=ckpt['reader'], planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as e:  # the latter is not an Exception
        raise unreadable(ckpt['shards'], e, ckpt['fix']) from None
    model = shards['model']
    model.update({name: model[first] for name, first in ckpt['aliases'].items()})
    rest = {k: v for k, v in ckpt.items() if k not in ('shards', 'aliases', 'reader', 'fix')}
    # DCP keys are strings
    state = {int(index): tensors for index, tensors in shards.get('optimizer', {}).items()}
    return dict(rest, model=model, optimizer=dict(ckpt['optimizer'], state=state))


class MetadataOnce(FileSystemReader):
    """A shard folder's reader that reads its .metadata (the layout of every tensor's shards: large for a
    large model) once, however often it is asked: placeholders, read_shards and dcp.load all need it."""

    def read_metadata(self, *args, **kwargs):
        if not hasattr(self, 'metadata'):
            self.metadata = super().read_metadata(*args, **kwargs)
        return self.metadata


def placeholders(ckpt, path, fix):
    """ckpt with its weights as meta tensors of the stored shapes and dtypes (a model to shard is built around
    them; read_shards fills the shards), the shard folder's path in 'shards', its reader in 'reader' and fix
    (what the user can do if the shards cannot be read: load_checkpoint's) in 'fix'."""
    folder = shard_folder(ckpt, path, fix)
    reader = MetadataOnce(folder)
    try:
        metadata = reader.read_metadata()
    except (Exception, CheckpointException) as e:  # the latter is not an Exception
        raise unreadable(folder, e, fix) from None
    model = {key.removeprefix('model.'): torch.empty(m.size, dtype=m.properties.dtype, device='meta')
             for key, m in metadata.state_dict_metadata.items() if key.startswith('model.')}
    model.update({name: model[first] for name, first in ckpt['aliases'].items()})
    return dict(ckpt, model=model, shards=folder, reader=reader, fix=fix)


def read_shards(ckpt, model, optimizer):
    """Fill a sharded model's weights and optimizer state with this rank's shards of ckpt's folder (ckpt:
    placeholders'). The optimizer has no state yet: its tensors are laid out like their parameters (by position)."""
    metadata = ckpt['reader'].read_metadata()
    params = [p for group in optimizer.param_groups for p in group['params']]
    weights, _ = without_aliases(model.state_dict(keep_vars=True))
    optimizer_state = {}
    for key, path in metadata.planner_data.items():
        if path[0] == 'optimizer':
            index, name = int(path[1]), path[2]
            stored, param = metadata.state_dict_metadata[key], params[index]
            optimizer_state.setdefault(index, {})[name] = (
                torch.empty_like(param.detach()) if stored.size == param.shape
                else torch.empty(stored.size, dtype=stored.properties.dtype))
    shards = {'model': weights, 'optimizer': optimizer_state}
    try:
        dcp.load(shards, storage_reader=ckpt['reader'])
    except (Exception, CheckpointException) as e:  # the latter is not an Exception
        raise unreadable(ckpt['shards'], e, ckpt['fix'], "could not be read into this run's model") from None
    optimizer.load_state_dict(dict(ckpt['optimizer'], state=shards['optimizer']))


if __name__ == '__main__':
    # the converter's import, not the module's: run.checkpoint imports this module (to read and write shards),
    # never the other way
    from configurator import install_excepthook
    from run.checkpoint import load_checkpoint, save_checkpoint
    install_excepthook()  # a missing or broken checkpoint: one paragraph, exit 2
    if len(sys.argv) != 3:
        sys.exit("usage: python -m run.sharded_checkpoint <sharded ckpt.pt> <one-file checkpoint to write>")
    save_checkpoint(sys.argv[2], load_checkpoint(sys.argv[1], fix="convert another sharded ckpt.pt"))
    print(f"wrote {sys.argv[2]}")
