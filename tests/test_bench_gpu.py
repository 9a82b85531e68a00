"""bench/gpu.py, the one command for a GPU: its dry run on the CPU (every part but nanoGPT's, tiny shapes, compile
off), and the GPU table it writes into README.md and runs/RESULTS.md from a run's JSON."""

import glob
import json
import os

import pytest

from configurator import UserError
from conftest import ROOT, run, script_definitions

PARTS = ['tests', 'gpt_b16', 'nanogpt_b16', 'gpt_b32', 'nanogpt_b32', 'llama8b_folder', 'lora8b_bfloat16',
         'lora8b_nf4', 'lora8b_bfloat16_compiled', 'lora8b_nf4_compiled', 'rl1b', 'rl1b_compiled_decoding',
         'lora8b_pack']


@pytest.mark.slow
def test_dry_run_runs_every_part_and_records_its_figures(tmp_path):
    run(['bench/gpu.py', '--dry_run=True', f'--out_dir={tmp_path}'], timeout=360)
    [path] = glob.glob(str(tmp_path / 'gpu' / 'gpu_cpu_*.json'))  # beside its runs, where git ignores it
    with open(path) as f:
        saved = json.load(f)
    parts = saved['parts']
    assert saved['dry_run'] and list(parts) == PARTS
    for name in ('nanogpt_b16', 'nanogpt_b32'):  # no nanoGPT folder given: skipped, saying how to give one
        assert parts[name]['status'] == 'skipped' and 'nanogpt_dir' in parts[name]['note']
    for name in ('lora8b_nf4_compiled', 'lora8b_bfloat16_compiled'):  # compile off: the eager parts' commands
        assert parts[name]['status'] == 'skipped' and 'compile off' in parts[name]['note']
    ran = [p for p in PARTS if p not in ('nanogpt_b16', 'nanogpt_b32', 'lora8b_nf4_compiled', 'lora8b_bfloat16_compiled')]
    assert {p: parts[p]['status'] for p in ran} == dict.fromkeys(ran, 'ok')
    assert parts['tests']['skipped'] >= 4 and 'failed' not in parts['tests']  # the cuda tests, skipped on a CPU
    for name in ('gpt_b16', 'gpt_b32'):
        assert parts[name]['tokens_per_sec'] > 0 and parts[name]['step_ms'] > 0
    for name in [p for p in ran if p.startswith('lora8b_')]:
        assert parts[name]['tokens_per_sec'] > 0 and parts[name]['peak_memory_mb'] > 0 and parts[name]['steps'] == 1
        assert '--lora_target_modules=all-linear' in parts[name]['command']
    assert '--lora_base_dtype=nf4' in parts['lora8b_nf4']['command']
    assert '--pack=True' in parts['lora8b_pack']['command']
    for name in ('rl1b', 'rl1b_compiled_decoding'):
        assert parts[name]['generation_tokens_per_sec'] > 0 and parts[name]['steps_per_sec'] > 0
    # rollouts as before issue 54, then from the merged copy (compiled on a GPU; compile off in a dry run)
    assert '--compile_decode=False --merged_rollouts=False' in parts['rl1b']['command']
    assert parts['rl1b']['merge_s'] == 0 < parts['rl1b_compiled_decoding']['merge_s']
    assert '--merged_rollouts=True' in parts['rl1b_compiled_decoding']['command']
    # a dry run's figures never become the README's GPU rows
    p = run(['bench/gpu.py', f'--table_only={path}'], check=False)
    assert p.returncode == 2 and 'dry run' in p.stderr and 'Traceback' not in p.stderr


def test_table_only_writes_the_gpu_rows_between_the_markers(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, 'bench'))
    gpu_table, rewrite_block, begin, end = script_definitions('bench/gpu.py', 'gpu_table', 'rewrite_block',
                                                              'GPU_BEGIN', 'GPU_END', 'result_text', 'gib')[:4]
    saved = {'parts': {
        'tests': dict(what='the tests that need CUDA', status='failed', note='1 failed, 5 passed'),
        'gpt_b16': dict(what='GPT-2, batch 16', status='ok', tokens_per_sec=489_500.0, step_ms=33.47, mfu=0.452,
                        peak_memory_mb=12_800),
        'nanogpt_b16': dict(what="nanoGPT's", status='ok', tokens_per_sec=445_000.0, step_ms=36.82),
        'lora8b_nf4_compiled': dict(what='NF4, compiled', status='timed out', note='still running after its 240 s'),
        'lora8b_bfloat16': dict(what='bf16, eager', status='ok', tokens_per_sec=5_210.4, mfu=0.18, peak_memory_mb=19_558),
        'rl1b': dict(what='RL', status='ok', generation_tokens_per_sec=12_085, steps_per_sec=0.15, generation_s=5.41,
                     training_s=1.3, peak_memory_mb=92_570)}}
    table = gpu_table(saved).splitlines()
    assert table[:2] == ['| part | what | result |', '|---|---|---|'] and len(table) == 8
    assert table[3] == ('| gpt_b16 | GPT-2, batch 16 | 489,500 tokens/s (33.5 ms a step), MFU 45.2%, 12.5 GiB; '
                        'nanoGPT 445,000 (36.8 ms): **1.100x** |')
    assert table[2] == '| tests | the tests that need CUDA | failed: 1 failed, 5 passed |'
    assert 'timed out: still running after its 240 s' in table[5]
    assert '5,210 tokens/s, MFU 18.0%, peak 19.1 GiB' in table[6]
    assert '12,085 generated tokens/s, 0.15 steps/s, rollouts 81% of a step, peak 90.4 GiB' in table[7]
    doc = tmp_path / 'README.md'
    doc.write_text(f"intro\n{begin}\nthe old rows\n{end}\nafter\n")
    rewrite_block(str(doc), 'the new rows')
    assert doc.read_text() == f"intro\n{begin}\nthe new rows\n{end}\nafter\n"
    doc.write_text('no markers\n')
    with pytest.raises(UserError, match='no .* block'):
        rewrite_block(str(doc), 'rows')
    for name in ('README.md', os.path.join('runs', 'RESULTS.md')):  # the blocks --table_only rewrites
        with open(os.path.join(ROOT, name)) as f:
            text = f.read()
        assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)
