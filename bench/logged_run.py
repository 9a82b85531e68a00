"""
A script run until its log.jsonl holds enough entries, then killed with every process it started: how the
benchmarks that time a few steps of train.py, train_dpo.py or train_rl.py (bench_llama1b.py, bench_rl_1b.py)
run them. SIGKILL, as a preemption would, so the run writes no checkpoint.
"""

import json
import os
import signal
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def descendants(pid):
    """Process ids started by pid, at any depth (torchrun's workers run in sessions of their own)."""
    children = {}
    for entry in os.listdir('/proc'):
        try:
            with open(f'/proc/{entry}/stat') as f:
                children.setdefault(int(f.read().rsplit(')', 1)[1].split()[1]), []).append(int(entry))
        except (ValueError, OSError):
            continue
    found, todo = [], [pid]
    while todo:
        started = children.get(todo.pop(), [])
        found += started
        todo += started
    return found


def kill_tree(pid):
    """SIGKILL pid and every process it started (a script's torchrun workers too)."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_until_logged(args, log_path, key, count, timeout):
    """Run args in the repository root until log_path (removed first: an old run's lines would count) holds
    count entries with key, the script ends, or timeout seconds pass; then SIGKILL it and what it started
    (torchrun's workers, compile workers), also when this process is stopped meanwhile: a run left behind
    holds its GPU memory. Returns (those entries, the script's output)."""
    if os.path.exists(log_path):
        os.remove(log_path)
    t0 = time.time()
    # a file, not a pipe: a script that prints more than a pipe holds (64 KiB) would stop until it is read
    output_file = tempfile.TemporaryFile(mode='w+')
    proc = subprocess.Popen(args, cwd=ROOT, stdout=output_file, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    entries = []
    try:
        while proc.poll() is None and time.time() - t0 < timeout and len(entries) < count:
            time.sleep(0.5)
            if os.path.exists(log_path):
                with open(log_path) as f:
                    entries = [e for e in map(json.loads, filter(str.strip, f)) if key in e]
    finally:
        kill_tree(proc.pid)
    proc.wait()
    output_file.seek(0)
    output = output_file.read()
    output_file.close()
    return entries, output
