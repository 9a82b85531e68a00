"""
Checkpoints that survive crashes, preemption and mistakes.

- save_checkpoint writes to a temp file in the same folder, fsyncs it and renames it over the
  target, so a crash mid-save leaves the previous checkpoint intact.
- load_checkpoint uses torch.load(weights_only=True): a checkpoint can hold tensors, numbers,
  strings, lists and dicts, never arbitrary pickled objects. Everything we store is of that kind.
- rng_state/set_rng_state capture every random stream a training step touches, so a resumed run
  continues bit-for-bit where the old one stopped; all_rng_states gathers every rank's.
- file_sha256 names the exact file a run depends on (a LoRA base, a DPO reference).
- run_log is what every training script writes besides checkpoints: out_dir/log.jsonl and TensorBoard.
"""

import hashlib
import json
import os
import random
import signal
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from configurator import UserError


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
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
    # make the rename itself durable
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path):
    if not os.path.isfile(path):
        problem = "is a folder, not a checkpoint file" if os.path.isdir(path) else "does not exist"
        raise UserError(f"checkpoint {path} {problem}. Check the path (train.py can also start from scratch: "
                        f"--init_from=scratch).")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = str(e).split('\n')[0][:200] or 'the file is empty or cut short'
        raise UserError(f"checkpoint {path} could not be read ({type(e).__name__}: {reason}). "
                        f"The file is corrupt or was not written by nanotrain; restore it from a backup, or start "
                        f"without it: point --init_from at another checkpoint, or use a new out_dir (train.py: "
                        f"--init_from=scratch; train_dpo.py: --resume=False).") from None


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


def run_log(out_dir, enabled, tensorboard, purge_step):
    """(record, writer): record(event) appends a dict with a 'step' to out_dir/log.jsonl and writes its
    numbers to TensorBoard (writer, None when tensorboard=False; purge_step drops events a resumed
    run repeats). Not enabled (every rank but 0): record does nothing and writer is None."""
    if not enabled:
        return (lambda event: None), None
    os.makedirs(out_dir, exist_ok=True)
    log_file = open(os.path.join(out_dir, 'log.jsonl'), 'a')
    writer = None
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(os.path.join(out_dir, 'tb'), purge_step=purge_step)

    def record(event):
        log_file.write(json.dumps(event) + '\n')
        log_file.flush()
        if writer:
            for k, v in event.items():
                if k != 'step' and isinstance(v, (int, float)):
                    writer.add_scalar(k, v, event['step'])
    return record, writer


def check_compatible(saved, wanted, what, path, fix="Set these keys to the checkpoint's values, or use a different "
                     "out_dir / --init_from=scratch to train a new model."):
    """Raise a UserError listing every field where a checkpoint disagrees with the current config, then fix."""
    diffs = [f"{k}: checkpoint has {saved.get(k)!r}, config has {wanted.get(k)!r}"
             for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
    if diffs:
        raise UserError(f"the {what} of checkpoint {path} does not match the current config (" + "; ".join(diffs)
                        + f"). {fix}")


class StopSignal:
    """SIGTERM/SIGINT set a flag; the training loop finishes its step, saves, and exits 143/130."""

    def __init__(self):
        self.requested = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = signum

    @property
    def exit_code(self):
        return 128 + self.requested
