"""
runs/RESULTS.md's generated table, regenerated: runs the documented commands as a user would (default
pretraining, SFT, LoRA, DPO) over several seeds, reads each run's log.jsonl, and writes a report with,
per figure, the median and the range over the seeds, every seed's value, the commit, the machine and
the wall time (nanochat's report card: nobody types a result). Every model of the chain, and a published
chat model (SmolLM2-135M-Instruct, built by ../shared/tools/make_smollm2_hf.py) as published, after a LoRA
SFT and after RL on it, also answers the same held-out number-task prompts through `eval.py` (exact match,
BLEU, ROUGE-L side by side). The published model's LoRA SFT runs once, on the first seed (~17 min on 2 cores);
its RL runs on every seed from that one SFT model. The text-to-speech recipes (espeak-ng's voice, and a natural
one: docs/tts.md) are scored as papers do: Whisper's error rates on held-out sentences (runs/tts_asr.py, in its
own venv at asr_python), beside the recordings and their mel through Griffin-Lim, with MCD-DTW and real-time factor.

    python runs/report.py                    # the full report: runs/report.md, runs/report.json and runs/RESULTS.md's table
    python runs/report.py --table_only=True  # no runs: runs/RESULTS.md's table rewritten from the committed runs/report.json
    python runs/report.py --quick=True       # the machinery in minutes (one seed, few steps): runs/results/report-quick.*
    python runs/report.py --lora_sweep=True  # instead, the LoRA recipe sweep (first seed): runs/lora_sweep.*
    python runs/report.py --stages=pretrain,sft --reuse=True  # some stages; finished runs are read, not rerun
    python runs/report.py --stages=tts-espeak,tts-natural  # the text-to-speech table; the other stages are kept

With a nanoGPT checkout at nanogpt_dir (`git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT`), the
speedrun's ratios (bench/speedrun.py, its own alternating pairs) join the report; without one they are skipped.

Each stage runs the documented command with --seed, its own --out_dir under work_dir and --init_from at the
previous stage's checkpoint, so a user's out/, out-sft/, ... are never touched. tests/test_report.py
checks that runs/RESULTS.md's table is this report's. Timings and quality are never unit tests.
"""

import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

from configurator import configure  # noqa: E402
from run.checkpoint import atomic_file, file_sha256, load_checkpoint  # noqa: E402
from run.device import cpu_name  # noqa: E402
from tasks.number_tasks import NUMBER_TASKS_DIR, prepare_number_tasks  # noqa: E402

# -----------------------------------------------------------------------------
seeds = (1337, 1338, 1339, 1340, 1341)  # one run of every stage per seed
tts_seeds = 3                # the text-to-speech stages run on the first tts_seeds seeds only (~55 min a seed)
quick = False                # one seed, a few steps per stage: checks the machinery, writes runs/results/report-quick.*
lora_sweep = False           # instead of the report: LORA_SWEEP against full SFT on the first seed, into runs/lora_sweep.*
nanogpt_dir = '/tmp/nanoGPT'  # a nanoGPT checkout: bench/speedrun.py's ratios join the report (its 3 pairs); '' or none there = skipped
work_dir = 'runs/results/report'  # the runs' out_dirs
reuse = False                # read a finished run of the same command and code back; continue a killed one
results_md = True            # put the report's table into runs/RESULTS.md (between the report markers); not with quick
table_only = False           # no runs: rewrite runs/RESULTS.md's table from the committed runs/report.json, and stop
stages = 'pretrain,sft,lora,dpo,rl,hf-lora,hf-rl,tts-espeak,tts-natural,tts-natural-long,tts-natural-wide'  # run, each after its start
hf_model = 'models/smollm2-135m-instruct'  # the published chat model of the hf- stages; not there = they are skipped
heldout_examples = 500       # held-out number-task prompts every model answers through eval.py (test.jsonl's first)
espeak_dir = '../shared/data/espeak-ljspeech'  # tts-espeak's corpus; its held-out split is scored
natural_dir = '../data/piper-ljspeech'  # tts-natural's corpus (docs/tts.md: a Piper corpus)
natural_heldout_dir = '../data/piper-ljspeech-heldout'  # sentences tts-natural never trains on
asr_python = '../asrvenv/bin/python'  # a python with faster-whisper (runs/tts_asr.py score); none = no WER
mos_python = '../mosvenv/bin/python'  # a python with speechmos (runs/tts_mos.py); none = no DNSMOS
# HiFi-GAN generators the TTS stages' speech also goes through (docs/tts.md); one missing is left out
vocoders = '../models/hifigan/generator_universal.pth.tar,../models/hifigan/generator_LJSpeech.pth.tar'
whisper = '../models/whisper-base-ct2'  # Whisper base in CTranslate2 layout (../shared/tools/make_whisper_base.py)
# -----------------------------------------------------------------------------
configure(globals())
if quick:
    seeds = seeds[:1]
    work_dir = work_dir + '-quick'
report_path = os.path.join(ROOT, 'runs', 'results', 'report-quick') if quick else os.path.join(ROOT, 'runs', 'report')

TTS_QUICK = ['--max_iters=20', '--lr_decay_iters=20', '--warmup_iters=2', '--align_prior_iters=10',
             '--eval_interval=20', '--eval_utterances=2', '--audio_samples=0']
# stage: (the documented command, the checkpoint it starts from (stage/file), quick-mode overrides)
STAGES = {
    'pretrain': (['train.py'], None, ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=20', '--eval_iters=2']),
    'sft': (['train.py', 'config/sft.py'], 'pretrain/ckpt.pt',
            ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=20', '--exact_match_examples=20']),
    'lora': (['train.py', 'config/lora.py'], 'pretrain/ckpt.pt',
             ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=20', '--exact_match_examples=20']),
    'dpo': (['train_dpo.py', 'config/dpo.py'], 'sft/ckpt.pt',
            ['--max_iters=10', '--lr_decay_iters=10', '--eval_interval=10', '--eval_pairs=50',
             '--exact_match_examples=20']),
    'rl': (['train_rl.py', 'config/rl.py'], 'sft/ckpt.pt',
           ['--max_iters=2', '--eval_interval=2', '--eval_prompts=4', '--exact_match_examples=10']),
    'hf-lora': (['train.py', 'config/lora_hf.py'], None,
                ['--max_iters=4', '--lr_decay_iters=4', '--warmup_iters=1', '--eval_interval=4', '--eval_iters=2',
                 '--exact_match_examples=10']),
    'hf-rl': (['train_rl.py', 'config/rl_hf.py'], 'hf-lora/merged.pt',
              ['--max_iters=2', '--eval_interval=2', '--eval_prompts=4', '--exact_match_examples=10']),
    'tts-espeak': (['train_tts.py', 'config/tts_espeak_cpu.py'], None, TTS_QUICK),
    'tts-natural': (['train_tts.py', 'config/tts_natural_cpu.py'], None, TTS_QUICK),
    'tts-natural-long': (['train_tts.py', 'config/tts_natural_cpu.py', 'config/tts_natural_long_cpu.py'], None,
                         TTS_QUICK),
    'tts-natural-wide': (['train_tts.py', 'config/tts_natural_cpu.py', 'config/tts_natural_wide_cpu.py'], None,
                         TTS_QUICK),
}
HF_STAGES = ('hf-lora', 'hf-rl')
LM_STAGES = ('pretrain', 'sft', 'lora', 'dpo', 'rl')  # the speedrun runs only with all of them (see the end)
# text-to-speech stages: their corpus, and the sentences Whisper hears ('' = the checkpoint's held out)
TTS_CORPORA = {'tts-espeak': (espeak_dir, ''), 'tts-natural': (natural_dir, natural_heldout_dir),
               'tts-natural-long': (natural_dir, natural_heldout_dir),
               'tts-natural-wide': (natural_dir, natural_heldout_dir)}
# text-to-speech stages whose model also speaks through the first of vocoders fine-tuned on its own mels (the
# recipe's generator: train_vocoder.py, in the stage's out_dir/vocoder)
GENERATOR_FT = {'tts-natural-long': ['train_vocoder.py', 'config/vocoder_natural_cpu.py']}
GENERATOR_FT_QUICK = ['--max_iters=2', '--eval_interval=2', '--eval_utterances=2']
REUSED = []  # a 1 per run read back, not run (reuse)
HEARTBEAT_S = 60  # how often a running run's wall time so far is recorded
# the models that answer the held-out prompts: stage (or 'hf-base', the published model itself) -> its file
EVALUATED = {'pretrain': 'ckpt.pt', 'sft': 'ckpt.pt', 'lora': 'ckpt.pt', 'dpo': 'ckpt.pt', 'rl': 'ckpt.pt',
             'hf-base': None, 'hf-lora': 'ckpt.pt', 'hf-rl': 'ckpt.pt'}
HELDOUT_METRICS = {'exact match': 'exact_match', 'BLEU': 'bleu', 'ROUGE-L': 'rouge_l'}  # eval.py's names
# LoRA recipes tried against config/lora.py (each: overrides of it), on the first seed
RECIPE_KEYS = ('learning_rate', 'max_iters', 'lora_r', 'lora_alpha', 'lora_target_modules', 'loraplus_lr_ratio')
LORA_SWEEP = {
    'config/lora.py': [],
    'lr 1e-2': ['--learning_rate=1e-2', '--min_lr=1e-3'],
    'lr 2e-2': ['--learning_rate=2e-2', '--min_lr=2e-3'],
    'r 32, alpha 64': ['--lora_r=32', '--lora_alpha=64.0'],
    'LoRA+ (B at 16x lr)': ['--loraplus_lr_ratio=16.0'],
    'lr 2e-3': ['--learning_rate=2e-3', '--min_lr=2e-4'],
    'lr 3e-3': ['--learning_rate=3e-3', '--min_lr=3e-4'],
    'lr 2e-3, 4000 steps': ['--learning_rate=2e-3', '--min_lr=2e-4', '--max_iters=4000', '--lr_decay_iters=4000'],
}


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def last(events, key):
    return [e[key] for e in events if key in e][-1]


def first(events, key):
    return [e[key] for e in events if key in e][0]


def figures_of(stage, events):
    """{figure name: value} that a stage's log gives."""
    if stage == 'pretrain':
        return {'val loss': last(events, 'val_loss')}
    if stage in ('sft', 'lora', 'hf-lora'):
        return {'exact match': last(events, 'eval/exact_match'), 'val loss': last(events, 'val_loss')}
    if stage in TTS_CORPORA:  # the final evaluation's line: MCD-DTW of the model mel, real-time factor
        return {'val loss': last(events, 'val_loss'), 'MCD-DTW, dB': last(events, 'mcd_model'),
                'RTF': last(events, 'rtf')}
    if stage in ('rl', 'hf-rl'):
        return {'exact match before': first(events, 'eval/exact_match'),
                'exact match after': last(events, 'eval/exact_match'),
                'eval pass@1 before': first(events, 'eval/pass@1'), 'eval pass@1': last(events, 'eval/pass@1')}
    return {'eval rewards/accuracies': last(events, 'eval/rewards/accuracies'),
            'exact match before': first(events, 'eval/exact_match'), 'exact match after': last(events, 'eval/exact_match')}


def code_hash(args):
    """sha256 of the code a command runs: the scripts and modules of the repo (its top and its packages) and its
    config files."""
    paths = sorted(glob.glob(os.path.join(ROOT, '*.py')) + [p for folder in ('lm', 'hf', 'run', 'tts', 'tasks')
                                                          for p in glob.glob(os.path.join(ROOT, folder, '*.py'))])
    paths += [os.path.join(ROOT, a) for a in args if a.endswith('.py')]
    return file_sha256(*paths)


def stage_dir(stage, seed):
    if stage == 'hf-lora':  # one SFT of the published model (the first seed's); its RL runs on every seed
        return os.path.join(work_dir, stage)
    return os.path.join(work_dir, f'seed{seed}', stage)


def run_stage(stage, seed, extra=(), name=None):
    """Run one stage's command; returns (its figures, its wall time in s)."""
    command, starts_from, quick_args = STAGES[stage]
    out_dir = os.path.join(work_dir, f'seed{seed}', name) if name else stage_dir(stage, seed)
    args = [*command, f'--seed={seed}', f'--out_dir={out_dir}', '--resume=False', *extra,
            *(quick_args if quick else [])]
    if starts_from:
        from_stage, file = starts_from.split('/')
        args.append(f'--init_from={os.path.join(stage_dir(from_stage, seed), file)}')
    elif stage == 'hf-lora':
        args.append(f'--init_from={hf_model}')
    if stage in TTS_CORPORA:
        args.append(f'--data_dir={TTS_CORPORA[stage][0]}')
    wall = run_once(args, out_dir, f"{stage} (seed {seed})")
    return figures_of(stage, read_log(os.path.join(ROOT, out_dir))), wall


def fine_tuned_generator(stage, seed, published):
    """The published generator fine-tuned on the mels of a TTS stage's model (GENERATOR_FT's command, in the
    stage's out_dir/vocoder): (its generator file, the run's wall time in s)."""
    out_dir = os.path.join(stage_dir(stage, seed), 'vocoder')
    model = os.path.join(stage_dir(stage, seed), 'ckpt.pt')
    args = [*GENERATOR_FT[stage], f'--seed={seed}', f'--out_dir={out_dir}', '--resume=False',
            f'--tts_ckpt={model}', f'--init_from={published}', *(GENERATOR_FT_QUICK if quick else [])]
    return os.path.join(out_dir, 'generator.pth.tar'), run_once(args, out_dir, f"{stage}'s generator (seed {seed})")


def run_once(args, out_dir, what):
    """Run `python args` (a run writing out_dir), or, with reuse, take the finished run of the same command and
    code that is there, or continue that run where a killed report left it (the script resumes its checkpoint);
    returns its wall time in s (a continued run's: its launches' added, each to within a minute)."""
    # the command and its code when it starts, its wall time so far while it runs and once it has ended: what
    # marks this script's runs
    finished = os.path.join(ROOT, out_dir, 'report_run.json')
    code = code_hash(args)
    previous = {}
    if reuse and os.path.exists(finished):
        with open(finished) as f:
            previous = json.load(f)
        if previous['args'] != args or previous['code'] != code:
            previous = {}
        elif 'wall_s' in previous:
            print(f"[reused] python {' '.join(args)}", flush=True)
            REUSED.append(1)
            return previous['wall_s']
    if os.path.exists(os.path.join(ROOT, out_dir, 'ckpt.pt')) and not os.path.exists(finished):
        sys.exit(f"error: {out_dir} holds a run this script did not start (no report_run.json), which its "
                 f"--resume=False would replace; pass another --work_dir, or delete that folder yourself.")
    os.makedirs(os.path.join(ROOT, out_dir), exist_ok=True)
    so_far, t0 = previous.get('partial_s', 0.0), time.time()

    def mark(**times):  # replaced whole: a report killed mid-write, or the run reading it, never sees half of it
        with atomic_file(finished) as f:
            f.write(json.dumps(dict(args=args, code=code, **times)).encode())
    mark(partial_s=so_far)
    argv = [a for a in args if a != '--resume=False'] if previous else args  # continued, not started again
    print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(argv)}", flush=True)
    run_checked([sys.executable, *argv], what, lambda: mark(partial_s=so_far + time.time() - t0))
    wall = so_far + time.time() - t0
    mark(wall_s=wall)
    return wall


def run_checked(argv, what, every_minute=None):
    """Run a command in the repo, calling every_minute while it runs; stop the report with its stderr's end if it
    fails."""
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        try:
            _, stderr = process.communicate(timeout=HEARTBEAT_S)
            break
        except subprocess.TimeoutExpired:  # communicate again: no output is lost
            if every_minute:
                every_minute()
    if process.returncode != 0:
        sys.exit(f"error: {what} failed with exit {process.returncode}:\n{stderr[-3000:]}")


def vocoder_short(path):
    """'universal' for .../generator_universal.pth.tar: what names a vocoder's folder and rows."""
    return os.path.basename(path).split('.')[0].removeprefix('generator_')


def vocoder_name(path):
    return f'HiFi-GAN {vocoder_short(path)}'


def speech_scores(stage, out_dir, ckpt='', vocoder=''):
    """{kind: {figure: value}} of the held-out sentences: Whisper's error rates (runs/tts_asr.py), DNSMOS with
    mos_python (runs/tts_mos.py) and the real-time factor of synthesis through a vocoder. The kinds: with ckpt
    the model's speech ('model'), without one the floors: the recordings and their mel through Griffin-Lim, or
    the mel through the vocoder ('vocoder'). The speech goes through vocoder ('' = Griffin-Lim); with reuse,
    the scores are read back when newer than what was spoken."""
    corpus, held_out = TTS_CORPORA[stage]
    kinds = 'model' if ckpt else 'vocoder' if vocoder else 'reference,griffin_lim'
    wav_dir = os.path.join(out_dir, 'asr' + (f'-{vocoder_short(vocoder)}' if vocoder else ''))
    result = os.path.join(ROOT, wav_dir, f"whisper_{kinds.replace(',', '_')}.json")
    mos = os.path.join(ROOT, wav_dir, f"dnsmos_{kinds.replace(',', '_')}.json")
    source = os.path.join(ROOT, ckpt) if ckpt else os.path.join(ROOT, held_out or corpus, 'metadata.csv')
    if not (reuse and os.path.exists(result) and os.path.getmtime(result) > os.path.getmtime(source)
            and (os.path.exists(mos) or not dnsmos)):
        synthesize = ['runs/tts_asr.py', 'synthesize', f'--wav_dir={wav_dir}', f'--kinds={kinds}',
                      *([f'--ckpt={ckpt}'] if ckpt else []), *([f'--vocoder={vocoder}'] if vocoder else []),
                      f'--held_out_dir={held_out}' if held_out else f'--data_dir={corpus}',
                      *(['--utterances=2'] if quick else [])]
        print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(synthesize)}", flush=True)
        run_checked([sys.executable, *synthesize], f"synthesizing {stage}'s held-out sentences")
        score = ['runs/tts_asr.py', 'score', f'--wav_dir={wav_dir}', f'--whisper={whisper}', f'--kinds={kinds}']
        print(f"[{time.strftime('%H:%M:%S')}] {asr_python} {' '.join(score)}", flush=True)
        run_checked([asr_python, *score], f"Whisper on {stage}'s speech")
        if dnsmos:
            rate = ['runs/tts_mos.py', f'--wav_dir={wav_dir}', f'--kinds={kinds}']
            print(f"[{time.strftime('%H:%M:%S')}] {mos_python} {' '.join(rate)}", flush=True)
            run_checked([mos_python, *rate], f"DNSMOS of {stage}'s speech")
    with open(result) as f:
        scores = json.load(f)
    with open(os.path.join(ROOT, wav_dir, 'manifest.json')) as f:
        manifest = json.load(f)
    # CPU time where the manifest has it: beside other jobs the clock's figure measures them too
    rtf = manifest.get('cpu_rtf', manifest['rtf'])
    out = {kind: {'Whisper WER': scores['wer'][kind], 'Whisper CER': scores['cer'][kind]} for kind in scores['wer']}
    if dnsmos:
        with open(mos) as f:
            means = json.load(f)['means']
        for kind in out:
            out[kind].update({'DNSMOS OVRL': means[kind]['ovrl_mos'], 'DNSMOS P.808': means[kind]['p808_mos']})
    for kind in out:
        if vocoder and kind in rtf:  # Griffin-Lim's RTF is the training run's own evaluation's
            out[kind]['RTF'] = rtf[kind]
    return out


def machine():
    return {'cpu': cpu_name(), 'threads': torch.get_num_threads(), 'torch': torch.__version__,
            'python': platform.python_version(), 'gpu': torch.cuda.get_device_name() if torch.cuda.is_available()
            else None}


def commit():
    done = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True)
    status = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT, capture_output=True,
                            text=True).stdout.splitlines()
    # the files a report writes itself (a partial report's earlier runs) do not make its code dirty
    dirty = [line for line in status if line[3:] not in ('runs/report.json', 'runs/report.md', 'runs/RESULTS.md',
                                                         'README.md')]
    return done.stdout.strip() + (' (with uncommitted changes)' if dirty else '')


FORMATS = {'val loss': '{:.4f}', 'exact match': '{:.1%}', 'exact match before': '{:.1%}',
           'exact match after': '{:.1%}', 'eval rewards/accuracies': '{:.3f}',
           'wall time to nanoGPT\'s val loss, ratio': '{:.3f}', 'tokens/s at nanoGPT\'s model, ratio': '{:.2f}',
           'eval pass@1': '{:.3f}', 'eval pass@1 before': '{:.3f}', 'BLEU': '{:.1f}', 'ROUGE-L': '{:.3f}',
           'Whisper WER': '{:.1%}',
           'Whisper CER': '{:.1%}', 'DNSMOS OVRL': '{:.2f}', 'DNSMOS P.808': '{:.2f}', 'MCD-DTW, dB': '{:.2f}',
           'RTF': '{:.3f}', 'wall time, min': '{:.1f}'}
COMMANDS = {'pretrain': '`python train.py`', 'sft': '`python train.py config/sft.py`',
            'lora': '`python train.py config/lora.py`', 'dpo': '`python train_dpo.py config/dpo.py`',
            'rl': '`python train_rl.py config/rl.py`', 'hf-base': '(as published)',
            'hf-lora': '`python train.py config/lora_hf.py` (one run, the first seed)',
            'hf-rl': '`python train_rl.py config/rl_hf.py` (from the hf-lora model)',
            'speedrun': '`python bench/speedrun.py` (pairs, not seeds)',
            'tts-espeak': '`python train_tts.py config/tts_espeak_cpu.py`',
            'tts-natural': '`python train_tts.py config/tts_natural_cpu.py`',
            'tts-natural-long': '`python train_tts.py config/tts_natural_cpu.py config/tts_natural_long_cpu.py`',
            'tts-natural-wide': '`python train_tts.py config/tts_natural_cpu.py config/tts_natural_wide_cpu.py`'}
TTS_NAMES = {'tts-espeak': 'espeak-ng (400 utterances, 19 min; its 20 held out)',
             'tts-natural': 'Piper "joe" in phonemes (1,000 utterances, 42.5 min; 100 other sentences)',
             'tts-natural-long': 'the same, 10,000 steps',
             'tts-natural-wide': 'the same, 5,000 steps of a 4x wider model (11.9M parameters; '
                                 'issue 56\'s recipe)'}
TTS_COLUMNS = ('Whisper WER', 'Whisper CER', 'DNSMOS OVRL', 'DNSMOS P.808', 'MCD-DTW, dB', 'RTF', 'wall time, min')
STARTS = {'dpo': 'sft', 'rl': 'sft', 'hf-rl': 'hf-lora'}  # the steps that start from another model of the chain
HELDOUT_NAMES = {'pretrain': 'base (pretrained)', 'sft': 'SFT', 'lora': 'LoRA', 'dpo': 'DPO after SFT',
                 'rl': 'RL after SFT', 'hf-base': 'SmolLM2-135M-Instruct', 'hf-lora': 'SmolLM2 + LoRA SFT',
                 'hf-rl': 'SmolLM2 + LoRA SFT + RL'}


def run_speedrun():
    """bench/speedrun.py's per-pair ratios against nanoGPT; returns (figures, wall time in s)."""
    out_dir = os.path.join(work_dir, 'speedrun')
    args = ['bench/speedrun.py', f'--nanogpt_dir={nanogpt_dir}', f'--work_dir={out_dir}',
            f"--plot={os.path.join(out_dir, 'speedrun.png')}"] + (['--pairs=1', '--throughput_iters=50'] if quick else [])
    print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(args)}", flush=True)
    t0 = time.time()
    run_checked([sys.executable, *args], 'the speedrun')
    with open(os.path.join(ROOT, out_dir, 'results.json')) as f:
        results = json.load(f)
    return {"wall time to nanoGPT's val loss, ratio": [r['ratio'] for r in results['runs']],
            "tokens/s at nanoGPT's model, ratio": [r['nanogpt_model'] / r['nanogpt'] for r in results['shape_runs']]
            }, time.time() - t0


def summary(values, fmt):
    """'median (min-max)' of one figure over the seeds; the value alone for one seed."""
    median = fmt.format(statistics.median(values))
    return median if len(values) == 1 else f"{median} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def results_table(report):
    """The markdown table of a report: a row per stage's figure, median (range) over the seeds."""
    lines = [f"| what | command | median (range) over seeds {', '.join(map(str, report['seeds']))} | each seed |",
             '| --- | --- | --- | --- |']
    for stage, figures in report['figures'].items():
        for figure, values in figures.items():
            fmt = FORMATS[figure]
            lines.append(f"| {stage}: {figure} | {COMMANDS[stage]} | {summary(values, fmt)} | "
                         f"{', '.join(fmt.format(v) for v in values)} |")
    return '\n\n'.join(['\n'.join(lines)] + ([tts_table(report)] if report.get('tts') else [])
                       + ([heldout_table(report)] if report.get('heldout') else []))


def tts_table(report):
    """Text-to-speech as papers report it: per corpus the floors (the recordings, their mel through Griffin-Lim
    and through each HiFi-GAN generator) and the recipe's model through each, median (range) over the seeds, and
    each seed's (through Griffin-Lim)."""
    measured = {k for stage in report['tts'] for k in report['figures'][stage]}  # a report without DNSMOS, say
    columns = [k for k in TTS_COLUMNS if k in measured or k == 'wall time, min']
    said = {'Whisper WER': 'Whisper base word and character error rates', 'DNSMOS OVRL': 'DNSMOS (overall P.835, '
            'P.808)', 'MCD-DTW, dB': "MCD-DTW of the model mel (the floor's: the reference mel through Griffin-Lim)",
            'RTF': "real-time factor on one thread (CPU time over audio time: an idle core's; through "
                   "Griffin-Lim: the final evaluation's, by the clock)"}
    lines = ["Text-to-speech on held-out sentences: " + ', '.join(said[k] for k in said if k in columns)
             + ", wall time of the training runs (the model's, and its generator's where it is fine-tuned):\n",
             '| corpus | speech | ' + ' | '.join(columns) + ' |', '| --- | --- |' + ' --- |' * len(columns)]
    cells = lambda values: [FORMATS[k].format(values[k]) if k in values else '' for k in columns]  # noqa: E731
    summaries = lambda figures: [summary(figures[k], FORMATS[k]) if k in figures else ''  # noqa: E731
                                 for k in columns]
    for stage, floor in report['tts'].items():
        figures = dict(report['figures'][stage], **{'wall time, min': [w / 60 for w in report['wall_s'][stage]]})
        vocoded = report.get('vocoded', {}).get(stage, {})
        lines.append(f"| {TTS_NAMES[stage]} | recordings | " + ' | '.join(cells(floor['reference'])) + ' |')
        for kind in floor:
            if kind != 'reference':
                name = 'Griffin-Lim' if kind == 'griffin_lim' else kind
                lines.append(f"| | reference mel through {name} | " + ' | '.join(cells(floor[kind])) + ' |')
        lines.append(f"| | {COMMANDS[stage]}{', through Griffin-Lim' if vocoded else ''}, median (range) | "
                     + ' | '.join(summaries(figures)) + ' |')
        for name, values in vocoded.items():
            lines.append(f"| | the same models through {name}, median (range) | " + ' | '.join(summaries(values))
                         + ' |')
        ran = report['seeds'][:len(figures['val loss'])]  # tts_seeds of them
        for i, seed in enumerate(ran if len(ran) > 1 else []):
            seed_figures = {k: figures[k][i] for k in columns if k in figures}
            lines.append(f"| | seed {seed} | " + ' | '.join(cells(seed_figures)) + ' |')
    return '\n'.join(lines)


def prompts_note(m, n):
    """' (the first m prompts)' where a model kept from an earlier report answered m prompts, not n."""
    return '' if m == n else f" (the first {m} prompts)"


def flips(before_file, after_file):
    """[broken, mended]: held-out prompts right before and wrong after, and the other way, from eval.py's
    per-example scores of two models on the same prompts."""
    right = []
    for path in (before_file, after_file):
        with open(os.path.join(ROOT, path)) as f:
            right.append([e['scores']['exact_match'] for e in json.load(f)['examples']])
    pairs = list(zip(*right, strict=True))
    return [sum(a > b for a, b in pairs), sum(b > a for a, b in pairs)]


def paired_changes(report, stage):
    """Each seed's held-out exact-match change (points) from the model the stage started from, same prompts."""
    after, before = report['heldout'][stage]['exact match'], report['heldout'][STARTS[stage]]['exact match']
    before = before * len(after) if len(before) == 1 else before  # hf-lora: one model every seed's RL starts from
    return [100 * (a - b) for a, b in zip(after, before, strict=True)]


def flip_note(report, stage, i):
    flipped = report.get('flips', {}).get(stage)
    return f" ({flipped[i][0]} / {flipped[i][1]})" if flipped else ''


def changes_table(report):
    """What DPO and RL change, paired: each seed's model against the one it started from, on the same prompts
    (medians of different seeds side by side would hide each seed's change)."""
    n = report['heldout_examples']
    lines = [f"Each seed's change from the model it started from, on the same {n} held-out prompts (points; one "
             f"prompt is {100 / n:.1f}); for RL also its reward's sampled pass@1 on its own held-out prompts "
             f"(train_rl.py's eval, before and after):\n",
             '| step | from | exact match change, median (range) | each seed (prompts broken / mended) | '
             'pass@1 change, each seed |', '| --- | --- | --- | --- | --- |']
    counts = report.get('heldout_n', {})
    for stage in [s for s in STARTS if s in report['heldout'] and STARTS[s] in report['heldout']]:
        m = counts.get(stage, n)
        if counts.get(STARTS[stage], n) != m:  # not the same prompts: no pairs
            continue
        changes = paired_changes(report, stage)
        figures = report['figures'].get(stage, {})
        passes = ', '.join(f"{after - before:+.3f}" for before, after in
                           zip(figures.get('eval pass@1 before', []), figures.get('eval pass@1', [])))
        spread = f" ({min(changes):+.1f} to {max(changes):+.1f})" if len(changes) > 1 else ''
        lines.append(f"| {HELDOUT_NAMES[stage]} | {HELDOUT_NAMES[STARTS[stage]]}{prompts_note(m, n)} | "
                     f"{statistics.median(changes):+.1f}{spread} | "
                     f"{', '.join(f'{c:+.1f}' + flip_note(report, stage, i) for i, c in enumerate(changes))} | "
                     f"{passes} |")
    return '\n'.join(lines)


def heldout_table(report):
    """The models side by side on the same held-out prompts, as eval.py scores them; then DPO's and RL's
    paired changes."""
    lines = [f"Held-out answers by `eval.py` (greedy, the first {report['heldout_examples']} prompts of the number "
             f"tasks' test split), median (range) over the seeds:\n",
             '| model | trained by | ' + ' | '.join(HELDOUT_METRICS) + ' |', '| --- | --- |' + ' --- |' * len(HELDOUT_METRICS)]
    for stage, figures in sorted(report['heldout'].items(), key=lambda item: list(HELDOUT_NAMES).index(item[0])):
        n = report['heldout_examples']
        note = prompts_note(report.get('heldout_n', {}).get(stage, n), n)
        lines.append(f"| {HELDOUT_NAMES[stage]}{note} | {COMMANDS[stage]} | "
                     + ' | '.join(summary(figures[k], FORMATS[k]) for k in HELDOUT_METRICS) + ' |')
    return '\n'.join(lines) + (f"\n\n{changes_table(report)}" if any(s in report['heldout'] for s in STARTS) else '')


RESULTS_BEGIN = '<!-- report: generated by runs/report.py, do not edit -->'
RESULTS_END = '<!-- report end -->'
RESULTS_PATH = os.path.join(ROOT, 'runs', 'RESULTS.md')
README_BEGIN, README_END = '<!-- held-out: generated by runs/report.py, do not edit -->', '<!-- held-out end -->'
README_TTS_BEGIN, README_TTS_END = '<!-- tts: generated by runs/report.py, do not edit -->', '<!-- tts end -->'
README_PATH = os.path.join(ROOT, 'README.md')


def in_stage_order(by_stage):
    """by_stage ({stage: ...}) in a full report's order: the published model, STAGES' order, the speedrun (a
    partial report's tables then read as a full one's, whichever stages it ran)."""
    rank = {stage: i for i, stage in enumerate(['hf-base', *STAGES, 'speedrun'])}
    return dict(sorted(by_stage.items(), key=lambda item: rank[item[0]]))


def kept_note(report):
    """' Kept from the report of <date, commit> (not run here): <stages>.' for each earlier run a partial report
    keeps stages of; '' for a full one."""
    origins = report.get('origin', {})
    return ''.join(f" Kept from the report of {origin} (not run here): "
                   f"{', '.join(stage for stage in origins if origins[stage] == origin)}."
                   for origin in dict.fromkeys(origins.values()))


def write_report(report):
    table = results_table(report)
    m = report['machine']
    walls = ', '.join(f"{stage} {statistics.median(t) / 60:.1f} min" for stage, t in report['wall_s'].items())
    text = ["# nanotrain results report\n",
            f"`python runs/report.py{' --quick=True' if quick else ''}` on {report['date']}, commit "
            f"{report['commit']}. Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, "
            f"Python {m['python']}" + (f", {m['gpu']}" if m['gpu'] else ', no GPU') + '.',
            f"Wall time per run (median over seeds): {walls}; the whole report {report['total_s'] / 60:.1f} min"
            + (f" (all runs together; {report['reused']} of them finished before, read back with --reuse)"
               if report.get('reused') else '') + '.'
            + kept_note(report) + '\n',
            table]
    os.makedirs(os.path.dirname(report_path), exist_ok=True)  # runs/results/ (ignored) for a quick report
    with open(report_path + '.md', 'w') as f:
        f.write('\n'.join(text) + '\n')
    with open(report_path + '.json', 'w') as f:
        json.dump(report, f, indent=1)
    print(f"wrote {report_path}.md and .json")
    return table


def put_between(path, begin, end, block):
    """Replace what path holds between its begin and end markers (kept) with block."""
    with open(path) as f:
        text = f.read()
    before, _, rest = text.partition(begin)
    _, _, after = rest.partition(end)
    if not rest:
        sys.exit(f"error: {os.path.relpath(path, ROOT)} has no '{begin}' marker; put one (and '{end}') where the "
                 f"table belongs.")
    with open(path, 'w') as f:
        f.write(before + begin + '\n' + block + '\n' + end + after)


def put_in_results(table, report):
    """The report's tables into runs/RESULTS.md, and its held-out comparison into the README."""
    put_between(RESULTS_PATH, RESULTS_BEGIN, RESULTS_END,
                f"`python runs/report.py`, {report['date']}, commit {report['commit']}, {report['machine']['cpu']} "
                f"({report['machine']['threads']} threads); full report: `runs/report.md`.{kept_note(report)}"
                f"\n\n{table}")
    print("updated runs/RESULTS.md's results table")
    if report.get('heldout'):
        put_between(README_PATH, README_BEGIN, README_END, heldout_table(report))
        print("updated README.md's held-out table")
    if report.get('tts'):
        put_between(README_PATH, README_TTS_BEGIN, README_TTS_END, tts_table(report))
        print("updated README.md's text-to-speech table")


def heldout_file():
    """The held-out prompts as eval.py reads them: the first heldout_examples of the number tasks' test.jsonl
    (the split train.py's exact match answers), each with its answer as the reference."""
    prepare_number_tasks(os.path.join(ROOT, NUMBER_TASKS_DIR))  # as train.py writes it
    with open(os.path.join(ROOT, NUMBER_TASKS_DIR, 'test.jsonl')) as f:
        rows = [json.loads(line) for line in f][:heldout_examples]
    path = os.path.join(work_dir, 'heldout.jsonl')
    os.makedirs(os.path.join(ROOT, work_dir), exist_ok=True)
    with open(os.path.join(ROOT, path), 'w') as f:
        f.writelines(json.dumps({'prompt': row['prompt'], 'reference': row['response']}) + '\n' for row in rows)
    return path


def heldout_scores(model, out, eval_data):
    """{figure: [value]} of eval.py's greedy answers of model to the held-out prompts (HELDOUT_METRICS); with
    reuse, read from out when it is newer than the model."""
    if not (reuse and os.path.exists(os.path.join(ROOT, out))
            and os.path.getmtime(os.path.join(ROOT, out)) > os.path.getmtime(os.path.join(ROOT, model))):
        args = ['eval.py', f'--init_from={model}', f'--eval_data={eval_data}', f'--out={out}', '--max_new_tokens=48',
                f"--metrics={','.join(HELDOUT_METRICS.values())}", '--batch_size=50',
                *(['--max_examples=20'] if quick else [])]
        print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(args)}", flush=True)
        run_checked([sys.executable, *args], f'eval.py on {model}')
    with open(os.path.join(ROOT, out)) as f:
        scores = json.load(f)['scores']
    return {figure: [scores[name]] for figure, name in HELDOUT_METRICS.items()}


def lora_sweep_report():
    """Full SFT and every LORA_SWEEP recipe from the first seed's pretrained model: runs/lora_sweep.md/.json."""
    seed = seeds[0]
    sft_figures = {}
    for stage in ('pretrain', 'sft'):
        sft_figures, _ = run_stage(stage, seed)
    runs = {}
    for name, overrides in LORA_SWEEP.items():
        figures, wall = run_stage('lora', seed, overrides, name=f"lora-sweep-{len(runs)}")
        config = load_checkpoint(os.path.join(ROOT, work_dir, f'seed{seed}', f'lora-sweep-{len(runs)}', 'ckpt.pt'))['config']
        recipe = {k: config[k] for k in RECIPE_KEYS}  # as run, whatever config/lora.py says later
        runs[name] = dict(figures, overrides=overrides, recipe=recipe, wall_s=wall)
        print(f"  LoRA sweep {name}: exact match {figures['exact match']:.1%}, val loss {figures['val loss']:.4f}",
              flush=True)
    sweep = dict(date=time.strftime('%Y-%m-%d'), commit=commit(), machine=machine(), seed=seed, sft=sft_figures,
                 runs=runs)
    path = os.path.join(ROOT, 'runs', 'results' if quick else '', 'lora_sweep')
    with open(path + '.json', 'w') as f:
        json.dump(sweep, f, indent=1)
    lines = ["# LoRA recipe sweep\n",
             f"`python runs/report.py --lora_sweep=True` on {sweep['date']}, commit {sweep['commit']}, "
             f"{sweep['machine']['cpu']}: seed {seed}, every recipe from the same pretrained model, against full SFT "
             f"(`python train.py config/sft.py`): exact match {sft_figures['exact match']:.1%}, val loss "
             f"{sft_figures['val loss']:.4f}.\n",
             '| recipe | overrides of config/lora.py | as run | exact match | val loss | wall |',
             '| --- | --- | --- | --- | --- | --- |']
    lines += [f"| {name} | `{' '.join(r['overrides']) or '(none)'}` | "
              + ', '.join(f'{k} {v}' for k, v in r['recipe'].items())
              + f" | {r['exact match']:.1%} | {r['val loss']:.4f} | {r['wall_s'] / 60:.1f} min |" for name, r in runs.items()]
    with open(path + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if lora_sweep:
    lora_sweep_report()
    sys.exit(0)
if table_only:
    with open(os.path.join(ROOT, 'runs', 'report.json')) as f:
        saved = json.load(f)
    put_in_results(results_table(saved), saved)
    sys.exit(0)
todo = [stage.strip() for stage in stages.split(',') if stage.strip()]
if set(todo) - set(STAGES):
    sys.exit(f"error: stages={stages!r}: unknown {sorted(set(todo) - set(STAGES))}; the stages are {list(STAGES)}.")
if set(todo) & set(HF_STAGES) and not os.path.exists(os.path.join(ROOT, hf_model, 'config.json')):
    print(f"no Hugging Face model folder at hf_model={hf_model!r} (../shared/tools/make_smollm2_hf.py builds "
          f"SmolLM2-135M-Instruct): the {', '.join(HF_STAGES)} stages are left out of the report")
    todo = [stage for stage in todo if stage not in HF_STAGES]
for stage in [stage for stage in todo if stage in TTS_CORPORA]:
    missing = [d for d in TTS_CORPORA[stage] if d and not os.path.exists(os.path.join(ROOT, d, 'metadata.csv'))]
    if missing:
        print(f"no corpus at {', '.join(missing)} (docs/tts.md makes it): the {stage} stage is left out of the report")
        todo.remove(stage)
asr = os.path.exists(os.path.join(ROOT, asr_python)) and os.path.exists(os.path.join(ROOT, whisper))
if set(todo) & set(TTS_CORPORA) and not asr:
    print(f"no faster-whisper python at asr_python={asr_python!r} or no model at whisper={whisper!r}: text-to-speech "
          f"is reported without Whisper's error rates")
dnsmos = asr and os.path.exists(os.path.join(ROOT, mos_python))
if set(todo) & set(TTS_CORPORA) and asr and not dnsmos:
    print(f"no speechmos python at mos_python={mos_python!r}: text-to-speech is reported without DNSMOS")
listed_vocoders = [v for v in vocoders.split(',') if v]
vocoder_files = [v for v in listed_vocoders if os.path.exists(os.path.join(ROOT, v))] if asr else []
if set(todo) & set(TTS_CORPORA) and asr and len(vocoder_files) < len(listed_vocoders):
    print(f"vocoders={vocoders!r}: only {vocoder_files} found (../shared/tools/get_hifigan.py, docs/tts.md): the "
          f"speech goes through those and Griffin-Lim")
t_start = time.time()
heldout = heldout_file()
report = {'date': time.strftime('%Y-%m-%d'), 'commit': commit(), 'machine': machine(), 'seeds': list(seeds),
          'figures': {stage: {} for stage in todo}, 'wall_s': {stage: [] for stage in todo}, 'heldout': {},
          'heldout_examples': heldout_examples, 'heldout_n': {}, 'flips': {}, 'tts': {}, 'vocoded': {}}
if set(todo) & set(HF_STAGES):  # the published model as it is, once: greedy answers do not depend on the seed
    report['heldout']['hf-base'] = heldout_scores(hf_model, os.path.join(work_dir, 'hf-base.eval.json'), heldout)
    report['heldout_n']['hf-base'] = heldout_examples
for seed in seeds:
    for stage in todo:
        if stage == 'hf-lora' and seed != seeds[0] or stage in TTS_CORPORA and seed not in seeds[:tts_seeds]:
            continue
        figures, wall = run_stage(stage, seed)
        for figure, value in figures.items():
            report['figures'][stage].setdefault(figure, []).append(value)
        report['wall_s'][stage].append(wall)
        out_dir = stage_dir(stage, seed)
        if stage in TTS_CORPORA:
            if asr:
                for figure, value in speech_scores(stage, out_dir, os.path.join(out_dir, 'ckpt.pt'))['model'].items():
                    report['figures'][stage].setdefault(figure, []).append(value)
            generators = {vocoder_name(vocoder): vocoder for vocoder in vocoder_files}
            if stage in GENERATOR_FT and vocoder_files:  # the recipe's own generator, trained after the model
                name = f'{vocoder_name(vocoder_files[0])} fine-tuned on their mels'
                generators[name], generator_wall = fine_tuned_generator(stage, seed, vocoder_files[0])
                report['wall_s'][stage][-1] += generator_wall
            for name, vocoder in generators.items():  # the same model's speech through each generator
                scores = speech_scores(stage, out_dir, os.path.join(out_dir, 'ckpt.pt'), vocoder)['model']
                for figure, value in scores.items():
                    report['vocoded'].setdefault(stage, {}).setdefault(name, {}).setdefault(figure, []).append(value)
            print(f"  {stage}, seed {seed}: " + ', '.join(f"{k} {FORMATS[k].format(v[-1])}"
                                                         for k, v in report['figures'][stage].items())
                  + f" ({wall / 60:.1f} min)", flush=True)
            continue
        scores = heldout_scores(os.path.join(out_dir, EVALUATED[stage]), os.path.join(out_dir, 'heldout.eval.json'),
                                heldout)
        for name, value in scores.items():
            report['heldout'].setdefault(stage, {}).setdefault(name, []).append(value[0])
        report['heldout_n'][stage] = heldout_examples
        if stage in STARTS:  # which prompts the step broke and mended, against the model it started from
            report['flips'].setdefault(stage, []).append(
                flips(os.path.join(stage_dir(STARTS[stage], seed), 'heldout.eval.json'),
                      os.path.join(out_dir, 'heldout.eval.json')))
        print(f"  {stage}, seed {seed}: " + ', '.join(f"{k} {FORMATS[k].format(v)}" for k, v in figures.items())
              + "; held-out " + ', '.join(f"{k} {FORMATS[k].format(v[0])}" for k, v in scores.items())
              + f" ({wall / 60:.1f} min)", flush=True)
for stage in [stage for stage in todo if stage in TTS_CORPORA and asr]:  # the floor, once per corpus
    floor = speech_scores(stage, os.path.join(work_dir, f'{stage}-floor'))
    floor['griffin_lim']['MCD-DTW, dB'] = statistics.median(
        last(read_log(os.path.join(ROOT, stage_dir(stage, seed))), 'mcd_reference_audio') for seed in seeds[:tts_seeds])
    for vocoder in vocoder_files:  # the reference mel through each generator: its floor
        floor[vocoder_name(vocoder)] = speech_scores(stage, os.path.join(work_dir, f'{stage}-floor'), '',
                                                     vocoder)['vocoder']
    report['tts'][stage] = floor
if set(todo) != set(STAGES) and os.path.exists(report_path + '.json'):  # partial: keep the other stages
    with open(report_path + '.json') as f:
        saved = json.load(f)
    for key in ('figures', 'wall_s', 'heldout', 'tts', 'flips', 'vocoded'):
        for stage, value in saved.get(key, {}).items():
            if stage not in todo:  # what this run measured itself (e.g. the published model's answers) stays
                report[key].setdefault(stage, value)
    for stage in report['heldout']:  # how many prompts each kept model answered
        report['heldout_n'].setdefault(stage, saved.get('heldout_n', {}).get(stage, saved['heldout_examples']))
    report['origin'] = {stage: saved.get('origin', {}).get(stage, f"{saved['date']}, commit {saved['commit']}")
                        for stage in saved['figures'] if stage not in todo}  # where each kept stage was run
    for key in ('figures', 'wall_s', 'heldout', 'tts', 'flips', 'vocoded'):  # run and kept stages interleaved
        report[key] = in_stage_order(report[key])
if not set(LM_STAGES) <= set(todo):
    pass  # the speedrun runs with the whole language-model chain; a partial report keeps the saved one
elif nanogpt_dir and os.path.exists(os.path.join(nanogpt_dir, 'train.py')):
    report['figures']['speedrun'], wall = run_speedrun()
    report['wall_s']['speedrun'] = [wall]
    report.get('origin', {}).pop('speedrun', None)
else:
    print(f"no nanoGPT checkout at nanogpt_dir={nanogpt_dir!r}: the speedrun is not run"
          + (" (the saved report's is kept)" if 'speedrun' in report['figures'] else ''))
reused = sum(REUSED)
# runs read back count with their own wall time
report['total_s'] = time.time() - t_start + sum(sum(w) for w in report['wall_s'].values()) * bool(reused)
report['reused'] = reused
table = write_report(report)
print(table)
if results_md and not quick:
    put_in_results(table, report)
