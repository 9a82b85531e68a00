"""
The harness the test files share: running the scripts as subprocesses (and under torchrun), what a run
leaves behind (log.jsonl, checkpoints), the tiny datasets and models the end-to-end tests train on, and
the helpers more than one test file uses. Plain functions and constants are imported with
`from conftest import ...` (pytest puts tests/ on sys.path); fixtures (data_dir, sft_env, dpo_env, task)
need no import.

A quick local run: `python -m pytest -m "not slow"` leaves out the end-to-end script launches and the
torchrun tests marked slow (pytest.ini); `python -m pytest` runs the whole suite.
"""

import ast
import glob
import io
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from configurator import assignment_lines
from data import prepare
from hf.checkpoint import gpt_config, read_hf_weights
from lm.chat_data import PreferenceBatches
from lm.dpo import reference_logps
from lm.generate import stop_tokens
from lm.tokenizer import CharTokenizer, ChatTokenizer
from model import GPT, GPTConfig
from run.run_folder import logged_step
from tasks.number_tasks import prepare_number_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get('PYTEST_XDIST_WORKER'):
    # a worker a core (-n auto), one thread each, as the scripts they launch: more threads than cores spin
    torch.set_num_threads(1)
HF_FIXTURES = os.path.join(ROOT, 'tests', 'fixtures', 'hf')
if os.environ.get('ATEN_CPU_CAPABILITY'):
    # on an AVX512 CPU, a run told AVX2 that read the inductor cache filled under the CPU's own kernels crashed (a
    # bus error, torch 2.11; with an empty cache it passed): a cache a capability
    os.environ.setdefault('TORCHINDUCTOR_CACHE_DIR', os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getattr(os, 'getuid', str)()}_{os.environ['ATEN_CPU_CAPABILITY']}"))
# CI reruns comparisons with ATEN_CPU_CAPABILITY=default; there torch 2.11's inductor, told not to vectorize, still
# writes vector code for some kernels and fails to compile it (a C++ error: 'at::vec' has not been declared)
INDUCTOR_ON_THIS_CPU = pytest.mark.skipif(os.environ.get('ATEN_CPU_CAPABILITY') == 'default',
                                          reason="inductor's C++ fails to compile under ATEN_CPU_CAPABILITY=default")

def pytest_collection_modifyitems(config, items):
    """Tests marked cuda need a CUDA GPU: skipped without one (bench/gpu.py runs them on one)."""
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker('cuda'):
                item.add_marker(pytest.mark.skip(reason='needs a CUDA GPU'))


def script_config_keys(path):
    """The keys of a script: its top-level assignments before the statement that calls configure (none in a
    script that does not: an argparse one, or a module)."""
    with open(path, encoding='utf-8') as f:
        body = ast.parse(f.read()).body
    end = next((node.lineno for node in body if any(isinstance(call, ast.Call) and getattr(call.func, 'id', None)
                                                    == 'configure' for call in ast.walk(node))), 0)
    return {key for key, line in assignment_lines(path).items() if line < end and not key.startswith('_')}


# ----------------------------------------------------------------------------- running the scripts


def script_definitions(script, *names):
    """The named top-level classes, functions and constants (plain assignments) of a root script, compiled with
    the script's own imports but without running it (importing a script runs its training): tests reach the
    code the script runs, where nanoGPT's layout keeps it."""
    path = os.path.join(ROOT, script)
    with open(path) as f:
        tree = ast.parse(f.read())

    def defined(node):
        if isinstance(node, ast.Assign):
            return {t.id for t in node.targets if isinstance(t, ast.Name)} | \
                {e.id for t in node.targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)}
        return {node.name} if isinstance(node, (ast.ClassDef, ast.FunctionDef)) else set()
    body = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)) or defined(node) & set(names)]
    missing = set(names) - set().union(*map(defined, body))
    assert not missing, f'{script} defines no {missing}'
    namespace = {'__name__': script[:-3]}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, 'exec'), namespace)
    return [namespace[name] for name in names]


def script_env(**extra):
    """The environment of a script the tests launch: one thread per process (the suite runs in parallel) and
    unbuffered output (a test reads it while the script runs)."""
    return dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', **extra)


class ForkServer:
    """A Python that has imported torch, forking each launch of a script (tests/forkserver.py says how and why)."""

    def __init__(self):
        self.process = None

    def run(self, args, env, timeout):
        """`python *args` in the repository root with env: a subprocess.CompletedProcess, output as text."""
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen([sys.executable, os.path.join(ROOT, 'tests', 'forkserver.py')], cwd=ROOT,
                                            env=script_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, 'stdout'), os.path.join(folder, 'stderr')
            request = dict(args=list(args), cwd=ROOT, env=env, stdout=out, stderr=err)
            self.process.stdin.write(json.dumps(request).encode() + b'\n')
            self.process.stdin.flush()
            pid = self.number()
            ready, _, _ = select.select([self.process.stdout], [], [], timeout)
            if not ready:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended as the time ran out
                    pass
            code = self.number()
            with open(out, errors='replace') as f, open(err, errors='replace') as g:
                stdout, stderr = f.read(), g.read()
        if not ready:
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess([sys.executable, *args], code, stdout, stderr)

    def number(self):
        """The next line the server wrote, a number, read a byte at a time from the pipe itself: a buffered reader
        could take the exit status along with the pid, and select would then wait for a line already read."""
        line = b''
        while not line.endswith(b'\n'):
            byte = os.read(self.process.stdout.fileno(), 1)
            if not byte:
                raise RuntimeError('tests/forkserver.py stopped: ' + (line.decode() or 'nothing written'))
            line += byte
        return int(line)


FORK_SERVER = ForkServer() if os.environ.get('NANOTRAIN_TESTS_FORK', '1') != '0' else None


def run(args, env_extra=None, check=True, timeout=300, **kw):
    """`python *args` in the repository root; check: fail the test, with the output's ends, on a non-zero exit.
    A script's or a module's launch (not `-c`) forks from FORK_SERVER, unless env_extra sets more than PYTHONPATH
    (which only makes the child's sys.path, as the fork's is made): what torch read at import would not see it."""
    env = script_env(**(env_extra or {}))
    forkable = args[0].endswith('.py') or args[0] == '-m'
    if FORK_SERVER and forkable and not kw and set(env_extra or ()) <= {'PYTHONPATH'}:
        p = FORK_SERVER.run(args, env, timeout)
    else:
        p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-3000:]}")
    return p


def start(args, **kw):
    """`python *args` in the repository root, in the background (subprocess.Popen's keywords)."""
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=script_env(), **kw)


def torchrun(ranks=2):
    """The arguments that launch a script on `ranks` local processes: tests/ranks.py, which forks them from a Python
    that has imported torch and gives them torchrun's environment (NANOTRAIN_TESTS_FORK=0: real torchrun)."""
    if not FORK_SERVER:
        return real_torchrun(ranks)
    return ['tests/ranks.py', f'--nproc_per_node={ranks}']


def real_torchrun(ranks=2):
    """torchrun itself (its ranks new Pythons): for the tests of what torchrun reports when a rank fails."""
    return ['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}']


def launch(script, out_dir, data_dir, *args, faults=None, ranks=1, **kw):
    """`python script --out_dir --data_dir *args` (run's keywords). faults: e.g. 'nan@2,oom@1', injected by
    tests/faults.py at those steps; ranks > 1: under torchrun."""
    launcher = [*(torchrun(ranks) if ranks > 1 else []), *(['tests/faults.py', faults] if faults else [])]
    return run([*launcher, script, f'--out_dir={out_dir}', f'--data_dir={data_dir}', *args], **kw)


def start_up_refusal(monkeypatch, script, *args):
    """The UserError a script raises at start-up (before it does any work) for args, run in this process: ~0.1 s
    where a launch costs seconds. configure() installs its excepthook and stream wrappers: put back afterwards. A
    script that goes on to its work (compute_init, every training script's first) fails the test there."""
    import runpy
    from configurator import UserError
    from run import runtime

    def no_work(*_, **__):
        raise AssertionError(f'{script} {" ".join(args)} was not refused at start-up')

    monkeypatch.setattr(runtime, 'compute_init', no_work)
    for name in ('excepthook', 'stdout', 'stderr'):
        monkeypatch.setattr(sys, name, getattr(sys, name))
    monkeypatch.setattr(sys, 'argv', [script, *args])
    with pytest.raises(UserError) as refused:
        runpy.run_path(os.path.join(ROOT, script), run_name='__main__')
    return str(refused.value)


def assert_user_error(p, *says):
    """p, a finished script, stopped on a user error: exit status 2, each of says in its stderr, no traceback."""
    assert p.returncode == 2 and 'Traceback' not in p.stderr and all(s in p.stderr for s in says), (
        p.args, says, p.returncode, p.stderr)


def sigterm_after_steps(args, out_dir, step_key, steps=3):
    """Start `python *args`, send it SIGTERM once its log holds `steps` events with step_key; it must exit
    143 (the step finishes and ckpt.pt is saved). Returns its output."""
    proc = start(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(os.path.join(out_dir, 'log.jsonl'))
                                          and len(logged(out_dir, step_key)) >= steps):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output
    return output


def process_tree(pid):
    """pid and all its descendants (Linux /proc): torchrun starts its workers in sessions of their own."""
    children = {}
    for stat in glob.glob('/proc/[0-9]*/stat'):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(')', 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split('/')[2]))
    tree = [pid]
    for parent in tree:
        tree.extend(children.get(parent, []))
    return tree


def kill_and_relaunch(args, out_dir, step_key='train_loss', timeout=240):
    """Run `python *args` until out_dir holds a checkpoint and its log a later step, SIGKILL it and every
    process it started (as a preemption does), then relaunch the very same command to its end.
    Returns (the checkpoint's step at the kill, the relaunch's output, the steps of the log's events
    that have step_key)."""
    proc = start(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_path, log_path = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'log.jsonl')
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if os.path.exists(ckpt_path) and os.path.exists(log_path):
            with open(log_path) as f:
                last_step = max(logged_step(line) or 0 for line in f)
            if last_step > load(ckpt_path)['iter_num']:
                break
        time.sleep(0.02)
    assert proc.poll() is None, 'the run ended before it could be killed'
    for pid in process_tree(proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    killed_at = load(ckpt_path)['iter_num']
    p = run(args)
    return killed_at, p.stdout + p.stderr, [e['step'] for e in read_log(out_dir) if step_key in e]

# ----------------------------------------------------------------------------- Weights & Biases (run/tracker.py)

FAKE_WANDB = os.path.join(ROOT, 'tests', 'fixtures', 'fake_wandb')


def wandb_env():
    """The env_extra of a launch whose `import wandb` finds the stand-in package in tests/fixtures/fake_wandb, which
    writes each call to out_dir/wandb/fake_calls.jsonl."""
    return {'PYTHONPATH': FAKE_WANDB}


def wandb_calls(out_dir):
    """The stand-in wandb's calls in a run, in order: dicts with 'call' ('init', 'log', 'finish') and its arguments."""
    with open(os.path.join(out_dir, 'wandb', 'fake_calls.jsonl')) as f:
        return [json.loads(line) for line in f]


def assert_logged_to_wandb(out_dir, launches=1):
    """Every number of every log.jsonl event went to W&B at the event's step, each launch started its W&B run (the
    last with the checkpoint's config) and ended it; a relaunch resumed the first launch's W&B run."""
    calls = wandb_calls(out_dir)
    inits, finishes = [c for c in calls if c['call'] == 'init'], [c for c in calls if c['call'] == 'finish']
    assert len(inits) == len(finishes) == launches, calls
    ckpt = load(os.path.join(out_dir, 'ckpt.pt'))
    config = json.loads(json.dumps(ckpt['config']))  # DPO's and RL's add their training_type
    assert inits[-1]['config'] == {k: config[k] for k in inits[-1]['config']}
    assert set(config) - set(inits[-1]['config']) <= {'training_type'}
    assert all(c['id'] == ckpt['wandb_run_id'] for c in inits[1:])
    logged_at = {}
    for c in calls:
        if c['call'] == 'log':
            logged_at.setdefault(c['step'], {}).update(c['data'])
    for event in read_log(out_dir):
        numbers = {k: v for k, v in event.items() if k != 'step' and isinstance(v, (int, float))}
        assert numbers.items() <= logged_at.get(event['step'], {}).items(), (event, logged_at.get(event['step']))

# ----------------------------------------------------------------------------- what a run leaves


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def logged(out_dir, key):
    """{step: value} of key in the log's events that have it."""
    return {e['step']: e[key] for e in read_log(out_dir) if key in e}


def train_losses(out_dir):
    return logged(out_dir, 'train_loss')


def load(path):
    return torch.load(path, map_location='cpu', weights_only=True)


def torch_saved(state):
    """state through torch.save, as a file object to torch.load from."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def read_json_file(path):
    with open(path) as f:
        return json.load(f)


def write_jsonl(path, lines):
    """lines (dicts, or strings written as they are) one a line; returns str(path)."""
    path.write_text('\n'.join(line if isinstance(line, str) else json.dumps(line) for line in lines) + '\n')
    return str(path)

# ----------------------------------------------------------------------------- pretraining: a tiny char corpus


def tiny_gpt_args(block_size):
    """train.py's settings for a tiny model that trains in seconds on CPU."""
    return ['--n_layer=2', '--n_head=2', '--n_embd=32', f'--block_size={block_size}', '--batch_size=4',
            '--eval_iters=2', '--log_interval=1', '--tensorboard=False', '--sample_tokens=10', '--warmup_iters=2',
            '--device=cpu', '--dtype=float32', '--learning_rate=1e-2', '--min_lr=1e-3']


TINY = tiny_gpt_args(32)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
    """12-word lines of a 13-word vocabulary, prepared with the char tokenizer."""
    rng = random.Random(0)
    words = ['alpha', 'beta', 'gamma', 'delta', 'def', 'return', 'if', 'else', 'for', 'in', '(', ')', ':']
    text = '\n'.join(' '.join(rng.choice(words) for _ in range(12)) for _ in range(800))
    src = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
    src.write_text(text)
    out = tmp_path_factory.mktemp('prepared')
    prepare(str(src), str(out), tokenizer='char')
    return str(out)


def train(out_dir, data_dir, *extra, **kw):
    """train.py on the tiny model (launch's keywords: faults, ranks, check...)."""
    return launch('train.py', out_dir, data_dir, *TINY, *extra, **kw)

# ----------------------------------------------------------------------------- SFT: the number tasks


CHARS = sorted(set("What is 0123456789+-=?<|>abcdefghijklmnopqrstuvwxyz \n:,.ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
SFT_TINY = tiny_gpt_args(48)
SFT = ['--max_length=48', '--exact_match_examples=4', '--bucket_batches=2']


def char_tokenizer():
    return ChatTokenizer(CharTokenizer(CHARS))


@pytest.fixture(scope='session')
def sft_env(tmp_path_factory):
    """A char corpus that covers the number tasks, the tasks' JSONL files, and a tiny model pretrained on it."""
    root = tmp_path_factory.mktemp('sft')
    task = prepare_number_tasks(str(root / 'task'), n_train=200, n_eval=12)
    with open(os.path.join(task, 'train.jsonl')) as f:
        text = ''.join(f"{r['prompt']} {r['response']}\n" for r in map(json.loads, f)) * 3
    (root / 'corpus.txt').write_text(text)
    prepared = prepare(str(root / 'corpus.txt'), str(root / 'prepared'), tokenizer='char')
    base = root / 'base'
    run(['train.py', f'--out_dir={base}', f'--data_dir={prepared}', *SFT_TINY, '--max_iters=3', '--eval_interval=3',
         '--lr_decay_iters=3'])
    return dict(data_dir=prepared, task=task, base=str(base / 'ckpt.pt'))


def sft_args(env, out_dir, *extra, training_type='sft'):
    return ['train.py', f'--training_type={training_type}', f'--out_dir={out_dir}', f'--data_dir={env["data_dir"]}',
            f'--sft_data={env["task"]}', f'--init_from={env["base"]}', *SFT_TINY, *SFT, *extra]


def sft(env, out_dir, *extra, training_type='sft', **kw):
    return run(sft_args(env, out_dir, *extra, training_type=training_type), **kw)


def sft_mixture(env, arithmetic=1.0, digits=0.5):
    """--sft_data naming the tasks' two kinds (tasks/number_tasks.py's folders) as two sources with these weights."""
    task = env['task']
    return f"--sft_data={{'arithmetic': ('{task}/arithmetic', {arithmetic}), 'digits': ('{task}/digits', {digits})}}"


ANSWERS = [  # each kind of question, and how to answer it (sums and differences: the result of the working)
    (r'What is (\d+)\+(\d+)\?', lambda a, b: int(a) + int(b)),
    (r'What is (\d+)-(\d+)\?', lambda a, b: int(a) - int(b)),
    (r'Reverse the digits of (\d+)\.', lambda n: n[::-1]),
    (r'Which is larger, (\d+) or (\d+)\?', lambda a, b: max(int(a), int(b))),
    (r'How many digits does (\d+) have\?', len),
    (r'What comes after (\d+)\?', lambda n: int(n) + 1),
]

WORKING = r'(\d+)([+-])(\d+)=(\d+), (\d+)([+-])(\d+)((?:[+-]1)?)=(\d+), so (\d+)'


def checked_answer(kind, match, response):
    """The answer in a response; for a sum or difference (kinds 0 and 1) the result of its working,
    after checking that the working is right column by column: units first, then the tens with the
    carry (or the borrowed ten), then the result made of the two."""
    if kind > 1:
        return response
    a, b = map(int, match.groups())
    w = re.fullmatch(WORKING, response)
    assert w, response
    units_a, op, units_b, units, tens_a, op2, tens_b, carry, tens, result = w.groups()
    sign = 1 if kind == 0 else -1
    assert op == op2 == '+-'[kind]
    assert int(units_a) % 10 == a % 10 and int(units_b) == b % 10
    assert int(units) == int(units_a) + sign * int(units_b) and 0 <= int(units) <= 18
    assert int(tens_a) == a // 10 and int(tens_b) == b // 10
    carried = int(units) >= 10 if kind == 0 else int(units_a) >= 10  # a carry out, or a ten borrowed
    assert carry == (op + '1' if carried else '') and int(units_a) < 10 + 10 * (kind == 1 and carried)
    assert int(tens) == int(tens_a) + sign * (int(tens_b) + carried)
    assert int(result) == 10 * int(tens) + int(units) % 10
    return result

# ----------------------------------------------------------------------------- DPO: preference pairs


DPO = ['--device=cpu', '--dtype=float32', '--tensorboard=False', '--max_length=40', '--max_prompt_length=32',
       '--batch_size=4', '--eval_pairs=8', '--exact_match_examples=0', '--log_interval=1', '--warmup_iters=0',
       '--learning_rate=1e-2', '--loss_type=sigmoid', '--beta=0.1', '--label_smoothing=0']  # rpo_alpha: default, 0
TRAIN_METRICS = ('loss', 'rewards/chosen', 'rewards/rejected', 'rewards/margins', 'rewards/accuracies',
                 'logps/chosen', 'logps/rejected', 'nll/chosen', 'kl')


@pytest.fixture(scope='session')
def dpo_env(sft_env, tmp_path_factory):
    """sft_env's char corpus and base model, a tiny SFT checkpoint trained from it, and number-task pairs (once a
    pytest process: five test files use them, none writes there)."""
    root = tmp_path_factory.mktemp('dpo')
    sft(sft_env, root / 'sft', '--max_iters=3', '--eval_interval=3', '--lr_decay_iters=3', '--exact_match_examples=0')
    pairs = prepare_number_tasks(str(root / 'pairs'), n_train=40, n_eval=8, seed=1, preferences=True)
    return dict(sft_env, sft=str(root / 'sft' / 'ckpt.pt'), pairs=pairs)


def dpo_args(env, out_dir, *extra, ranks=1, faults=None):
    """train_dpo.py's command line; faults: as launch's."""
    return [*(torchrun(ranks) if ranks > 1 else []), *(['tests/faults.py', faults] if faults else []), 'train_dpo.py',
            f'--out_dir={out_dir}', f'--data_dir={env["data_dir"]}', f'--dpo_data={env["pairs"]}',
            f'--init_from={env["sft"]}', *DPO, *extra]


def dpo(env, out_dir, *extra, ranks=1, faults=None, **kw):
    return run(dpo_args(env, out_dir, *extra, ranks=ranks, faults=faults), **kw)


def evals(out_dir):
    return [e for e in read_log(out_dir) if 'eval/loss' in e]


def train_metrics(out_dir):
    return {e['step']: e for e in read_log(out_dir) if 'lr' in e}


def random_pairs(n, seed=0, vocab=10):
    """n (prompt, chosen, rejected) pairs of random token ids."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: torch.randint(vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()  # noqa: E731
    return [(draw(1, 8), draw(1, 6), draw(1, 6)) for _ in range(n)]


REFERENCE = GPTConfig(block_size=16, vocab_size=10, n_layer=2, n_head=2, n_embd=64, bias=True, mlp='swiglu',
                      pos_emb='rope')  # tied: the frozen reference's tests


def parameter_bytes(model):
    """Bytes of model's parameters (a tied weight counted once; under FSDP this rank's shards)."""
    local = [p.to_local() if hasattr(p, 'to_local') else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local)


def reference_logps_under_bf16_autocast(model):
    """(per-sequence sums, logits) of a fixed packed batch of 4 pairs, scored as in a bf16 run."""
    batch = PreferenceBatches(random_pairs(6, seed=1), 0, 0, 16, pack=True).get(torch.tensor([5, 1, 2, 0]))
    return reference_logps(model, batch, 4, torch.autocast('cpu', dtype=torch.bfloat16))

# ----------------------------------------------------------------------------- published models (tests/fixtures/hf)


HF_TINY = ['--batch_size=4', '--block_size=128', '--max_length=128', '--eval_iters=2', '--eval_interval=4',
           '--log_interval=1', '--tensorboard=False', '--sample_tokens=8', '--warmup_iters=1', '--device=cpu',
           '--dtype=float32', '--exact_match_examples=4', '--max_iters=8', '--lr_decay_iters=8']


def hf_fixture(name):
    """The folder of a published model's fixture (tests/fixtures/hf/README.md)."""
    return os.path.join(HF_FIXTURES, name)


def load_gpt(folder):
    """A Hugging Face folder as a GPT, in eval mode."""
    hf = read_json_file(os.path.join(folder, 'config.json'))
    return GPT.from_state_dict(GPTConfig(**gpt_config(hf, folder)), read_hf_weights(folder, hf)).eval()


def greedy_answer(loaded, messages, max_new_tokens):
    """The answer to messages by loaded (loading.load_for_generation's), computed here: the template's prompt of the
    conversation, greedy tokens to the first stop token (stop_tokens), decoded."""
    ids = loaded.tokenizer.encode_prompt(messages)
    out = loaded.model.generate(torch.tensor([ids]), max_new_tokens, temperature=0)[0, len(ids):].tolist()
    stops = stop_tokens(loaded.tokenizer)
    answer = out[:min([out.index(s) for s in stops if s in out], default=len(out))]
    return loaded.tokenizer.decode(answer, skip_special=True)


@pytest.fixture(scope='module')
def task(tmp_path_factory):
    """The number tasks, small, for fine-tuning the published fixtures."""
    return prepare_number_tasks(str(tmp_path_factory.mktemp('hf') / 'task'), n_train=64, n_eval=8)


def fine_tune(out_dir, task, model, *extra, training_type='sft', **kw):
    """train.py fine-tuning the fixture `model` on task."""
    return run(['train.py', f'--training_type={training_type}', f'--init_from={hf_fixture(model)}',
                f'--out_dir={out_dir}', f'--sft_data={task}', *HF_TINY, *extra], **kw)


def val_losses(out_dir):
    return [e['val_loss'] for e in read_log(out_dir) if 'val_loss' in e]
