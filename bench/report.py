"""
bench/RESULTS.md's generated table, regenerated: runs the documented commands as a user would (default
pretraining, SFT, LoRA, DPO) over several seeds, reads each run's log.jsonl, and writes a report with,
per figure, the median and the range over the seeds, every seed's value, the commit, the machine and
the wall time (nanochat's report card: nobody types a result).

    python bench/report.py                    # the full report: bench/report.md, bench/report.json and bench/RESULTS.md's table
    python bench/report.py --table_only=True  # no runs: bench/RESULTS.md's table rewritten from the committed bench/report.json
    python bench/report.py --quick=True       # the machinery in minutes (one seed, few steps): bench/results/report-quick.*
    python bench/report.py --lora_sweep=True  # instead, the LoRA recipe sweep (first seed): bench/lora_sweep.*

With a nanoGPT checkout at nanogpt_dir (`git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT`), the
speedrun's ratios (bench/speedrun.py, its own alternating pairs) join the report; without one they are skipped.

Each stage runs the documented command with --seed, its own --out_dir under work_dir and --init_from at the
previous stage's checkpoint, so a user's out/, out-sft/, ... are never touched. tests/test_report.py
checks that bench/RESULTS.md's table is this report's. Timings and quality are never unit tests.
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
from run.checkpoint import file_sha256, load_checkpoint  # noqa: E402

# -----------------------------------------------------------------------------
seeds = (1337, 1338, 1339)   # one run of every stage per seed
quick = False                # one seed, a few steps per stage: checks the machinery, writes bench/results/report-quick.*
lora_sweep = False           # instead of the report: LORA_SWEEP against full SFT on the first seed, into bench/lora_sweep.*
nanogpt_dir = '/tmp/nanoGPT'  # a nanoGPT checkout: bench/speedrun.py's ratios join the report (its 3 pairs); '' or none there = skipped
work_dir = 'bench/results/report'  # the runs' out_dirs
reuse = False                # a run whose out_dir holds a finished run of the same command and code is read, not run again
results_md = True            # put the report's table into bench/RESULTS.md (between the report markers); not with quick
table_only = False           # no runs: rewrite bench/RESULTS.md's table from the committed bench/report.json, and stop
# -----------------------------------------------------------------------------
configure(globals())
if quick:
    seeds = seeds[:1]
    work_dir = work_dir + '-quick'
report_path = os.path.join(ROOT, 'bench', 'results', 'report-quick') if quick else os.path.join(ROOT, 'bench', 'report')

# stage: (the documented command, what it starts from, quick-mode overrides)
STAGES = {
    'pretrain': (['train.py'], None, ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=20', '--eval_iters=2']),
    'sft': (['train.py', 'config/sft.py'], 'pretrain',
            ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=20', '--exact_match_examples=20']),
    'lora': (['train.py', 'config/lora.py'], 'pretrain',
             ['--max_iters=20', '--lr_decay_iters=20', '--eval_interval=20', '--exact_match_examples=20']),
    'dpo': (['train_dpo.py', 'config/dpo.py'], 'sft',
            ['--max_iters=10', '--lr_decay_iters=10', '--eval_interval=10', '--eval_pairs=50',
             '--exact_match_examples=20']),
}
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
    if stage in ('sft', 'lora'):
        return {'exact match': last(events, 'eval/exact_match'), 'val loss': last(events, 'val_loss')}
    return {'eval rewards/accuracies': last(events, 'eval/rewards/accuracies'),
            'exact match before': first(events, 'eval/exact_match'), 'exact match after': last(events, 'eval/exact_match')}


def code_hash(args):
    """sha256 of the code a command runs: the scripts and modules of the repo (its top and its packages) and its
    config files."""
    paths = sorted(glob.glob(os.path.join(ROOT, '*.py')) + [p for folder in ('lm', 'hf', 'run', 'tts', 'tasks')
                                                          for p in glob.glob(os.path.join(ROOT, folder, '*.py'))])
    paths += [os.path.join(ROOT, a) for a in args if a.endswith('.py')]
    return file_sha256(*paths)


def run_stage(stage, seed, starts_from, extra=(), name=None):
    """Run one stage's command; returns (its figures, its wall time in s)."""
    command, _, quick_args = STAGES[stage]
    out_dir = os.path.join(work_dir, f'seed{seed}', name or stage)
    args = [*command, f'--seed={seed}', f'--out_dir={out_dir}', '--resume=False', *extra,
            *(quick_args if quick else [])]
    if starts_from:
        args.append(f'--init_from={os.path.join(work_dir, f"seed{seed}", starts_from, "ckpt.pt")}')
    finished = os.path.join(ROOT, out_dir, 'report_run.json')  # the command, its code and wall time, once it has ended
    code = code_hash(args)
    if reuse and os.path.exists(finished):
        with open(finished) as f:
            previous = json.load(f)
        if previous['args'] == args and previous['code'] == code:
            print(f"[reused] python {' '.join(args)}", flush=True)
            return figures_of(stage, read_log(os.path.join(ROOT, out_dir))), previous['wall_s']
    print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(args)}", flush=True)
    t0 = time.time()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {stage} (seed {seed}) failed with exit {done.returncode}:\n{done.stderr[-3000:]}")
    wall = time.time() - t0
    with open(finished, 'w') as f:
        json.dump(dict(args=args, code=code, wall_s=wall), f)
    return figures_of(stage, read_log(os.path.join(ROOT, out_dir))), wall


def machine():
    cpu = platform.processor() or platform.machine()
    if os.path.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as f:
            cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), cpu)
    return {'cpu': cpu, 'threads': torch.get_num_threads(), 'torch': torch.__version__,
            'python': platform.python_version(), 'gpu': torch.cuda.get_device_name() if torch.cuda.is_available()
            else None}


def commit():
    done = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return done.stdout.strip() + (' (with uncommitted changes)' if dirty else '')


FORMATS = {'val loss': '{:.4f}', 'exact match': '{:.1%}', 'exact match before': '{:.1%}',
           'exact match after': '{:.1%}', 'eval rewards/accuracies': '{:.3f}',
           'wall time to nanoGPT\'s val loss, ratio': '{:.3f}', 'tokens/s at nanoGPT\'s model, ratio': '{:.2f}'}
COMMANDS = {'pretrain': '`python train.py`', 'sft': '`python train.py config/sft.py`',
            'lora': '`python train.py config/lora.py`', 'dpo': '`python train_dpo.py config/dpo.py`',
            'speedrun': '`python bench/speedrun.py` (pairs, not seeds)'}


def run_speedrun():
    """bench/speedrun.py's per-pair ratios against nanoGPT; returns (figures, wall time in s)."""
    out_dir = os.path.join(work_dir, 'speedrun')
    args = ['bench/speedrun.py', f'--nanogpt_dir={nanogpt_dir}', f'--work_dir={out_dir}',
            f"--plot={os.path.join(out_dir, 'speedrun.png')}"] + (['--pairs=1', '--throughput_iters=50'] if quick else [])
    print(f"[{time.strftime('%H:%M:%S')}] python {' '.join(args)}", flush=True)
    t0 = time.time()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: the speedrun failed with exit {done.returncode}:\n{done.stderr[-3000:]}")
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
    return '\n'.join(lines)


RESULTS_BEGIN = '<!-- report: generated by bench/report.py, do not edit -->'
RESULTS_END = '<!-- report end -->'
RESULTS_PATH = os.path.join(ROOT, 'bench', 'RESULTS.md')


def write_report(report):
    table = results_table(report)
    m = report['machine']
    walls = ', '.join(f"{stage} {statistics.median(t) / 60:.1f} min" for stage, t in report['wall_s'].items())
    text = [f"# nanotrain results report\n",
            f"`python bench/report.py{' --quick=True' if quick else ''}` on {report['date']}, commit "
            f"{report['commit']}. Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}, "
            f"Python {m['python']}" + (f", {m['gpu']}" if m['gpu'] else ', no GPU') + '.',
            f"Wall time per run (median over seeds): {walls}; the whole report {report['total_s'] / 60:.1f} min.\n",
            table]
    with open(report_path + '.md', 'w') as f:
        f.write('\n'.join(text) + '\n')
    with open(report_path + '.json', 'w') as f:
        json.dump(report, f, indent=1)
    print(f"wrote {report_path}.md and .json")
    return table


def put_in_results(table, report):
    with open(RESULTS_PATH) as f:
        text = f.read()
    before, _, rest = text.partition(RESULTS_BEGIN)
    _, _, after = rest.partition(RESULTS_END)
    if not rest:
        sys.exit(f"error: bench/RESULTS.md has no '{RESULTS_BEGIN}' marker; put one (and '{RESULTS_END}') where the "
                 f"table belongs.")
    block = (f"{RESULTS_BEGIN}\n`python bench/report.py`, {report['date']}, commit {report['commit']}, "
             f"{report['machine']['cpu']} ({report['machine']['threads']} threads); full report: "
             f"`bench/report.md`.\n\n{table}\n{RESULTS_END}")
    with open(RESULTS_PATH, 'w') as f:
        f.write(before + block + after)
    print("updated bench/RESULTS.md's results table")


def lora_sweep_report():
    """Full SFT and every LORA_SWEEP recipe from the first seed's pretrained model: bench/lora_sweep.md/.json."""
    seed = seeds[0]
    sft_figures = {}
    for stage in ('pretrain', 'sft'):
        sft_figures, _ = run_stage(stage, seed, STAGES[stage][1])
    runs = {}
    for name, overrides in LORA_SWEEP.items():
        figures, wall = run_stage('lora', seed, 'pretrain', overrides, name=f"lora-sweep-{len(runs)}")
        config = load_checkpoint(os.path.join(ROOT, work_dir, f'seed{seed}', f'lora-sweep-{len(runs)}', 'ckpt.pt'))['config']
        recipe = {k: config[k] for k in RECIPE_KEYS}  # as run, whatever config/lora.py says later
        runs[name] = dict(figures, overrides=overrides, recipe=recipe, wall_s=wall)
        print(f"  LoRA sweep {name}: exact match {figures['exact match']:.1%}, val loss {figures['val loss']:.4f}",
              flush=True)
    sweep = dict(date=time.strftime('%Y-%m-%d'), commit=commit(), machine=machine(), seed=seed, sft=sft_figures,
                 runs=runs)
    path = os.path.join(ROOT, 'bench', 'results' if quick else '', 'lora_sweep')
    with open(path + '.json', 'w') as f:
        json.dump(sweep, f, indent=1)
    lines = [f"# LoRA recipe sweep\n",
             f"`python bench/report.py --lora_sweep=True` on {sweep['date']}, commit {sweep['commit']}, "
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
    with open(os.path.join(ROOT, 'bench', 'report.json')) as f:
        saved = json.load(f)
    put_in_results(results_table(saved), saved)
    sys.exit(0)
t_start = time.time()
report = {'date': time.strftime('%Y-%m-%d'), 'commit': commit(), 'machine': machine(), 'seeds': list(seeds),
          'figures': {stage: {} for stage in STAGES}, 'wall_s': {stage: [] for stage in STAGES}}
for seed in seeds:
    for stage, (_, starts_from, _) in STAGES.items():
        figures, wall = run_stage(stage, seed, starts_from)
        for figure, value in figures.items():
            report['figures'][stage].setdefault(figure, []).append(value)
        report['wall_s'][stage].append(wall)
        print(f"  {stage}, seed {seed}: " + ', '.join(f"{k} {FORMATS[k].format(v)}" for k, v in figures.items())
              + f" ({wall / 60:.1f} min)", flush=True)
if nanogpt_dir and os.path.exists(os.path.join(nanogpt_dir, 'train.py')):
    report['figures']['speedrun'], wall = run_speedrun()
    report['wall_s']['speedrun'] = [wall]
else:
    print(f"no nanoGPT checkout at nanogpt_dir={nanogpt_dir!r}: the speedrun is left out of the report")
report['total_s'] = time.time() - t_start
table = write_report(report)
print(table)
if results_md and not quick:
    put_in_results(table, report)
