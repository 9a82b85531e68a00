"""
train_rl.py on a tiny char-level chat model, on the CPU in minutes: does RL raise the reward of a model that
SFT left weak? A 2-layer, 64-wide GPT is pretrained on the embedded number tasks' text and fine-tuned on them
(SFT, train.py), then trained with train_rl.py on the number tasks, their checker as the reward: once on the
two kinds it half knows (the next number, counting digits), once on all six. Each stage runs the scripts
themselves, one thread each; the table gives the held-out pass@1/pass@4 (sampled at temperature 1) and the
greedy exact match before and after RL, and the training reward of the first and last quarters of its steps.

    OMP_NUM_THREADS=1 python runs/rl_tiny.py      # ~10 minutes on a busy 2-core CPU

Everything is written under runs/results/rl_tiny/ (a rerun starts over).
"""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data import prepare
from tasks.number_tasks import prepare_number_tasks

OUT = os.path.join(ROOT, 'runs', 'results', 'rl_tiny')
MODEL = ['--n_layer=2', '--n_head=2', '--n_embd=64', '--block_size=64', '--dropout=0.0', '--device=cpu',
         '--dtype=float32', '--tensorboard=False', '--batch_size=16', '--eval_iters=5', '--log_interval=100']
RL = ['--device=cpu', '--dtype=float32', '--tensorboard=False', '--eval_prompts=100', '--pass_k=4',
      '--exact_match_examples=200', '--log_interval=10', '--max_prompt_length=38', '--max_new_tokens=26',
      '--learning_rate=1e-3']


def python(*args):
    """Run a script quietly (its progress bars too); its output's end if it fails."""
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    if p.returncode:
        sys.exit(f"{' '.join(args[:1])} failed (exit {p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def summary(out_dir):
    """(first eval, last eval, first exact match, last exact match, reward of the first and last quarters)."""
    events = read_log(out_dir)
    evals = [e for e in events if 'eval/pass@1' in e]
    exact = [e['eval/exact_match'] for e in events if 'eval/exact_match' in e]
    rewards = [e['reward'] for e in events if 'reward' in e]
    q = max(1, len(rewards) // 4)
    return evals[0], evals[-1], exact[0], exact[-1], sum(rewards[:q]) / q, sum(rewards[-q:]) / q


shutil.rmtree(OUT, ignore_errors=True)
task = prepare_number_tasks(os.path.join(OUT, 'task'))
with open(os.path.join(task, 'train.jsonl')) as f:
    text = ''.join(f"{r['prompt']} {r['response']}\n" for r in map(json.loads, f))
with open(os.path.join(OUT, 'corpus.txt'), 'w') as f:
    f.write(text)
prepared = prepare(os.path.join(OUT, 'corpus.txt'), os.path.join(OUT, 'prepared'), tokenizer='char')
easy = os.path.join(OUT, 'easy')  # the kinds the SFT model half knows
os.makedirs(easy)
for split in ('train', 'val', 'test'):
    with open(os.path.join(task, f'{split}.jsonl')) as f, open(os.path.join(easy, f'{split}.jsonl'), 'w') as g:
        g.writelines(line for line in f if line.startswith(('{"prompt": "What comes after', '{"prompt": "How many')))

python('train.py', f'--out_dir={OUT}/base', f'--data_dir={prepared}', *MODEL, '--max_iters=600', '--lr_decay_iters=600',
       '--eval_interval=600', '--learning_rate=3e-3', '--min_lr=3e-4', '--warmup_iters=30', '--sample_tokens=20')
python('train.py', '--training_type=sft', f'--out_dir={OUT}/sft', f'--data_dir={prepared}', f'--sft_data={task}',
       f'--init_from={OUT}/base/ckpt.pt', *MODEL, '--max_length=64', '--max_iters=600', '--lr_decay_iters=600',
       '--eval_interval=600', '--learning_rate=2e-3', '--min_lr=2e-4', '--warmup_iters=20', '--exact_match_examples=0')
runs = {'next number, digit count': (easy, ['--prompts_per_step=16', '--max_iters=100', '--eval_interval=50']),
        'all six kinds': (task, ['--prompts_per_step=32', '--max_iters=200', '--eval_interval=100'])}
print("| prompts | steps | pass@1 | pass@4 | greedy exact match | train reward (first -> last quarter) |")
print("| --- | --- | --- | --- | --- | --- |")
for name, (data, args) in runs.items():
    out = os.path.join(OUT, 'rl_' + name.split()[0])
    python('train_rl.py', f'--out_dir={out}', f'--init_from={OUT}/sft/ckpt.pt', f'--data_dir={prepared}',
           f'--rl_data={data}', *RL, *args)
    first, last, exact0, exact1, reward0, reward1 = summary(out)
    print(f"| {name} | {last['step']} | {first['eval/pass@1']:.3f} -> {last['eval/pass@1']:.3f} | "
          f"{first['eval/pass@4']:.3f} -> {last['eval/pass@4']:.3f} | {exact0:.1%} -> {exact1:.1%} | "
          f"{reward0:.3f} -> {reward1:.3f} |")
