import math
import os
import subprocess
import sys
import time

import pytest
import torch

import memory
from configurator import UserError
from run import checkpoint
from conftest import ROOT
from faults import Faults
from memory import (MemoryMonitor, halve_micro_batch, is_oom, memory_usage, peak_memory_bytes, pressure_level,
                    recover_from_oom, resumed_micro_batch, split_micro_batches)
from run.device import autocast_context, cpu_name, pick_device, pick_dtype
from run.runtime import StepProfiler


# ---------------------------------------------------------------------------- device, dtype, autocast

def test_pick_device_and_dtype_on_cpu():
    auto = pick_device("auto")
    assert auto in ("cuda", "mps", "cpu")
    assert pick_device("cpu") == "cpu"
    with pytest.raises(UserError, match="'auto', 'cpu', 'cuda'"):
        pick_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="not available"):
            pick_device("cuda")
    assert pick_dtype("cpu") == torch.float32
    assert pick_dtype("cpu", "float32") == torch.float32
    assert pick_dtype("cpu", "float16") == torch.float16
    with pytest.raises(UserError, match="'float32', 'bfloat16', 'float16'"):
        pick_dtype("cpu", "fp8")


def test_cpu_name_says_model_kernels_and_native_bf16(tmp_path):
    capability = torch.backends.cpu.get_cpu_capability()
    info = tmp_path / 'cpuinfo'
    for flags, native in (('fpu avx2 avx512f avx512_bf16', True), ('fpu amx_tile amx_bf16', True),
                          ('fpu avx2 fma', False)):
        info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: {flags}\n\n"
                        f"processor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: {flags}\n")
        assert cpu_name(str(info)) == f"AMD EPYC 9654 ({capability}{', native bf16' if native else ''})"
    assert cpu_name(str(tmp_path / 'none')).endswith(f"({capability})")  # no /proc: the platform's name


def test_autocast_context_is_reusable_and_null_for_fp32():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    ctx = autocast_context("cpu", torch.bfloat16)
    for _ in range(2):  # training scripts enter the same context every micro-step
        with ctx:
            assert (a @ b).dtype == torch.bfloat16
    with autocast_context("cpu", torch.float32):
        assert (a @ b).dtype == torch.float32
        assert not torch.is_autocast_enabled("cpu")


# ---------------------------------------------------------------------------- loss scaling (torch.amp.GradScaler)

def test_a_continued_run_takes_its_loss_scale_or_keeps_its_own_when_there_is_none():
    """restore_training_state gives a fp16 run its checkpoint's loss scale; a checkpoint of a run without fp16
    (bf16 on another machine) holds none, and the scale stays the initial one (torch refuses an empty state)."""
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    ckpt = dict(optimizer=optimizer.state_dict(), rng=[checkpoint.rng_state()], iter_num=7, best_val_loss=1.0,
                evals_without_improvement=0)
    scaled = torch.amp.GradScaler('cpu', init_scale=2.0**9, growth_interval=3)
    for stored, scale in [(scaled.state_dict(), 2.0**9), ({}, 2.0**16)]:
        scaler = torch.amp.GradScaler('cpu')
        assert checkpoint.restore_training_state(dict(ckpt, scaler=stored), 'ckpt.pt', optimizer, scaler, 0, 1)[0] == 7
        assert scaler.get_scale() == scale and scaler.state_dict()['growth_interval'] == (3 if stored else 2000)


# ---------------------------------------------------------------------------- memory monitor

def test_pressure_levels():
    assert [pressure_level(f) for f in (0.0, 0.5999, 0.60, 0.7499, 0.75, 0.8499, 0.85, 1.0)] == [
        "low", "low", "moderate", "moderate", "high", "high", "critical", "critical"]


def test_monitor_cleans_when_pressure_rises_to_high_and_critical():
    usage = iter([0.3, 0.65, 0.8, 0.8, 0.9, 0.9, 0.8, 0.5, 0.8])
    calls = []
    monitor = MemoryMonitor("cpu", usage_fn=lambda: next(usage), cleanup=lambda: calls.append("cleanup"),
                            emergency_cleanup=lambda: calls.append("emergency"))
    levels = [monitor.check() for _ in range(9)]
    assert levels == ["low", "moderate", "high", "high", "critical", "critical", "high", "low", "high"]
    # once on each rise; a device that stays full (or whose pressure falls) is not cleaned again and again
    assert calls == ["cleanup", "emergency", "cleanup"]
    assert monitor.checks == 9 and monitor.usage == 0.8


def test_monitor_measures_its_overhead():
    monitor = MemoryMonitor("cpu", usage_fn=lambda: time.sleep(0.01) or 0.1)
    monitor.check()
    monitor.check()
    assert 0.02 <= monitor.overhead_s < 1.0


def test_real_usage_and_peak_on_cpu():
    assert 0.0 < memory_usage("cpu") < 1.0
    assert MemoryMonitor("cpu").check() in ("low", "moderate", "high", "critical")
    # this process holds at least torch's libraries: well over 10 MiB, and under a TiB
    assert 10 * 2**20 < peak_memory_bytes("cpu") < 2**40


def test_default_cleanup_hooks_run_on_cpu(monkeypatch):
    collected = []
    monkeypatch.setattr(memory.gc, "collect", lambda *a: collected.append(1))
    MemoryMonitor("cpu", usage_fn=lambda: 0.8).check()
    MemoryMonitor("cpu", usage_fn=lambda: 0.95).check()
    assert len(collected) == 2


# ---------------------------------------------------------------------------- OOM helpers and faults

def test_is_oom():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB)"))
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("out of memory"))
    with pytest.raises(RuntimeError) as refused:  # the CPU allocator's own error: 1 EiB, past any address space
        torch.empty(2 ** 60, dtype=torch.uint8)
    assert is_oom(refused.value)


def test_halve_micro_batch_keeps_global_batch():
    assert halve_micro_batch(16, 1) == (8, 2)
    assert halve_micro_batch(2, 5) == (1, 10)
    with pytest.raises(UserError, match="micro-batch size 1"):
        halve_micro_batch(1, 8)
    with pytest.raises(UserError, match="odd"):
        halve_micro_batch(3, 4)


def test_split_micro_batches_doubles_the_chunks_until_one_utterance_each():
    assert split_micro_batches(1, 5, 3) == 2 and split_micro_batches(4, 5, 3) == 8
    with pytest.raises(UserError, match=r"one utterance per micro-batch \(step 3\)"):
        split_micro_batches(8, 5, 3)


def test_a_resumed_run_keeps_its_global_batch_on_another_number_of_processes():
    def ckpt(batch, accum, processes, command=(4, 1)):  # as train.py writes it; an OOM may halve the split
        return {'batch_size': batch, 'gradient_accumulation_steps': accum, 'rng': [{}] * processes,
                'config': {'batch_size': command[0], 'gradient_accumulation_steps': command[1]}}
    assert resumed_micro_batch(ckpt(2, 2, 1), 4, 1, 1) == (2, 2, '')  # OOM-halved: kept
    assert resumed_micro_batch(ckpt(4, 1, 2), 8, 1, 1) == (8, 1, '')  # batch_size changed: as given
    batch, accum, note = resumed_micro_batch(ckpt(4, 1, 2), 4, 1, 1)  # a 2-process run on 1: twice the accumulation
    assert (batch, accum) == (4, 2) and 'global batch of 8 is kept on 1 process instead of 2' in note
    assert resumed_micro_batch(ckpt(4, 2, 1), 4, 1, 1) == (4, 2, '')  # and so on at the next relaunch
    assert resumed_micro_batch(ckpt(4, 1, 1), 4, 1, 2)[:2] == (2, 1)  # 1 -> 2 processes: half the micro-batch
    assert resumed_micro_batch(ckpt(2, 2, 2), 4, 1, 4)[:2] == (2, 1)
    batch, accum, note = resumed_micro_batch(ckpt(3, 1, 1, (3, 1)), 3, 1, 2)  # 3 does not split over 2: said plainly
    assert (batch, accum) == (3, 1) and 'global batch changes from 3 to 6' in note
    no_split = {'rng': [{}] * 2, 'config': {'batch_size': 4, 'gradient_accumulation_steps': 1}}  # a DPO checkpoint
    assert resumed_micro_batch(no_split, 4, 1, 1)[:2] == (4, 2)


def test_injected_faults_fire_once_at_the_scripts_steps(monkeypatch):
    """faults.py counts the steps by torch.amp.GradScaler.update, from where restore_training_state says a run resumes."""
    weight = torch.nn.Parameter(torch.ones(()))
    optimizer, scaler = torch.optim.SGD([weight], lr=0.1), torch.amp.GradScaler('cpu', enabled=False)

    def step():  # a script's training step: two micro-batches scaled into backward, then the optimizer step
        try:
            scaled = [scaler.scale(weight * 2) for _ in range(2)]
        except torch.OutOfMemoryError:
            optimizer.zero_grad()
            return "oom"  # the script retries the same step, having called no update
        sum(scaled).backward()
        if math.isfinite(sum(scaled).item()):  # the scripts' step block: a non-finite step is skipped,
            scaler.step(optimizer)  # and update ends every step
        scaler.update()
        optimizer.zero_grad()
        return "nan" if scaled[0].isnan() else None

    faults = Faults("oom@3, nan@5").install(monkeypatch.setattr)
    assert [step() for _ in range(4)] == [None, None, None, "oom"] and faults.step == 3
    assert [step() for _ in range(4)] == [None, None, "nan", None]  # step 3 retried, then 4, 5, 6
    assert faults.step == 7 and not faults.pending

    monkeypatch.undo()
    monkeypatch.setattr(checkpoint, "restore_training_state", lambda *args: (5, 1.0, 0))  # a run resumed at step 5
    faults = Faults("nan@5").install(monkeypatch.setattr)
    assert checkpoint.restore_training_state("ckpt", "path") == (5, 1.0, 0)
    assert step() == "nan" and faults.step == 6


# ---------------------------------------------------------------------------- profiler

def test_step_profiler_records_sections():
    prof = StepProfiler("cpu")
    for _ in range(2):
        with prof.section("data"):
            pass
        with prof.section("forward"):
            time.sleep(0.02)
    assert prof.throughput(1000) == pytest.approx(1000 / 0.04, rel=0.5)
    summary = prof.summary()
    assert set(summary) == {"data", "forward"}
    assert summary["forward"] >= 19 and summary["data"] < summary["forward"]
    assert prof.summary() == {}  # a new window starts after each summary


def test_step_profiler_disabled_records_nothing():
    prof = StepProfiler("cpu", enabled=False)
    with prof.section("forward"):
        pass
    assert prof.summary() == {}


def test_recover_from_oom_frees_or_reraises():
    net = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.ones(1, 2)).sum().backward()
    recover_from_oom(torch.OutOfMemoryError('CUDA out of memory'), False, optimizer, 'cpu')
    assert all(p.grad is None for p in net.parameters())  # the failed step's gradients are gone
    recover_from_oom(RuntimeError('MPS backend out of memory'), False, optimizer, 'cpu')
    with pytest.raises(torch.OutOfMemoryError):  # under DDP the ranks cannot agree on a smaller split
        recover_from_oom(torch.OutOfMemoryError('CUDA out of memory'), True, optimizer, 'cpu')
    with pytest.raises(RuntimeError, match='shape mismatch'):
        recover_from_oom(RuntimeError('shape mismatch'), False, optimizer, 'cpu')


RETAINED_AFTER_FREE = """
import sys, torch
from memory import return_freed_buffers
def resident(): return int(open('/proc/self/statm').read().split()[1]) * 4096
if sys.argv[1] == 'fixed':
    return_freed_buffers()
torch.ones(4 << 20)  # 16 MB, freed: glibc's default threshold rises to it (as FSDP's gathered blocks do)
before = resident()
torch.ones(2 << 20)  # 8 MB, freed
print((resident() - before) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason="glibc's malloc")
def test_return_freed_buffers_gives_memory_back():
    # FSDP's CPU ranks set it (run/fsdp.shard_model): a freed 8 MB buffer leaves the process instead of
    # staying on the heap, where each step's gathered blocks piled up (bench/bench_fsdp_rss.py)
    def kept_mb(mode):
        out = subprocess.run([sys.executable, '-c', RETAINED_AFTER_FREE, mode], cwd=ROOT, capture_output=True,
                             text=True, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
        return float(out.stdout)
    assert kept_mb('default') > 6 and kept_mb('fixed') < 1
