"""
LoRA fine-tuning of a published Hugging Face model: nanotrain against transformers + PEFT, on CPU, on
the same model, the same batch of token ids and the same LoRA. Reports steps/s and peak memory (RSS) of
both, their ratios, that both compute the same step-1 loss, and the time and memory of loading the
model alone.

    python bench/bench_hf_lora.py --model=/work/models/smollm2-135m-instruct

transformers and PEFT are never dependencies of this project: they live in their own virtual
environment (hf_python, here /work/hfvenv with transformers 5.24, peft 0.21 and torch 2.13 CPU), whose
Python runs this same file in a worker mode (--mode=hf_train | hf_load). nanotrain's side runs in
this Python (mode nano_train | nano_load). Every measurement is a fresh process, so each one's peak RSS
is its own. The model must be a Llama-architecture folder both load (SmolLM2-135M-Instruct: float32,
tied embeddings, 30 layers, 49,152-token vocabulary).

What it does (about 10 minutes on a 2-core CPU):

1. The batch: batch_size examples of the embedded number tasks (tasks.number_tasks, written to a
   temporary folder), rendered with the model's own chat template by nanotrain's hf_tokenizer, read
   as train.py reads them (chat_data.load_sft_split: ids, and labels that are -100 outside the
   assistant turns), right-padded to the longest example: input_ids (the tokenizer's pad id on
   padding), labels (-100 on padding) and attention_mask, saved to one .pt that both sides read.
   nanotrain trains on x = input_ids[:, :-1], y = labels[:, 1:] (asserted equal to what
   chat_data.SFTBatches gives train.py); transformers on input_ids, attention_mask and labels, which
   it shifts itself. Both losses are the mean cross-entropy over the same labelled positions.
   transformers' forward runs over one more column (the last one, whose prediction has no label).
2. The LoRA, the same on both sides: r, lora_alpha, dropout 0, on q_proj, k_proj, v_proj, o_proj, no
   bias; A from nanotrain's initialisation (seeded), copied into PEFT's lora_A, B zero on both.
   AdamW (fused, both) with lr, betas, eps 1e-8, weight decay 0; gradients clipped to grad_clip
   (train.py's and the transformers Trainer's default 1.0); float32; no gradient checkpointing;
   no dropout. nanotrain's step is train.py's: model(x, logits_at=y != -100) (logits only at the labelled
   positions), losses.weighted_cross_entropy, backward, clip, step; with --pack=True on the 8 examples
   packed into one row (doc_ids: attention within each example, no padding), with --compile=True through
   torch.compile (its compiling happens in the warmup steps). transformers' is a plain loop:
   PeftModel(input_ids, attention_mask, labels, use_cache=False).loss, attention "sdpa", backward,
   clip, step.
3. Speed and memory: three rows (SIDES): nanotrain in this Python, transformers + PEFT in theirs, and
   as a control nanotrain in transformers' Python, on the same torch build as transformers (the two
   builds differ: this venv's CUDA build of torch takes ~265 MiB more RSS at `import torch` alone).
   rounds rounds, every row once per round, in that order in even rounds and reversed in odd ones.
   A run loads the model, adds the adapters, runs warmup_steps and then timed_steps steps of the same
   batch; steps/s = timed_steps / their total time. Peak RSS (VmHWM of /proc/self/status, Linux; the
   memory-mapped safetensors pages count once touched, on both sides) after the imports, after loading
   (model + adapters + optimizer) and after training. The table gives each value's median over rounds
   and the ratios to transformers. Every process gets OMP_NUM_THREADS=threads and
   torch.set_num_threads(threads). On a machine shared with other work, --threads=1 leaves a core to
   the other load: with every core in use, one busy co-tenant makes OpenMP's barriers stall and a
   step take 2-10x longer at random.
4. Equal losses: each run's step-1 loss (the base model's, as B starts at zero) must agree with the
   other side's to loss_tolerance; the losses of later steps (which test the adapters' init and the
   optimizer) are compared too and reported.
5. Loading alone: load_rounds fresh processes per side, alternating: nanotrain's
   hf_checkpoint.load_hf_checkpoint + GPT.from_state_dict against transformers'
   AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32); seconds and peak RSS, medians.

The two sides run different torch builds (nanotrain's venv and transformers' own); the versions go
into the results, with the load average before and after. Output: a table on stdout and everything
in bench/results/hf_lora.json.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch

from configurator import at_least, check_values, configure
from run.device import cpu_name

# -----------------------------------------------------------------------------
mode = 'all'                 # 'all' (the benchmark) | workers: 'nano_train' | 'hf_train' | 'nano_load' | 'hf_load'
model = ''                   # the Hugging Face model folder (required)
hf_python = '/work/hfvenv/bin/python'  # Python of the environment with transformers and peft
batch_size = 8               # examples in the one batch every step trains on
warmup_steps = 3             # untimed steps at the start of each run
timed_steps = 10             # steps timed after them
rounds = 3                   # each side once per round, alternating which goes first
load_rounds = 3              # load-only processes per side
threads = os.cpu_count()     # OMP_NUM_THREADS and torch.set_num_threads, both sides
lora_r = 16
lora_alpha = 32.0
learning_rate = 1e-4
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
loss_tolerance = 1e-4        # the largest allowed difference between the two sides' step-1 losses
seed = 1337
pack = False                 # nanotrain's side: the examples packed into one row, attention within each (train.py's pack=True)
compile = False              # nanotrain's side: torch.compile the model (train.py's compile=True); its compiling falls in the warmup steps
out = os.path.join(ROOT, 'bench', 'results', 'hf_lora.json')
batch_file = ''              # (workers) the .pt with the batch and the adapters' initial A matrices
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('batch_size', 'timed_steps', 'rounds', 'load_rounds', 'threads', 'lora_r')),
                      (at_least(0), ('warmup_steps', 'learning_rate', 'grad_clip'))])
TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
# the rows: side -> (its Python, its worker modes). The third is a control: nanotrain on transformers'
# torch build, which separates what the code does from what the two builds do (speed, and the CUDA
# build's larger memory just after `import torch`)
SIDES = {'nanotrain': (sys.executable, dict(train='nano_train', load='nano_load')),
         'transformers': (hf_python, dict(train='hf_train', load='hf_load')),
         'nanotrain_same_torch': (hf_python, dict(train='nano_train', load='nano_load'))}
RESULT = 'RESULT '  # a worker's last line of stdout: RESULT {json}


def peak_rss_mb():
    """This process's peak resident memory so far in MiB (VmHWM of /proc/self/status)."""
    with open('/proc/self/status') as f:
        fields = dict(line.split(':', 1) for line in f)
    return int(fields['VmHWM'].split()[0]) / 1024


def report(result):
    print(RESULT + json.dumps(result), flush=True)


# -----------------------------------------------------------------------------
# workers: one run each, in a fresh process

def load_nanotrain():
    from hf.checkpoint import load_hf_checkpoint
    from model import GPT, GPTConfig
    ckpt = load_hf_checkpoint(model)
    return GPT.from_state_dict(GPTConfig(**ckpt['model_args']), ckpt['model'])


def load_transformers():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation='sdpa')


def run_load(load):
    """Time and peak RSS of loading the model alone."""
    imported = peak_rss_mb()
    start = time.perf_counter()
    net = load()
    seconds = time.perf_counter() - start
    report(dict(load_s=seconds, rss_import_mb=imported, rss_loaded_mb=peak_rss_mb(),
                params=sum(p.numel() for p in net.parameters())))


def training_step(compute_loss, trained, optimizer):
    """One step, the same on both sides: the side's loss, backward, clipping, AdamW; returns the loss."""
    def step():
        loss = compute_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def nanotrain_step_fn(batch):
    """The model with adapters and train.py's LoRA step on the batch."""
    from lm.lora import LoRALinear, apply_lora, lora_optimizer
    from losses import weighted_cross_entropy
    net = load_nanotrain()
    apply_lora(net, lora_r, lora_alpha, 0.0, ','.join(TARGETS))
    with torch.no_grad():
        for name, m in net.named_modules():
            if isinstance(m, LoRALinear):
                m.lora_A.copy_(batch['lora_A'][name])
    net.train()
    optimizer = lora_optimizer(net, 0.0, learning_rate, (beta1, beta2), 'cpu')
    trained = [p for p in net.parameters() if p.requires_grad]
    x, y, doc_ids = (batch['packed'] if pack else (batch['input_ids'][:, :-1], batch['labels'][:, 1:], None))
    forward = torch.compile(net) if compile else net

    def loss():
        labels_at = y != -100
        logits, _ = forward(x, doc_ids=doc_ids, logits_at=labels_at)
        return weighted_cross_entropy(logits, y[labels_at])
    return training_step(loss, trained, optimizer), sum(p.numel() for p in trained)


def transformers_step_fn(batch):
    """The same model in transformers with PEFT's LoRA, and a plain training step."""
    from peft import LoraConfig, get_peft_model
    net = get_peft_model(load_transformers(), LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                         target_modules=list(TARGETS), bias='none',
                                                         task_type='CAUSAL_LM'))
    with torch.no_grad():
        for name, a in batch['lora_A_hf'].items():
            net.base_model.model.get_submodule(name).lora_A['default'].weight.copy_(a)
    net.train()
    trained = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=learning_rate, betas=(beta1, beta2), eps=1e-8, weight_decay=0.0,
                                  fused=True)
    inputs = dict(input_ids=batch['input_ids'], attention_mask=batch['attention_mask'], labels=batch['labels'])

    def loss():
        return net(**inputs, use_cache=False).loss
    return training_step(loss, trained, optimizer), sum(p.numel() for p in trained)


def run_train(make_step):
    """Load, add the adapters, warmup_steps + timed_steps steps; losses, steps/s and memory."""
    batch = torch.load(batch_file)
    imported = peak_rss_mb()
    start = time.perf_counter()
    step, trained = make_step(batch)
    load_s = time.perf_counter() - start
    loaded = peak_rss_mb()
    losses, times = [], []
    for i in range(warmup_steps + timed_steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    timed = times[warmup_steps:]
    report(dict(losses=losses, step_s=times, steps_per_s=len(timed) / sum(timed), load_s=load_s,
                trained_params=trained, rss_import_mb=imported, rss_loaded_mb=loaded,
                rss_trained_mb=peak_rss_mb(), torch=torch.__version__, threads=torch.get_num_threads()))


# -----------------------------------------------------------------------------
# the benchmark

def prepare_batch(path):
    """The batch (input_ids, labels, attention_mask) and the adapters' initial A matrices, under
    nanotrain's names and under transformers' module names, saved to path."""
    from lm.chat_data import SFTBatches, load_sft_split
    from hf.checkpoint import hf_names, load_hf_checkpoint
    from hf.tokenizer import load_hf_tokenizer
    from lm.lora import LoRALinear, apply_lora
    from model import GPT, GPTConfig
    from tasks.number_tasks import prepare_number_tasks
    tokenizer = load_hf_tokenizer(model)
    with tempfile.TemporaryDirectory() as tasks:
        prepare_number_tasks(tasks, n_train=batch_size, n_eval=1, seed=0)
        _, examples = load_sft_split(os.path.join(tasks, 'train.jsonl'), tokenizer, max_length=10_000)
    T = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), T), tokenizer.pad_id)
    labels = torch.full((len(examples), T), -100)
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, (ids, labs) in enumerate(examples):
        input_ids[i, :len(ids)], labels[i, :len(ids)], attention_mask[i, :len(ids)] = torch.tensor(ids), \
            torch.tensor(labs), 1
    # what train.py would train on: the same tokens at every position that is attended to or labelled
    x, y, _, _ = SFTBatches(examples, seed, tokenizer.pad_id, T).get(torch.arange(len(examples)))
    assert torch.equal(y, labels[:, 1:])
    inside = attention_mask[:, 1:].bool()  # x's real tokens: each example's ids but its last
    assert torch.equal(x[inside], input_ids[:, :-1][inside])
    # pack=True: the same examples in one row (as train.py packs them), the same labelled tokens
    packed = SFTBatches(examples, seed, tokenizer.pad_id, sum(len(ids) for ids, _ in examples), pack=True).get(
        torch.arange(len(examples)))
    labelled = packed[1][packed[1] != -100]  # in the order the examples were packed
    assert packed[0].size(0) == 1 and torch.equal(labelled.sort().values, y[y != -100].sort().values)

    ckpt = load_hf_checkpoint(model)
    net = GPT.from_state_dict(GPTConfig(**ckpt['model_args']), ckpt['model'])
    torch.manual_seed(seed)
    apply_lora(net, lora_r, lora_alpha, 0.0, ','.join(TARGETS))
    lora_A = {name: m.lora_A.detach().clone() for name, m in net.named_modules() if isinstance(m, LoRALinear)}
    to_hf = hf_names([name + '.weight' for name in lora_A], ckpt['hf_config'])
    lora_A_hf = {to_hf[name + '.weight'].removesuffix('.weight'): a for name, a in lora_A.items()}
    torch.save(dict(input_ids=input_ids, labels=labels, attention_mask=attention_mask, lora_A=lora_A,
                    lora_A_hf=lora_A_hf, packed=packed), path)
    return dict(examples=len(examples), padded_length=T, packed_length=packed[0].size(1), tokens=int(attention_mask.sum()),
                labelled=int((labels[:, 1:] != -100).sum()), lengths=[len(ids) for ids, _ in examples])


def run_worker(side, kind, path=''):
    """One worker process of a side (SIDES) for kind 'train' or 'load'; its result."""
    python, modes = SIDES[side]
    args = [python, os.path.abspath(__file__), f'--mode={modes[kind]}', f'--model={model}', f'--threads={threads}',
            f'--batch_size={batch_size}', f'--warmup_steps={warmup_steps}', f'--timed_steps={timed_steps}',
            f'--lora_r={lora_r}', f'--lora_alpha={lora_alpha}', f'--learning_rate={learning_rate}',
            f'--beta1={beta1}', f'--beta2={beta2}', f'--grad_clip={grad_clip}', f'--batch_file={path}',
            f'--pack={pack}', f'--compile={compile}']
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM='false')
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise SystemExit(f"{side} worker {modes[kind]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def alternating(n):
    """Every side once per round, in SIDES order in even rounds and reversed in odd ones."""
    return [list(SIDES) if r % 2 == 0 else list(SIDES)[::-1] for r in range(n)]


def median(runs, key):
    return statistics.median(run[key] for run in runs)


def versions():
    code = "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
    hf_torch, transformers_version, peft_version = subprocess.run(
        [hf_python, '-c', code], capture_output=True, text=True, check=True).stdout.split()
    return dict(nanotrain_torch=torch.__version__, transformers_torch=hf_torch, transformers=transformers_version,
                peft=peft_version, python=sys.version.split()[0])


def main():
    if not model:
        raise SystemExit("--model=<Hugging Face model folder> is required")
    started, load_before = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, 'batch.pt')
        batch = prepare_batch(path)
        print(f"batch: {batch['examples']} examples, padded to {batch['padded_length']} tokens, {batch['tokens']} "
              f"tokens, {batch['labelled']} labelled positions", flush=True)
        train = {side: [] for side in SIDES}
        for r, order in enumerate(alternating(rounds)):
            for side in order:
                run = run_worker(side, 'train', path)
                train[side].append(run)
                print(f"round {r + 1} {side}: {run['steps_per_s']:.3f} steps/s, step-1 loss {run['losses'][0]:.6f}, "
                      f"peak RSS {run['rss_trained_mb']:.0f} MiB", flush=True)
    load = {side: [] for side in SIDES}
    for order in alternating(load_rounds):
        for side in order:
            load[side].append(run_worker(side, 'load'))

    hf_losses = [run['losses'] for run in train['transformers']]
    step1_diff = max(abs(run['losses'][0] - hf[0]) for runs in train.values() for run in runs for hf in hf_losses)
    loss_diff_per_step = [abs(a - b) for a, b in zip(train['nanotrain'][0]['losses'], hf_losses[0])]
    summary = {side: dict(steps_per_s=median(runs, 'steps_per_s'), step_ms=1000 / median(runs, 'steps_per_s'),
                          steps_per_s_range=[min(r['steps_per_s'] for r in runs), max(r['steps_per_s'] for r in runs)],
                          rss_import_mb=median(runs, 'rss_import_mb'), rss_loaded_mb=median(runs, 'rss_loaded_mb'),
                          rss_trained_mb=median(runs, 'rss_trained_mb'),
                          rss_above_import_mb=statistics.median(r['rss_trained_mb'] - r['rss_import_mb'] for r in runs),
                          setup_s=median(runs, 'load_s'), step1_loss=runs[0]['losses'][0],
                          trained_params=runs[0]['trained_params'], torch=runs[0]['torch'])
               for side, runs in train.items()}
    load_summary = {side: dict(load_s=median(runs, 'load_s'), rss_import_mb=median(runs, 'rss_import_mb'),
                               rss_loaded_mb=median(runs, 'rss_loaded_mb'), params=runs[0]['params'])
                    for side, runs in load.items()}
    hf = summary['transformers']
    ratios = {side: dict(steps_per_s=s['steps_per_s'] / hf['steps_per_s'],
                         peak_rss=s['rss_trained_mb'] / hf['rss_trained_mb'],
                         peak_rss_above_import=s['rss_above_import_mb'] / hf['rss_above_import_mb'],
                         load_s=load_summary[side]['load_s'] / load_summary['transformers']['load_s'],
                         load_rss=load_summary[side]['rss_loaded_mb'] / load_summary['transformers']['rss_loaded_mb'])
              for side, s in summary.items() if side != 'transformers'}
    target_met = ratios['nanotrain']['steps_per_s'] >= 1.5 and ratios['nanotrain']['peak_rss'] <= 1.0

    print(f"\nLoRA SFT on {model}: r={lora_r}, alpha={lora_alpha:g}, {', '.join(TARGETS)}, batch {batch['examples']} x "
          f"{batch['padded_length']} tokens ({batch['labelled']} labelled), fp32, {threads} threads; medians of "
          f"{rounds} runs of {timed_steps} timed steps; nanotrain's side: pack={pack}, compile={compile}")
    print("| | torch | steps/s (min-max) | ms/step | peak RSS MiB: import / loaded / trained (above import) "
          "| x steps/s | x peak RSS (above import) | step-1 loss |")
    print("|---|---|---|---|---|---|---|---|")
    for side, s in summary.items():
        r = ratios.get(side, dict(steps_per_s=1.0, peak_rss=1.0, peak_rss_above_import=1.0))
        print(f"| {side} | {s['torch']} | {s['steps_per_s']:.3f} ({s['steps_per_s_range'][0]:.3f}-"
              f"{s['steps_per_s_range'][1]:.3f}) | {s['step_ms']:.0f} | {s['rss_import_mb']:.0f} / "
              f"{s['rss_loaded_mb']:.0f} / {s['rss_trained_mb']:.0f} ({s['rss_above_import_mb']:.0f}) | "
              f"{r['steps_per_s']:.2f} | {r['peak_rss']:.2f} ({r['peak_rss_above_import']:.2f}) | {s['step1_loss']:.6f} |")
    print(f"target (nanotrain >= 1.5x transformers' steps/s at <= its peak RSS): {'met' if target_met else 'NOT met'}; "
          f"step-1 losses differ by at most {step1_diff:.2e} over all runs; nanotrain vs transformers, round 1, "
          f"steps 1-{len(loss_diff_per_step)}: at most {max(loss_diff_per_step):.2e}")
    print(f"\nloading the model alone (median of {load_rounds}):")
    print("| | seconds | peak RSS MiB (after import) | x seconds | x peak RSS |")
    print("|---|---|---|---|---|")
    for side, s in load_summary.items():
        r = ratios.get(side, dict(load_s=1.0, load_rss=1.0))
        print(f"| {side} | {s['load_s']:.2f} | {s['rss_loaded_mb']:.0f} ({s['rss_import_mb']:.0f}) | "
              f"{r['load_s']:.2f} | {r['load_rss']:.2f} |")
    assert step1_diff < loss_tolerance, f"step-1 losses differ by {step1_diff:.2e} (tolerance {loss_tolerance})"

    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, 'w') as f:
        json.dump(dict(command=' '.join([sys.executable, *sys.argv]),
                       cpu=cpu_name(), cpu_count=os.cpu_count(), threads=threads, versions=versions(),
                       settings={k: config[k] for k in ('batch_size', 'pack', 'compile', 'warmup_steps', 'timed_steps', 'rounds',
                                                        'load_rounds', 'lora_r', 'lora_alpha', 'learning_rate',
                                                        'beta1', 'beta2', 'grad_clip', 'seed')},
                       targets=TARGETS, batch=batch, train=summary, load=load_summary, ratios_to_transformers=ratios,
                       target_met=target_met, step1_loss_diff=step1_diff, loss_diff_per_step=loss_diff_per_step,
                       load_average=[load_before, os.getloadavg()], runs=train, load_runs=load,
                       wall_s=time.time() - started), f, indent=1)
    print(f"wrote {out}")


if __name__ == '__main__':
    torch.set_num_threads(threads)
    # a worker imports its libraries first: the memory "after import" and the load time leave them out
    if mode in ('hf_train', 'hf_load'):
        from peft import get_peft_model  # noqa: F401
        from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401
    elif mode != 'all':
        from hf import checkpoint as hf_checkpoint  # noqa: F401
        from lm import lora  # noqa: F401
    if mode == 'all':
        main()
    elif mode in ('nano_train', 'hf_train'):
        run_train(nanotrain_step_fn if mode == 'nano_train' else transformers_step_fn)
    else:
        run_load(load_nanotrain if mode == 'nano_load' else load_transformers)
