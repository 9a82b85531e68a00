"""
FSDP's memory as a user measures it: the whole-process peak resident memory (VmHWM) of train.py run as one
process and of each rank of the same run under `torchrun --nproc_per_node=2 --parallel=fsdp` (CPU, gloo),
polled every 0.1 s, with the wall time of each job. The run is issue 45's: the 12 x 768 GPT (88M parameters)
from scratch, 4 steps of 2 windows of 128 tokens, one eval. (bench_fsdp_memory.py splits a step into phases
above the process's own baseline; this is the number `/usr/bin/time -v` gives.)

    python bench/bench_fsdp_rss.py                      # ~3 minutes on 2 cores
    python bench/bench_fsdp_rss.py --baseline=../old    # the same runs of another checkout, side by side

Writes results/fsdp_rss.json: per job and checkout the median over repeats of the peak (MB; for FSDP the
larger rank's) and of the wall time, every repeat's numbers, and the ratio rank / one process.
"""

import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configurator import at_least, check_values, configure
from logged_run import descendants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# -----------------------------------------------------------------------------
repeats = 3                  # runs of each job; medians reported
baseline = ''                # another checkout of nanotrain to measure the same way ('' = none)
out_dir = '/tmp/nanotrain_fsdp_rss'
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('repeats',))])
RUN = ['--init_from=scratch', '--n_layer=12', '--n_head=12', '--n_embd=768', '--max_iters=4', '--eval_interval=4',
       '--eval_iters=1', '--batch_size=2', '--block_size=128', '--sample_tokens=0', '--tensorboard=False',
       '--resume=False', '--device=cpu']


def peak_mb(pid):
    """(VmHWM in MB, command line) of a live process, or None."""
    try:
        with open(f'/proc/{pid}/status') as f:
            status = dict(line.split(':', 1) for line in f)
        with open(f'/proc/{pid}/cmdline') as f:
            return int(status['VmHWM'].split()[0]) // 1024, f.read()
    except (OSError, KeyError):
        return None


def measure(root, fsdp):
    """{'peaks_mb': each train.py process's peak, 'wall_s'} of one job in checkout root."""
    python = sys.executable
    out = os.path.join(out_dir, 'fsdp' if fsdp else 'single')
    args = ([python, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', *RUN,
             '--parallel=fsdp'] if fsdp else [python, 'train.py', *RUN]) + [f'--out_dir={out}']
    env = dict(os.environ, OMP_NUM_THREADS='1')
    start, peaks = time.time(), {}
    job = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while job.poll() is None:
        for pid in [job.pid, *descendants(job.pid)]:
            seen = peak_mb(pid)
            # the training processes only, not torchrun's launcher
            if seen and 'train.py' in seen[1] and 'torch.distributed.run' not in seen[1]:
                peaks[pid] = max(peaks.get(pid, 0), seen[0])
        time.sleep(0.1)
    output = job.stdout.read()
    if job.returncode:
        sys.exit(f"{' '.join(args)} failed in {root}:\n{output[-2000:]}")
    return {'peaks_mb': sorted(peaks.values()), 'wall_s': round(time.time() - start, 1)}


results = {}
for name, root in [('this checkout', ROOT)] + ([('baseline', os.path.abspath(baseline))] if baseline else []):
    runs = {job: [] for job in ('single', 'fsdp')}
    for _ in range(repeats):  # interleaved, so a slower stretch of the machine hits both jobs
        for job in runs:
            runs[job].append(measure(root, job == 'fsdp'))
            print(name, job, runs[job][-1], flush=True)
    summary = {job: {'peak_mb': statistics.median(max(r['peaks_mb']) for r in rs),
                     'wall_s': statistics.median(r['wall_s'] for r in rs), 'runs': rs} for job, rs in runs.items()}
    summary['rank_over_single'] = round(summary['fsdp']['peak_mb'] / summary['single']['peak_mb'], 2)
    results[name] = dict(summary, root=root)
    print(f"{name}: one process {summary['single']['peak_mb']} MB ({summary['single']['wall_s']} s), FSDP rank "
          f"{summary['fsdp']['peak_mb']} MB ({summary['fsdp']['wall_s']} s): {summary['rank_over_single']}x")

os.makedirs(os.path.join(ROOT, 'bench', 'results'), exist_ok=True)
path = os.path.join(ROOT, 'bench', 'results', 'fsdp_rss.json')
with open(path, 'w') as f:
    json.dump(dict(results, run=RUN, repeats=repeats, threads_per_process=1, cpu=os.cpu_count()), f, indent=1)
print(f"wrote {path}")
