"""
Weights & Biases, the run tracker beside TensorBoard: wandb_log=True, with nanoGPT's keys wandb_project
and wandb_run_name, in every training script. run_log (run/run_folder.py) gives it every scalar it
writes to TensorBoard, at the same step, and the run's config goes with the run.

One W&B run per run, however often it is relaunched: its id is kept in the checkpoints, and a launch
that continues the run resumes that W&B run (resume='allow', which also takes a run whose earlier
launches were offline and not yet synced; 'must' would refuse it). W&B keeps a run's steps increasing,
so the steps a killed launch logged past its checkpoint stay as they were logged (log.jsonl and
TensorBoard drop them and log them again; a continued run is bit-exact, only timings differ). The run's
files go under out_dir/wandb: WANDB_MODE=offline writes them there only, for `wandb sync` later.

wandb is an optional dependency, imported only when asked for and on rank 0 only; a missing package is
an error before the run does any work.
"""

import importlib.util
import os
import sys

from configurator import UserError


def require_wandb(wandb_log):
    """A UserError, before any work, when wandb_log=True and the wandb package is not installed."""
    if wandb_log and importlib.util.find_spec('wandb') is None:
        raise UserError("wandb_log=True logs the run to Weights & Biases, whose package is not installed: run "
                        "`pip install wandb` (then `wandb login`, or set WANDB_MODE=offline to keep the run in "
                        "out_dir/wandb for `wandb sync` later), or drop wandb_log.")


class WandbRun:
    """This launch's W&B run: a new one, or with run_id (a continued run's, from its checkpoint) that one resumed."""

    def __init__(self, config, run_id):
        import wandb
        out_dir = config['out_dir']
        name = config['wandb_run_name'] or os.path.basename(os.path.abspath(out_dir))
        try:
            self.run = wandb.init(project=config['wandb_project'], name=name, id=run_id,
                                  resume='allow' if run_id else None, dir=out_dir, config=config)
        except wandb.Error as e:  # not logged in, a server that cannot be reached
            raise UserError(f"Weights & Biases could not start the run (wandb_log=True): {e} Log in with `wandb "
                            f"login`, or set WANDB_MODE=offline to keep the run in {out_dir}/wandb for `wandb sync` "
                            f"later.") from None
        self.id = self.run.id

    def log(self, event):
        """The numbers of a log.jsonl event (a dict with a 'step'), at its step."""
        self.run.log({k: v for k, v in event.items() if k != 'step' and isinstance(v, (int, float))},
                     step=event['step'])


def start_wandb(config, run_id, master):
    """This launch's WandbRun on rank 0 when config['wandb_log'] (run_id: a continued run's, else None); else None."""
    return WandbRun(config, run_id) if config['wandb_log'] and master else None


def finish_wandb(exit_code=0):
    """End the W&B run, if one was started, with the process's exit code. run/runtime.py's compute_cleanup calls it:
    under torchrun it ends the process with os._exit, which skips the hook by which wandb would finish (and write out)
    the run."""
    wandb = sys.modules.get('wandb')
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=exit_code)
