"""runs/tts_curve.py: the larger corpora are the report's 1,000 utterances and the first rows of the extra ones
(the same held-out sentences for every cell), the table puts each cell's scores under their generator, and a
cell resumed after a kill costs what an unbroken run of it would; a scored folder is read back."""

import json
import os

import torch

from conftest import script_definitions

assemble, table, step_of, whole_run_cost, scored = script_definitions('runs/tts_curve.py', 'assemble', 'table',
                                                                       'step_of', 'whole_run_cost', 'scored')


def test_a_larger_corpus_is_the_first_ones_and_the_first_extra_rows(tmp_path):
    for folder, prefix, n in (('small', 'PJ', 3), ('extra', 'PK', 4)):
        os.makedirs(tmp_path / folder / 'wavs')
        rows = [f'{prefix}{i}|line {prefix}{i}|line {prefix}{i}\n' for i in range(n)]
        (tmp_path / folder / 'metadata.csv').write_text(''.join(rows))
        for i in range(n):
            (tmp_path / folder / 'wavs' / f'{prefix}{i}.wav').write_bytes(f'{prefix}{i}'.encode())
    assemble(str(tmp_path), 'both', [('small', 3), ('extra', 2)])
    lines = (tmp_path / 'both' / 'metadata.csv').read_text().splitlines()
    assert [line.split('|')[0] for line in lines] == ['PJ0', 'PJ1', 'PJ2', 'PK0', 'PK1']
    assert sorted(os.listdir(tmp_path / 'both' / 'wavs')) == [f'{i}.wav' for i in ('PJ0', 'PJ1', 'PJ2', 'PK0', 'PK1')]
    assert (tmp_path / 'both' / 'wavs' / 'PK1.wav').read_bytes() == b'PK1'
    assemble(str(tmp_path), 'both', [('small', 3), ('extra', 2)])  # again: the same corpus, no error
    assert (tmp_path / 'both' / 'metadata.csv').read_text().splitlines() == lines


def test_the_table_puts_each_cell_under_its_generator():
    score = lambda wer: dict(wer=wer, cer=wer / 2, ovrl=3.0, rtf=0.3)
    floors = dict(recordings=score(0.10), vocoders={'LJSpeech': score(0.11), 'universal': score(0.12)})
    results = {'base': dict(args=['train_tts.py'], cpu_s=7200,
                            speech={'LJSpeech': score(0.13), 'universal': score(0.15)}),
               'vocoder-ft': dict(args=['train_vocoder.py'], cpu_s=3600, speech={'LJSpeech': score(0.12)}),
               'unscored-rtf': dict(args=['x.py'], cpu_s=0, speech={'universal': dict(score(0.2), rtf=None)})}
    rows = table(results, floors).splitlines()
    assert rows[4] == ('| base | `python train_tts.py` | 2.00 | 13.0% (1.30x) / 6.5% / 3.00 | '
                       '15.0% (1.50x) / 7.5% / 3.00 | 0.30 |')
    assert rows[5] == '| vocoder-ft | `python train_vocoder.py` | 1.00 | 12.0% (1.20x) / 6.0% / 3.00 |  | 0.30 |'
    assert rows[6] == '| unscored-rtf | `python x.py` | 0.00 |  | 20.0% (2.00x) / 10.0% / 3.00 | |'
    assert all(row.count('|') == rows[0].count('|') for row in rows)


def test_a_resumed_cell_costs_its_last_launch_scaled_to_all_its_steps(tmp_path):
    assert step_of(str(tmp_path)) == 0  # a new cell
    torch.save(dict(iter_num=2500), tmp_path / 'ckpt.pt')
    assert step_of(str(tmp_path)) == 2500
    assert whole_run_cost(100.0, 0, 5000) == 100.0  # unbroken
    assert whole_run_cost(100.0, 2500, 5000) == 200.0  # continued halfway: the launch did half the steps
    assert whole_run_cost(300.0, 1000, 5000) == 375.0


def test_a_scored_folder_reads_back_the_cpu_time_real_time_factor_where_measured(tmp_path):
    """scored: speech synthesized and scored once is read back; its RTF is the manifest's CPU-time figure (the
    clock's counts the other cells training beside it), the clock's in an older manifest."""
    (tmp_path / 'whisper_model.json').write_text(json.dumps(dict(wer={'model': 0.2}, cer={'model': 0.1})))
    (tmp_path / 'dnsmos_model.json').write_text(json.dumps(dict(means={'model': dict(ovrl_mos=3.0)})))
    manifest = dict(rtf={'model': 2.5}, cpu_rtf={'model': 0.9})
    for drop, expected in ((None, 0.9), ('cpu_rtf', 2.5)):
        (tmp_path / 'manifest.json').write_text(json.dumps({k: v for k, v in manifest.items() if k != drop}))
        assert scored(str(tmp_path), 'model') == {'model': dict(wer=0.2, cer=0.1, ovrl=3.0, rtf=expected)}
