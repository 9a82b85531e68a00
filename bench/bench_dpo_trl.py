"""
DPO side by side: train_dpo.py against Hugging Face TRL's DPOTrainer, on CPU, on the same tiny model
and the same preference pairs with identical token ids. Reports the steps/s of five setups (two of
TRL's, three of ours), their ratios to TRL's default, and shows that both compute the same DPO loss.

    python bench/bench_dpo_trl.py --trl_python=/tmp/trlvenv/bin/python

TRL is never a dependency of this project: it lives in its own virtual environment, whose Python
runs this same file in a worker mode (--mode=trl_export | trl_eval | trl_train). One way to make it
without a second copy of torch (the .pth line makes this Python's torch importable there):

    python3 -m venv /tmp/trlvenv
    python -c "import site; print(site.getsitepackages()[0])" > /tmp/trlvenv/lib/python3.11/site-packages/shared.pth  # this project's Python
    /tmp/trlvenv/bin/pip install trl

The rows (RUNS below), each run in a fresh process:

1. `trl`: TRL's DPOTrainer with its default batching: every pair's prompt + chosen and prompt + rejected
   as two right-padded rows of one batch (the prompt is computed twice), and a frozen reference model
   that runs a forward pass on the same rows every step. The 1.00x baseline.
2. `trl_precompute`: the same with precompute_ref_log_probs=True: before training, DPOTrainer runs the
   reference over all training pairs and the held-out pairs once (batches of batch_size) and keeps the
   log-probs as dataset columns; training steps then run the policy only. The one-off pass is timed
   apart (around DPOTrainer._precompute_ref_logps, which also writes the log-probs to an Arrow cache
   file) and is not in steps/s.
3. `ours_padded`: train_dpo.py --pack=False: the same rows as TRL's default (one right-padded sequence
   per row, chosen then rejected) and a frozen reference's forward pass every step: the same work per
   step as row 1.
4. `ours_packed`: train_dpo.py --pack=True, its default: padding-free packing, each pair laid out once as
   prompt + chosen[:-1] + rejected[:-1], both completions attending to the one copy of the prompt
   (an explicit attention mask and positions), several pairs per row; the reference runs every step on
   the same packed rows.
5. `ours_packed_precompute`: train_dpo.py --pack=True --precompute_ref_logps=True: the reference's
   log-probs of all training and validation pairs computed once before training (timed apart, from the
   line train_dpo.py logs) and cached on disk; training steps run the policy only.

TRL's own padding-free mode is no row: in trl 1.16, DPOConfig(padding_free=True) only warns and falls
back to padding ("temporarily unavailable since the DPO refactor"; it was meant for FlashAttention 2/3,
which does not run on CPU either).

What it does, in one invocation (about 8 minutes on a 2-core CPU):

1. Data: the embedded number-task pairs (tasks.number_tasks.prepare_number_tasks(..., preferences=True), train_dpo.py's
   default pairs) with a character-level tokenizer: data.prepare() on the pairs' own text, our
   ChatTokenizer on top, and on TRL's side a tokenizers WordLevel tokenizer with the same id for every
   character and special token and a chat template rendering our template (`<|role|>` content `<|end|>`
   per turn, a prompt ending in `<|assistant|>`). TRL tokenizes the pairs itself (its conversational
   path); the worker asserts that its prompt/chosen/rejected ids equal ours for every pair.
2. Model: a random GPT with learned positions, LayerNorm, GELU, no biases and tied embeddings, saved as
   an SFT checkpoint, and the same weights as a transformers GPT2LMHeadModel (fused c_attn, transposed
   Conv1D weights, biases zero and frozen); the worker asserts both give the same logits.
3. Speed: `rounds` rounds; in each, every row once, in RUNS order in even rounds and reversed in odd
   ones. `steps` steps of batch_size pairs, the same hyperparameters everywhere (plain sigmoid DPO:
   rpo_alpha 0, no label smoothing; beta; lr constant without warmup; AdamW (fused, both) with betas
   (0.9, 0.95), no weight decay; grad clip 1; fp32; dropout 0; no gradient checkpointing; no evals or
   saves inside the timed steps), every train_dpo.py setting passed explicitly whatever its defaults.
   A run's steps/s is the median over log_interval-step windows, the first window left out: ours from
   train_dpo.py's log.jsonl, TRL's from per-step timestamps taken by a TrainerCallback; a row's is the
   median over rounds. All see the same OMP_NUM_THREADS.
4. Equal losses: every train_dpo.py row evaluates its held-out pairs (the first eval_pairs of val.jsonl)
   at step 0 (policy == reference: loss ln 2) and after training, in its own batching (padded or
   packed) and with its own reference (a frozen copy or the cached log-probs). TRL's DPOTrainer.evaluate()
   (default settings) computes the same metrics on the same pairs for the same policies (step 0, and each
   of our rows' round-1 trained policy, converted) against the same reference. Each must agree to
   loss_tolerance.
5. Training losses, step by step: the batches come in the same order in every row. Our PreferenceBatches
   takes its first epoch from torch.randperm(n_pairs) of a generator seeded with `seed`, and so does the
   transformers Trainer's sampler with the same seed (a later epoch would differ: steps * batch_size must
   stay below the 10,000 training pairs). So each row's training losses at the logged steps are compared
   with row 1's. They agree up to float rounding, which training amplifies: all rows within 2e-7 of each
   other at step 20, then drifting apart, up to ~1e-3 by step 100 (our padded row drifts furthest, about
   as far from our own packed row as from TRL's; a row's trajectory is the same in every round).

Output: a markdown table on stdout, everything in bench/results/dpo_trl/results.json.
"""

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch

from configurator import POSITIVE, UserError, at_least, check_values, configure

# -----------------------------------------------------------------------------
mode = 'all'                 # 'all' (the whole benchmark) | 'trl_export' | 'trl_eval' | 'trl_train' (workers, run by trl_python)
trl_python = ''              # Python of a separate environment with trl installed (required)
rounds = 3                   # each implementation once per round, alternating which goes first
steps = 100                  # optimizer steps per run
log_interval = 10            # steps per timing window (the first window is start-up, not timed)
threads = 2                  # OMP_NUM_THREADS for both implementations
# model: a tiny GPT that maps exactly onto GPT-2
n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
# DPO, the same for both
batch_size = 32              # pairs per step
learning_rate = 3e-4
beta = 0.1
max_length = 64              # prompt + completion tokens (no embedded pair is that long: nothing is truncated)
max_prompt_length = 48
eval_pairs = 256             # held-out pairs (the first of val.jsonl) both evaluate
loss_tolerance = 1e-4        # the largest allowed difference between the two evals' losses, rewards and log-probs
seed = 1337
out = os.path.join(ROOT, 'bench', 'results', 'dpo_trl')
worker_round = 0             # (trl_train worker) the round it runs in
worker_run = 'trl'           # (trl_train worker) which TRL row of RUNS it runs
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('batch_size', 'log_interval', 'eval_pairs', 'block_size', 'max_length',
                                     'max_prompt_length', 'n_layer', 'n_head', 'n_embd')),
                      (at_least(0), ('learning_rate',)), (POSITIVE, ('beta',))])

# the rows of the table, in order: name -> (label, settings). Every train_dpo.py setting not named here is
# pinned in run_ours(); TRL's in dpo_config(). Row 1 is the baseline of the ratios.
RUNS = {
    'trl': ('TRL DPOTrainer, default (padded rows, reference every step)',
            dict(precompute_ref_log_probs=False)),
    'trl_precompute': ('TRL DPOTrainer, precompute_ref_log_probs=True',
                       dict(precompute_ref_log_probs=True)),
    'ours_padded': ('train_dpo.py --pack=False (padded rows, as TRL)',
                    dict(pack=False, precompute_ref_logps=False)),
    'ours_packed': ('train_dpo.py --pack=True (default: packed, shared prompts)',
                    dict(pack=True, precompute_ref_logps=False)),
    'ours_packed_precompute': ('train_dpo.py --pack=True --precompute_ref_logps=True',
                               dict(pack=True, precompute_ref_logps=True)),
}
BASELINE = 'trl'
OURS = [name for name in RUNS if name.startswith('ours')]

SPECIAL_TOKENS = ('<|system|>', '<|user|>', '<|assistant|>', '<|end|>')  # tokenizer.CHAT_SPECIAL_TOKENS, in order
# our chat template (tokenizer.ChatTokenizer.encode_chat / encode_prompt) in Jinja, for transformers
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
EVAL_KEYS = ('loss', 'rewards/chosen', 'rewards/rejected', 'rewards/margins', 'logps/chosen', 'logps/rejected')

paths = {name: os.path.join(out, name) for name in (
    'pairs',          # train/val/test.jsonl of preference pairs
    'chars',          # the character-level dataset folder (its meta.json is our tokenizer)
    'ids.json',       # our token ids of every train and held-out pair, for the worker to compare with TRL's
    'init.pt',        # the random model as our SFT checkpoint
    'check.pt',       # a batch and our logits on it, for the worker to compare with GPT-2's
    'hf_init',        # the same model as a transformers GPT2LMHeadModel, with its tokenizer
    'trl_eval.json',  # TRL's eval metrics at step 0 and of our trained policy
)}


def run_dir(name, round_):
    return os.path.join(out, f'{name}_round{round_}')


def read_pairs(split, n=None):
    """(prompt, chosen, rejected) strings of a split of the embedded pairs (each prompt is one user turn)."""
    with open(os.path.join(paths['pairs'], f'{split}.jsonl')) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [(r['prompt'], r['chosen'], r['rejected']) for r in records[:n]]


def to_gpt2(state, n_layer):
    """Our GPT's state dict (learned positions, LayerNorm, GELU, no biases, tied embeddings) as GPT-2's:
    q/k/v fused into c_attn, Linear weights transposed into Conv1D's (in, out) layout, zero biases."""
    zeros = lambda n: torch.zeros(n)
    C = state['transformer.wte.weight'].size(1)
    sd = {'transformer.wte.weight': state['transformer.wte.weight'], 'lm_head.weight': state['lm_head.weight'],
          'transformer.wpe.weight': state['transformer.wpe.weight'],
          'transformer.ln_f.weight': state['transformer.ln_f.weight'], 'transformer.ln_f.bias': zeros(C)}
    for i in range(n_layer):
        p = f'transformer.h.{i}.'
        qkv = torch.cat([state[p + f'attn.{x}.weight'] for x in 'qkv'])  # (3C, C)
        sd.update({p + 'ln_1.weight': state[p + 'ln_1.weight'], p + 'ln_1.bias': zeros(C),
                   p + 'attn.c_attn.weight': qkv.T.contiguous(), p + 'attn.c_attn.bias': zeros(3 * C),
                   p + 'attn.c_proj.weight': state[p + 'attn.proj.weight'].T.contiguous(), p + 'attn.c_proj.bias': zeros(C),
                   p + 'ln_2.weight': state[p + 'ln_2.weight'], p + 'ln_2.bias': zeros(C),
                   p + 'mlp.c_fc.weight': state[p + 'mlp.fc.weight'].T.contiguous(), p + 'mlp.c_fc.bias': zeros(4 * C),
                   p + 'mlp.c_proj.weight': state[p + 'mlp.proj.weight'].T.contiguous(), p + 'mlp.c_proj.bias': zeros(C)})
    return sd


# -----------------------------------------------------------------------------
# TRL's side: these run in trl_python's environment and import nothing of this project but configurator

def hf_gpt2(state):
    """A GPT2LMHeadModel holding our weights (a state dict of our GPT), biases frozen at zero as ours has none."""
    from transformers import GPT2Config, GPT2LMHeadModel
    vocab_size, C = state['transformer.wte.weight'].shape
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab_size, n_positions=block_size, n_embd=C, n_layer=n_layer, n_head=n_head,
        activation_function='gelu',  # exact (erf) GELU, as F.gelu
        layer_norm_epsilon=1e-5,     # nn.LayerNorm's default, as model.make_norm
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1))
    model.load_state_dict(to_gpt2(state, n_layer), strict=True)
    for name, p in model.named_parameters():
        if name.endswith('.bias'):
            p.requires_grad_(False)
    return model.float()


def load_hf_model(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, p in model.named_parameters():
        if name.endswith('.bias'):
            p.requires_grad_(False)
    return model


def hf_tokenizer(chars):
    """A transformers tokenizer with our ChatTokenizer(CharTokenizer(chars))'s ids: one token per
    character, then the four special tokens, and our chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), behavior='isolated')  # every character alone
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token='<|end|>', pad_token='<|end|>',
                                  chat_template=CHAT_TEMPLATE)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(chars), len(chars) + 4))
    return tok


def conversational(pairs):
    from datasets import Dataset
    return Dataset.from_list([{'prompt': [{'role': 'user', 'content': p}],
                               'chosen': [{'role': 'assistant', 'content': c}],
                               'rejected': [{'role': 'assistant', 'content': r}]} for p, c, r in pairs])


def dpo_config(output_dir, **overrides):
    from trl import DPOConfig
    return DPOConfig(
        output_dir=output_dir, per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        max_steps=steps, learning_rate=learning_rate, lr_scheduler_type='constant', warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0, optim='adamw_torch_fused',
        beta=beta, loss_type=['sigmoid'], max_length=max_length,
        bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,  # TRL's defaults: bf16, checkpointing on
        logging_steps=log_interval, eval_strategy='no', save_strategy='no', report_to='none',
        dataloader_num_workers=0, seed=seed, **overrides)


def check_ids(trainer_dataset, ours, name):
    """Assert TRL's tokenization of every pair equals ours."""
    theirs = zip(*(list(trainer_dataset[k]) for k in ('prompt_ids', 'chosen_ids', 'rejected_ids')))
    count = 0
    for i, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        assert [list(x) for x in t] == o, f"{name} pair {i}: TRL's token ids {t} differ from ours {o}"
        count += 1
    return count


def trl_export():
    """The GPT-2 copy of init.pt and its tokenizer, saved with save_pretrained; asserts equal logits and ids."""
    with open(os.path.join(paths['chars'], 'meta.json')) as f:
        tok = hf_tokenizer(json.load(f)['chars'])
    model = hf_gpt2(torch.load(paths['init.pt'], weights_only=True)['model']).eval()
    check = torch.load(paths['check.pt'], weights_only=True)
    with torch.no_grad():
        diff = (model(check['x']).logits - check['logits']).abs().max().item()
    assert diff < 1e-5, f"GPT-2's logits differ from ours by {diff}"
    with open(paths['ids.json']) as f:
        ids = json.load(f)
    for (p, c, r), (pi, ci, ri) in zip(read_pairs('val', 4), ids['val']):  # and by the tokenizer alone
        assert tok.apply_chat_template([{'role': 'user', 'content': p}], add_generation_prompt=True)['input_ids'] == pi
        assert tok(c + '<|end|>', add_special_tokens=False)['input_ids'] == ci
    model.save_pretrained(paths['hf_init'])
    tok.save_pretrained(paths['hf_init'])
    print(json.dumps({'max_logit_diff': diff}))


def trl_eval():
    """TRL's eval metrics on the held-out pairs, through DPOTrainer.evaluate() with its default settings, for
    the policy at step 0 (== the reference) and for each of our rows' trained policy (round 1), the
    reference being init.pt."""
    from trl import DPOTrainer
    with open(paths['ids.json']) as f:
        ours = json.load(f)['val']
    data = conversational(read_pairs('val', eval_pairs))
    results = {}
    for policy_name in ['step 0'] + [f'{name} trained' for name in OURS]:
        policy = load_hf_model(paths['hf_init'])
        if policy_name != 'step 0':
            trained = torch.load(os.path.join(run_dir(policy_name.split()[0], 0), 'ckpt.pt'), weights_only=True)
            policy.load_state_dict(to_gpt2(trained['model'], n_layer))
        trainer = DPOTrainer(policy, ref_model=load_hf_model(paths['hf_init']), args=dpo_config(os.path.join(out, 'trl_eval')),
                             train_dataset=data, eval_dataset=data, processing_class=policy_tokenizer())
        check_ids(trainer.eval_dataset, ours, 'held-out')
        metrics = trainer.evaluate()
        results[policy_name] = {k: metrics[f'eval_{k}'] for k in EVAL_KEYS + ('rewards/accuracies',)}
    with open(paths['trl_eval.json'], 'w') as f:
        json.dump(results, f, indent=1)


def policy_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(paths['hf_init'])


def trl_train(name, round_):
    """DPOTrainer (RUNS[name]'s settings) for `steps` steps from hf_init (its own frozen copy as the reference,
    as by default, or precomputed log-probs): per-step timestamps and losses, the time of the one-off
    reference pass if any, then (untimed) the eval metrics on the held-out pairs."""
    import transformers
    import trl
    from transformers import TrainerCallback
    from trl import DPOTrainer

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    class RecordingDPOTrainer(DPOTrainer):
        """Records per-step training losses (TRL logs window means) and times the reference precompute."""
        precompute_s, precompute_pairs = 0.0, 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.step_losses.append(loss.detach())
            return loss

        def _precompute_ref_logps(self, dataset, name, batch_size):  # in __init__: the train, then the eval pairs
            t = time.perf_counter()
            dataset = super()._precompute_ref_logps(dataset, name, batch_size)
            self.precompute_s += time.perf_counter() - t
            self.precompute_pairs += len(dataset)
            return dataset

    t_start = time.time()
    with open(paths['ids.json']) as f:
        ids = json.load(f)
    timer = StepTimes()
    trainer = RecordingDPOTrainer(
        load_hf_model(paths['hf_init']), args=dpo_config(run_dir(name, round_), **RUNS[name][1]),
        train_dataset=conversational(read_pairs('train')), eval_dataset=conversational(read_pairs('val', eval_pairs)),
        processing_class=policy_tokenizer(), callbacks=[timer])
    trainer.step_losses = []
    checked = check_ids(trainer.train_dataset, ids['train'], 'train') + check_ids(trainer.eval_dataset, ids['val'], 'held-out')
    trainer.train()
    t = timer.times
    windows = [log_interval / (t[k + log_interval - 1] - t[k - 1]) for k in range(log_interval, len(t) - log_interval + 1, log_interval)]
    metrics = trainer.evaluate()
    result = dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__,
                  threads=torch.get_num_threads(), pairs_checked=checked,
                  steps_per_sec=statistics.median(windows), windows=windows,
                  losses=[x.item() for x in trainer.step_losses],
                  precompute_s=trainer.precompute_s or None, precompute_pairs=trainer.precompute_pairs,
                  eval={k: metrics[f'eval_{k}'] for k in EVAL_KEYS + ('rewards/accuracies',)},
                  wall_s=time.time() - t_start)
    with open(os.path.join(run_dir(name, round_), 'result.json'), 'w') as f:
        json.dump(result, f, indent=1)


# -----------------------------------------------------------------------------
# our side, and the benchmark

def worker(worker_mode, *extra):
    """This file in trl_python's environment, in a worker mode; exits on failure with its output."""
    args = [trl_python, os.path.abspath(__file__), f'--mode={worker_mode}', *extra,
            *(f'--{k}={v}' for k, v in config.items() if k not in ('ROOT', 'mode', 'trl_python', 'worker_round', 'worker_run'))]
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True)


def check(proc, name):
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def run_ours(name, round_):
    """train_dpo.py (RUNS[name]'s settings) in a fresh process: median steps/s over the logged windows after
    the first, the per-step losses it logged, its evals at step 0 and at the end, and the time of the
    one-off reference pass if any (from the line it logs)."""
    folder = run_dir(name, round_)
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run: log.jsonl is appended to, the reference cache reused
    settings = RUNS[name][1]
    t0 = time.time()
    proc = check(subprocess.run([
        sys.executable, 'train_dpo.py', f"--init_from={paths['init.pt']}", f'--out_dir={folder}', '--resume=False',
        f"--data_dir={paths['chars']}", f"--dpo_data={paths['pairs']}", f'--batch_size={batch_size}',
        f'--max_iters={steps}', f'--log_interval={log_interval}', f'--eval_interval={steps}',
        f'--eval_pairs={eval_pairs}', '--exact_match_examples=0', '--tensorboard=False',
        f'--max_length={max_length}', f'--max_prompt_length={max_prompt_length}', f'--learning_rate={learning_rate}',
        '--lr_schedule=constant', '--warmup_iters=0', '--weight_decay=0.0', '--beta1=0.9', '--beta2=0.95',
        '--grad_clip=1.0', f'--beta={beta}', '--loss_type=sigmoid', '--dropout=0.0', '--device=cpu',
        '--dtype=float32', f'--seed={seed}', '--num_threads=0',
        # plain DPO, as TRL runs it: pinned, whatever train_dpo.py's defaults are
        '--rpo_alpha=0.0', '--label_smoothing=0.0', '--reference_free=False', '--use_lora=False',
        '--gradient_accumulation_steps=1', '--compile=False', '--activation_checkpointing=False',
        # what this row varies
        f"--pack={settings['pack']}", f"--precompute_ref_logps={settings['precompute_ref_logps']}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True), f'train_dpo.py ({name})')
    precomputed = re.search(r'reference log-probs of ([\d,]+) pairs computed in ([\d.]+) s', proc.stdout)
    if settings['precompute_ref_logps'] and not precomputed:
        sys.exit(f"train_dpo.py ({name}) did not log its reference precompute:\n{proc.stdout[-4000:]}")
    with open(os.path.join(folder, 'log.jsonl')) as f:
        events = [json.loads(line) for line in f if line.strip()]
    train = [e for e in events if 'steps_per_sec' in e]
    evals = {e['step']: {k: e[f'eval/{k}'] for k in EVAL_KEYS + ('rewards/accuracies',)}
             for e in events if 'eval/loss' in e}
    return dict(steps_per_sec=statistics.median(e['steps_per_sec'] for e in train[1:]),
                windows=[e['steps_per_sec'] for e in train], losses={e['step']: e['loss'] for e in train},
                precompute_s=float(precomputed[2]) if precomputed else None,
                precompute_pairs=int(precomputed[1].replace(',', '')) if precomputed else 0,
                eval_step0=evals[0], eval=evals[steps], wall_s=time.time() - t0)


def run_trl(name, round_):
    shutil.rmtree(run_dir(name, round_), ignore_errors=True)
    check(worker('trl_train', f'--worker_run={name}', f'--worker_round={round_}'), f'the TRL run ({name})')
    with open(os.path.join(run_dir(name, round_), 'result.json')) as f:
        result = json.load(f)
    result['losses'] = {step: result['losses'][step - 1] for step in range(log_interval, steps + 1, log_interval)}
    return result


def run(name, round_):
    return run_ours(name, round_) if name in OURS else run_trl(name, round_)


def prepare_everything():
    """The pairs, the char tokenizer, our token ids, the random model as init.pt and a logits check batch."""
    from lm.chat_data import PreferenceBatches, encode_pair, load_preference_split
    from run.checkpoint import save_checkpoint
    from data import prepare
    from model import GPT, GPTConfig
    from tasks.number_tasks import prepare_number_tasks
    from lm.tokenizer import ChatTokenizer, load_tokenizer

    prepare_number_tasks(paths['pairs'], seed=1, preferences=True)  # train_dpo.py's default pairs
    text = ''.join(''.join(pair) for split in ('train', 'val', 'test') for pair in read_pairs(split))
    corpus = os.path.join(out, 'chars.txt')
    with open(corpus, 'w') as f:
        f.write(text)
    tokenizer = ChatTokenizer(load_tokenizer(prepare(corpus, paths['chars'], 'char')))
    ids = {}
    for split, n in (('train', None), ('val', eval_pairs)):
        _, pairs = load_preference_split(os.path.join(paths['pairs'], f'{split}.jsonl'), tokenizer, max_length,
                                         max_prompt_length)
        whole = [list(encode_pair(tokenizer, [{'role': 'user', 'content': p}], c, r)) for p, c, r in read_pairs(split)]
        assert [list(p) for p in pairs] == whole, f"some {split} pairs were truncated; raise max_length"
        ids[split] = whole[:n]
    with open(paths['ids.json'], 'w') as f:
        json.dump(ids, f)

    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=tokenizer.vocab_size, n_layer=n_layer, n_head=n_head,
                          n_embd=n_embd, dropout=0.0, bias=False, pos_emb='learned', norm='layernorm', mlp='gelu',
                          tie_embeddings=True))
    save_checkpoint(paths['init.pt'], dict(kind='gpt', model=model.state_dict(), model_args=model.model_args(),
                                           config={'training_type': 'sft'}, tokenizer=tokenizer.identity(),
                                           data_dir=os.path.abspath(paths['chars'])))
    batches = PreferenceBatches(ids['val'], seed, tokenizer.eos_id, max_length)
    x = batches.get(torch.arange(16))['x']  # 16 pairs: 32 right-padded sequences
    with torch.no_grad():
        save_checkpoint(paths['check.pt'], dict(x=x, logits=model.eval()(x)[0]))
    return model


def our_version():
    """The commit, and with uncommitted changes the sha256 of train_dpo.py as it ran."""
    git = lambda *args: subprocess.run(['git', *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    try:
        head, dirty = git('rev-parse', '--short', 'HEAD'), git('status', '--porcelain', 'train_dpo.py', 'lm/chat_data.py',
                                                               'lm/tokenizer.py', 'losses.py', 'model.py', 'lm/lora.py',
                                                               'run/runtime.py')
    except OSError:
        head, dirty = 'unknown', 'unknown'
    with open(os.path.join(ROOT, 'train_dpo.py'), 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:8]
    return head + (f' + changes (train_dpo.py {digest})' if dirty else '')


def main():
    if not trl_python or not os.path.exists(trl_python):
        raise UserError(f"trl_python={trl_python!r}: pass the Python of an environment with trl installed, e.g. "
                        f"--trl_python=/tmp/trlvenv/bin/python (how to make one: the docstring, `--help`).")
    if steps * batch_size > 10_000:
        raise UserError(f"steps * batch_size = {steps * batch_size} pairs is more than an epoch of the 10,000 training "
                        f"pairs, after which the two samplers' orders differ; lower steps.")
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    version = our_version()  # before the runs: other edits while they run would change it
    model = prepare_everything()
    export = json.loads(check(worker('trl_export'), 'the GPT-2 export').stdout.strip().splitlines()[-1])
    print(f"data and models ready ({time.time() - t0:.0f} s): GPT-2 logits within {export['max_logit_diff']:.1e} of ours",
          flush=True)

    results = {name: [] for name in RUNS}
    for round_ in range(rounds):
        for name in (list(RUNS) if round_ % 2 == 0 else list(RUNS)[::-1]):
            results[name].append(run(name, round_))
            r = results[name][-1]
            print(f"round {round_ + 1}: {name}: {r['steps_per_sec']:.2f} steps/s, final eval loss {r['eval']['loss']:.4f}"
                  + (f", reference precompute {r['precompute_s']:.1f} s" if r['precompute_s'] else '')
                  + f", {r['wall_s']:.0f} s", flush=True)
    check(worker('trl_eval'), 'the TRL eval')  # TRL evaluates step 0 and our rows' round-1 trained policies

    # equal losses: the same policies and reference, the same held-out pairs, each implementation's own eval
    with open(paths['trl_eval.json']) as f:
        trl_evals = json.load(f)
    ours_evals = {(name, policy): results[name][0]['eval_step0' if policy == 'step 0' else 'eval']
                  for name in OURS for policy in ('step 0', f'{name} trained')}
    diffs = {key: {k: abs(ours_evals[key][k] - trl_evals[key[1]][k]) for k in EVAL_KEYS} for key in ours_evals}
    worst = max(max(d.values()) for d in diffs.values())

    speed = {name: statistics.median(r['steps_per_sec'] for r in results[name]) for name in RUNS}
    precompute = {name: (statistics.median(r['precompute_s'] for r in results[name]), results[name][0]['precompute_pairs'])
                  for name in RUNS if results[name][0]['precompute_s']}
    first = {name: results[name][0] for name in RUNS}  # round 1: losses and trajectories
    logged = list(range(log_interval, steps + 1, log_interval))
    trajectory = {name: max(abs(first[name]['losses'][s] - first[BASELINE]['losses'][s]) for s in logged)
                  for name in RUNS if name != BASELINE}
    trl_info = first[BASELINE]

    print(f"\nCPU, {threads} threads each (OMP_NUM_THREADS), torch {torch.__version__}; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter GPT ({n_layer}x{n_embd}, block "
          f"{block_size}, vocab {model.config.vocab_size}, char-level); {batch_size} pairs per step, {steps} steps; "
          f"steps/s: median over {log_interval}-step windows after the first, then median of {rounds} rounds; "
          f"ours: {version}; trl {trl_info['trl']}, transformers {trl_info['transformers']}")
    print(f"| implementation / mode | steps/s | vs row 1 | loss @ step {logged[0]} | loss @ step {steps} "
          f"| held-out eval loss after {steps} steps | one-off reference precompute |")
    print("|---|---|---|---|---|---|---|")
    for i, (name, (label, _)) in enumerate(RUNS.items(), 1):
        pre = f"{precompute[name][0]:.1f} s ({precompute[name][1]:,} pairs)" if name in precompute else '-'
        print(f"| {i}. {label} | {speed[name]:.2f} | {speed[name] / speed[BASELINE]:.2f}x "
              f"| {first[name]['losses'][logged[0]]:.4f} | {first[name]['losses'][steps]:.4f} "
              f"| {statistics.median(r['eval']['loss'] for r in results[name]):.4f} | {pre} |")
    print("\nsteps/s per round: " + "; ".join(f"{name} {[round(r['steps_per_sec'], 2) for r in results[name]]}"
                                           for name in RUNS))
    print("step time: " + ", ".join(f"{name} {1000 / speed[name]:.1f} ms" for name in RUNS))
    print(f"token ids: TRL's tokenization equals ours for all {trl_info['pairs_checked']:,} pairs checked")
    print("training loss at the logged steps (round 1, the same batches in the same order), largest difference "
          "from row 1: " + ", ".join(f"{name} {d:.1e}" for name, d in trajectory.items()))
    print(f"\nequal losses (each implementation's own eval of the same {eval_pairs} held-out pairs, same policy and "
          f"reference; TRL's with its default settings): largest difference {worst:.1e} (tolerance {loss_tolerance:.0e})")
    print("| policy | evaluated by | " + " | ".join(EVAL_KEYS) + " | rewards/accuracies |")
    print("|---|---|" + "---|" * (len(EVAL_KEYS) + 1))
    for policy in trl_evals:
        rows = [('TRL', trl_evals[policy])] + [(name, ev) for (name, p), ev in ours_evals.items() if p == policy]
        for who, ev in rows:
            print(f"| {policy} | {who} | " + " | ".join(f"{ev[k]:.6f}" for k in EVAL_KEYS + ('rewards/accuracies',)) + " |")
    print("(rewards/accuracies: ours counts a tie, as at step 0, as half right; TRL as wrong)")
    with open(os.path.join(out, 'results.json'), 'w') as f:
        json.dump(dict(config=config, runs={name: label for name, (label, _) in RUNS.items()}, version=version,
                       trl_version=trl_info['trl'], transformers_version=trl_info['transformers'], export=export,
                       results=results, trl_eval=trl_evals,
                       ours_eval={f'{name} / {policy}': ev for (name, policy), ev in ours_evals.items()},
                       eval_diffs={f'{name} / {policy}': d for (name, policy), d in diffs.items()},
                       trajectory_diff=trajectory, steps_per_sec=speed,
                       ratio={name: speed[name] / speed[BASELINE] for name in RUNS},
                       precompute={name: dict(seconds=s, pairs=n) for name, (s, n) in precompute.items()},
                       wall_s=time.time() - t0), f, indent=1)
    print(f"total {time.time() - t0:.0f} s")
    if worst > loss_tolerance:
        sys.exit(f"the two implementations' eval metrics differ by {worst:.1e} > loss_tolerance={loss_tolerance}")


ENV = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED='1',
           TOKENIZERS_PARALLELISM='false', HF_HUB_OFFLINE='1')
if mode == 'all':
    main()
elif mode == 'trl_export':
    trl_export()
elif mode == 'trl_eval':
    trl_eval()
elif mode == 'trl_train':
    trl_train(worker_run, worker_round)
else:
    raise UserError(f"mode={mode!r}: use 'all' (the benchmark) or, as a worker, 'trl_export', 'trl_eval' or 'trl_train'.")
