"""
Checkpoints that survive crashes, preemption and mistakes.

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
- claim_out_dir checks out_dir can be written and locks it for the run's lifetime; run_to_continue
  decides whether a launch continues the run out_dir holds, so that relaunching the same command
  after a kill continues it and a different run never overwrites it; open_run does both, as every
  training script starts. require_starting_weights: a new run's init_from must be there.
- training_state/restore_training_state: the part of a checkpoint every training script saves and
  continues from the same way (optimizer, loss scaler, step counters, random streams).
- run_log is what every training script writes besides checkpoints: out_dir/log.jsonl and TensorBoard.
- training_data_hash: a continued run must read the training file it began with; cached_tensors:
  values computed once per run and kept in out_dir (DPO's reference log-probs).
(The model a GPT run starts from, a checkpoint or a Hugging Face folder: run/starting_model.py.)
"""

import fcntl
import glob
import hashlib
import json
import math
import os
import pickle
import random
import shutil
import tempfile
import zipfile

import numpy as np
import torch
import torch.distributed as dist

from configurator import UserError, require_writable_folder
from run.fsdp import full_state_dict, shard_optimizer_state
from run.runtime import log

CHECKPOINT_FORMATS = ('file', 'sharded')  # one file, or a folder of every rank's shards (run/sharded_checkpoint.py)


def save_checkpoint(path, state):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; a checkpoint is an ordinary readable file
        os.replace(tmp_path, path)
    except BaseException as e:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        if isinstance(e, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
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
    them (sharded under FSDP): one file, every sharded tensor gathered whole onto rank 0 (full_state_dict), or
    with sharded a folder of every rank's shards that the file names (run/sharded_checkpoint.py). Shard folders of
    earlier saves are removed once path is written. Collective under DDP and FSDP: every rank must call it."""
    if sharded:
        from run.sharded_checkpoint import write_shards  # imports torch.distributed.checkpoint (0.2 s): only if used
        state = write_shards(path, state)
    else:
        state = full_state_dict(state)
    if master:
        save_checkpoint(path, state)
        for folder in shard_folders(path):
            if os.path.basename(folder) != state.get('shards'):
                shutil.rmtree(folder, ignore_errors=True)


def shard_folders(path):
    """The folders of shards written for the checkpoint file path (ckpt.pt: ckpt-<step>.dcp)."""
    return glob.glob(glob.escape(os.path.splitext(path)[0]) + '-*.dcp')


def load_checkpoint(path, whole=True):
    """A checkpoint file, its tensors memory-mapped. A sharded one's folder is read whole, as if it were one
    file; not whole, its weights are placeholders on the meta device (restore_training_state reads each rank's
    shards into a sharded model)."""
    if not os.path.isfile(path):
        problem = "is a folder, not a checkpoint file" if os.path.isdir(path) else "does not exist"
        raise UserError(f"checkpoint {path} {problem}. Check the path (train.py can also start from scratch: "
                        f"--init_from=scratch).")
    try:
        if not zipfile.is_zipfile(path):  # what torch.save writes (and mmap needs)
            raise EOFError()
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:  # torch's own text advises weights_only=False, i.e. running the file's code
        detail = str(e).partition('WeightsUnpickler error:')[2].strip().split('\n')[0].split('. ')[0][:200]
        raise UserError(f"checkpoint {path} could not be read ({detail or 'not a checkpoint'}): it is corrupt, or it "
                        f"holds objects other than tensors and plain values, which nanotrain never writes and does not "
                        f"load because loading them can run code. Restore it from a backup, or point at a nanotrain "
                        f"checkpoint.") from None
    except Exception as e:
        reason = str(e).split('\n')[0][:200] or 'the file is empty or cut short'
        raise UserError(f"checkpoint {path} could not be read ({type(e).__name__}: {reason}). "
                        f"The file is corrupt or was not written by nanotrain; restore it from a backup, or start "
                        f"without it: point --init_from at another checkpoint, or start a new run (another out_dir, "
                        f"or --resume=False to replace the run in this one).") from None
    if isinstance(ckpt, dict) and 'shards' in ckpt:
        from run.sharded_checkpoint import placeholders, read_whole
        return read_whole(ckpt, path) if whole else placeholders(ckpt, path)
    return ckpt


def claim_out_dir(out_dir):
    """Create out_dir, check that files can be written in it, and lock it for the life of this process
    (the lock goes with the process, so a killed run leaves none behind). Temporaries of a save that
    was killed are removed. Returns the open lock file: keep a reference to it."""
    require_writable_folder(out_dir)
    lock = open(os.path.join(out_dir, 'run.lock'), 'a+')
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or 'unknown'
        raise UserError(f"another run (process {holder}) is training in {out_dir}. Wait for it to end, stop it, or "
                        f"pick another --out_dir.") from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    for stale in glob.glob(os.path.join(glob.escape(out_dir), '*.tmp')):
        os.remove(stale)
    return lock


def continued_origin(init_from, out_dir, resume):
    """init_from, but for nanoGPT's init_from='resume' (continue the run in out_dir, which nanotrain does whenever
    there is one) the init_from that run began with, so that this launch is that run; never a file named
    'resume'. 'auto' is no setting: a UserError says what is."""
    if init_from == 'auto':
        raise UserError("init_from='auto' is not a setting: a run in out_dir is continued anyway (resume=True, the "
                        "default), and init_from says where a new run's weights start: 'scratch', a checkpoint file, "
                        "a Hugging Face folder, or 'resume' to continue the run in out_dir and nothing else.")
    if init_from != 'resume':
        return init_from
    path = os.path.join(out_dir, 'ckpt.pt')
    if not resume:
        raise UserError("init_from='resume' continues the run in out_dir and resume=False starts a new one there; "
                        "drop one of them.")
    if not os.path.exists(path):
        raise UserError(f"init_from='resume' continues the run in {out_dir}, but there is none ({path} does not "
                        f"exist). Point --out_dir at the run's folder, or start a new run with --init_from=scratch "
                        f"or a checkpoint.")
    return load_checkpoint(path, whole=False).get('run', {}).get('init_from', 'scratch')


def run_origin(init_from):
    """Where a run's weights start, as its checkpoints record it: 'scratch' or a checkpoint's absolute path."""
    return init_from if init_from == 'scratch' else os.path.abspath(init_from)


def is_hf_folder(path):
    """A Hugging Face model folder: one with a config.json (hf/checkpoint.py reads it)."""
    return os.path.isfile(os.path.join(path, 'config.json'))


def require_init_from(init_from, made_by=None, hf_folders=False):
    """A UserError unless init_from is a checkpoint file (or, with hf_folders, a Hugging Face model
    folder); made_by: the command that writes it, when init_from is where a documented command writes
    its model."""
    if os.path.isfile(init_from) or hf_folders and is_hf_folder(init_from):
        return
    how = f"It is made by {made_by}; run that first, or point" if made_by else "Check the path, or point"
    what = "a checkpoint file or a Hugging Face model folder (one with a config.json)" if hf_folders else "a checkpoint file"
    raise UserError(f"init_from={init_from!r} is not {what}. {how} --init_from at the checkpoint this run should "
                    f"start from.")


def run_to_continue(out_dir, resume, run, eval_only, whole=True):
    """The checkpoint of the run in out_dir when this launch continues it, else None (a new run); whole as in
    load_checkpoint.
    run: what identifies this launch's run (script, training type, where its weights start); a
    checkpoint recorded by another run is refused unless resume=False (which replaces that run).
    eval_only evaluates whatever run of this script is there, wherever its weights started."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if not resume or not os.path.exists(path):
        return None
    ckpt = load_checkpoint(path, whole)
    saved = ckpt.get('run', {})  # older checkpoints do not say: continue them
    # init_from may differ to evaluate, or where the model the run began from has moved (gone from where it was,
    # there where this command says: the script checks it is the same model, by its sha256 or its tokenizer)
    moved = saved.get('init_from', 'scratch') != 'scratch' and not os.path.exists(saved['init_from']) \
        and os.path.exists(run.get('init_from', ''))
    diffs = [f"{k}: the run there has {saved[k]!r}, this command {run.get(k)!r}"
             for k in saved if saved[k] != run.get(k) and not (k == 'init_from' and (eval_only or moved))]
    if diffs:
        raise UserError(f"{out_dir} holds another run, and this command would overwrite its checkpoints ("
                        + "; ".join(diffs) + "). Use another --out_dir, or --resume=False to start a new run there "
                        "in its place.")
    return ckpt


def open_run(out_dir, resume, run, eval_only, master, whole=True):
    """What every training script does first with out_dir: rank 0 claims it before any work (claim_out_dir), and
    a checkpoint there is this run's to continue, never another's (run_to_continue). Returns (the lock, None on
    the other ranks: keep a reference to it; the checkpoint's path; the checkpoint to continue, or None)."""
    lock = claim_out_dir(out_dir) if master else None
    return lock, os.path.join(out_dir, 'ckpt.pt'), run_to_continue(out_dir, resume, run, eval_only, whole)


def require_starting_weights(ckpt, init_from, eval_only, ckpt_path, made_by=None, hf_folders=False,
                             what='a checkpoint'):
    """A UserError unless a new run (ckpt None) has weights to start from: init_from must be there (as in
    require_init_from), and eval_only needs a trained model (what: the kind init_from should point at)."""
    if ckpt is not None:
        return
    if init_from != 'scratch':
        require_init_from(init_from, made_by, hf_folders)
    elif eval_only:
        raise UserError(f"eval_only=True needs a trained model, but {ckpt_path} does not exist; point --out_dir at a "
                        f"run or --init_from at {what}.")


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


def logged_step(line):
    """The step of a log.jsonl line; None for a line cut short by a kill."""
    try:
        return json.loads(line)['step']
    except (ValueError, KeyError, TypeError):
        return None


def run_log(out_dir, enabled, tensorboard, keep_until):
    """(record, writer): record(event) appends a dict with a 'step' to out_dir/log.jsonl and writes its
    numbers to TensorBoard (writer, None when tensorboard=False). keep_until: the existing log keeps
    its events up to this step: a continued run's step (the events a killed run wrote past its
    checkpoint are done again), -1 for a new run (an empty log), math.inf to append (eval_only).
    Not enabled (every rank but 0): record does nothing and writer is None."""
    if not enabled:
        return (lambda event: None), None
    log_path = os.path.join(out_dir, 'log.jsonl')
    kept = []
    if os.path.exists(log_path):
        with open(log_path) as f:
            kept = [line for line in f if (step := logged_step(line)) is not None and step <= keep_until]
    with open(log_path + '.tmp', 'w') as f:
        f.writelines(kept)
    os.replace(log_path + '.tmp', log_path)
    log_file = open(log_path, 'a')
    writer = None
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(out_dir, 'tb'),
                               purge_step=None if keep_until == math.inf else max(keep_until, 0))

    def record(event):
        log_file.write(json.dumps(event) + '\n')
        log_file.flush()
        if writer:
            for k, v in event.items():
                if k != 'step' and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, event['step'])
            writer.flush()  # on disk now, like log.jsonl: a torchrun process ends without closing it (run/runtime.py)
    return record, writer


def check_compatible(saved, wanted, what, path, fix="Set these keys to the checkpoint's values, or use a different "
                     "out_dir / --init_from=scratch to train a new model.", may_differ=()):
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
    scaler.load_state_dict(ckpt['scaler'])
    if len(ckpt['rng']) == world_size:
        set_rng_state(ckpt['rng'][rank])
    else:
        written_by = len(ckpt['rng'])
        log(f"note: checkpoint was written by {written_by} process{'es' * (written_by != 1)}, now {world_size}: "
            f"random streams restart")
    log(f"resuming from {ckpt_path} at step {ckpt['iter_num']}")
    return ckpt['iter_num'], ckpt['best_val_loss'], ckpt['evals_without_improvement']


def training_data_hash(path, ckpt, out_dir, setting):
    """sha256 of a run's training data file; a continued run's (ckpt) must be the file it began with.
    setting: the config key that names the data, for the message."""
    data_hash = file_sha256(path)
    if ckpt and data_hash != ckpt.get('train_data_hash', data_hash):  # older checkpoints: unknown
        raise UserError(f"{path} has changed since the run in {out_dir} began; resuming would go on with other "
                        f"examples. Restore the file (or {setting}), or start a new run (another out_dir, or "
                        f"--resume=False to replace it).")
    return data_hash


def cached_tensors(out_dir, name, key, shapes, compute, master, what):
    """{name: tensor} computed once and cached in out_dir, in a file named by name and a hash of key (everything
    the tensors depend on, JSON): read back when it is there, else compute() (on every rank) and saved by master.
    shapes: the {name: shape} the cached tensors must have; what: what they are, for messages."""
    path = os.path.join(out_dir, f"{name}_{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.pt")
    if not os.path.exists(path):
        tensors = compute()
        if master:
            save_checkpoint(path, tensors)
        log(f"{what} computed, cached in {path}")
        return tensors
    try:
        tensors = load_checkpoint(path)
        fits = {k: tensors[k].shape for k in shapes} == shapes
    except (UserError, KeyError, AttributeError, TypeError):
        fits = False
    if not fits:
        raise UserError(f"{path}, the cached {what}, is unreadable or does not fit the data. Delete it: it is "
                        f"computed again.")
    log(f"{what} from {path}")
    return tensors
