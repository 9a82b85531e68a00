"""Online RL (train_rl.py, lm/rl.py, lm/rewards.py): every loss type and advantage scaling against its formula
written out in float64 loops, the k3 KL, clipping with epsilon_high, the plain policy gradient at ratio 1, one big
batch = gradient accumulation, masked truncated completions, the number-task verifier, reward-function errors,
and the script end to end (metrics in log.jsonl, bit-exact resume)."""

import json
import math
import os
import re
import shutil
import signal
import warnings

import pytest
import torch

from conftest import (assert_logged_to_wandb, assert_user_error, hf_fixture, kill_and_relaunch, load, read_log, run,
                      real_torchrun, script_definitions, sft, sigterm_after_steps, torchrun, wandb_env, write_jsonl)
from configurator import UserError
from lm.chat_data import rl_prompt, rl_reference
from lm.metrics import exact_match
from lm.rewards import (Reward, check_rows, final_answer, load_reward, load_rewards, number_task_reward,
                        reward_values)
from lm.tokenizer import CharTokenizer, ChatTokenizer
from lm.rl import (clipped_token_loss, completion_batches, group_advantages, k3_kl, normalized_loss, sequence_log_ratio,
                   token_entropy)
from model import GPT, GPTConfig
from tasks.number_tasks import prepare_number_tasks


# -- advantages and losses against hand-written float64 loops ------------------------------------------------

def hand_advantages(rewards, G, scale_rewards):
    """(r - group mean) / (std + 1e-4), std with Bessel's correction, written out."""
    n = len(rewards)
    out = []
    batch_mean = sum(rewards) / n
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in rewards) / (n - 1))
    for i, r in enumerate(rewards):
        group = rewards[i // G * G:(i // G + 1) * G]
        mean = sum(group) / G
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (G - 1))
        if scale_rewards == 'none':
            out.append(r - mean)
        else:
            out.append((r - mean) / ((std if scale_rewards == 'group' else batch_std) + 1e-4))
    return out


def hand_loss(logps, old, ref, adv, lengths, loss_type, eps, eps_high, beta, max_new_tokens):
    """The batch loss of sequences of per-token lists (logps, old, ref), one advantage per sequence, written out."""
    per_seq, tokens = [], 0
    for lp, ol, rf, a in zip(logps, old, ref, adv):
        terms = []
        for x, o, q in zip(lp, ol, rf):
            ratio = math.exp(x - o)
            clipped = min(max(ratio, 1 - eps), 1 + eps_high)
            kl = math.exp(q - x) - (q - x) - 1
            terms.append(-min(ratio * a, clipped * a) + beta * kl)
        per_seq.append(terms)
        tokens += len(terms)
    S = len(logps)
    if loss_type == 'grpo':
        return sum(sum(t) / max(len(t), 1) for t in per_seq) / S
    if loss_type == 'dapo':
        return sum(sum(t) for t in per_seq) / tokens
    return sum(sum(t) for t in per_seq) / (S * max_new_tokens)


def random_batch(seed, n_seq=6, max_len=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n_seq,), generator=g)
    owners = torch.repeat_interleave(torch.arange(n_seq), lengths)
    N = len(owners)
    logps = -torch.rand(N, generator=g, dtype=torch.float64) * 3
    old = logps + 0.4 * torch.randn(N, generator=g, dtype=torch.float64)  # ratios well outside [0.8, 1.28]
    ref = logps + 0.5 * torch.randn(N, generator=g, dtype=torch.float64)
    rewards = torch.randint(0, 3, (n_seq,), generator=g).double()
    return lengths, owners, logps, old, ref, rewards


def split(values, lengths):
    return [t.tolist() for t in values.split(lengths.tolist())]


def batch_loss(logps, old, ref, owners, lengths, advantages, loss_type, beta, eps=0.2, eps_high=0.28, max_new=5):
    token_loss, clipped = clipped_token_loss(logps - old, advantages[owners], eps, eps_high)
    token_loss = token_loss + beta * k3_kl(logps, ref)
    totals = (len(lengths), int(lengths.sum()), max_new)
    return normalized_loss(token_loss, owners, lengths, loss_type, totals), clipped


@pytest.mark.comparison
@pytest.mark.parametrize('scale_rewards', ['group', 'batch', 'none'])
def test_group_advantages_match_the_formula(scale_rewards):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5, 3.0, 0.0, 1.0], dtype=torch.float64)
    got = group_advantages(rewards, 4, scale_rewards)
    assert got.tolist() == pytest.approx(hand_advantages(rewards.tolist(), 4, scale_rewards), abs=1e-12)
    assert got[4:8].abs().max() == 0  # a group of equal rewards carries no signal, and no NaN


@pytest.mark.comparison
@pytest.mark.parametrize('loss_type', ['grpo', 'dapo', 'dr_grpo'])
@pytest.mark.parametrize('scale_rewards', ['group', 'batch', 'none'])
@pytest.mark.parametrize('beta', [0.0, 0.1])
def test_loss_matches_the_formula(loss_type, scale_rewards, beta):
    """Clipped ratio (epsilon 0.2, epsilon_high 0.28), k3 KL and each normalisation: equal to the float64 loops."""
    lengths, owners, logps, old, ref, rewards = random_batch(0)
    advantages = group_advantages(rewards, 3, scale_rewards)
    loss, clipped = batch_loss(logps, old, ref, owners, lengths, advantages, loss_type, beta)
    expected = hand_loss(split(logps, lengths), split(old, lengths), split(ref, lengths), advantages.tolist(),
                         lengths, loss_type, 0.2, 0.28, beta, 5)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert 0 < clipped.sum() < len(clipped)  # some tokens clipped, some not: both branches tested


def test_clipping_bounds_are_epsilon_and_epsilon_high():
    """A positive advantage stops gaining above 1 + epsilon_high, a negative one below 1 - epsilon; the clipped
    tokens have no gradient."""
    ratio = torch.tensor([0.5, 0.9, 1.2, 1.5, 0.5, 0.9, 1.2, 1.5], dtype=torch.float64)
    advantages = torch.tensor([1.0] * 4 + [-1.0] * 4, dtype=torch.float64)
    logps = ratio.log().requires_grad_()
    loss, clipped = clipped_token_loss(logps, advantages, 0.2, 0.3)
    assert loss.tolist() == pytest.approx([-0.5, -0.9, -1.2, -1.3, 0.8, 0.9, 1.2, 1.5], abs=1e-12)
    assert clipped.tolist() == [False, False, False, True, True, False, False, False]
    loss.sum().backward()
    assert [g == 0 for g in logps.grad.tolist()] == clipped.tolist()


def test_k3_kl_is_its_formula_and_zero_at_the_reference():
    logps = torch.tensor([-1.0, -2.0, -0.1], dtype=torch.float64)
    ref = torch.tensor([-1.5, -2.0, -3.0], dtype=torch.float64)
    expected = [math.exp(q - p) - (q - p) - 1 for p, q in zip(logps.tolist(), ref.tolist())]
    assert k3_kl(logps, ref).tolist() == pytest.approx(expected, abs=1e-15)
    assert k3_kl(logps, ref)[1] == 0 and (k3_kl(logps, ref) >= 0).all()


def test_one_iteration_gradient_is_the_plain_policy_gradient():
    """With old = logps.detach() the ratio is 1 and the gradient of the loss is that of -sum A logp / normaliser."""
    lengths, owners, logps, _, ref, rewards = random_batch(1)
    advantages = group_advantages(rewards, 3, 'group')
    for loss_type in ('grpo', 'dapo', 'dr_grpo'):
        x = logps.clone().requires_grad_()
        loss, clipped = batch_loss(x, x.detach(), ref, owners, lengths, advantages, loss_type, 0.0)
        loss.backward()
        y = logps.clone().requires_grad_()
        weights = {'grpo': 1 / (lengths[owners].double() * len(lengths)), 'dapo': 1 / lengths.sum().double(),
                   'dr_grpo': 1 / (len(lengths) * 5)}[loss_type]
        (-(advantages[owners] * y * weights).sum()).backward()
        assert torch.allclose(x.grad, y.grad, rtol=1e-12, atol=1e-15) and not clipped.any(), loss_type


@pytest.mark.comparison
@pytest.mark.parametrize('loss_type', ['grpo', 'dapo', 'dr_grpo'])
def test_accumulation_shares_add_up_to_the_big_batch(loss_type):
    """The micro-batches' losses (each normalised by the whole batch's totals) sum to the big batch's loss, and
    their gradients to its gradient: float64, the same terms added in another order (~1e-15 relative)."""
    lengths, owners, logps, old, ref, rewards = random_batch(2, n_seq=8)
    lengths[3] = 0  # a masked truncated completion: no tokens, still one of the S sequences
    owners = torch.repeat_interleave(torch.arange(8), lengths)
    N = len(owners)
    logps, old, ref = logps[:N], old[:N], ref[:N]
    advantages = group_advantages(rewards, 4, 'group')
    totals = (8, int(lengths.sum()), 5)

    def loss_of(x, seqs):
        keep = (owners >= seqs[0]) & (owners < seqs[-1] + 1)
        token_loss, _ = clipped_token_loss(x[keep] - old[keep], advantages[owners[keep]], 0.2, 0.28)
        token_loss = token_loss + 0.1 * k3_kl(x[keep], ref[keep])
        return normalized_loss(token_loss, owners[keep] - seqs[0], lengths[seqs], loss_type, totals)

    big = logps.clone().requires_grad_()
    whole = loss_of(big, torch.arange(8))
    whole.backward()
    acc = logps.clone().requires_grad_()
    total = 0.0
    for part in torch.arange(8).split(2):
        share = loss_of(acc, part)
        share.backward()
        total += share.item()
    assert total == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(acc.grad, big.grad, rtol=1e-12, atol=1e-15)


def test_masked_truncated_sequence_adds_nothing_but_counts_in_grpo_and_dr_grpo():
    """A sequence with no scored tokens (masked: cut at max_new_tokens) adds 0 to the sum; grpo and dr_grpo still
    divide by all S sequences (as TRL does), dapo by the tokens left."""
    token_loss = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64)
    owners, lengths = torch.tensor([0, 0, 2]), torch.tensor([2, 0, 1])
    assert normalized_loss(token_loss, owners, lengths, 'grpo', (3, 3, 4)).item() == pytest.approx((2 + 2) / 3)
    assert normalized_loss(token_loss, owners, lengths, 'dapo', (3, 3, 4)).item() == pytest.approx(6 / 3)
    assert normalized_loss(token_loss, owners, lengths, 'dr_grpo', (3, 3, 4)).item() == pytest.approx(6 / 12)


def test_token_entropy():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert token_entropy(logits).tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


# -- rewards and prompts ---------------------------------------------------------------------------------------

def test_number_task_verifier():
    row = {'response': '8+6=14, 4+2+1=7, so 74'}
    assert final_answer(row['response']) == '74'
    assert number_task_reward([], '8+6=14, 4+2+1=7, so 74', row) == 1.0
    assert number_task_reward([], ' 74 ', row) == 1.0  # the final answer is what counts
    assert number_task_reward([], '8+6=14, 4+2=6, so 64', row) == 0.0
    assert number_task_reward([], '8+6=14, 4+2+1=8, so 84', row, format_weight=0.1) == pytest.approx(0.1)
    assert number_task_reward([], '1+1=2, 1+1+1=3, so 74', row, format_weight=0.1) == pytest.approx(1.1)
    assert number_task_reward([], '74', {'response': '75'}, format_weight=0.5) == 0.5
    # the whole answer: the working must be the reference's too (a carry added or dropped earns nothing)
    assert number_task_reward([], ' 8+6=14,  4+2+1=7, so 74', row, whole=True) == 1.0
    assert number_task_reward([], '1+1=2, 1+1+1=3, so 74', row, whole=True) == 0.0
    assert number_task_reward([], '74', row, format_weight=0.1, whole=True) == 0.0
    assert number_task_reward([], '5', {'response': '5'}, whole=True) == 1.0
    exact, name = load_reward('number_tasks_exact', format_weight=0.1)[:2]  # train_rl.py's --reward=number_tasks_exact
    assert name == 'number_tasks_exact' and exact(prompt=[], completion='74', row=row) == 0.0
    assert exact(prompt=[], completion=row['response'], row=row) == pytest.approx(1.1)


def test_number_task_reward_judges_answers_as_exact_match_does():
    """The verifier and eval.py's exact match agree on every answer: the whole answer (number_tasks_exact), and the
    final answer after ', so ' (number_tasks), however it is spaced (tabs, newlines, no-break spaces) or cased."""
    references = ['8+6=14, 4+2+1=7, so 74', '74', 'The answer is 5.', 'a b']
    answers = references + [' 8+6=14,\t4+2+1=7, so 74\n', '8+6=14, 4+2+1=7, so  74 ', '\u00a074', '74.', 'the answer is 5.',
                            'The  answer\nis 5.', 'a\u2003b', 'ab', '', '7 4', 'so 74', '1+1=2, so 74']
    for reference in references:
        for answer in answers:
            whole = number_task_reward([], answer, {'response': reference}, whole=True)
            assert whole == exact_match([answer], [reference]), (answer, reference)
            final = number_task_reward([], answer, {'response': reference})
            tails = [text.rpartition(', so ')[2] for text in (answer, reference)]
            assert final == exact_match(tails[:1], tails[1:]), (answer, reference)


def test_rl_prompt_formats():
    user = [{'role': 'user', 'content': 'What is 1+1?'}]
    assert rl_prompt({'prompt': 'What is 1+1?', 'response': '2'}) == user
    assert rl_prompt({'prompt': user}) == user
    assert rl_prompt({'messages': user + [{'role': 'assistant', 'content': '2'}]}) == user
    assert rl_prompt({'conversations': [{'from': 'human', 'value': 'What is 1+1?'}, {'from': 'gpt', 'value': '2'}]}) == user
    for bad in ({'response': '2'}, {'prompt': 3}, {'messages': [{'role': 'assistant', 'content': '2'}]},
                {'conversations': [{'from': 'gpt', 'value': '2'}]}):
        with pytest.raises(ValueError):
            rl_prompt(bad)


# -- the script end to end -------------------------------------------------------------------------------------

RL = ['--device=cpu', '--dtype=float32', '--tensorboard=False', '--prompts_per_step=4', '--num_generations=4',
      '--max_prompt_length=36', '--max_new_tokens=12', '--eval_prompts=4', '--pass_k=2', '--exact_match_examples=2',
      '--log_interval=1', '--learning_rate=1e-3']
TRAIN_METRICS = ('loss', 'reward', 'reward_std', 'accuracy', 'frac_reward_zero_std', 'completions/mean_length',
                 'completions/clipped_ratio', 'clip_ratio/region_mean', 'clip_ratio/low_mean', 'clip_ratio/high_mean',
                 'entropy', 'time/generation_s', 'time/training_s', 'time/merge_s',
                 'generation/tokens_per_sec', 'grad_norm')


@pytest.fixture(scope='module')
def rl_env(sft_env, tmp_path_factory):
    """sft_env's char corpus, a tiny SFT checkpoint trained from its base model, and small number-task prompts."""
    root = tmp_path_factory.mktemp('rl')
    sft(sft_env, root / 'sft', '--max_iters=3', '--eval_interval=3', '--lr_decay_iters=3', '--exact_match_examples=0')
    prompts = prepare_number_tasks(str(root / 'prompts'), n_train=40, n_eval=8)
    # rewards a tiny model earns from the start (it answers no number task right): an arbitrary function of
    # the characters, and the share of sevens, which a working policy gradient raises
    (root / 'rewards.py').write_text("def chars(prompt, completion, row):\n    return sum(map(ord, completion)) % 3\n\n"
                                     "def sevens(prompt, completion, row):\n"
                                     "    return completion.count('7') / max(len(completion), 1)\n")
    return dict(sft_env, sft=str(root / 'sft' / 'ckpt.pt'), prompts=prompts, rewards=str(root / 'rewards.py'))


def rl_args(env, out_dir, *extra, ranks=1, faults=None):
    """train_rl.py's command line; faults: injected by tests/faults.py, e.g. 'oom@1'."""
    return [*(torchrun(ranks) if ranks > 1 else []), *(['tests/faults.py', faults] if faults else []), 'train_rl.py',
            f'--out_dir={out_dir}', f'--data_dir={env["data_dir"]}', f'--rl_data={env["prompts"]}',
            f'--init_from={env["sft"]}', *RL, *extra]


def rl(env, out_dir, *extra, ranks=1, faults=None, **kw):
    return run(rl_args(env, out_dir, *extra, ranks=ranks, faults=faults), **kw)


def train_events(out_dir):
    return {e['step']: e for e in read_log(out_dir) if 'reward' in e}


@pytest.mark.slow
def test_run_logs_metrics_and_resumes_bit_exactly(tmp_path, rl_env):
    """2 steps straight to 4 = 2 steps then resumed to 4 (sampling, two iterations per batch with the PPO clip,
    a KL penalty against the frozen reference, accumulation): every logged metric but the timings, the weights and
    the optimizer state equal exactly; the metrics are all in log.jsonl, with evals at 0, 2, 4. The resumed run logs
    to W&B too (a stand-in wandb package): all of log.jsonl's numbers, in the one W&B run of its two launches."""
    common = ['--num_iterations=2', '--beta=0.05', '--gradient_accumulation_steps=2', '--eval_interval=2',
              '--loss_type=grpo', f'--reward={rl_env["rewards"]}:chars', '--correct_reward=2']
    straight, split_run = tmp_path / 'straight', tmp_path / 'split'
    rl(rl_env, straight, '--max_iters=4', *common)
    rl(rl_env, split_run, '--max_iters=2', *common, '--wandb_log=True', env_extra=wandb_env())
    p = rl(rl_env, split_run, '--max_iters=4', '--init_from=resume', *common, '--wandb_log=True',  # nanoGPT's: the
           env_extra=wandb_env())  # run's own origin
    assert 'resuming' in p.stdout + p.stderr
    a, b = train_events(straight), train_events(split_run)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert all(math.isfinite(a[step][k]) for k in TRAIN_METRICS + ('kl',)), a[step]
        for k in TRAIN_METRICS + ('kl',):
            if not k.startswith(('time/', 'generation/')):
                assert a[step][k] == b[step][k], (step, k)
    assert 0 < a[1]['accuracy'] < 1 and a[1]['completions/mean_length'] > 0 and a[1]['reward_std'] > 0
    # loss-side metrics: the two iterations' mean (as TRL); the 2nd's ratios are off 1, some clipped
    assert a[1]['clip_ratio/region_mean'] > 0 and a[1]['kl'] > 0 and a[1]['entropy'] > 0
    evals = [e for e in read_log(straight) if 'eval/pass@1' in e]
    assert [e['step'] for e in evals] == [0, 2, 4] and all(0 <= e['eval/pass@2'] <= 1 for e in evals)
    assert [e['step'] for e in read_log(straight) if 'eval/exact_match' in e] == [0, 4]
    ca, cb = load(straight / 'ckpt.pt'), load(split_run / 'ckpt.pt')
    assert ca['iter_num'] == cb['iter_num'] == 4
    assert all(torch.equal(ca['model'][k], cb['model'][k]) for k in ca['model'])
    # the checkpoint's config is what the user passed; what the run derived is stored beside it
    assert (ca['config']['init_from'], cb['config']['init_from']) == (rl_env['sft'], 'resume')
    assert ca['run']['init_from'] == cb['run']['init_from'] == os.path.abspath(rl_env['sft'])
    assert ca['config']['device'] == 'cpu' and ca['config']['data_dir'] == rl_env['data_dir']
    assert ca['data_dir'] == os.path.abspath(rl_env['data_dir'])
    # best_val_loss holds -pass@1 (lower is better), as RL checkpoints always have: the best of the
    # evals after step 0's
    assert ca['best_val_loss'] == cb['best_val_loss'] == -max(e['eval/pass@1'] for e in evals[1:])
    start = load(rl_env['sft'])['model']
    assert max((ca['model'][k] - start[k]).abs().max().item() for k in start) > 0  # it trained
    assert_logged_to_wandb(split_run, launches=2)


@pytest.mark.slow
@pytest.mark.comparison
@pytest.mark.parametrize('loss_type', ['dapo'])  # its global token count; all three: test_accumulation_shares_...
def test_gradient_accumulation_matches_one_big_batch(tmp_path, rl_env, loss_type):
    """The same rollouts (generation does not depend on the split) trained as 1 micro-batch of 16 completions or
    4 of 4: the same loss and gradient norm at the first step, each micro-batch's loss normalised by the whole
    batch's totals. rel=1e-5: float32 sums of the same ~150 terms in other orders and other matmul shapes move by
    ~n * 2^-24 of their size (~1e-5 at most); a wrong normaliser is off by a factor of 2 or more."""
    common = ['--max_iters=1', '--eval_prompts=1', '--exact_match_examples=0', f'--loss_type={loss_type}',
              f'--reward={rl_env["rewards"]}:chars', '--scale_rewards=batch', '--beta=0.1',
              '--mask_truncated_completions=True']
    rl(rl_env, tmp_path / 'big', *common)
    rl(rl_env, tmp_path / 'acc', *common, '--gradient_accumulation_steps=4')
    big, acc = train_events(tmp_path / 'big')[1], train_events(tmp_path / 'acc')[1]
    assert big['reward'] == acc['reward'] and big['completions/mean_length'] == acc['completions/mean_length']
    assert big['grad_norm'] > 0 and big['loss'] != 0
    for k in ('loss', 'grad_norm', 'entropy', 'kl'):
        assert acc[k] == pytest.approx(big[k], rel=1e-5, abs=1e-7), k


@pytest.mark.slow
@pytest.mark.comparison
@pytest.mark.parametrize('fault, said', [
    ('scoreoom@0', 'scoring: out of memory, retrying with 8 completions a micro-batch'),
    ('oom@1', 'step 0: out of memory, retrying with 8 completions a micro-batch')])
def test_oom_halves_the_completions_a_micro_batch_holds(tmp_path, rl_env, fault, said):
    """An out-of-memory error in the scoring passes (the reference's and the sampling policy's log-probs) or in
    a step (oom@1 with two iterations: the step's second optimizer step, whose fixed log-probs are split again,
    not recomputed under the moved policy) halves the completions a micro-batch holds, 16 -> 8: the run logs
    what a run that fit logs, to the accumulation test's tolerance."""
    common = ['--max_iters=2', '--eval_interval=100', '--eval_prompts=1', '--exact_match_examples=0',
              '--num_iterations=2', '--beta=0.1', f'--reward={rl_env["rewards"]}:chars', '--scale_rewards=batch']
    rl(rl_env, tmp_path / 'fit', *common)
    p = rl(rl_env, tmp_path / 'oom', *common, faults=fault)
    assert said in p.stdout
    fit, halved = train_events(tmp_path / 'fit'), train_events(tmp_path / 'oom')
    assert sorted(fit) == sorted(halved) == [1, 2]
    for step in fit:
        for k in ('reward', 'loss', 'grad_norm', 'entropy', 'kl', 'clip_ratio/region_mean'):
            assert halved[step][k] == pytest.approx(fit[step][k], rel=1e-5, abs=1e-7), (step, k)
    # the checkpoint keeps the halved split, and a continued run takes it up
    assert load(tmp_path / 'oom' / 'ckpt.pt')['completions_per_micro_batch'] == 8
    p = rl(rl_env, tmp_path / 'oom', *common, '--max_iters=3')
    assert 'continuing with 8 completions a micro-batch' in p.stdout


@pytest.mark.slow
@pytest.mark.comparison
def test_rollouts_out_of_memory_are_sampled_in_halves_from_the_same_numbers(tmp_path, rl_env):
    """An out-of-memory error while sampling a step's rollouts: its prompts are sampled 2 at a time from then on,
    each part from the step's generator state again, so every completion draws the numbers it drew in one batch:
    the same rewards and lengths as a run that fit, and its losses (other batch shapes: 1e-5)."""
    common = ['--max_iters=2', '--eval_interval=100', '--eval_prompts=4', '--exact_match_examples=0',
              '--temperature=1.0', f'--reward={rl_env["rewards"]}:chars', '--scale_rewards=batch']
    rl(rl_env, tmp_path / 'fit', *common)
    p = rl(rl_env, tmp_path / 'oom', *common, faults='sampleoom@1')
    assert 'rollouts: out of memory, sampling 2 prompts at a time from here on' in p.stdout
    fit, halved = train_events(tmp_path / 'fit'), train_events(tmp_path / 'oom')
    assert sorted(fit) == sorted(halved) == [1, 2] and fit[2]['reward_std'] > 0
    for step in fit:
        for k in ('reward', 'reward_std', 'completions/mean_length', 'completions/clipped_ratio'):
            assert halved[step][k] == fit[step][k], (step, k)
        for k in ('loss', 'grad_norm', 'entropy', 'kl'):
            assert halved[step][k] == pytest.approx(fit[step][k], rel=1e-5, abs=1e-7), (step, k)
    evals = [[e for e in read_log(tmp_path / run) if 'eval/pass@1' in e] for run in ('fit', 'oom')]
    assert [e['step'] for e in evals[0]] == [0, 2] and evals[0] == evals[1]
    # the checkpoint keeps the size that fit, and a continued run samples at it
    p = rl(rl_env, tmp_path / 'oom', *common, '--max_iters=3')
    assert 'continuing to sample 2 prompts at a time' in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize('use_lora', [False, True])
def test_reference_is_the_starting_model_kl_0_at_the_first_step(tmp_path, rl_env, use_lora):
    """beta > 0 with one iteration: at step 1 the policy is still the reference (a frozen copy, or the LoRA model
    with its adapters disabled, B = 0), so the KL is exactly 0; after updates it is not. LoRA saves merged.pt."""
    out = tmp_path / 'out'
    # LoRA samples from the merged copy (lora.merged_copy, the GPU default), refreshed after every step
    rl(rl_env, out, '--beta=0.1', '--max_iters=3', '--eval_interval=3', f'--use_lora={use_lora}',
       f'--merged_rollouts={use_lora}', f'--reward={rl_env["rewards"]}:chars', '--eval_prompts=1',
       '--exact_match_examples=0')
    events = train_events(out)
    assert events[1]['kl'] == 0 and events[3]['kl'] > 0 and events[1]['grad_norm'] > 0
    assert (events[3]['time/merge_s'] > 0) == use_lora
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['kind'] == ('lora' if use_lora else 'gpt') and (out / 'merged.pt').exists() == use_lora


@pytest.mark.slow
def test_published_chat_model_with_lora(tmp_path, rl_env):
    """A Hugging Face folder (the Qwen2 fixture: its own tokenizer, chat template and stop tokens) trained with LoRA
    on q_proj/v_proj: the reference is the model with its adapters off (KL 0 at step 1), merged.pt at the end."""
    out = tmp_path / 'out'
    run(['train_rl.py', f'--init_from={hf_fixture("qwen2")}', f'--out_dir={out}', f'--rl_data={rl_env["prompts"]}',
         *RL, '--max_prompt_length=100', '--max_new_tokens=16', '--use_lora=True',
         '--lora_target_modules=q_proj,v_proj', '--beta=0.1', '--max_iters=2', '--eval_interval=2',
         f'--reward={rl_env["rewards"]}:chars'])
    events = train_events(out)
    assert events[1]['kl'] == 0 and events[1]['grad_norm'] > 0 and (out / 'merged.pt').exists()


@pytest.mark.slow
@pytest.mark.comparison
def test_ddp_two_ranks_equal_one_process_and_resume(tmp_path, rl_env):
    """torchrun with 2 processes (gloo) = one process: each rank samples its half of the prompts with the numbers
    one process draws for them (the same rollouts and rewards, exactly), the 'batch' advantage scale sees all
    rewards, DAPO divides by the tokens of both ranks, and the metrics add up over ranks: the same loss, KL and
    grad norm, the same evals. rel=1e-5 as accumulation: the same float32 sums in other orders and shapes (and
    a gradient all-reduce); a wrong normaliser or advantage is off by far more. A relaunch continues the run."""
    common = ['--scale_rewards=batch', '--beta=0.1', f'--reward={rl_env["rewards"]}:chars', '--correct_reward=2',
              '--eval_interval=2']
    out, one = tmp_path / 'ddp', tmp_path / 'one'
    rl(rl_env, out, '--max_iters=2', *common, ranks=2)
    rl(rl_env, one, '--max_iters=2', *common)
    ddp, single = train_events(out), train_events(one)
    for step in (1, 2):  # step 2 samples from the weights step 1 made on each side
        for k in ('reward', 'reward_std', 'accuracy', 'frac_reward_zero_std', 'completions/mean_length'):
            assert ddp[step][k] == single[step][k], (step, k)
        for k in ('loss', 'grad_norm', 'entropy', 'kl'):
            assert ddp[step][k] == pytest.approx(single[step][k], rel=1e-5, abs=1e-7), (step, k)
    assert single[1]['reward_std'] > 0 and single[1]['grad_norm'] > 0 and single[2]['kl'] > 0
    evals = [[e['eval/pass@1'] for e in read_log(d) if 'eval/pass@1' in e] for d in (out, one)]
    assert evals[0] == evals[1] and len(evals[0]) == 2
    p = rl(rl_env, out, '--max_iters=3', *common, ranks=2)
    assert f'resuming from {out / "ckpt.pt"} at step 2' in p.stdout + p.stderr
    events = train_events(out)
    assert sorted(events) == [1, 2, 3] and all(math.isfinite(e[k]) for e in events.values() for k in TRAIN_METRICS)
    assert load(out / 'ckpt.pt')['iter_num'] == 3


@pytest.mark.slow
def test_sigterm_saves_and_exits_143(tmp_path, rl_env):
    out = tmp_path / 'out'
    sigterm_after_steps(rl_args(rl_env, out, '--max_iters=100000', '--eval_interval=100000',
                                f'--reward={rl_env["rewards"]}:chars'), out, 'reward')
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] >= 3 and ckpt['iter_num'] == max(train_events(out))


@pytest.mark.slow
def test_relaunch_after_sigkill_continues_the_run(tmp_path, rl_env):
    out = tmp_path / 'out'
    args = rl_args(rl_env, out, '--max_iters=40', '--eval_interval=5', '--eval_prompts=1', '--exact_match_examples=0',
                   f'--reward={rl_env["rewards"]}:chars')
    killed_at, output, steps = kill_and_relaunch(args, out, step_key='reward')
    assert killed_at >= 5 and f'resuming from {out / "ckpt.pt"} at step {killed_at}\n' in output
    assert steps == list(range(1, 41)) and load(out / 'ckpt.pt')['iter_num'] == 40


@pytest.mark.slow
def test_reward_rises_on_a_tiny_model(tmp_path, rl_env):
    """The policy gradient's sign and scale at work: 30 steps on the share of sevens in a completion lift the mean
    reward of the last 5 steps well above that of the first 5 (deterministic: seeded sampling on the CPU)."""
    rl(rl_env, tmp_path / 'out', f'--reward={rl_env["rewards"]}:sevens', '--max_iters=30', '--eval_interval=30',
       '--learning_rate=3e-3', '--eval_prompts=1', '--exact_match_examples=0', '--prompts_per_step=4',
       '--num_generations=8')
    rewards = [e['reward'] for _, e in sorted(train_events(tmp_path / 'out').items())]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > 2 * first + 0.05, rewards


def score(reward, completion, row, where):
    """One completion's value of a per-completion Reward, as train_rl.py's rollouts compute it."""
    return reward_values(reward, [[]], [completion], [row], [where])[0]


def test_reward_function_errors_name_it(tmp_path):
    """A missing file or function, a raise, a non-number, a NaN: a UserError naming the function and the prompt."""
    rewards = tmp_path / 'rewards.py'
    rewards.write_text("def boom(prompt, completion, row):\n    raise KeyError('answer')\n\n"
                       "def text(prompt, completion, row):\n    return 'good'\n\n"
                       "def nan(prompt, completion, row):\n    return float('nan')\n\n"
                       "def fine(prompt, completion, row):\n    return len(row['response']) + (completion == 'x')\n")
    for spec, says in [(f'{tmp_path / "missing.py"}:f', 'does not exist'), (f'{rewards}:absent', 'no function'),
                       ('rewards:f', "neither 'number_tasks', 'number_tasks_exact', 'tool_calls' nor 'path.py:name'")]:
        with pytest.raises(UserError, match=says):
            load_reward(spec)
    for name, says in [('boom', "raised KeyError: 'answer' on the prompt of data.jsonl (prompt 3)"),
                       ('text', "returned 'good' for the prompt of data.jsonl (prompt 3)"), ('nan', 'returned nan')]:
        with pytest.raises(UserError, match=re.escape(says)) as e:
            score(load_reward(f'{rewards}:{name}'), 'x', {'response': '12'}, 'data.jsonl (prompt 3)')
        assert f'{rewards}:{name}' in str(e.value)
    assert score(load_reward(f'{rewards}:fine'), 'x', {'response': '12'}, 'here') == 3.0


def test_reward_files_import_as_modules_and_numpy_numbers_count(tmp_path):
    """A reward file is a module as Python imports one: a dataclass under `from __future__ import annotations`
    (which looks its module up in sys.modules) and a helper module beside it work; NumPy bools and numbers,
    0-d arrays and tensors are numbers."""
    (tmp_path / 'helper_for_reward.py').write_text("BONUS = 0.5\n")
    (tmp_path / 'dc.py').write_text(
        "from __future__ import annotations\nimport dataclasses\nimport numpy as np\nimport torch\n"
        "from helper_for_reward import BONUS\n\n@dataclasses.dataclass\nclass Grade:\n    points: float\n\n"
        "def graded(prompt, completion, row):\n    return Grade(len(completion) + BONUS).points\n\n"
        "def np_bool(prompt, completion, row):\n    return np.bool_(completion == 'x')\n\n"
        "def np_float(prompt, completion, row):\n    return np.float32(0.25)\n\n"
        "def zero_d(prompt, completion, row):\n    return np.array(2)\n\n"
        "def tensor(prompt, completion, row):\n    return torch.tensor(1.5)\n")
    for name, want in [('graded', 1.5), ('np_bool', 1.0), ('np_float', 0.25), ('zero_d', 2.0), ('tensor', 1.5)]:
        value = score(load_reward(f'{tmp_path / "dc.py"}:{name}'), 'x', {}, 'here')
        assert value == want and type(value) is float, name


def test_a_reward_that_exits_or_overflows_is_named(tmp_path, monkeypatch):
    """exit() inside a reward (code that runs model output), a KeyboardInterrupt its own code raises while the
    run's stop signal holds SIGINT, a number beyond float32 (inf in the rewards tensor): each a UserError naming
    the function; a Ctrl-C before the run handles SIGINT stays a KeyboardInterrupt."""
    (tmp_path / 'r.py').write_text("import sys\n\ndef leaves(prompt, completion, row):\n    sys.exit(0)\n\n"
                                   "def interrupted(prompt, completion, row):\n    raise KeyboardInterrupt\n\n"
                                   "def huge(prompt, completion, row):\n    return 1e39\n")
    for name, says in [('leaves', 'called exit(0)'), ('huge', "within float32's range")]:
        reward = load_reward(f'{tmp_path / "r.py"}:{name}')
        with pytest.raises(UserError, match=re.escape(says)) as e:
            score(reward, 'x', {}, 'data.jsonl (prompt 1)')
        assert reward.spec in str(e.value) and 'data.jsonl (prompt 1)' in str(e.value)
    reward = load_reward(f'{tmp_path / "r.py"}:interrupted')
    # Python's own Ctrl-C handler (a background job, as CI's, may start with SIGINT ignored instead)
    monkeypatch.setattr(signal, 'getsignal', lambda sig: signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):
        score(reward, 'x', {}, 'here')
    monkeypatch.setattr(signal, 'getsignal', lambda sig: lambda *a: None)  # the run's StopSignal handles SIGINT
    with pytest.raises(UserError, match='raised KeyboardInterrupt'):
        score(reward, 'x', {}, 'here')


def test_built_in_rewards_check_their_rows_up_front():
    """number_tasks on prompt rows without "response": refused before any rollout, naming the row and the fix,
    not as a failure of the built-in function when the row is first sampled."""
    rows = [([1], {'prompt': 'a', 'response': '1'}, 'train.jsonl (prompt 1)'),
            ([2], {'prompt': 'b'}, 'train.jsonl (prompt 2)')]
    for spec in ('number_tasks', 'number_tasks_exact'):
        with pytest.raises(UserError, match=re.escape('train.jsonl (prompt 2) has no "response"')):
            check_rows([load_reward(spec)], rows)
    check_rows([load_reward('number_tasks')._replace(spec='my.py:f')], rows)  # a user's reward checks its own
    check_rows([load_reward('number_tasks')], rows[:1])
    with pytest.raises(UserError, match=re.escape("train.jsonl (prompt 1) has no reference turn, which "
                                                  "reward='tool_calls'")):
        check_rows([load_reward('tool_calls')], rows)


def test_held_out_references_are_the_response_or_the_final_assistant_turn():
    """RL's held-out exact match reads a row's "response", else its final assistant turn (messages or ShareGPT's
    conversations); a row with neither, or a call that nanotrain's own template cannot write, has none."""
    tok = ChatTokenizer(CharTokenizer(list('abcdefghijklmnopqrstuvwxyz0123456789 ?+')))
    user, answer = {'role': 'user', 'content': 'what is 1+1?'}, {'role': 'assistant', 'content': '2'}
    rows = [{'prompt': 'what is 1+1?', 'response': '2'}, {'messages': [user, answer]},
            {'conversations': [{'from': 'human', 'value': 'a'}, {'from': 'gpt', 'value': '2'}]}, {'prompt': 'a'},
            {'messages': [user, {'role': 'assistant', 'tool_calls': [{'function': {'name': 'f', 'arguments': {}}}]}]}]
    assert [rl_reference(tok, row) for row in rows] == ['2', '2', '2', None, None]


def test_the_tool_calls_reward_compares_calls_as_the_metric_does():
    """reward=tool_calls: 1 when a completion writes the calls of the row's final assistant turn (messages or
    ShareGPT's conversations; a turn without calls wants none), in any template's form, else 0."""
    user = {'role': 'user', 'content': 'Weather in Oslo and Lima?'}
    call = lambda city, args=None: {'type': 'function', 'function': {  # noqa: E731
        'name': 'get_weather', 'arguments': args or {'city': city}}}
    row = {'messages': [user, {'role': 'assistant', 'content': None, 'tool_calls': [call('Oslo'), call('Lima')]}]}
    reward = load_rewards('tool_calls')[0][0]
    assert reward.name == 'tool_calls' and rl_prompt(row) == [user]
    qwen = ''.join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
                   for c in ('Lima', 'Oslo'))  # the other order
    mistral = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "abcdefghi"}, ' \
              '{"name": "get_weather", "arguments": {"city": "Lima"}, "id": "bcdefghij"}]'
    values = [reward.fn(prompt=[user], completion=text, row=row)
              for text in (qwen, mistral, qwen.replace('Lima', 'Quito'), 'It is sunny.')]
    assert values == [1.0, 1.0, 0.0, 0.0]
    answer = {'conversations': [{'from': 'human', 'value': 'Hi'}, {'from': 'gpt', 'value': 'Hello!'}]}
    assert [reward.fn(prompt=[], completion=text, row=answer) for text in ('Hi there.', qwen)] == [1.0, 0.0]
    as_string = {'messages': [user, {'role': 'assistant', 'tool_calls': [call('', '{"city": "Oslo"}')]}]}
    assert reward.fn(prompt=[user], completion=qwen.split('</tool_call>')[1] + '</tool_call>', row=as_string) == 1.0
    clock = {'messages': [user, {'role': 'assistant', 'tool_calls': [  # Llama's key; a call without arguments
        {'name': 'get_weather', 'parameters': {'city': 'Oslo'}}, {'function': {'name': 'get_time'}}]}]}
    written = '{"name": "get_time", "parameters": {}} {"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert reward.fn(prompt=[user], completion=written, row=clock) == 1.0


def test_the_reward_reads_completions_without_special_tokens():
    """As TRL decodes with skip_special_tokens=True: the chat template's tokens in a completion are left out."""
    tokenizer = ChatTokenizer(CharTokenizer(list('abc ')))
    ids = tokenizer.encode('ab') + [tokenizer.special['<|user|>']] + tokenizer.encode('c') + [tokenizer.eos_id]
    assert tokenizer.decode(ids) == 'ab<|user|>c<|end|>'
    assert tokenizer.decode(ids, skip_special=True) == 'abc'


@pytest.mark.slow
def test_reward_function_that_raises_exits_2(tmp_path, rl_env):
    (tmp_path / 'r.py').write_text("def boom(prompt, completion, row):\n    raise KeyError('answer')\n")
    p = rl(rl_env, tmp_path / 'out', f'--reward={tmp_path / "r.py"}:boom', check=False)
    assert_user_error(p, f'{tmp_path / "r.py"}:boom', 'raised KeyError', '.jsonl (prompt 1)')


@pytest.mark.slow
def test_constant_reward_warns_and_stays_finite(tmp_path, rl_env):
    """A reward that never varies within a group: every advantage is 0 (no NaN from the 0 std), the loss and the
    gradient are 0, and each step's log line says that nothing was learned. A reward that returns None for every
    completion says so, once, and is not logged as NaN (nor warned about by torch's std)."""
    (tmp_path / 'r.py').write_text("def one(prompt, completion, row):\n    return 1\n\n"
                                   "def never(prompt, completion, row):\n    return None\n")
    p = rl(rl_env, tmp_path / 'out', f'--reward={tmp_path / "r.py"}:one', '--max_iters=2', '--eval_prompts=1',
           '--exact_match_examples=0')
    assert "warning: every group's 4 rewards were equal" in p.stdout + p.stderr
    assert "(too hard or too easy prompts, or a constant reward)" in p.stdout + p.stderr
    events = train_events(tmp_path / 'out')
    assert sorted(events) == [1, 2]  # both steps logged: the checks below are of something
    for e in events.values():
        assert e['reward'] == 1 and e['reward_std'] == 0 and e['frac_reward_zero_std'] == 1
        assert e['loss'] == 0 and e['grad_norm'] == 0 and e['accuracy'] == 1
    p = rl(rl_env, tmp_path / 'never', f'--reward={tmp_path / "r.py"}:never', '--max_iters=2', '--eval_prompts=1',
           '--exact_match_examples=0')
    output = p.stdout + p.stderr
    assert output.count('warning: reward never scored none of the 16 completions') == 1
    assert "nothing was learned (no reward scored any completion)" in output and 'degrees of freedom' not in output
    events = train_events(tmp_path / 'never')
    assert sorted(events) == [1, 2] and all('rewards/never/mean' not in e and e['reward'] == 0 for e in events.values())
    assert 'NaN' not in (tmp_path / 'never' / 'log.jsonl').read_text()


@pytest.mark.slow
def test_bad_prompts_and_settings_exit_2(tmp_path, rl_env):
    bad = tmp_path / 'bad'
    bad.mkdir()
    write_jsonl(bad / 'train.jsonl', [{'prompt': 'What is 1+1?', 'response': '2'}, {'response': '2'}])
    write_jsonl(bad / 'val.jsonl', [{'prompt': 'What is 1+1?', 'response': '2'}])
    cases = [([f'--rl_data={bad}'], [f'{bad / "train.jsonl"}:2:', '"prompt"']),
             (['--num_generations=1'], ['num_generations=1', 'at least 2']),
             (['--prompts_per_step=3', '--gradient_accumulation_steps=5'], ['split evenly']),
             (['--loss_type=ppo'], ['loss_type']), (['--epsilon_high=-0.1'], ['epsilon_high=-0.1', 'or None'])]
    for i, (args, says) in enumerate(cases):
        p = rl(rl_env, tmp_path / f'out{i}', *args, check=False)
        assert_user_error(p, *says)


@pytest.mark.slow
def test_masked_truncated_completions_run_and_leave_the_loss_to_the_others(tmp_path, rl_env):
    """max_new_tokens=1 truncates nearly every completion: masked, what is left is the few stopped ones (loss 0 and
    no gradient when there are none); unmasked, every completion trains."""
    (tmp_path / 'r.py').write_text("def chars(prompt, completion, row):\n    return sum(map(ord, completion)) % 3\n")
    common = ['--max_new_tokens=1', '--max_iters=1', '--eval_prompts=1', '--exact_match_examples=0',
              '--loss_type=dapo', '--scale_rewards=none', f'--reward={tmp_path / "r.py"}:chars']
    rl(rl_env, tmp_path / 'masked', *common, '--mask_truncated_completions=True')
    rl(rl_env, tmp_path / 'plain', *common)
    masked, plain = train_events(tmp_path / 'masked')[1], train_events(tmp_path / 'plain')[1]
    assert masked['completions/clipped_ratio'] == plain['completions/clipped_ratio'] > 0.5  # the same rollouts
    assert plain['grad_norm'] > 0 and plain['entropy'] > 0
    if masked['completions/clipped_ratio'] == 1:
        assert masked['loss'] == 0 and masked['grad_norm'] == 0 and masked['entropy'] == 0
    else:
        assert masked['grad_norm'] != plain['grad_norm']


def test_completion_batches_lay_each_prompt_out_once_and_leave_masked_completions_out():
    """A micro-batch is one row: a prompt once, then its scored completions (a masked one, scored False, is left
    out and scores nothing), each token predicted from the position before it (the first from the prompt's
    last), positions continuing the prompt's; lengths count what is scored; a micro-batch boundary starts a
    new row (the prompt again)."""
    a, b = [1, 2], [7, 8, 9]
    sequences = [(a, [3, 4, 0]), (a, [6]), (a, [5, 6, 7]), (b, [1, 2]), (b, [4, 5])]
    batches = completion_batches(sequences, [True, False, True, True, True], 4)
    assert [batch.first for batch in batches] == [0, 4]
    first, second = batches
    assert first.x.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 1]]
    assert first.positions.tolist() == [[0, 1, 2, 3, 2, 3, 0, 1, 2, 3]]
    assert first.rows.tolist() == [0] * 8
    assert first.cols.tolist() == [1, 2, 3, 1, 4, 5, 8, 9] and first.targets.tolist() == [3, 4, 0, 5, 6, 7, 1, 2]
    assert first.owners.tolist() == [0, 0, 0, 2, 2, 2, 3, 3] and first.lengths.tolist() == [3, 0, 3, 2]
    layout = first.mask
    assert layout.prompts.tolist() == [[0, 1, 0], [6, 7, 8]]  # padded with a span's first column
    assert layout.completions.tolist() == [[2, 3], [4, 5], [9, 9]] and layout.prompt_of.tolist() == [0, 0, 1]
    assert second.x.tolist() == [[7, 8, 9, 4]] and second.lengths.tolist() == [2]


@pytest.mark.comparison
@pytest.mark.parametrize('window', [0, 3])
def test_shared_prompts_attend_as_a_dense_mask_of_their_rule_does(window):
    """SharedPrompts' attention (two grids, gathered and scattered) equals attention over the whole row
    with the mask its rule gives: a token sees earlier tokens of its prompt and of its own completion (and a
    completion's token its prompt), within the window (positions). GQA; float64: only the order of sums differs."""
    from lm.shared_prompts import SharedPrompts
    from model import attend, window_mask
    g = torch.Generator().manual_seed(0)
    # prompts of 3 and 4 tokens; completions of 2, 4, 1 (prompt 0) and 3 (prompt 1) fed tokens
    spans = [('p', 0, range(0, 3)), ('c', 0, range(3, 5)), ('c', 0, range(5, 9)), ('c', 0, range(9, 10)),
             ('p', 1, range(10, 14)), ('c', 1, range(14, 17))]
    prompts = [list(s) for kind, _, s in spans if kind == 'p']
    completions = [list(s) for kind, _, s in spans if kind == 'c']
    layout = SharedPrompts(prompts, completions, [group for kind, group, _ in spans if kind == 'c'])
    N = 17
    group, branch, position = torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long), torch.zeros(N)
    for i, (kind, gr, span) in enumerate(spans):
        start = 0 if kind == 'p' else len(prompts[gr])
        for t, col in enumerate(span):
            group[col], branch[col], position[col] = gr, 0 if kind == 'p' else i, start + t
    cols = torch.arange(N)
    allowed = ((group[:, None] == group) & ((branch == 0) | (branch[:, None] == branch))
               & (cols <= cols[:, None]))
    if window:
        allowed &= window_mask(position, position, window)
    q, k, v = torch.randn(1, 4, N, 8, generator=g, dtype=torch.float64), *torch.randn(2, 1, 2, N, 8, generator=g,
                                                                                     dtype=torch.float64)
    want = attend(q, k, v, causal=False, mask=allowed[None, None])
    torch.testing.assert_close(layout.attend(q, k, v, window=window), want, rtol=0, atol=1e-12)


@pytest.mark.comparison
@pytest.mark.parametrize('opts', [dict(pos_emb='rope'), dict(pos_emb='learned'),
                                  dict(pos_emb='rope', sliding_window=4)])
def test_shared_prompt_rows_give_each_completion_its_logps_alone(opts):
    """Through a tiny GPT, the micro-batches' rows give every completion token the log-prob it has when the
    sequence runs alone, and the gradient of their sum is the sum of the sequences' alone (float64: only the
    order of sums differs)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=12, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                          **opts)).double().eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 12, (n,), generator=g).tolist() for n in (3, 7, 5)]
    sequences = [(p, torch.randint(0, 12, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist())
                 for p in prompts for _ in range(4)]
    assert min(len(c) for _, c in sequences) == 1  # a completion with no token fed
    scored = [i % 5 != 3 for i in range(len(sequences))]
    want = []  # each scored sequence alone: its log-probs, and the gradient of their sum
    model.zero_grad()
    for (prompt, completion), keep in zip(sequences, scored):
        if keep:
            alone, _ = model(torch.tensor([prompt + completion[:-1]]))
            logps = alone[0, len(prompt) - 1:].log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
            logps.sum().backward()
            want += logps.tolist()
    alone_grad = [p.grad.clone() for p in model.parameters()]
    for micro_batch_size in (12, 5):
        got = []
        model.zero_grad()
        for batch in completion_batches(sequences, scored, micro_batch_size):
            logits, _ = model(batch.x, positions=batch.positions, mask=batch.mask,
                              logits_at=(batch.rows, batch.cols))
            logps = logits.log_softmax(-1).gather(1, batch.targets[:, None])[:, 0]
            logps.sum().backward()
            got += logps.tolist()
        grad = [p.grad.clone() for p in model.parameters()]
        assert len(got) == sum(len(c) for (_, c), keep in zip(sequences, scored) if keep)
        assert got == pytest.approx(want, abs=1e-12)
        for mine, theirs in zip(grad, alone_grad):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)


@pytest.mark.slow
def test_a_fixed_reward_field_continues_the_run_and_epsilon_high_follows_epsilon(tmp_path, rl_env):
    """A relaunch after the rows' other fields (the reward's) were fixed continues the run, saying so; a changed
    prompt is refused. epsilon_high left unset is epsilon (TRL's default): --epsilon=0.1 clips to [0.9, 1.1]."""
    data = tmp_path / 'prompts'
    shutil.copytree(rl_env['prompts'], data)
    args = [f'--rl_data={data}', f'--reward={rl_env["rewards"]}:chars', '--eval_prompts=1',
            '--exact_match_examples=0', '--epsilon=0.1']
    p = rl(rl_env, tmp_path / 'out', '--max_iters=1', *args)
    assert 'ratio clipped to [0.9, 1.1]' in p.stdout + p.stderr
    rows = [json.loads(line) for line in (data / 'train.jsonl').read_text().splitlines()]
    rows[3]['response'] = 'fixed'
    write_jsonl(data / 'train.jsonl', rows)
    p = rl(rl_env, tmp_path / 'out', '--max_iters=2', *args)
    assert 'its prompts are the same, in the same order: continuing' in p.stdout + p.stderr
    assert sorted(train_events(tmp_path / 'out')) == [1, 2]
    rows[3]['prompt'] = rows[4]['prompt']
    write_jsonl(data / 'train.jsonl', rows)
    p = rl(rl_env, tmp_path / 'out', '--max_iters=3', *args, check=False)
    assert_user_error(p, 'train.jsonl is not the training data the run in')


@pytest.mark.slow
def test_metrics_are_trls(tmp_path, rl_env):
    """TRL's meanings: every metric is the mean over the log_interval window (both iterations of a batch
    included); clip_ratio/region_mean is low_mean + high_mean (a clipped token has A != 0); frac_reward_zero_std
    counts groups whose std is close to 0 (torch.isclose, as TRL), with scale_rewards='batch' the step's std."""
    common = ['--num_iterations=2', '--max_iters=2', '--eval_interval=2', '--exact_match_examples=0',
              f'--reward={rl_env["rewards"]}:chars', '--epsilon=0.05']
    rl(rl_env, tmp_path / 'each', *common, '--log_interval=1')
    rl(rl_env, tmp_path / 'window', *common, '--log_interval=2')
    each, window = train_events(tmp_path / 'each'), train_events(tmp_path / 'window')
    assert sorted(window) == [2]
    for k in TRAIN_METRICS:
        if not k.startswith(('time/', 'generation/')):
            want = each[2][k] if k == 'grad_norm' else (each[1][k] + each[2][k]) / 2  # the Trainer's last grad_norm
            assert window[2][k] == pytest.approx(want, rel=1e-12, abs=1e-15), k
    for e in each.values():
        assert e['clip_ratio/region_mean'] == pytest.approx(e['clip_ratio/low_mean'] + e['clip_ratio/high_mean'])
    assert any(e['clip_ratio/low_mean'] > 0 for e in each.values())
    (tmp_path / 'r.py').write_text("def almost(prompt, completion, row):\n    return 1e-9 * len(completion)\n")
    for scale in ('group', 'batch'):
        rl(rl_env, tmp_path / scale, f'--reward={tmp_path / "r.py"}:almost', '--max_iters=1', '--eval_prompts=1',
           '--exact_match_examples=0', f'--scale_rewards={scale}')
        e = train_events(tmp_path / scale)[1]
        assert 0 < e['reward_std'] < 1e-8 and e['frac_reward_zero_std'] == 1, scale


@pytest.mark.slow
def test_a_rank_that_stops_leaves_one_message_and_no_rank_traceback(tmp_path, rl_env):
    """Under torchrun, a reward that fails on rank 1 only, and a launch on an out_dir another run holds (rank 0
    finds the lock): the rank that stopped says why, the other is ended by torchrun or says in one line that a
    peer ended first; no rank prints a traceback (torchrun's own failure summary follows, as for any failed rank)."""
    import fcntl
    (tmp_path / 'r.py').write_text("import os\n\ndef f(prompt, completion, row):\n"
                                   "    if os.environ['RANK'] == '1':\n        raise KeyError('x')\n    return 1.0\n")
    (tmp_path / 'held').mkdir()
    with open(tmp_path / 'held' / 'run.lock', 'a+') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write('4242\n')
        lock.flush()
        for out, args, says in [(tmp_path / 'out', [f'--reward={tmp_path / "r.py"}:f'], "raised KeyError: 'x'"),
                                (tmp_path / 'held', [], 'another run (process 4242) is training in')]:
            p = run([*real_torchrun(2), *rl_args(rl_env, out, '--max_iters=2', *args)], check=False)
            assert p.returncode != 0 and p.stderr.count(says) == 1, p.stderr
            # the other rank: torchrun's SIGTERM, or one line if its collective failed first
            assert p.stderr.count('error: ') <= 2 and 'Connection closed' not in p.stderr
            # one traceback at most: torchrun's own, whose frames are all the launcher's
            tracebacks = p.stderr.split('Traceback (most recent call last):')[1:]
            assert len(tracebacks) <= 1 and 'Connection closed' not in p.stderr, p.stderr
            assert all('ChildFailedError' in t and 'train_rl.py", line' not in t for t in tracebacks), p.stderr


def test_several_rewards_weights_none_and_batched_calls(tmp_path):
    """TRL's combination: each reward's values (None -> NaN, left out of that reward's mean), the total their
    weighted nansum; a function marked batched is called once with the lists; the weights and names checked."""
    (tmp_path / 'r.py').write_text(
        "def length(prompt, completion, row):\n    return len(completion)\n\n"
        "def maybe(prompts, completions, rows):\n    return [None if c == 'b' else 0.5 * r['k'] for c, r in "
        "zip(completions, rows)]\nmaybe.batched = True\n\n"
        "def wrong_count(prompts, completions, rows):\n    return [1.0]\nwrong_count.batched = True\n")
    rewards, weights = load_rewards(f'{tmp_path / "r.py"}:length, {tmp_path / "r.py"}:maybe', '2, -1')
    assert [r.name for r in rewards] == ['length', 'maybe'] and [r.batched for r in rewards] == [False, True]
    assert weights == [2.0, -1.0]
    completions, rows = ['a', 'b', 'ccc'], [{'k': 1}, {'k': 2}, {'k': 4}]
    values = [reward_values(r, [[]] * 3, completions, rows, ['w1', 'w2', 'w3']) for r in rewards]
    assert values[0] == [1.0, 1.0, 3.0] and values[1][0] == 0.5 and math.isnan(values[1][1]) and values[1][2] == 2.0
    per_reward = torch.tensor(values).T
    total = (per_reward * torch.tensor(weights)).nansum(1)  # train_rl.py's rollouts
    assert total.tolist() == [2 * 1 - 0.5, 2 * 1, 2 * 3 - 2.0]
    for spec, weights_spec, says in [(f'{tmp_path / "r.py"}:length', '1,2', 'must be 1 comma-separated'),
                                     (f'{tmp_path / "r.py"}:length,{tmp_path / "r.py"}:length', '', 'twice'),
                                     ('', '', 'names no reward')]:
        with pytest.raises(UserError, match=says):
            load_rewards(spec, weights_spec)
    with pytest.raises(UserError, match='for a batch of 3 completions; it must return a list of 3'):
        reward_values(load_reward(f'{tmp_path / "r.py"}:wrong_count'), [[]] * 3, completions, rows, ['w'] * 3)


def test_a_reward_whose_parameters_do_not_fit_its_call_is_refused_when_loaded(tmp_path):
    """A TRL reward function (prompts, completions, **kwargs) without batched, a per-completion one marked batched,
    one that needs another argument: refused at load, before any rollout, naming the call and the fix; **kwargs
    and defaulted extra parameters fit."""
    (tmp_path / 'r.py').write_text(
        "def trl(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n\n"
        "def single(prompt, completion, row):\n    return 1.0\nsingle.batched = True\n\n"
        "def needs(prompt, completion, row, tokenizer):\n    return 1.0\n\n"
        "def loose(**kwargs):\n    return 1.0\n\n"
        "def defaulted(prompt, completion, row, scale=2):\n    return 1.0\n\n"
        "def trl_batched(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n"
        "trl_batched.batched = True\n")
    for name, says in [('trl', 'trl(prompts, completions, **kwargs) cannot be called as trl(prompt=..., '
                               'completion=..., row=...)'),
                       ('trl', '`trl.batched = True` below it'),
                       ('single', 'single(prompt, completion, row) cannot be called as single(prompts=..., '
                                  'completions=..., rows=...)'),
                       ('single', 'drop `single.batched = True`'),
                       ('needs', 'needs(prompt, completion, row, tokenizer) cannot be called')]:
        with pytest.raises(UserError, match=re.escape(says)):
            load_reward(f'{tmp_path / "r.py"}:{name}')
    assert score(load_reward(f'{tmp_path / "r.py"}:loose'), 'x', {}, 'here') == 1.0
    assert score(load_reward(f'{tmp_path / "r.py"}:defaulted'), 'x', {}, 'here') == 1.0
    batched = load_reward(f'{tmp_path / "r.py"}:trl_batched')
    assert reward_values(batched, [[]] * 2, ['a', 'b'], [{}, {}], ['w'] * 2) == [1.0, 1.0]


def test_a_batched_reward_takes_the_rows_fields_as_trl_passes_columns(tmp_path):
    """TRL's reward functions read a data set's columns as keyword lists (accuracy(completions, solution,
    **kwargs)): a batched reward gets each field of the rows it names or takes through **kwargs (None where a row
    lacks it; prompt is ours); a row without a field that a parameter needs is refused before any rollout."""
    (tmp_path / 'r.py').write_text(
        "def accuracy(completions, solution, **kwargs):\n"
        "    return [float(c == s) for c, s in zip(completions, solution)]\naccuracy.batched = True\n\n"
        "def seen(prompts, completions, rows, **kwargs):\n"
        "    return [len(kwargs)] * len(completions) if sorted(kwargs) == ['level', 'solution'] else None\n"
        "seen.batched = True\n\n"
        "def named(prompts, completions, rows, level=None):\n    return [level[0]] * len(completions)\n"
        "named.batched = True\n")
    rows = [{'prompt': 'p1', 'solution': 'a', 'level': 1}, {'prompt': 'p2', 'solution': 'b'}]
    values = [reward_values(load_reward(f'{tmp_path / "r.py"}:{name}'), [[]] * 2, ['a', 'c'], rows, ['w'] * 2)
              for name in ('accuracy', 'seen', 'named')]
    assert values == [[1.0, 0.0], [2.0, 2.0], [1.0, 1.0]]
    accuracy = load_reward(f'{tmp_path / "r.py"}:accuracy')
    check_rows([accuracy], [([1], rows[0], 'train.jsonl (prompt 1)')])
    # one written for TRL's conversational data ([{"role", "content"}] completions): the error says what they are
    (tmp_path / 'conv.py').write_text("def conv(completions, **kwargs):\n"
                                      "    return [float(c[0]['content'] == 'a') for c in completions]\n"
                                      "conv.batched = True\n")
    with pytest.raises(UserError, match=re.escape("raised TypeError: string indices must be integers")) as e:
        reward_values(load_reward(f'{tmp_path / "conv.py"}:conv'), [[]] * 2, ['a', 'c'], rows, ['w'] * 2)
    assert "A completion is its text here, not TRL's conversational" in str(e.value)
    with pytest.raises(UserError, match=re.escape('train.jsonl (prompt 2) has no "solution", which reward=')):
        check_rows([accuracy], [([1], rows[0], 'train.jsonl (prompt 1)'), ([2], {'prompt': 'p'},
                                                                          'train.jsonl (prompt 2)')])


def test_per_reward_metrics_leave_out_what_a_reward_did_not_score():
    """TRL's nanmean and nanstd of each reward's values, without NaN or torch's 'degrees of freedom' warning: no
    mean for a reward that scored no completion (named), no std for one that scored one."""
    per_reward_metrics, = script_definitions('train_rl.py', 'per_reward_metrics')
    rewards = [Reward(None, name, name, False) for name in ('one', 'none', 'once')]
    nan = math.nan
    values = torch.tensor([[1.0, nan, nan], [3.0, nan, 2.0], [2.0, nan, nan]])
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        metrics, scored_none = per_reward_metrics(rewards, values)
    assert metrics == {'rewards/one/mean': 2.0, 'rewards/one/std': 1.0, 'rewards/once/mean': 2.0}
    assert scored_none == ['none']


@pytest.mark.slow
def test_several_rewards_are_logged_each_and_summed(tmp_path, rl_env):
    """--reward=a,b,c --reward_weights=2,1,1: rewards/<name>/mean and /std of each (None left out), the logged
    reward their weighted sum; the third returns None for every completion."""
    (tmp_path / 'r.py').write_text(
        "def one(prompt, completion, row):\n    return 1\n\n"
        "def odd(prompts, completions, rows):\n    return [0.5 if len(c) % 2 else None for c in completions]\n"
        "odd.batched = True\n\n"
        "def never(prompt, completion, row):\n    return None\n")
    p = rl(rl_env, tmp_path / 'out', f'--reward={tmp_path / "r.py"}:one,{tmp_path / "r.py"}:odd,'
           f'{tmp_path / "r.py"}:never', '--reward_weights=2,1,1', '--max_iters=2', '--eval_prompts=1',
           '--exact_match_examples=0', '--correct_reward=2')
    events = train_events(tmp_path / 'out')
    assert sorted(events) == [1, 2]  # both steps logged: the checks below are of something
    for e in events.values():
        assert e['rewards/one/mean'] == 1 and e['rewards/one/std'] == 0 and e['rewards/odd/mean'] == 0.5
        assert 2 <= e['reward'] <= 2.5 and e['accuracy'] == 1 and 'rewards/never/mean' not in e
    # the one that scored nothing is named once, and neither logged as NaN nor warned about by torch's std
    assert (p.stdout + p.stderr).count('warning: reward never scored none of the 16 completions') == 1
    assert 'degrees of freedom' not in p.stderr and 'NaN' not in (tmp_path / 'out' / 'log.jsonl').read_text()



@pytest.mark.comparison
@pytest.mark.parametrize('loss_type', ['grpo', 'dapo', 'dr_grpo'])
def test_sequence_level_importance_sampling_matches_gspo(loss_type):
    """importance_sampling_level='sequence' (GSPO, TRL's formula): every token of sequence i weighted by
    s_i = exp(mean_t(logp_it - old_it)), clipped to [1 - eps, 1 + eps_high], written out sequence by sequence in
    float64; the loss and its gradient equal, and two micro-batches' shares add up to the whole batch's."""
    lengths, owners, logps, old, _, rewards = random_batch(5, n_seq=7)
    noise = torch.randn(len(logps), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    old = logps.detach() + 0.3 * noise
    advantages = group_advantages(rewards, 7, 'none')
    eps, eps_high, max_new = 0.05, 0.08, 5
    totals = (len(lengths), int(lengths.sum()), max_new)
    ours_logps = logps.detach().clone().requires_grad_()
    token_loss, clipped = clipped_token_loss(sequence_log_ratio(ours_logps - old, owners, lengths),
                                             advantages[owners], eps, eps_high)
    ours = normalized_loss(token_loss, owners, lengths, loss_type, totals)
    ours.backward()
    hand_logps = logps.detach().clone().requires_grad_()
    per_seq = []
    for lp, ol, a in zip(hand_logps.split(lengths.tolist()), old.split(lengths.tolist()), advantages):
        s = torch.exp((lp - ol).mean()) if len(lp) else torch.tensor(1.0, dtype=torch.float64)
        per_seq.append(-torch.min(s * a, s.clamp(1 - eps, 1 + eps_high) * a).expand(len(lp)))
    S, T = len(lengths), int(lengths.sum())
    hand = (sum(t.sum() / max(len(t), 1) for t in per_seq) / S if loss_type == 'grpo' else
            sum(t.sum() for t in per_seq) / (T if loss_type == 'dapo' else S * max_new))
    hand.backward()
    assert clipped.any() and not clipped.all()  # both sides of the clip are exercised
    torch.testing.assert_close(ours, hand, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours_logps.grad, hand_logps.grad, rtol=1e-12, atol=1e-14)
    # micro-batches: the first 3 sequences and the rest, each normalised by the whole batch's totals
    cut = int(lengths[:3].sum())
    shares = 0.0
    for part, seqs in [(slice(0, cut), slice(0, 3)), (slice(cut, None), slice(3, None))]:
        part_owners = owners[part] - owners[part].min() if cut else owners[part]
        part_loss, _ = clipped_token_loss(sequence_log_ratio(logps[part] - old[part], part_owners, lengths[seqs]),
                                          advantages[seqs][part_owners], eps, eps_high)
        shares = shares + normalized_loss(part_loss, part_owners, lengths[seqs], loss_type, totals)
    torch.testing.assert_close(shares, ours.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_a_gspo_run_trains(tmp_path, rl_env):
    """importance_sampling_level='sequence' end to end: two iterations a batch, the second's sequence ratios off 1
    and clipped at GSPO's tight bounds, the weights moved."""
    rl(rl_env, tmp_path / 'out', '--importance_sampling_level=sequence', '--num_iterations=2', '--epsilon=3e-4',
       '--epsilon_high=4e-4', '--max_iters=1', '--eval_prompts=1', '--exact_match_examples=0',
       f'--reward={rl_env["rewards"]}:chars')
    e = train_events(tmp_path / 'out')[1]
    assert math.isfinite(e['loss']) and e['clip_ratio/region_mean'] > 0 and e['grad_norm'] > 0


@pytest.mark.parametrize('bias', ['all', 'lora_only'])
def test_lora_reference_is_the_starting_model_after_its_biases_trained(bias):
    """RL's and DPO's reference, the policy with adapters disabled, is the starting model bit for bit after training
    steps that moved the trained biases; outside the block the trained biases are back (and autograd is intact)."""
    import copy
    from lm.lora import apply_lora, disable_adapters
    torch.manual_seed(0)
    base = GPT(GPTConfig(block_size=16, vocab_size=16, n_layer=2, n_head=2, n_embd=8, bias=True, norm='layernorm'))
    model = copy.deepcopy(base)
    apply_lora(model, r=2, lora_alpha=4, target_modules='attn.q,attn.v', bias=bias)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, y = torch.randint(16, (4, 8)), torch.randint(16, (4, 8))
    for _ in range(3):
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not torch.equal(model.transformer.h[0].attn.q.bias, base.transformer.h[0].attn.q.bias)
    trained = model(x)[0]
    logits, loss = model(x, y)  # a pending graph: the reference pass in between must not break its backward
    with torch.no_grad(), disable_adapters(model):
        assert torch.equal(model(x)[0], base(x)[0])
    loss.backward()
    assert torch.equal(model(x)[0], trained)
