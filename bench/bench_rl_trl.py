"""
Online RL side by side: train_rl.py against Hugging Face TRL's GRPOTrainer, on CPU, at equal work: the same
tiny model, the same prompts at every step (identical token ids), G, max_new_tokens, temperature, loss type,
beta=0 and one iteration per batch. Reports the steps/s of both with the time split into rollouts and training,
and shows that both compute the same loss, gradient and per-token log-probs on the same rollouts.

    python bench/bench_rl_trl.py --trl_python=/work/trlvenv/bin/python

TRL is never a dependency of this project: it lives in its own virtual environment, whose Python runs this
same file in a worker mode (--mode=trl_check | trl_train). One way to make it without a second copy of torch
(the .pth line makes this Python's torch importable there), as for bench/bench_dpo_trl.py:

    python3 -m venv /work/trlvenv
    python -c "import site; print(site.getsitepackages()[0])" > /work/trlvenv/lib/python3.11/site-packages/shared.pth
    /work/trlvenv/bin/pip install trl

What it does, in one invocation (about 2 minutes on a quiet 2-core CPU, 3 rounds; 15 on a loaded one):

1. Data: the embedded number tasks (train_rl.py's default prompts) with a character-level tokenizer made
   from their text (data.prepare, our ChatTokenizer). No prompt is dropped (max_prompt_length is above the
   longest), so both sides hold the same list of prompts in the same order.
2. Model: a random GPT with RoPE, RMSNorm and a SwiGLU MLP, saved as an SFT checkpoint, and exported by
   export.py as a LlamaForCausalLM folder with its tokenizer and chat template; the worker asserts equal
   logits and that TRL's tokenization of every prompt (apply_chat_template) equals ours.
3. Reward: bench/digits_reward.py (the number of digits in a completion), on both sides the same function on
   the completion's text. A random model never answers a number task right, so the verifier would give
   every completion 0 and nothing would be learned; the digit count varies within every group.
4. Equal losses: TRL's GRPOTrainer takes one step for each loss type in check_loss_types (its own sampled
   rollouts: the two sides draw from different random streams, so their samples differ), and records its
   step-1 rollouts (prompt and completion ids), rewards, advantages, loss, pre-clip grad norm, entropy and
   per-token log-probs. Our side then feeds those very completions to lm/rl.py exactly as train_rl.py's
   train_step does (completion_batches, the policy's log-probs of logits / temperature, clipped_token_loss
   with the old log-probs detached, normalized_loss) on the same starting weights, and compares. With one
   iteration the ratio is exactly 1, so the loss's value is a function of the advantages and lengths alone
   (-sum A_i |o_i| / T for dapo); the model enters through the gradient, which the grad norm and the
   per-token log-probs check. The loss is computed in the rollout order (each prompt shared by its G
   completions), the log-probs in the order TRL trained in (it shuffles the batch: most prompts then come
   once per completion), so completion_batches' layout meets TRL's numbers both ways. Tolerances: rewards
   equal exactly (integers); the loss within the float32 bound of the two computations (each side's error
   at most (n + 2G + 8) u times the sum of |terms| it normalises, n the elements summed, u = 2^-24, 2G + 8
   for the advantage's mean, std, sqrt and division);
   log-probs within 2 x logit_tolerance (a log-softmax moves at most twice the largest logit difference);
   the grad norm within grad_tolerance (relative; a sanity bound, not derived).
5. Speed: `rounds` rounds; in each, both sides once (ours first in even rounds, TRL first in odd ones), each a
   fresh process running `steps` steps, the same settings everywhere (fp32, no gradient checkpointing, AdamW
   fused with betas (0.9, 0.99), no weight decay, grad clip 1, lr constant, dropout 0, no evals or saves
   inside the timed steps). The same prompts come at each step on both sides: our PromptSampler and TRL's
   RepeatSampler both take torch.randperm(n_prompts) of a generator seeded with `seed` (the worker asserts
   its prompts of every step equal ours). A run's steps/s is over the steps after the first warmup_steps:
   ours from the time/generation_s + time/training_s train_rl.py logs for each step, TRL's from per-step
   timestamps (a TrainerCallback); the rollout part (sampling, rewards, advantages) timed around TRL's
   _generate_and_score_completions (and the sampling alone around _generate_single_turn), training the rest.
   A row's numbers are the medians over rounds. Both sample from the same model at the same temperature, so
   their completions have the same expected length (the table gives both means).

Output: markdown tables on stdout, everything in bench/results/rl_trl/results.json.
"""

import hashlib
import json
import os
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
mode = 'all'                 # 'all' (the benchmark) | 'trl_check' | 'trl_train' (workers, run by trl_python)
trl_python = ''              # Python of a separate environment with trl installed (required)
rounds = 3                   # each implementation once per round, alternating which goes first
steps = 12                   # optimizer steps per timed run
warmup_steps = 2             # the first steps of a run are start-up, not timed
threads = 1                  # OMP_NUM_THREADS for both (on a shared machine 2 threads wait at every op's barrier)
# model: a tiny GPT that export.py writes as Llama
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
# RL, the same for both
prompts_per_step = 16        # prompts per step
num_generations = 8          # G
max_new_tokens = 32          # TRL's max_completion_length
max_prompt_length = 64       # above the longest prompt: none is dropped
temperature = 1.0            # sampling temperature (no top-k, no top-p)
learning_rate = 1e-4         # constant, AdamW
loss_type = 'dapo'           # the timed runs' (both sides' default)
check_loss_types = 'dapo,grpo,dr_grpo'  # the loss types whose step-1 losses are compared
logit_tolerance = 1e-5       # the largest allowed logit difference between our GPT and its Llama export
grad_tolerance = 1e-4        # the largest allowed relative difference of the step-1 grad norms
seed = 1337
out = os.path.join(ROOT, 'bench', 'results', 'rl_trl')
worker_round = 0             # (trl_train worker) the round it runs in
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('rounds', 'steps', 'prompts_per_step', 'max_new_tokens', 'max_prompt_length',
                                     'n_layer', 'n_head', 'n_embd', 'block_size')),
                      (at_least(2), ('num_generations',)), (at_least(0), ('warmup_steps', 'learning_rate')),
                      (POSITIVE, ('temperature', 'logit_tolerance', 'grad_tolerance'))])
LOSS_TYPES = check_loss_types.split(',')
REWARD = os.path.join(ROOT, 'bench', 'digits_reward.py')
EPSILON = 0.2                # PPO clip, both bounds (inactive at one iteration: the ratio is 1)
U = 2.0 ** -24               # float32's unit roundoff

paths = {name: os.path.join(out, name) for name in (
    'prompts',          # train/val/test.jsonl: the embedded number tasks
    'chars',            # the character-level dataset folder (its meta.json is our tokenizer)
    'ids.json',         # our token ids of every training prompt, for the worker to compare with TRL's
    'init.pt',          # the random model as our SFT checkpoint
    'check.pt',         # a batch and our logits on it, for the worker to compare with Llama's
    'hf_init',          # the same model exported by export.py: a LlamaForCausalLM folder with its tokenizer
    'trl_check.json',   # TRL's step-1 rollouts, loss, grad norm and log-probs, per loss type
)}


def run_dir(name, round_):
    return os.path.join(out, f'{name}_round{round_}')


def read_prompts(split='train'):
    with open(os.path.join(paths['prompts'], f'{split}.jsonl')) as f:
        return [json.loads(line)['prompt'] for line in f if line.strip()]


def step_prompts(n_prompts):
    """The indices of each step's prompts, as our PromptSampler draws them (the first epoch: TRL's order too)."""
    from lm.chat_data import PromptSampler
    sampler = PromptSampler(n_prompts, seed)
    return [sampler.sample(prompts_per_step).tolist() for _ in range(steps)]


# -----------------------------------------------------------------------------
# TRL's side: these run in trl_python's environment (torch and this project's lm/ shared with it)

def grpo_config(output_dir, loss, max_steps, logging_steps):
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=prompts_per_step * num_generations,
        num_generations=num_generations, max_completion_length=max_new_tokens, temperature=temperature,
        top_p=1.0, top_k=0, beta=0.0, loss_type=loss, scale_rewards='group', num_iterations=1,
        epsilon=EPSILON, epsilon_high=EPSILON, mask_truncated_completions=False,
        max_steps=max_steps, learning_rate=learning_rate, lr_scheduler_type='constant', warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, optim='adamw_torch_fused',
        bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,  # TRL's defaults: bf16, checkpointing on
        disable_dropout=True, logging_steps=logging_steps, save_strategy='no', report_to='none',
        log_completions=False, dataloader_num_workers=0, seed=seed)


def unpadded(rows, mask):
    """The rows (B, T) of a padded batch as lists without their padding (mask (B, T): 1 where not padding)."""
    return [row[m.bool()].tolist() for row, m in zip(rows, mask)]


def recording_trainer(loss, output_dir, max_steps, logging_steps, record_logps=False):
    """GRPOTrainer on hf_init and the training prompts that records each step's rollouts and rewards, the time
    of its rollouts and of their sampling, its losses and logged metrics, and the per-step end times; with
    record_logps also the per-token log-probs of the step's completions before its update."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from lm.rewards import load_reward
    digits = load_reward(f'{REWARD}:digits').fn

    class Recorder(TrainerCallback):
        def __init__(self):
            self.times, self.logs = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    class RecordingGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            rollout = super()._generate_and_score_completions(inputs)
            self.rollout_s.append(time.perf_counter() - t)
            self.rollouts.append(dict(prompt_ids=unpadded(rollout['prompt_ids'], rollout['prompt_mask']),
                                      completion_ids=unpadded(rollout['completion_ids'], rollout['completion_mask']),
                                      advantages=rollout['advantages'].tolist()))
            return rollout

        def _generate_single_turn(self, *args, **kwargs):
            t = time.perf_counter()
            result = super()._generate_single_turn(*args, **kwargs)
            self.sampling_s.append(time.perf_counter() - t)
            return result

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if record_logps:
                ids = torch.cat([inputs['prompt_ids'], inputs['completion_ids']], 1)
                mask = torch.cat([inputs['prompt_mask'], inputs['completion_mask']], 1)
                with torch.no_grad():
                    logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, mask,
                                                                          inputs['completion_ids'].size(1))
                # TRL shuffles the batch before training on it: sequences and log-probs, its order
                self.logps.append(dict(prompt_ids=unpadded(inputs['prompt_ids'], inputs['prompt_mask']),
                                       completion_ids=unpadded(inputs['completion_ids'], inputs['completion_mask']),
                                       logps=unpadded(logps, inputs['completion_mask'])))
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(loss.item())
            return loss

    def reward(prompts, completions, **kwargs):  # TRL's signature; conversational completions are messages
        values = [digits(prompt=p, completion=c[0]['content'], row=None) for p, c in zip(prompts, completions)]
        trainer.rewards.append(values)
        return values

    recorder = Recorder()
    data = Dataset.from_list([{'prompt': [{'role': 'user', 'content': p}]} for p in read_prompts()])
    trainer = RecordingGRPOTrainer(
        AutoModelForCausalLM.from_pretrained(paths['hf_init'], dtype=torch.float32), reward_funcs=[reward],
        args=grpo_config(output_dir, loss, max_steps, logging_steps), train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(paths['hf_init']), callbacks=[recorder])
    trainer.rollouts, trainer.rewards, trainer.rollout_s, trainer.sampling_s, trainer.losses, trainer.logps = \
        [], [], [], [], [], []
    trainer.recorder = recorder
    return trainer


def check_step_prompts(trainer, ids):
    """Assert that every step's prompts, G times each, are ours (same order, same token ids)."""
    for step, (rollout, chosen) in enumerate(zip(trainer.rollouts, step_prompts(len(ids)))):
        ours = [ids[i] for i in chosen for _ in range(num_generations)]
        assert rollout['prompt_ids'] == ours, f"step {step + 1}: TRL's prompt ids differ from ours"
    return len(trainer.rollouts) * prompts_per_step


def trl_check():
    """Equal models and tokenization, then one GRPOTrainer step per loss type, recorded for our side."""
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(paths['hf_init'], dtype=torch.float32).eval()
    check = torch.load(paths['check.pt'], weights_only=True)
    with torch.no_grad():
        logit_diff = (model(check['x']).logits - check['logits']).abs().max().item()
    assert logit_diff < logit_tolerance, f"Llama's logits differ from ours by {logit_diff}"
    tok = AutoTokenizer.from_pretrained(paths['hf_init'])
    with open(paths['ids.json']) as f:
        ids = json.load(f)
    for p, ours in zip(read_prompts(), ids):
        theirs = tok.apply_chat_template([{'role': 'user', 'content': p}], add_generation_prompt=True)['input_ids']
        assert theirs == ours, f"prompt {p!r}: TRL's token ids {theirs} differ from ours {ours}"
    results = dict(trl=trl.__version__, transformers=transformers.__version__, logit_diff=logit_diff,
                   prompts_checked=len(ids), eos=tok.eos_token_id, pad=tok.pad_token_id)
    for loss in LOSS_TYPES:
        trainer = recording_trainer(loss, os.path.join(out, f'trl_check_{loss}'), 1, 1, record_logps=True)
        trainer.train()
        check_step_prompts(trainer, ids)
        log = next(entry for entry in trainer.recorder.logs if 'grad_norm' in entry)
        results[loss] = dict(trainer.rollouts[0], rewards=trainer.rewards[0], loss=trainer.losses[0],
                             grad_norm=log['grad_norm'], entropy=log['entropy'], trained=trainer.logps[0])
    with open(paths['trl_check.json'], 'w') as f:
        json.dump(results, f)


def trl_train(round_):
    """GRPOTrainer for `steps` steps: per-step times and the rollout part of each, completion lengths."""
    import trl
    folder = run_dir('trl', round_)
    with open(paths['ids.json']) as f:
        ids = json.load(f)
    trainer = recording_trainer(loss_type, folder, steps, steps)
    trainer.train()
    checked = check_step_prompts(trainer, ids)
    t = trainer.recorder.times
    result = dict(trl=trl.__version__, step_s=[b - a for a, b in zip(t, t[1:])], rollout_s=trainer.rollout_s,
                  sampling_s=trainer.sampling_s, prompts_checked=checked,
                  mean_length=[statistics.mean(map(len, r['completion_ids'])) for r in trainer.rollouts],
                  reward=[statistics.mean(r) for r in trainer.rewards], losses=trainer.losses)
    with open(os.path.join(folder, 'result.json'), 'w') as f:
        json.dump(result, f, indent=1)


# -----------------------------------------------------------------------------
# our side, and the benchmark

def worker(worker_mode, *extra):
    """This file in trl_python's environment, in a worker mode; exits on failure with its output."""
    args = [trl_python, os.path.abspath(__file__), f'--mode={worker_mode}', *extra,
            *(f'--{k}={v}' for k, v in config.items() if k not in ('ROOT', 'mode', 'trl_python', 'worker_round'))]
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True)


def check(proc, name):
    if proc.returncode != 0:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def run_ours(round_):
    """train_rl.py in a fresh process, every setting pinned whatever its defaults: per-step times from its log."""
    folder = run_dir('ours', round_)
    shutil.rmtree(folder, ignore_errors=True)
    check(subprocess.run([
        sys.executable, 'train_rl.py', f"--init_from={paths['init.pt']}", f'--out_dir={folder}', '--resume=False',
        f"--data_dir={paths['chars']}", f"--rl_data={paths['prompts']}", f'--reward={REWARD}:digits',
        f'--prompts_per_step={prompts_per_step}', f'--num_generations={num_generations}',
        f'--max_prompt_length={max_prompt_length}', f'--max_new_tokens={max_new_tokens}',
        f'--temperature={temperature}', '--top_k=0', '--top_p=1.0', f'--loss_type={loss_type}',
        '--scale_rewards=group', '--beta=0.0', f'--epsilon={EPSILON}', f'--epsilon_high={EPSILON}',
        '--num_iterations=1', '--mask_truncated_completions=False', '--gradient_accumulation_steps=1',
        '--use_lora=False', '--dropout=0.0', f'--learning_rate={learning_rate}', f'--max_iters={steps}',
        '--lr_schedule=constant', '--warmup_iters=0', '--weight_decay=0.0', '--beta1=0.9', '--beta2=0.99',
        '--grad_clip=1.0', '--device=cpu', '--dtype=float32', '--compile=False', '--num_threads=0',
        f'--seed={seed}', '--tensorboard=False', '--log_interval=1', f'--eval_interval={steps}',
        # the evals at the start and end (outside the timed steps): as small as they go
        '--eval_prompts=1', '--pass_k=1', '--exact_match_examples=0'],
        cwd=ROOT, env=ENV, capture_output=True, text=True), f'train_rl.py (round {round_ + 1})')
    with open(os.path.join(folder, 'log.jsonl')) as f:
        train = [e for e in map(json.loads, f) if 'time/generation_s' in e]
    return dict(step_s=[e['time/generation_s'] + e['time/training_s'] for e in train],
                rollout_s=[e['time/generation_s'] for e in train],
                mean_length=[e['completions/mean_length'] for e in train], reward=[e['reward'] for e in train],
                losses=[e['loss'] for e in train])


def run_trl(round_):
    shutil.rmtree(run_dir('trl', round_), ignore_errors=True)
    check(worker('trl_train', f'--worker_round={round_}'), f'the TRL run (round {round_ + 1})')
    with open(os.path.join(run_dir('trl', round_), 'result.json')) as f:
        return json.load(f)


def timed(result):
    """steps/s and the mean seconds per step of rollouts and of training, over the steps after warmup_steps."""
    step_s, rollout_s = result['step_s'][warmup_steps:], result['rollout_s'][warmup_steps:]
    return dict(steps_per_sec=len(step_s) / sum(step_s), rollout_s=statistics.mean(rollout_s),
                training_s=statistics.mean(s - r for s, r in zip(step_s, rollout_s)),
                sampling_s=statistics.mean(result['sampling_s'][warmup_steps:]) if 'sampling_s' in result else None,
                mean_length=statistics.mean(result['mean_length'][warmup_steps:]))


def prepare_everything():
    """The prompts, the char tokenizer, our prompt ids, the random model as init.pt, its Llama export and a
    logits check batch."""
    from data import prepare
    from lm.chat_data import load_prompt_split
    from lm.tokenizer import ChatTokenizer, load_tokenizer
    from model import GPT, GPTConfig
    from run.checkpoint import save_checkpoint
    from tasks.number_tasks import prepare_number_tasks

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    prepare_number_tasks(paths['prompts'], seed=1)
    text = ''
    for split in ('train', 'val', 'test'):
        with open(os.path.join(paths['prompts'], f'{split}.jsonl')) as f:
            text += ''.join(r['prompt'] + r['response'] for r in map(json.loads, f))
    corpus = os.path.join(out, 'chars.txt')
    with open(corpus, 'w') as f:
        f.write(text)
    tokenizer = ChatTokenizer(load_tokenizer(prepare(corpus, paths['chars'], 'char')))
    prompts = load_prompt_split(os.path.join(paths['prompts'], 'train.jsonl'), tokenizer, max_prompt_length)
    assert len(prompts) == len(read_prompts()), "some prompts are longer than max_prompt_length; raise it"
    with open(paths['ids.json'], 'w') as f:
        json.dump([ids for ids, _ in prompts], f)

    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=block_size, vocab_size=tokenizer.vocab_size, n_layer=n_layer, n_head=n_head,
                          n_embd=n_embd, dropout=0.0, bias=False, pos_emb='rope', norm='rmsnorm', mlp='swiglu'))
    save_checkpoint(paths['init.pt'], dict(kind='gpt', model=model.state_dict(), model_args=model.model_args(),
                                           config={'training_type': 'sft'}, tokenizer=tokenizer.identity(),
                                           data_dir=os.path.abspath(paths['chars'])))
    check(subprocess.run([sys.executable, 'export.py', paths['init.pt'], paths['hf_init']], cwd=ROOT,
                         capture_output=True, text=True), 'export.py')
    x = torch.tensor([ids + [0] * (max_prompt_length - len(ids)) for ids, _ in prompts[:16]])
    with torch.no_grad():
        save_checkpoint(paths['check.pt'], dict(x=x, logits=model.eval()(x)[0]))
    return model, tokenizer


def our_step1(model, tokenizer, theirs, loss):
    """Our loss, grad norm, entropy, per-token log-probs and rewards on TRL's step-1 rollouts, as train_rl.py's
    train_step computes them (lm/rl.py), from the starting weights; and the float32 bound on the loss."""
    import torch.nn.functional as F
    from lm.rewards import load_reward
    from lm.rl import clipped_token_loss, completion_batches, group_advantages, normalized_loss, token_entropy
    digits = load_reward(f'{REWARD}:digits').fn
    model.load_state_dict(torch.load(paths['init.pt'], weights_only=True)['model'])
    model.train()
    model.zero_grad(set_to_none=True)
    completions = theirs['completion_ids']
    text = [tokenizer.decode(c[:-1] if c and c[-1] == tokenizer.eos_id else c) for c in completions]
    rewards = torch.tensor([float(digits(prompt=None, completion=t, row=None)) for t in text])
    advantages = group_advantages(rewards, num_generations, 'group')
    n = len(completions)
    batch = completion_batches(list(zip(theirs['prompt_ids'], completions)), [True] * n, n)[0]
    logits, _ = model(batch.x, logits_at=(batch.rows, batch.cols), positions=batch.positions,
                      mask=batch.mask)
    logits = logits.float() / temperature
    logps = -F.cross_entropy(logits, batch.targets, reduction='none')
    token_advantages = advantages[batch.first + batch.owners]
    token_loss, _ = clipped_token_loss(logps - logps.detach(), token_advantages, EPSILON, EPSILON)
    totals = (n, int(batch.lengths.sum()), max_new_tokens)
    value = normalized_loss(token_loss, batch.owners, batch.lengths, loss, totals)
    value.backward()
    entropy = token_entropy(logits.detach()).mean().item()
    grad_norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])).item()
    # each side's rounding: n summed elements (TRL sums the padded (B, C) grid), the advantages'
    summed = n * max(map(len, completions))
    magnitude = normalized_loss(token_loss.detach().abs(), batch.owners, batch.lengths, loss, totals).item()
    bound = 2 * (summed + 2 * num_generations + 8) * U * magnitude
    # the per-token log-probs of the sequences in the (shuffled) order TRL trained on them
    trained = theirs['trained']
    n = len(trained['completion_ids'])
    batch = completion_batches(list(zip(trained['prompt_ids'], trained['completion_ids'])), [True] * n, n)[0]
    with torch.no_grad():
        logits, _ = model(batch.x, logits_at=(batch.rows, batch.cols), positions=batch.positions,
                         mask=batch.mask)
    trained_logps = -F.cross_entropy(logits.float() / temperature, batch.targets, reduction='none')
    return dict(rewards=rewards.tolist(), advantages=advantages.tolist(), loss=value.item(), grad_norm=grad_norm,
                entropy=entropy, logps=trained_logps.tolist(), loss_bound=bound)


def compare_step1(model, tokenizer):
    """Per loss type: our step-1 numbers on TRL's rollouts against TRL's, and whether each is within tolerance."""
    with open(paths['trl_check.json']) as f:
        trl_check = json.load(f)
    rows = {}
    for loss in LOSS_TYPES:
        theirs = trl_check[loss]
        ours = our_step1(model, tokenizer, theirs, loss)
        their_logps = [x for row in theirs['trained']['logps'] for x in row]
        rows[loss] = dict(
            ours=ours['loss'], trl=theirs['loss'], loss_diff=abs(ours['loss'] - theirs['loss']),
            loss_bound=ours['loss_bound'], rewards_equal=ours['rewards'] == [float(r) for r in theirs['rewards']],
            advantage_diff=max(abs(a - b) for a, b in zip(ours['advantages'], theirs['advantages'])),
            logp_diff=max(abs(a - b) for a, b in zip(ours['logps'], their_logps, strict=True)),
            grad_norm_ours=ours['grad_norm'], grad_norm_trl=theirs['grad_norm'],
            grad_norm_rel=abs(ours['grad_norm'] - theirs['grad_norm']) / theirs['grad_norm'],
            entropy_ours=ours['entropy'], entropy_trl=theirs['entropy'],
            completions=len(theirs['completion_ids']), tokens=len(their_logps),
            stopped=sum(bool(c) and c[-1] == tokenizer.eos_id for c in theirs['completion_ids']))
        r = rows[loss]
        r['ok'] = (r['rewards_equal'] and r['loss_diff'] <= r['loss_bound'] and r['logp_diff'] <= 2 * logit_tolerance
                   and r['grad_norm_rel'] <= grad_tolerance)
    return trl_check, rows


def our_version():
    """The commit, and with uncommitted changes the sha256 of train_rl.py as it ran."""
    git = lambda *args: subprocess.run(['git', *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    try:
        head, dirty = git('rev-parse', '--short', 'HEAD'), git('status', '--porcelain', 'train_rl.py', 'lm/rl.py',
                                                               'lm/generate.py', 'model.py', 'lm/chat_data.py')
    except OSError:
        head, dirty = 'unknown', 'unknown'
    with open(os.path.join(ROOT, 'train_rl.py'), 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:8]
    return head + (f' + changes (train_rl.py {digest})' if dirty else '')


def main():
    if not trl_python or not os.path.exists(trl_python):
        raise UserError(f"trl_python={trl_python!r}: pass the Python of an environment with trl installed, e.g. "
                        f"--trl_python=/work/trlvenv/bin/python (how to make one: the docstring, `--help`).")
    if warmup_steps >= steps:
        raise UserError(f"warmup_steps={warmup_steps} leaves none of the {steps} steps to time; lower it.")
    t0 = time.time()
    version = our_version()  # before the runs: other edits while they run would change it
    model, tokenizer = prepare_everything()
    if (steps + 1) * prompts_per_step > len(read_prompts()):
        raise UserError("steps * prompts_per_step is more than an epoch of prompts, after which the two samplers' "
                        "orders differ; lower steps.")
    check(worker('trl_check'), 'the TRL check')
    trl_check, step1 = compare_step1(model, tokenizer)
    print(f"data, models and the step-1 check ready ({time.time() - t0:.0f} s): Llama logits within "
          f"{trl_check['logit_diff']:.1e} of ours, TRL's token ids equal ours for all {trl_check['prompts_checked']:,} "
          f"prompts", flush=True)

    results = {'ours': [], 'trl': []}
    for round_ in range(rounds):
        for name in (['ours', 'trl'] if round_ % 2 == 0 else ['trl', 'ours']):
            results[name].append(run_ours(round_) if name == 'ours' else run_trl(round_))
            r = timed(results[name][-1])
            print(f"round {round_ + 1}: {name}: {r['steps_per_sec']:.3f} steps/s (rollouts {r['rollout_s']:.2f} s, "
                  f"training {r['training_s']:.2f} s per step), mean length {r['mean_length']:.1f}", flush=True)
    per_round = {name: [timed(r) for r in runs] for name, runs in results.items()}
    median = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0] if rows[0][k] is not None}
              for name, rows in per_round.items()}
    ratio = median['ours']['steps_per_sec'] / median['trl']['steps_per_sec']
    round_ratios = [o['steps_per_sec'] / t['steps_per_sec'] for o, t in zip(per_round['ours'], per_round['trl'])]

    n_params = sum(p.numel() for p in model.parameters())
    print(f"\nCPU, {threads} threads each (OMP_NUM_THREADS), torch {torch.__version__}; "
          f"{n_params / 1e6:.2f}M-parameter GPT as Llama ({n_layer}x{n_embd}, vocab {model.config.vocab_size}, "
          f"char-level); {prompts_per_step} prompts x G={num_generations}, max_new_tokens {max_new_tokens}, "
          f"temperature {temperature}, loss {loss_type}, beta 0, one iteration; {steps} steps, the first "
          f"{warmup_steps} not timed; medians of {rounds} rounds; ours: {version}; trl {trl_check['trl']}, "
          f"transformers {trl_check['transformers']}")
    print("| implementation | steps/s | vs TRL | rollouts s/step | (of which sampling) | training s/step "
          "| mean completion length |")
    print("|---|---|---|---|---|---|---|")
    for name, label in (('trl', 'TRL GRPOTrainer'), ('ours', 'train_rl.py')):
        m = median[name]
        sampling = f"{m['sampling_s']:.3f}" if 'sampling_s' in m else '-'  # timed on TRL's side only
        print(f"| {label} | {m['steps_per_sec']:.3f} | {m['steps_per_sec'] / median['trl']['steps_per_sec']:.2f}x "
              f"| {m['rollout_s']:.3f} | {sampling} | {m['training_s']:.3f} | {m['mean_length']:.1f} |")
    print("\nsteps/s per round: " + "; ".join(f"{name} {[round(r['steps_per_sec'], 3) for r in rows]}"
                                           for name, rows in per_round.items())
          + f"; ratio per round {[round(x, 2) for x in round_ratios]}, median "
            f"{statistics.median(round_ratios):.2f}x")
    print(f"\nstep-1 loss on TRL's own rollouts ({prompts_per_step} x {num_generations} completions from the starting "
          f"model), ours computed by lm/rl.py as train_rl.py does:")
    print("| loss_type | TRL loss | our loss | difference | float32 bound | rewards equal | max advantage diff "
          "| max log-prob diff | grad norm TRL / ours (rel. diff) | entropy TRL / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for loss, r in step1.items():
        print(f"| {loss} | {r['trl']:.9f} | {r['ours']:.9f} | {r['loss_diff']:.1e} | {r['loss_bound']:.1e} "
              f"| {r['rewards_equal']} | {r['advantage_diff']:.1e} | {r['logp_diff']:.1e} "
              f"| {r['grad_norm_trl']:.6f} / {r['grad_norm_ours']:.6f} ({r['grad_norm_rel']:.1e}) "
              f"| {r['entropy_trl']:.5f} / {r['entropy_ours']:.5f} |")
    first = next(iter(step1.values()))
    print(f"({first['completions']} completions, {first['tokens']} completion tokens, {first['stopped']} ended by "
          f"<|end|>, the rest cut at max_new_tokens)")
    with open(os.path.join(out, 'results.json'), 'w') as f:
        json.dump(dict(config=config, version=version, trl_version=trl_check['trl'],
                       transformers_version=trl_check['transformers'], logit_diff=trl_check['logit_diff'],
                       results=results, per_round=per_round, median=median, ratio=ratio, round_ratios=round_ratios,
                       step1=step1, wall_s=time.time() - t0), f, indent=1)
    print(f"total {time.time() - t0:.0f} s")
    if not all(r['ok'] for r in step1.values()):
        sys.exit("the two implementations' step-1 numbers differ beyond their tolerances (the table above)")


ENV = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED='1',
           TOKENIZERS_PARALLELISM='false', HF_HUB_OFFLINE='1')
if mode == 'all':
    main()
elif mode == 'trl_check':
    trl_check()
elif mode == 'trl_train':
    trl_train(worker_round)
else:
    raise UserError(f"mode={mode!r}: use 'all' (the benchmark) or, as a worker, 'trl_check' or 'trl_train'.")
