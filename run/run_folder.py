"""
The run folder (out_dir): what a training script does with it besides writing checkpoints.

- claim_out_dir checks out_dir can be written and locks it for the run's lifetime; run_to_continue
  decides whether a launch continues the run out_dir holds, so that relaunching the same command
  after a kill continues it and a different run never overwrites it; open_run does both, as every
  training script starts. require_starting_weights: a new run's init_from must be there.
- run_log is what every training script writes besides checkpoints: out_dir/log.jsonl and TensorBoard,
  and with wandb_log the same numbers to Weights & Biases (run/tracker.py).
- training_data_hash: a continued run must read the training file it began with; cached_tensors:
  values computed once per run and kept in out_dir (DPO's reference log-probs).
(The checkpoint files themselves: run/checkpoint.py.)
"""
import fcntl
import glob
import hashlib
import json
import math
import os
import re
import shutil
from typing import NamedTuple

from configurator import UserError, on_refusal, require_writable_folder
from run.checkpoint import RESUME_FIX, NotACheckpoint, file_sha256, load_checkpoint, save_checkpoint, shard_folders
from run.runtime import log


# the temporaries of a killed save (run.checkpoint.atomic_file's <name>.pt.XXXXXXXX.tmp, train_vocoder.py's
# generator.pth.tar and config.json's) or log rewrite (run_log's log.jsonl.tmp), never another *.tmp a user keeps
STALE = re.compile(r'(.+\.pt|generator\.pth\.tar|config\.json)\.[a-z0-9_]+\.tmp|log\.jsonl\.tmp')
# what a training run writes in out_dir: a run that wrote one of these is never undone (leave_as_found)
CHECKPOINT_NAMES = ('ckpt.pt', 'best.pt', 'merged.pt')


def folder_entries(folder):
    """{name: modification time} of the entries of folder."""
    with os.scandir(folder) as entries:
        return {e.name: e.stat(follow_symlinks=False).st_mtime_ns for e in entries}


def claim_out_dir(out_dir):
    """Create out_dir, check that files can be written in it, and lock it for the life of this process
    (the lock goes with the process, so a killed run leaves none behind). Temporaries of a save that
    was killed are removed. A run refused before it saved a checkpoint (a UserError) leaves out_dir as it
    found it: a folder it created is removed, from one that was there what it added (leave_as_found).
    Returns the open lock file: keep a reference to it."""
    created = require_writable_folder(out_dir)
    found = folder_entries(out_dir)
    lock_path = os.path.join(out_dir, 'run.lock')
    lock = open(lock_path, 'a+')
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
        if STALE.fullmatch(os.path.basename(stale)):
            os.remove(stale)
    on_refusal(lambda: leave_as_found(out_dir, created, found))
    return lock


def leave_as_found(out_dir, created, found):
    """Undo a refused run's traces in out_dir, unless it saved a checkpoint there (then it is a run that
    stopped, and everything stays): the folders it created (created, outermost first) go, and from a
    folder that was there (found: its entries then, {name: mtime}) the entries it added (run.lock,
    log.jsonl, tb/, a cache). The run's process still holds the lock; none else can be in out_dir."""
    now = folder_entries(out_dir)
    saved = [name for name in now if (name in CHECKPOINT_NAMES or name.endswith('.dcp'))
             and found.get(name) != now[name]]
    if saved:
        return
    if created:
        shutil.rmtree(created[0])
        return
    for name in set(now) - set(found):
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def run_origin(init_from, out_dir, resume):
    """Where the run of this launch began, as its checkpoints record it: 'scratch' or a model's absolute path.
    That is init_from's, but for nanoGPT's init_from='resume' (continue the run in out_dir, which nanotrain does
    whenever there is one) the origin that run recorded, so that this launch is that run; never a file named
    'resume'. 'auto' is no setting: a UserError says what is."""
    if init_from == 'auto':
        raise UserError("init_from='auto' is not a setting: a run in out_dir is continued anyway (resume=True, the "
                        "default), and init_from says where a new run's weights start: a checkpoint file, say, or "
                        "'resume' to continue the run in out_dir and nothing else (--help says which kinds this "
                        "script takes).")
    if init_from != 'resume':
        return init_from if init_from == 'scratch' else os.path.abspath(init_from)
    path = os.path.join(out_dir, 'ckpt.pt')
    if not resume:
        raise UserError("init_from='resume' continues the run in out_dir and resume=False starts a new one there; "
                        "drop one of them.")
    if not os.path.exists(path):
        raise UserError(f"init_from='resume' continues the run in {out_dir}, but there is none ({path} does not "
                        f"exist). Point --out_dir at the run's folder, or start a new run: set --init_from to the "
                        f"model it starts from (--help says which kinds this script takes).")
    return load_checkpoint(path, whole=False, fix=resume_fix(out_dir)).get('run', {}).get('init_from', 'scratch')


def resume_fix(out_dir):
    """What to do when out_dir's ckpt.pt cannot be read: a one-file best.pt, a whole checkpoint too, continues the
    run from the best eval's step (a sharded one names its own shard folders, which its next save removes)."""
    best = os.path.join(out_dir, 'best.pt')
    return (f"copy {best} over it to continue from the best eval's step (it is a whole checkpoint too), or "
            f"{RESUME_FIX}" if os.path.isfile(best) and not shard_folders(best) else RESUME_FIX)


def is_hf_folder(path):
    """A Hugging Face model folder: one with a config.json (hf/checkpoint.py reads it)."""
    return os.path.isfile(os.path.join(path, 'config.json'))


# where the documented commands write their models, and how: named when a run starts from one not made yet
MADE_BY = {'out/ckpt.pt': '`python train.py` (pretraining)',
           'out-sft/ckpt.pt': '`python train.py` (pretraining, out/ckpt.pt) then `python train.py config/sft.py` (SFT)'}


def require_init_from(init_from, hf_folders=False):
    """A UserError unless init_from is a checkpoint file (or, with hf_folders, a Hugging Face model
    folder); one a documented command writes (MADE_BY) is named with that command."""
    if os.path.isfile(init_from) or hf_folders and is_hf_folder(init_from):
        return
    # the language-model scripts (the ones that take Hugging Face folders) start from these; a TTS script never
    made_by = MADE_BY.get(os.path.normpath(init_from)) if hf_folders else None
    how = f"It is made by {made_by}; run that first, or point" if made_by else "Check the path, or point"
    what = "a checkpoint file or a Hugging Face model folder (one with a config.json)" if hf_folders else "a checkpoint file"
    raise UserError(f"init_from={init_from!r} is not {what}. {how} --init_from at the checkpoint this run should "
                    f"start from.")


def run_to_continue(out_dir, resume, run, eval_only, config=None):
    """The checkpoint of the run in out_dir when this launch continues it, else None (a new run); a sharded
    one's weights as placeholders (load_checkpoint, not whole: run.checkpoint.whole_checkpoint reads them in).
    run: what identifies this launch's run (script, training type, where its weights start); a
    checkpoint recorded by another run is refused unless resume=False (which replaces that run).
    eval_only evaluates whatever run of this script is there, wherever its weights started. config: this launch's
    keys, which a new run's best.pt or merged.pt must have been saved with to be its own (check_replaceable)."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if not resume or not os.path.exists(path):
        if not eval_only:  # a new run: what it will save over must be an earlier run's, replaced on request
            check_replaceable(out_dir, resume, run, config)
        return None
    try:
        ckpt = load_checkpoint(path, whole=False, fix=resume_fix(out_dir))
    except NotACheckpoint:  # its advice (copy best.pt over it) would replace a file nanotrain never wrote
        raise UserError(foreign(path)) from None
    if 'kind' not in ckpt:
        raise UserError(foreign(path))
    saved = ckpt.get('run', {})  # older checkpoints do not say: continue them
    # init_from may differ to evaluate, or where the model the run began from has moved (gone from
    # where it was, there where this command says: the script checks it is the same model, by its
    # sha256 or its tokenizer)
    moved = saved.get('init_from', 'scratch') != 'scratch' and not os.path.exists(saved['init_from']) \
        and os.path.exists(run.get('init_from', ''))
    diffs = [f"{k}: the run there has {saved[k]!r}, this command {run.get(k)!r}"
             for k in saved if saved[k] != run.get(k) and not (k == 'init_from' and (eval_only or moved))]
    if diffs:
        raise UserError(f"{out_dir} holds another run, and this command would overwrite its checkpoints ("
                        + "; ".join(diffs) + "). Use another --out_dir, or --resume=False to start a new run there "
                        "in its place.")
    return ckpt


def foreign(path, what="a checkpoint nanotrain wrote (it holds no 'kind')"):
    return (f"{path} is not {what}, and a run in its folder would write over it: such a file is never replaced. "
            f"Use another --out_dir, or move that file away.")


def check_replaceable(out_dir, resume, run, config=None):
    """A UserError unless a new run (run: its identity, as in run_to_continue) may save its checkpoints
    (CHECKPOINT_NAMES) in out_dir: none there, or an earlier run's that resume=False replaces (one too corrupt
    to read counts as another run's). A file nanotrain did not write is never replaced. Without resume=False
    (so without a ckpt.pt) another run's best.pt or merged.pt (a folder cleaned to keep its best model) is
    refused; this run's own is replaced, as a relaunch after a kill between its first two saves (best.pt,
    then ckpt.pt) must: the same identity and the same config (the same command: two runs from scratch of one
    script share an identity, not their data or shape)."""
    found, others = [], []
    log_path = os.path.join(out_dir, 'log.jsonl')
    if os.path.isfile(log_path):  # a new run empties it: only a run's log, whose lines are events with a step
        with open(log_path, 'rb') as f:
            first = f.readline().decode('utf-8', 'replace')
        if first.strip() and logged_step(first) is None:
            raise UserError(foreign(log_path, "a run's log (its first line is no event with a step)"))
    for name in CHECKPOINT_NAMES:
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            continue
        found.append(name)
        try:
            ckpt = load_checkpoint(path, whole=False)
        except NotACheckpoint:
            raise UserError(foreign(path)) from None
        except UserError:  # corrupt, cut short, or its shards gone: whose, none can say
            others.append(name)
            continue
        if 'kind' not in ckpt:
            raise UserError(foreign(path))
        saved, settings = ckpt.get('run', {}), ckpt.get('config') or {}
        if any(saved[k] != run.get(k) for k in saved) or not saved or any(
                k in (config or {}) and settings[k] != config[k] for k in settings):
            others.append(name)
    if others and resume:
        raise UserError(f"{out_dir} holds {' and '.join(others)} of another run (or unreadable) but no ckpt.pt to "
                        f"continue it, and this new run would replace {'them' if len(others) > 1 else 'it'}. Use "
                        f"another --out_dir, or --resume=False to start a new run there in its place.")
    if found:
        log(f"{'resume=False: ' if not resume else ''}a new run starts in {out_dir}, and its saves replace the "
            f"{', '.join(found)} there")


class OpenRun(NamedTuple):
    """The run folder as a training script starts in it (open_run)."""
    lock: object  # the out_dir lock (None on every rank but 0): keep a reference to it
    ckpt_path: str  # out_dir/ckpt.pt
    ckpt: dict  # the checkpoint of the run this launch continues, or None (a new run)


def open_run(config, run, master):
    """What every training script does first with out_dir: rank 0 (master) claims it before any work
    (claim_out_dir), and a checkpoint there is this run's to continue, never another's (run_to_continue:
    a sharded one's weights are placeholders). config: the script's config keys (out_dir, resume, eval_only);
    run: as in run_to_continue."""
    out_dir = config['out_dir']
    lock = claim_out_dir(out_dir) if master else None
    ckpt = run_to_continue(out_dir, config['resume'], run, config['eval_only'], config)
    return OpenRun(lock, os.path.join(out_dir, 'ckpt.pt'), ckpt)


def require_starting_weights(ckpt, init_from, eval_only, ckpt_path, hf_folders=False):
    """A UserError unless a new run (ckpt None) has weights to start from: init_from must be there (as in
    require_init_from), and eval_only needs a trained model."""
    if ckpt is not None:
        return
    if init_from != 'scratch':
        require_init_from(init_from, hf_folders)
    elif eval_only:
        raise UserError(f"eval_only=True needs a trained model, but {ckpt_path} does not exist; point --out_dir at a "
                        f"run, or --init_from at a trained model's checkpoint.")


def logged_step(line):
    """The step of a log.jsonl line; None for a line cut short by a kill."""
    try:
        return json.loads(line)['step']
    except (ValueError, KeyError, TypeError):
        return None


def run_log(out_dir, enabled, tensorboard, keep_until, tracker=None):
    """(record, writer): record(event) appends a dict with a 'step' to out_dir/log.jsonl and writes its
    numbers to TensorBoard (writer, None when tensorboard=False) and to tracker (run/tracker.py's WandbRun,
    or None). keep_until: the existing log keeps its events up to this step: a continued run's step (the
    events a killed run wrote past its checkpoint are done again), -1 for a new run (an empty log),
    math.inf to append (eval_only). Not enabled (every rank but 0): record does nothing and writer is None."""
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
            # on disk now, like log.jsonl: a torchrun process
            # ends without closing it (run/runtime.py)
            writer.flush()
        if tracker:
            tracker.log(event)
    return record, writer


def training_data_hash(path, ckpt, out_dir, setting, same_examples=False):
    """sha256 of a run's training data file; a continued run's (ckpt) must be the file it began with, unless
    same_examples: the file changed but not the examples the run draws (RL prompt rows whose other fields,
    the reward's, were fixed), which is said. setting: the config key that names the data, for the message."""
    data_hash = file_sha256(path)
    if ckpt and isinstance(ckpt.get('train_data_hash'), dict):
        raise UserError(f"the run in {out_dir} began training on the sources {list(ckpt['train_data_hash'])}, and "
                        f"{setting} now names one folder; resuming would go on with other examples. Restore {setting}, "
                        f"or start a new run (another out_dir, or --resume=False to replace it).")
    if ckpt and data_hash != ckpt.get('train_data_hash', data_hash):  # older checkpoints: unknown
        if not same_examples:
            began = ckpt.get('config', {}).get(setting)
            raise UserError(f"{path} is not the training data the run in {out_dir} began with"
                            + (f" ({setting}={began!r} then)" if began not in (None, '') else '')
                            + f": it has changed since, or it is another file; resuming would go on with other "
                            f"examples. Restore the file (or {setting}), or start a new run (another out_dir, or "
                            f"--resume=False to replace it).")
        log(f"{path} has changed since the run began, but its prompts are the same, in the same order: continuing "
            f"with its other fields as they are now")
    return data_hash


def sources_data_hash(paths, ckpt, out_dir, setting):
    """{name: sha256} of the training file of each named data source ({name: path}, in order); a continued run's
    (ckpt) must train on the sources it began with: the same names in the same order, each file unchanged.
    setting: the config key that names the sources, for the message."""
    hashes = {name: file_sha256(path) for name, path in paths.items()}
    saved = ckpt.get('train_data_hash', hashes) if ckpt else hashes
    if not isinstance(saved, dict) or list(saved.items()) != list(hashes.items()):  # in order
        if not isinstance(saved, dict) or list(saved) != list(hashes):
            began = f"the sources {list(saved)}" if isinstance(saved, dict) else "one folder"
            raise UserError(f"the run in {out_dir} began training on {began}, and {setting} now trains on the "
                            f"sources {list(hashes)} (those of weight > 0, in order); resuming would go on with other "
                            f"examples. Restore {setting}, or start a new run (another out_dir, or --resume=False to "
                            f"replace it).")
        name = next(name for name in hashes if hashes[name] != saved[name])
        raise UserError(f"{paths[name]} (source {name!r}) has changed since the run in {out_dir} began; resuming would "
                        f"go on with other examples. Restore the file (or {setting}), or start a new run (another "
                        f"out_dir, or --resume=False to replace it).")
    return hashes


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
