"""
Checkpoint files that survive crashes, preemption and mistakes, and the training state in them.

- save_checkpoint writes to a temp file in the same folder, fsyncs it and renames it over the
  target, so a crash mid-save leaves the previous checkpoint intact. write_checkpoint: a training
  script's checkpoint, one file gathered onto rank 0, or every rank's shards (run/sharded_checkpoint.py).
- load_checkpoint uses torch.load(weights_only=True): a checkpoint can hold tensors, numbers,
  strings, lists and dicts, never arbitrary pickled objects. Everything we store is of that kind.
  Its tensors are memory-mapped: read from disk as they are used, so a rank that keeps only its
  shard of a model (FSDP) reads only that.
- rng_state/set_rng_state capture every random stream a training step touches, so a resumed run
  continues bit-for-bit where the old one stopped; all_rng_states gathers every rank's.
- file_sha256 names the exact file a run depends on (a LoRA base, a DPO reference).
- training_state/restore_training_state: the part of a checkpoint every training script saves and
  continues from the same way (optimizer, loss scaler, step counters, random streams).
(The run folder a checkpoint lives in, its lock, log and whether a launch continues it: run/run_folder.py.
The model a GPT run starts from, a checkpoint or a Hugging Face folder: starting_model.py.)
"""
import glob
import hashlib
import os
import pickle
import random
import re
import shutil
import struct
import tempfile
import zipfile
import zlib
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist

from configurator import UserError
from run.fsdp import is_dtensor, map_tensors, pieces_on_rank0, shard_optimizer_state, tensors_in
from run.runtime import log

# one file, or a folder of every rank's shards (run/sharded_checkpoint.py)
CHECKPOINT_FORMATS = ('file', 'sharded')


def save_checkpoint(path, state):
    with atomic_file(path) as f:
        torch.save(state, f)


@contextmanager
def atomic_file(path):
    """A file opened for writing, written to a temp file in path's folder, fsynced and renamed over path
    when the block ends: a crash or error mid-write leaves the previous file intact."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary readable file
        os.replace(tmp_path, path)
    except BaseException as e:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        # torch.save reports a failed write as a RuntimeError
        if isinstance(e, (OSError, RuntimeError)):
            kept = f"{path} was left as it was" if os.path.exists(path) else f"nothing was written to {path}"
            raise UserError(f"could not write checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
                            f"The disk may be full or a file-size limit (ulimit -f) reached; {kept}. Free space "
                            f"(or raise the limit) and relaunch the same command: it continues from the last "
                            f"checkpoint in {folder}.") from None
        raise
    # make the rename itself durable
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_checkpoint(path, state, sharded, master):
    """Write a training script's checkpoint, state, whose model and optimizer state dicts are as the run holds
    them (sharded under FSDP): one file, every sharded tensor gathered whole onto rank 0 one at a time
    (save_gathered), or with sharded a folder of every rank's shards that the file names
    (run/sharded_checkpoint.py). Shard folders of earlier saves are removed once path is written. Collective
    under DDP and FSDP: every rank must call it."""
    if sharded:
        # imports torch.distributed.checkpoint (0.2 s): only if used
        from run.sharded_checkpoint import write_shards
        state = write_shards(path, state, shard_folders(path))
    if not sharded and any(is_dtensor(t) for t in tensors_in(state)):
        save_gathered(path, state, master)
    elif master:
        save_checkpoint(path, map_tensors(state, torch.Tensor.detach))
    if master:
        for folder in shard_folders(path):
            if os.path.basename(folder) != state.get('shards'):
                shutil.rmtree(folder, ignore_errors=True)


@torch.no_grad()
def save_gathered(path, state, master):
    """Save state, whose sharded tensors (FSDP's DTensors) each rank holds its shards of, as the one file
    torch.save(full_state_dict(state)) writes, without any rank holding it whole. Rank 0 first writes the
    file's structure with a gap where each tensor's bytes go (torch.save under skip_data, of placeholders of
    the right shapes and dtypes that hold no memory) and reads back where each gap starts (the file loaded
    on the meta device); then each tensor in turn comes to rank 0's CPU a shard at a time
    (fsdp.pieces_on_rank0), which rank 0 writes into its gap. Beyond their shards, rank 0 holds one shard of
    one tensor at a time, the other ranks nothing. Collective: every rank must call it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    tensors = tensors_in(state)
    with (atomic_file(path) if master else nullcontext()) as f:
        if master:
            with FakeTensorMode():
                structure = map_tensors(state, lambda t: torch.empty(t.shape, dtype=t.dtype))
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(structure, f)
            f.seek(0)
            gaps = [t.untyped_storage()._checkpoint_offset
                    for t in tensors_in(torch.load(f, map_location='meta', weights_only=True))]
        checksums = {}  # a gap's offset -> the CRC-32 of the bytes written there
        for i, tensor in enumerate(tensors):
            for start, piece in pieces_on_rank0(tensor):  # collective
                if master:
                    checksums[gaps[i]] = write_bytes(f, gaps[i] + start, piece, checksums.get(gaps[i], 0))
                del piece  # before the next comes
        if master:
            write_checksums(f, checksums)


def write_bytes(f, offset, tensor, crc):
    """Write tensor's bytes (of any dtype, on the CPU) into f at offset; returns crc, a CRC-32, carried over
    them."""
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    f.seek(offset)
    f.write(data)
    return zlib.crc32(data, crc)


def write_checksums(f, checksums):
    """Write into the zip file f (a torch.save) the CRC-32 of each record whose data starts at an offset in
    checksums ({offset: CRC-32}), where torch.save's writer records it: in the central directory and in the
    data descriptor that follows the record's data (written under skip_data, they are a gap's)."""
    archive = zipfile.ZipFile(f)
    entry = archive.start_dir  # the central directory: an entry a record, in infolist's order
    for info in archive.infolist():
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack('<HH', f.read(4))
        start = info.header_offset + 30 + name_length + extra_length  # past the local header
        f.seek(entry + 28)
        entry_length = 46 + sum(struct.unpack('<HHH', f.read(6)))  # + name, extra field, comment
        if start in checksums and info.compress_size:  # an empty tensor's record has no descriptor
            crc = struct.pack('<I', checksums[start])
            f.seek(start + info.compress_size)
            if f.read(4) != b'PK\x07\x08':
                raise RuntimeError(f"{info.filename}: no data descriptor after its data (torch.save's zip changed?)")
            f.write(crc)
            f.seek(entry + 16)
            f.write(crc)
        entry += entry_length


def shard_folders(path):
    """The folders of shards written for the checkpoint file path (ckpt.pt: ckpt-<step>.dcp, ckpt-<step>.<n>.dcp;
    run/sharded_checkpoint.py names them), not another folder a user keeps there (ckpt-100-copy.dcp)."""
    stem = os.path.splitext(path)[0]
    return [folder for folder in glob.glob(glob.escape(stem) + '-*.dcp')
            if re.fullmatch(r'\d{6,}(\.\d+)?\.dcp', folder[len(stem) + 1:])]


def file_kind(path):
    """What a file that is no PyTorch checkpoint is, by its first bytes ('a WAV file (audio)', 'a text file',
    ...), for messages; '' for a file torch.save may have written (a zip archive, a pickle)."""
    with open(path, 'rb') as f:
        head = f.read(4096)
    if not head:
        return 'empty'
    if head[:4] == b'PK\x03\x04' or head[:1] == b'\x80':  # torch.save's zip; a legacy pickle (protocol 2+)
        return ''
    if head[:4] == b'RIFF' and head[8:12] == b'WAVE':
        return 'a WAV file (audio)'
    if len(head) > 8 and head[8:10] == b'{"':  # a little-endian header length, then its JSON
        return 'a safetensors file'
    try:
        text = head.decode('utf-8')
    except UnicodeDecodeError as e:
        text = head[:e.start].decode('utf-8') if e.start > len(head) - 4 else None  # cut mid-character at 4096
    if text is None or '\0' in text:
        return ''
    return 'a JSON file' if text.lstrip().startswith(('{', '[')) else 'a text file'


RUN_FIX = "point --init_from at another checkpoint"  # what a training script can do without its starting model
# ... and without the checkpoint of the run in out_dir, which is continued whatever init_from says
RESUME_FIX = "start a new run (another --out_dir, or --resume=False to replace the run there)"


def unpickling_detail(e):
    """What weights_only's refusal (a pickle.UnpicklingError) says of a file, without torch's advice to load it with
    weights_only=False, which would run the file's code."""
    return str(e).partition('WeightsUnpickler error:')[2].strip().split('\n')[0].split('. ')[0][:200]


class NotACheckpoint(UserError):
    """A file torch.load reads that holds no checkpoint (a dict): nanotrain never wrote it, so a run folder never
    replaces it (run/run_folder.py), unlike a checkpoint too corrupt to read."""


def load_checkpoint(path, whole=True, fix=RUN_FIX):
    """A checkpoint file, its tensors memory-mapped. A sharded one's folder is read whole, as if it were one
    file; not whole, its weights are placeholders on the meta device (restore_training_state reads each rank's
    shards into a sharded model). fix: what the calling script's user can do instead, for the messages."""
    if not os.path.isfile(path):
        problem = "is a folder, not a checkpoint file" if os.path.isdir(path) else "does not exist"
        raise UserError(f"checkpoint {path} {problem}. Check the path, or {fix}.")
    kind = file_kind(path)
    if kind not in ('', 'empty'):  # a file torch.save never writes: no backup to restore, a wrong path
        folder = os.path.dirname(os.path.abspath(path))
        published = (f" (a Hugging Face model's weights: the scripts that start from a published model take its "
                     f"folder, {folder})" if kind == 'a safetensors file'
                     and os.path.isfile(os.path.join(folder, 'config.json')) else '')
        raise UserError(f"checkpoint {path} is {kind}, not a checkpoint{published}. Check the path, or {fix}.")
    with open(path, 'rb') as f:
        if f.read(3) == b'\x80\x02\x8a':  # protocol 2, then torch's magic number: torch.save before 1.6
            raise UserError(f"checkpoint {path} is a PyTorch file of the format before torch 1.6 (a published "
                            f"HiFi-GAN generator is one), which nanotrain never writes. Check the path, or {fix}.")
    try:
        if not zipfile.is_zipfile(path):  # what torch.save writes (and mmap needs)
            raise EOFError()
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    # torch's own text advises weights_only=False, i.e. running the file's code
    except pickle.UnpicklingError as e:
        detail = unpickling_detail(e) or 'not a checkpoint'
        raise UserError(f"checkpoint {path} could not be read ({detail}): it is corrupt, or it "
                        f"holds objects other than tensors and plain values, which nanotrain never writes and does not "
                        f"load because loading them can run code. Restore it from a backup, or point at a nanotrain "
                        f"checkpoint.") from None
    except Exception as e:
        reason = str(e).split('\n')[0][:200] or 'the file is empty or cut short'
        raise UserError(f"checkpoint {path} could not be read ({type(e).__name__}: {reason}). "
                        f"The file is corrupt or was not written by nanotrain; restore it from a backup, or "
                        f"{fix}.") from None
    if not isinstance(ckpt, dict):
        raise NotACheckpoint(f"checkpoint {path} holds a {type(ckpt).__name__}, not a checkpoint (a run's state, a "
                             f"dict). Check the path, or {fix}.")
    if 'shards' in ckpt:
        from run.sharded_checkpoint import placeholders
        ckpt = placeholders(ckpt, path, fix)
    return whole_checkpoint(ckpt) if whole else ckpt


def check_model_fields(ckpt, path, fix):
    """A language model's checkpoint (kind 'gpt' or 'lora') holds what it is loaded by; one that lacks a field was
    edited, or written by something else."""
    lacks = [k for k in ('model', 'model_args', 'config', 'data_dir', 'tokenizer') + (
        ('base_checkpoint', 'base_hash') if ckpt['kind'] == 'lora' else ()) if k not in ckpt]
    if lacks:
        raise UserError(f"checkpoint {path} lacks {', '.join(map(repr, lacks))}, which a language model's checkpoint "
                        f"holds: it was edited, or not written by nanotrain. Restore it from a backup, or {fix}.")


def whole_checkpoint(ckpt):
    """ckpt as a process that holds the whole model needs it: a sharded checkpoint read not whole (load_checkpoint)
    has its weights and optimizer state read in from its folder; any other is returned as it is."""
    if not (isinstance(ckpt, dict) and 'reader' in ckpt):
        return ckpt
    from run.sharded_checkpoint import read_whole
    return read_whole(ckpt)


def rng_state():
    """Random streams of this process, stored as tensors/lists (loadable with weights_only=True)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def all_rng_states():
    """Every process's rng_state(), in rank order. Collective under DDP: every rank must call it."""
    if not dist.is_initialized():
        return [rng_state()]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def set_rng_state(state):
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


def file_sha256(*paths):
    """sha256 of the files' bytes, one after the other."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, 'rb') as f:
            for chunk in iter(lambda: f.read(1 << 20), b''):
                digest.update(chunk)
    return digest.hexdigest()


# how a refused relaunch starts over: init_from says where a new run starts, but the run in out_dir is continued
# whatever it says (run/run_folder.py), so a new run needs another out_dir or resume=False
NEW_RUN = "or start a new run: another --out_dir, or --resume=False to replace the one there"


def check_compatible(saved, wanted, what, path, fix=f"Set these keys back to the checkpoint's values to continue its "
                     f"run, {NEW_RUN}.", may_differ=()):
    """Raise a UserError listing every field where a checkpoint disagrees with the current config, then fix.
    may_differ: fields a run may change (e.g. dropout)."""
    diffs = [f"{k}: checkpoint has {saved.get(k)!r}, config has {wanted.get(k)!r}"
             for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k) and k not in may_differ]
    if diffs:
        raise UserError(f"the {what} of checkpoint {path} does not match the current config (" + "; ".join(diffs)
                        + f"). {fix}")


def training_state(run, config, optimizer, scaler, iter_num, best_val_loss, evals_without_improvement):
    """What every training script's checkpoint holds besides its model and data position: the run it
    belongs to, its config, the optimizer and loss-scaler state, the step counters, and every rank's
    random streams (collective under DDP and FSDP: every rank must call it). An FSDP run's optimizer state is
    its shards: write_checkpoint gathers them whole (run/fsdp.py), so any run can continue from it, or writes them."""
    return dict(run=run, config=config, optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                iter_num=iter_num, best_val_loss=best_val_loss, evals_without_improvement=evals_without_improvement,
                rng=all_rng_states())


def restore_training_state(ckpt, ckpt_path, optimizer, scaler, rank, world_size, model=None):
    """Load training_state's part of a checkpoint into a continued run; returns its step counters
    (iter_num, best_val_loss, evals_without_improvement). Each rank takes back its own random streams
    when the world size is the same, so the run continues bit for bit. A sharded checkpoint read not whole
    (load_checkpoint) fills the sharded model's weights too."""
    if 'shards' in ckpt:
        from run.sharded_checkpoint import read_shards
        read_shards(ckpt, model, optimizer)
    else:
        optimizer.load_state_dict(shard_optimizer_state(optimizer, ckpt['optimizer']))
    # empty from a run without fp16 (bf16 on another machine): a fp16 run keeps its initial scale, which
    # finds its level within a few steps (torch refuses an empty state)
    if ckpt['scaler']:
        scaler.load_state_dict(ckpt['scaler'])
    if len(ckpt['rng']) == world_size:
        set_rng_state(ckpt['rng'][rank])
    else:
        written_by = len(ckpt['rng'])
        log(f"note: checkpoint was written by {written_by} process{'es' * (written_by != 1)}, now {world_size}: "
            f"random streams restart")
    log(f"resuming from {ckpt_path} at step {ckpt['iter_num']}")
    return ckpt['iter_num'], ckpt['best_val_loss'], ckpt['evals_without_improvement']


