"""Direct Preference Optimization: the loss formulas and sequence log-probs (losses.py), preference
pairs from JSONL and their batching (lm/chat_data.py), the embedded number-task pairs, and train_dpo.py end
to end through subprocesses (step-0 identities for every reference kind, accumulation invariance,
bit-exact resume, RPO/IPO, clear errors)."""

import contextlib
import glob
import json
import math
import os
import re
import shutil

import pytest
import torch

from configurator import UserError
from lm.chat_data import PreferenceBatches, load_preference_split
from lm.dpo import reference_logps
from conftest import (ANSWERS, REFERENCE, TRAIN_METRICS, WORKING, assert_logged_to_wandb, assert_user_error,
                      char_tokenizer, checked_answer, dpo, dpo_args, evals, kill_and_relaunch, load, parameter_bytes,
                      random_pairs, read_log, reference_logps_under_bf16_autocast, sigterm_after_steps, torch_saved,
                      train_metrics, wandb_env, write_jsonl)
from starting_model import frozen_model
from lm.tokenizer import ChatTokenizer, load_tokenizer
from losses import DPO_LOSS_TYPES, dpo_loss, sequence_logps
from model import GPT, GPTConfig
from tasks.number_tasks import prepare_number_tasks

LN2 = math.log(2)


def hand_completion_logps(model, prompt, completion):
    """log p(completion | prompt) under model, summed, in float64: the sequence alone, no padding or packing."""
    ids = prompt + completion
    logits, _ = model(torch.tensor([ids[:-1]]))
    logps = logits[0].double().log_softmax(-1)
    return sum(logps[len(prompt) - 1 + j, token].item() for j, token in enumerate(completion))


# -- losses --------------------------------------------------------------------------------------

def log_sigmoid(z):
    return -math.log1p(math.exp(-z))


def test_frozen_reference_is_its_own_copy_of_the_weights():
    """The reference is built around a copy of the checkpoint's tensors (never a random model first): the same
    values, frozen, and no storage shared with the state the policy may be built around."""
    config = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)
    state = GPT(config).state_dict()
    reference = frozen_model(config, state, 'ddp', 'cpu', torch.float32, False)
    mine = reference.state_dict()
    assert mine.keys() == state.keys() and all(torch.equal(mine[k], state[k]) for k in state)
    assert not {t.data_ptr() for t in mine.values()} & {t.data_ptr() for t in state.values()}
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training


@pytest.mark.comparison
def test_frozen_reference_of_a_bf16_run_has_16_bit_linear_weights_and_the_same_logps_bit_for_bit():
    """A bf16 run's reference holds its blocks' Linear weights in bf16 (lora.cast_frozen_base),
    which autocast casts them to at every use anyway: the same log-probs under it, ~half the
    bytes."""
    torch.manual_seed(0)
    state = GPT(REFERENCE).state_dict()
    f32, bf16 = [frozen_model(REFERENCE, state, 'ddp', 'cpu', dtype, False)
                 for dtype in (torch.float32, torch.bfloat16)]
    linear = {n for n, _ in bf16.named_parameters() if ('.attn.' in n or '.mlp.' in n) and n.endswith('.weight')}
    assert {n for n, p in bf16.named_parameters() if p.dtype == torch.bfloat16} == linear and len(linear) == 14
    assert bf16.lm_head.weight is bf16.transformer.wte.weight  # still tied, and float32
    saved = sum(p.numel() * 2 for n, p in bf16.named_parameters() if n in linear)
    assert parameter_bytes(bf16) == parameter_bytes(f32) - saved < 0.55 * parameter_bytes(f32)
    (sums, logits), (sums16, logits16) = map(reference_logps_under_bf16_autocast, (f32, bf16))
    assert torch.equal(sums, sums16) and torch.equal(logits, logits16)


@pytest.mark.comparison
@pytest.mark.parametrize('loss_type,eps', [('sigmoid', 0.0), ('sigmoid', 0.2), ('robust', 0.2), ('robust', 0.0),
                                           ('ipo', 0.0), ('hinge', 0.0)])
def test_dpo_loss_matches_hand_formulas(loss_type, eps):
    """Every loss type on hand-picked log-probs equals the paper's formula written out with math.log/exp."""
    beta = 0.3
    pc, pr, rc, rr = [-3.0, -10.0, -2.5], [-5.0, -4.0, -2.5], [-4.0, -8.0, -1.0], [-4.5, -7.0, -1.0]
    losses, chosen_rewards, rejected_rewards = dpo_loss(*map(torch.tensor, (pc, pr, rc, rr)), beta, loss_type, eps)
    for k in range(3):
        h = (pc[k] - pr[k]) - (rc[k] - rr[k])
        expected = {
            'sigmoid': -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h),
            'robust': (-(1 - eps) * log_sigmoid(beta * h) + eps * log_sigmoid(-beta * h)) / (1 - 2 * eps),
            'ipo': (h - 1 / (2 * beta)) ** 2,
            'hinge': max(0.0, 1 - beta * h),
        }[loss_type]
        assert losses[k].item() == pytest.approx(expected, rel=1e-6, abs=1e-6), (loss_type, eps, k)
        assert chosen_rewards[k].item() == pytest.approx(beta * (pc[k] - rc[k]), abs=1e-6)
        assert rejected_rewards[k].item() == pytest.approx(beta * (pr[k] - rr[k]), abs=1e-6)
    assert loss_type in DPO_LOSS_TYPES


def test_dpo_loss_special_points_and_reference_free():
    """h = 0 gives ln 2 (sigmoid, and robust whatever the smoothing); rewards carry no gradient; reference-free
    DPO (zeros as the reference) is DPO on the policy's own margin; an unknown type is a UserError."""
    zero = torch.zeros(2)
    for eps in (0.0, 0.1, 0.3):
        for loss_type in ('sigmoid', 'robust'):
            losses, _, _ = dpo_loss(zero - 1, zero - 1, zero - 2, zero - 2, 0.1, loss_type, eps)
            assert torch.allclose(losses, torch.full((2,), LN2)), (loss_type, eps)
    pc = torch.tensor([-1.0, -6.0], requires_grad=True)
    pr = torch.tensor([-2.0, -3.0], requires_grad=True)
    losses, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, zero, zero, 0.5)
    for k in range(2):
        margin = pc[k].item() - pr[k].item()
        assert losses[k].item() == pytest.approx(math.log1p(math.exp(-0.5 * margin)), rel=1e-6)
    assert torch.equal(chosen_rewards, 0.5 * pc.detach()) and torch.equal(rejected_rewards, 0.5 * pr.detach())
    assert not chosen_rewards.requires_grad and not rejected_rewards.requires_grad and losses.requires_grad
    with pytest.raises(UserError, match='loss_type'):
        dpo_loss(pc, pr, zero, zero, 0.1, 'kto')


@pytest.mark.comparison
def test_sequence_logps_is_a_per_sequence_sum_in_fp32():
    """Per-sequence sums of log-softmax gathers, against a hand loop in float64; bf16 logits are summed in fp32."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 7, generator=g) * 3
    targets = torch.randint(7, (11,), generator=g)
    seq = torch.tensor([0, 0, 0, 2, 2, 1, 1, 1, 1, 3, 0])  # interleaved owners, as in packed rows
    sums, token_logps = sequence_logps(logits, targets, seq, 5)
    expected = [0.0] * 5
    for i in range(11):
        row = logits[i].double()
        logp = row[targets[i]].item() - math.log(sum(math.exp(v) for v in row.tolist()))
        assert token_logps[i].item() == pytest.approx(logp, abs=1e-5)
        expected[seq[i]] += logp
    assert sums.shape == (5,) and sums[4].item() == 0.0  # a sequence with no tokens sums to 0
    assert sums.tolist() == pytest.approx(expected, abs=1e-5)

    bf16 = (logits * 10).bfloat16()  # large logits: a bf16 log-softmax would be off by ~0.1
    sums, token_logps = sequence_logps(bf16, targets, seq, 5)
    assert sums.dtype == token_logps.dtype == torch.float32
    exact = bf16.double().log_softmax(-1).gather(1, targets[:, None])[:, 0]
    assert torch.allclose(token_logps.double(), exact, atol=1e-4)
    assert torch.allclose(sums.double(), torch.zeros(5, dtype=torch.float64).index_add(0, seq, exact), atol=1e-4)


# -- preference data -----------------------------------------------------------------------------

def test_three_jsonl_forms_give_the_same_tokens(tmp_path):
    """Prompt string, prompt messages with assistant-reply lists, an implicit shared-prefix prompt and ShareGPT's
    conversations: same ids; each completion ends with <|end|> (the EOS); a system turn and multi-turn prefix go
    into the prompt."""
    tok = char_tokenizer()
    q, c, r = 'What is 1+2?', '3', '14'
    user = [{'role': 'user', 'content': q}]
    answer = lambda text: [{'role': 'assistant', 'content': text}]  # noqa: E731
    path = write_jsonl(tmp_path / 'p.jsonl', [
        {'prompt': q, 'chosen': c, 'rejected': r},
        {'prompt': user, 'chosen': answer(c), 'rejected': answer(r)},
        {'chosen': user + answer(c), 'rejected': user + answer(r)},
        {'prompt': user, 'chosen': c, 'rejected': answer(r)},
        # ShareGPT's (LLaMA-Factory's layout): the prompt's turns, then one reply turn each
        {'conversations': [{'from': 'human', 'value': q}], 'chosen': {'from': 'gpt', 'value': c},
         'rejected': {'from': 'gpt', 'value': r}},
    ])
    references, pairs = load_preference_split(path, tok, 64, 48)
    special = tok.special
    prompt = [special['<|user|>'], *tok.encode(q), tok.eos_id, special['<|assistant|>']]
    assert tok.eos_id == special['<|end|>']
    assert pairs == [(prompt, [*tok.encode(c), tok.eos_id], [*tok.encode(r), tok.eos_id])] * 5
    assert references == [(prompt, c)] * 5

    system = [{'role': 'system', 'content': 'be brief'}]
    turns = system + user + answer('3') + [{'role': 'user', 'content': 'and 2+2?'}]
    path = write_jsonl(tmp_path / 'multi.jsonl', [{'chosen': turns + answer('4'), 'rejected': turns + answer('5')},
                                                  {'prompt': turns, 'chosen': '4', 'rejected': '5'}])
    _, (implicit, explicit) = load_preference_split(path, tok, 64, 48)
    assert implicit == explicit
    assert tok.decode(implicit[0]) == ('<|system|>be brief<|end|><|user|>What is 1+2?<|end|><|assistant|>3<|end|>'
                                       '<|user|>and 2+2?<|end|><|assistant|>')
    assert tok.decode(implicit[1]) == '4<|end|>' and tok.decode(implicit[2]) == '5<|end|>'


def test_a_reply_that_calls_tools_needs_a_template_that_writes_calls(tmp_path):
    """A chosen reply with "tool_calls" on nanotrain's own template: refused naming the line (the reference was
    read before the template's refusal: an AttributeError)."""
    call = {'role': 'assistant', 'content': '', 'tool_calls': [{'function': {'name': 'f', 'arguments': {}}}]}
    path = write_jsonl(tmp_path / 'p.jsonl', [{'prompt': 'What is 1+2?', 'chosen': [call], 'rejected': '4'}])
    with pytest.raises(UserError, match=f"{path}:1: nanotrain's own chat template has no tools"):
        load_preference_split(path, char_tokenizer(), 64, 48)


def test_anthropic_hh_transcripts(tmp_path, capsys):
    """Anthropic HH pairs (whole "\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts, no "prompt"): the turns before the
    last become user/assistant prompt messages, the last assistant turn of each the completions, giving the same
    tokens as the explicit form, multi-turn too. Transcripts that differ before their last turn, end on a Human
    turn or are no transcript at all are errors at path:line; identical ones are dropped and counted."""
    tok = char_tokenizer()
    turns = '\n\nHuman: What is 1+2?\n\nAssistant: 3\n\nHuman: and 2+2?\n\nAssistant:'
    messages = [{'role': 'user', 'content': 'What is 1+2?'}, {'role': 'assistant', 'content': '3'},
                {'role': 'user', 'content': 'and 2+2?'}]
    path = write_jsonl(tmp_path / 'hh.jsonl', [
        {'chosen': '\n\nHuman: What is 1+2?\n\nAssistant: 3', 'rejected': '\n\nHuman: What is 1+2?\n\nAssistant: 14'},
        {'chosen': turns + ' 4', 'rejected': turns + ' 5\n\nso five.'},  # a reply with a blank line in it
        {'prompt': 'What is 1+2?', 'chosen': '3', 'rejected': '14'},
        {'prompt': messages, 'chosen': '4', 'rejected': '5\n\nso five.'},
    ])
    references, pairs = load_preference_split(path, tok, 64, 48)
    assert pairs[:2] == pairs[2:] and references[:2] == references[2:]
    assert tok.decode(pairs[1][0]) == ('<|user|>What is 1+2?<|end|><|assistant|>3<|end|><|user|>and 2+2?<|end|>'
                                       '<|assistant|>')
    assert tok.decode(pairs[1][1]) == '4<|end|>' and tok.decode(pairs[1][2]) == '5\n\nso five.<|end|>'
    good = {'chosen': turns + ' 4', 'rejected': turns + ' 5'}
    _, pairs = load_preference_split(write_jsonl(tmp_path / 'same.jsonl', [good, {'chosen': turns + ' 4',
                                                                              'rejected': turns + ' 4'}]), tok, 64, 48)
    assert len(pairs) == 1 and '1 pairs dropped with chosen == rejected' in capsys.readouterr().out
    bad = [({'chosen': turns + ' 4', 'rejected': turns.replace('3', '7') + ' 5'},
            'the same conversation up to their last turn.* differ at turn 2 of 4 .*chosen: "3", rejected: "7"'),
           ({'chosen': turns + ' 4', 'rejected': '\n\nHuman: What is 1+2?\n\nAssistant: 5'},
            'chosen has 4 turns and rejected 2'),
           ({'chosen': turns + ' 4\n\nHuman: ok', 'rejected': turns + ' 5\n\nHuman: ok'},
            'the last turn is a user turn in chosen'),
           ({'chosen': '4', 'rejected': '5'}, 'no "prompt" beside it, so it must be a whole Anthropic HH transcript'),
           ({'chosen': 42, 'rejected': turns + ' 5'}, '"chosen" with no "prompt" beside it must be a whole '
                                                      'conversation: an Anthropic HH transcript string .* got 42')]
    for i, (line, message) in enumerate(bad):
        path = write_jsonl(tmp_path / f'bad{i}.jsonl', [good, line])
        with pytest.raises(UserError, match=rf'{path}:2: .*{message}'):
            load_preference_split(path, tok, 64, 48)


def test_malformed_lines_name_path_and_line(tmp_path, capsys):
    """Bad JSON, a missing "rejected", a wrong role, non-strings: UserError at path:line; skip_malformed counts them."""
    good = {'prompt': 'What is 1+1?', 'chosen': '2', 'rejected': '3'}
    bad = [
        '{"prompt": "What is 1+1?", "chosen": "2"',                                    # bad JSON
        {'prompt': 'What is 1+1?', 'chosen': '2'},                                     # missing rejected
        {'prompt': 'x', 'chosen': [{'role': 'user', 'content': '2'}], 'rejected': '3'},  # not an assistant reply
        {'prompt': [{'role': 'robot', 'content': 'x'}], 'chosen': '2', 'rejected': '3'},  # unknown role
        {'prompt': 'x', 'chosen': 2, 'rejected': '3'},                                 # not a string
        {'prompt': 'x', 'chosen': '2', 'rejected': [{'role': 'assistant', 'content': 3}]},
        [good],                                                                         # not an object
        {'prompt': [{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': 'y'}],  # ends with a reply
         'chosen': '2', 'rejected': '3'},
        '{"prompt": "What is 1+1?\\ud800", "chosen": "2", "rejected": "3"}',             # a lone surrogate
        '[' * 100_000 + ']' * 100_000,                                                  # nesting beyond recursion
        {'prompt': 5, 'chosen': '2', 'rejected': '3'},                                 # prompt neither text nor turns
    ]
    tok = char_tokenizer()
    for i, line in enumerate(bad):
        path = write_jsonl(tmp_path / f'bad{i}.jsonl', [good, '', line, good])
        with pytest.raises(UserError, match=rf'{path}:3: .*skip_malformed=True'):
            load_preference_split(path, tok, 64, 48)
    with pytest.raises(UserError, match='"prompt" must be a string or a list of .* got 5'):
        load_preference_split(path, tok, 64, 48)
    with pytest.raises(UserError, match=r'"chosen" must be the reply as a string \(the usual form\) or as .* got 2'):
        load_preference_split(str(tmp_path / 'bad4.jsonl'), tok, 64, 48)
    path = write_jsonl(tmp_path / 'mixed.jsonl', [good, *bad, good])
    references, pairs = load_preference_split(path, tok, 64, 48, skip_malformed=True)
    assert len(references) == len(pairs) == 2
    assert f'{len(bad)} malformed lines skipped' in capsys.readouterr().out
    with pytest.raises(UserError, match='no usable preference pairs'):
        load_preference_split(write_jsonl(tmp_path / 'empty.jsonl', ['']), tok, 64, 48)
    with pytest.raises(UserError, match='no usable preference pairs'):
        load_preference_split(write_jsonl(tmp_path / 'all_bad.jsonl', bad), tok, 64, 48, skip_malformed=True)
    with pytest.raises(UserError, match='does not exist'):
        load_preference_split(str(tmp_path / 'missing.jsonl'), tok, 64, 48)


def test_truncation_keeps_prompt_end_and_completion_start(tmp_path, capsys):
    """A long prompt keeps its last max_prompt_length tokens, a long completion its first tokens; a pair left
    with no room for a completion is dropped and counted; the exact-match reference keeps the whole prompt."""
    tok = char_tokenizer()
    long_prompt, long_reply = 'abcdefghijklmnopqrstuvwxyz', 'ABCDEFGHIJKLMNOPQRSTUVWXYZ'
    path = write_jsonl(tmp_path / 't.jsonl', [{'prompt': long_prompt, 'chosen': long_reply, 'rejected': 'no'},
                                              {'prompt': 'hi', 'chosen': 'yes', 'rejected': 'no'}])
    references, pairs = load_preference_split(path, tok, 20, 12)
    full_prompt = tok.encode_prompt([{'role': 'user', 'content': long_prompt}])
    (prompt, chosen, rejected), short = pairs
    assert prompt == full_prompt[-12:] and tok.decode(prompt).endswith('xyz<|end|><|assistant|>')
    assert chosen == tok.encode(long_reply)[:8] and tok.eos_id not in chosen  # its first 20 - 12 tokens
    assert rejected == [*tok.encode('no'), tok.eos_id]  # short enough: untouched
    assert short == (tok.encode_prompt([{'role': 'user', 'content': 'hi'}]), [*tok.encode('yes'), tok.eos_id],
                     [*tok.encode('no'), tok.eos_id])
    assert references[0] == (full_prompt, long_reply)
    out = capsys.readouterr().out
    assert '1 prompts cut' in out and '1 completions cut' in out and '0 pairs dropped' in out
    # chosen == rejected carries no preference: dropped and counted, also when they differ only past the cut
    path = write_jsonl(tmp_path / 'same.jsonl', [{'prompt': 'hi', 'chosen': 'yes', 'rejected': 'yes'},
                                                 {'prompt': 'hi', 'chosen': long_reply + 'A', 'rejected': long_reply},
                                                 {'prompt': 'hi', 'chosen': 'yes', 'rejected': 'no'}])
    _, pairs = load_preference_split(path, tok, 20, 12)
    assert len(pairs) == 1 and '2 pairs dropped with chosen == rejected' in capsys.readouterr().out
    only_same = write_jsonl(tmp_path / 'only_same.jsonl', [{'prompt': 'a', 'chosen': 'b', 'rejected': 'b'}])
    with pytest.raises(UserError, match='1 with chosen == rejected'):
        load_preference_split(only_same, tok, 20, 12)
    # max_prompt_length == max_length: the long prompt fills the row, nothing is left for its completions
    _, pairs = load_preference_split(path, tok, 12, 12)
    assert len(pairs) == 1 and pairs[0][0] == tok.encode_prompt([{'role': 'user', 'content': 'hi'}])
    assert '1 pairs dropped' in capsys.readouterr().out


# -- batching ------------------------------------------------------------------------------------

def test_preference_batches_layout():
    """Padded rows: the chosen sequences of the pairs, then their rejected ones, right-padded; exactly the
    completion tokens are scored, chosen k owned by k and rejected k by n + k."""
    pairs = random_pairs(5)
    batches = PreferenceBatches(pairs, seed=0, pad_id=99, max_length=16)
    indices = torch.tensor([3, 0, 4])
    batch = batches.get(indices)
    x = batch['x']
    assert batch['positions'] is None and batch['mask'] is None and x.shape[0] == 6
    for row, (k, completion) in enumerate([(k, 1) for k in range(3)] + [(k, 2) for k in range(3)]):
        prompt, reply = pairs[indices[k]][0], pairs[indices[k]][completion]
        n = len(prompt) + len(reply) - 1
        assert x[row, :n].tolist() == (prompt + reply)[:-1] and (x[row, n:] == 99).all()
        mine = batch['rows'] == row
        assert batch['cols'][mine].tolist() == list(range(len(prompt) - 1, n))
        assert batch['targets'][mine].tolist() == reply and (batch['owners'][mine] == row).all()
    assert batches.completion_tokens[indices].tolist() == [[len(pairs[i][1]), len(pairs[i][2])] for i in indices]
    assert batches.count_tokens(indices) == sum(len(p) + len(c) + len(p) + len(r) - 2 for p, c, r in
                                                (pairs[i] for i in indices))


def test_packed_pair_shares_its_prompt():
    """Packed: a pair is prompt, chosen[:-1], rejected[:-1] once; both completions continue the prompt's
    positions, see the prompt and themselves but not each other, and the prompt's last position scores
    the first token of both."""
    prompt, chosen, rejected = [1, 2, 3], [4, 5, 6], [7, 8]
    batch = PreferenceBatches([(prompt, chosen, rejected)], seed=0, pad_id=0, max_length=8, pack=True).get(
        torch.tensor([0]))
    assert batch['x'].tolist() == [[1, 2, 3, 4, 5, 7]]
    assert batch['positions'].tolist() == [[0, 1, 2, 3, 4, 3]]
    allowed = batch['mask'][0, 0]
    assert allowed[5].tolist() == [True, True, True, False, False, True]  # rejected: prompt and itself only
    assert allowed[4].tolist() == [True, True, True, True, True, False]   # chosen: causal, prompt and itself
    scored = list(zip(batch['cols'].tolist(), batch['targets'].tolist(), batch['owners'].tolist()))
    assert scored == [(2, 4, 0), (3, 5, 0), (4, 6, 0), (2, 7, 1), (5, 8, 1)]


@pytest.mark.comparison
def test_packed_and_padded_batches_give_the_same_sequence_logps():
    """Through a tiny GPT (as lm/dpo.sequence_logps_and_logits does it), packed rows (prompts shared, several
    pairs per row) and padded rows give each sequence the log-prob it has alone, to ~1e-5."""
    torch.manual_seed(0)
    pairs = random_pairs(6, seed=1)
    indices = torch.tensor([5, 1, 2, 0])
    for pos_emb in ('rope', 'learned'):
        model = GPT(GPTConfig(block_size=16, vocab_size=10, n_layer=2, n_head=2, n_embd=32, pos_emb=pos_emb)).eval()
        results = {}
        for pack in (False, True):
            batch = PreferenceBatches(pairs, 0, 0, 16, pack).get(indices)
            with torch.no_grad():
                logits, _ = model(batch['x'], positions=batch['positions'], mask=batch['mask'],
                                  logits_at=(batch['rows'], batch['cols']))
            results[pack] = sequence_logps(logits, batch['targets'], batch['owners'], 8)[0]
            assert (batch['x'].shape[0] < 4) == pack  # packing puts several pairs in a row
        with torch.no_grad():
            alone = [hand_completion_logps(model, pairs[i][0], pairs[i][c]) for c in (1, 2) for i in indices.tolist()]
        assert torch.allclose(results[False], results[True], atol=1e-5)
        assert results[True].tolist() == pytest.approx(alone, abs=1e-5)


def test_preference_sampling_epochs_and_state_dict_round_trip():
    """Each epoch draws every pair once; a state dict (saved and loaded) reproduces the following draws; a
    state for another number of pairs is refused."""
    pairs = random_pairs(10)
    a = PreferenceBatches(pairs, seed=3, pad_id=0, max_length=16)
    first_epoch = torch.cat([a.sample(5), a.sample(5)])
    assert sorted(first_epoch.tolist()) == list(range(10))
    a.sample(3)
    state = a.state_dict()
    expected = [a.sample(4).tolist() for _ in range(6)]  # crosses epoch boundaries
    b = PreferenceBatches(pairs, seed=99, pad_id=0, max_length=16)
    b.load_state_dict(torch.load(torch_saved(state), weights_only=True))
    assert [b.sample(4).tolist() for _ in range(6)] == expected and b.batches_drawn == a.batches_drawn
    with pytest.raises(UserError, match='training data changed'):
        PreferenceBatches(pairs[:9], seed=3, pad_id=0, max_length=16).load_state_dict(state)


# -- the embedded pairs ---------------------------------------------------------------------------

def test_embedded_pairs_are_correct_disjoint_and_deterministic(tmp_path):
    """Chosen is the right answer (sums and differences worked right), rejected a different non-negative number
    (or a working with a slip); splits share no question; the same arguments write the same files."""
    out = prepare_number_tasks(str(tmp_path / 'a'), n_train=200, n_eval=20, preferences=True)
    questions = {}
    for split in ('train', 'val', 'test'):
        with open(os.path.join(out, f'{split}.jsonl')) as f:
            rows = [json.loads(line) for line in f]
        assert len(rows) == (200 if split == 'train' else 20)
        for r in rows:
            assert set(r) == {'prompt', 'chosen', 'rejected'}
            kind, match = next((k, m) for k, (p, _) in enumerate(ANSWERS) if (m := re.fullmatch(p, r['prompt'])))
            assert checked_answer(kind, match, r['chosen']) == str(ANSWERS[kind][1](*match.groups()))
            assert r['rejected'] != r['chosen'], r
            assert re.fullmatch(WORKING, r['rejected']) if kind <= 1 else r['rejected'].isdigit(), r
        questions[split] = {r['prompt'] for r in rows}
        assert len(questions[split]) == len(rows)
    assert not (questions['train'] & questions['val'] or questions['train'] & questions['test']
                or questions['val'] & questions['test'])
    again = prepare_number_tasks(str(tmp_path / 'b'), n_train=200, n_eval=20, preferences=True)
    for split in ('train', 'val', 'test'):
        assert open(os.path.join(out, f'{split}.jsonl')).read() == open(os.path.join(again, f'{split}.jsonl')).read()


# -- train_dpo.py --------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def two_sources(dpo_env, tmp_path_factory):
    """--dpo_data naming two sources with weights 1 and 0.5: dpo_env's pairs, every other line of each split."""
    root = tmp_path_factory.mktemp('two_sources')
    for s, name in enumerate(('a', 'b')):
        (root / name).mkdir()
        for split in ('train', 'val', 'test'):
            lines = open(os.path.join(dpo_env['pairs'], f'{split}.jsonl')).read().splitlines()
            (root / name / f'{split}.jsonl').write_text('\n'.join(lines[s::2]) + '\n')
    return f"--dpo_data={{'a': ('{root / 'a'}', 1.0), 'b': ('{root / 'b'}', 0.5)}}"


SOURCE_METRICS = [f'{key}/{source}' for key in ('loss', 'rewards/accuracies', 'rewards/margins') for source in 'ab']


@pytest.fixture(scope='module')
def step0(dpo_env, tmp_path_factory):
    """An eval-only run of the SFT model against its frozen copy: the step-0 metrics."""
    out = tmp_path_factory.mktemp('step0')
    p = dpo(dpo_env, out, '--eval_only=True')
    return dict(out=out, stdout=p.stdout, eval=evals(out)[0])


def assert_step0_identities(e, tol=1e-6, exact_ties=True):
    """Policy == reference: every pair's margin is 0, so the loss is ln 2 (plain DPO, the default: no RPO term), the
    rewards 0, and the accuracy 0: TRL's, where a tie counts wrong (exact_ties=False: the reference's log-probs are
    equal only up to float noise, which may break ties)."""
    assert abs(e['eval/loss'] - LN2) < tol, e
    assert abs(e['eval/rewards/chosen']) < tol and abs(e['eval/rewards/rejected']) < tol, e
    assert abs(e['eval/rewards/margins']) < tol, e
    assert e['eval/rewards/accuracies'] == 0.0 or not exact_ties, e


@pytest.mark.slow
def test_step0_frozen_reference_is_ln2_and_logs_hand_logps(step0, dpo_env):
    """Frozen-copy reference at step 0: loss ln 2, rewards 0, accuracy 0 (all ties), KL 0; the logged mean log-probs
    and NLL of the chosen completions match the SFT model run on each pair alone."""
    e = step0['eval']
    assert e['step'] == 0 and 'a frozen copy' in step0['stdout']
    assert_step0_identities(e)
    assert abs(e['eval/kl']) < 1e-6
    assert not (step0['out'] / 'ckpt.pt').exists()  # eval_only saves nothing
    ckpt = load(dpo_env['sft'])
    model = GPT(GPTConfig(**ckpt['model_args'])).eval()
    model.load_state_dict(ckpt['model'])
    tok = ChatTokenizer(load_tokenizer(dpo_env['data_dir']))
    _, pairs = load_preference_split(os.path.join(dpo_env['pairs'], 'val.jsonl'), tok, 40, 32)
    with torch.no_grad():
        chosen = [hand_completion_logps(model, p, c) for p, c, _ in pairs]
        rejected = [hand_completion_logps(model, p, r) for p, _, r in pairs]
    assert e['eval/logps/chosen'] == pytest.approx(sum(chosen) / len(pairs), abs=1e-4)
    assert e['eval/logps/rejected'] == pytest.approx(sum(rejected) / len(pairs), abs=1e-4)
    assert e['eval/nll/chosen'] == pytest.approx(-sum(chosen) / sum(len(c) for _, c, _ in pairs), abs=1e-5)


@pytest.mark.slow
def test_step0_lora_reference_is_the_model_with_adapters_disabled(tmp_path, dpo_env):
    """LoRA: B starts at zero, so policy == base == reference (adapters disabled) and the step-0 loss is ln 2;
    after training, the adapters' checkpoint and a merged.pt are written."""
    out = tmp_path / 'lora'
    p = dpo(dpo_env, out, '--use_lora=True', '--lora_r=2', '--max_iters=1', '--eval_interval=1')
    assert 'adapters disabled' in p.stdout
    assert_step0_identities(evals(out)[0])
    assert evals(out)[1]['eval/rewards/margins'] != 0, \
        "after a step the policy (adapters on) must differ from the reference (adapters disabled)"
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['kind'] == 'lora' and all('lora_' in k for k in ckpt['model']) and (out / 'merged.pt').exists()
    # resuming with another adapter scale would silently rescale the trained adapters
    p = dpo(dpo_env, out, '--use_lora=True', '--lora_r=2', '--lora_alpha=64', '--max_iters=2', check=False)
    assert_user_error(p, 'lora_alpha: checkpoint has 16.0')
    assert load(out / 'ckpt.pt')['iter_num'] == ckpt['iter_num']


@pytest.mark.slow
def test_held_out_metrics_at_every_eval(tmp_path, dpo_env):
    """eval_metrics: greedy answers to the held-out prompts scored against the chosen answers at step 0 and
    every eval, as eval/<name> next to eval/loss. Counted in epochs, evaluated at each epoch's end: 2 epochs of the
    40 pairs in global batches of 48 are a step each, whose last 8 places hold no pair; at step 1 (the starting
    weights) the loss is ln 2 and the chosen log-probs the mean over the 40 pairs, as if the 8 were not there.
    With --wandb_log=True (a stand-in wandb package) every number of log.jsonl went to W&B too."""
    p = dpo(dpo_env, tmp_path, '--num_train_epochs=2', '--eval_every_epochs=1', '--eval_interval=1000',
            '--batch_size=24', '--gradient_accumulation_steps=2', '--exact_match_examples=4',
            '--eval_metrics=exact_match,chrf', '--wandb_log=True', env_extra=wandb_env())
    held_out = [e for e in read_log(tmp_path) if 'eval/exact_match' in e]
    assert [e['step'] for e in held_out] == [0, 1, 2] and all(0 <= e['eval/chrf'] <= 100 for e in held_out)
    assert 'step 2: exact_match ' in p.stdout and 'on 4 held-out prompts' in p.stdout
    assert 'num_train_epochs=2: 2 epoch(s) of 1 step each, 48 pairs a step' in p.stdout
    step1 = train_metrics(tmp_path)[1]
    assert step1['epoch'] == 1.0 and abs(step1['loss'] - LN2) < 1e-6 and step1['rewards/accuracies'] == 0
    ckpt = load(dpo_env['sft'])
    model = GPT(GPTConfig(**ckpt['model_args'])).eval()
    model.load_state_dict(ckpt['model'])
    _, pairs = load_preference_split(os.path.join(dpo_env['pairs'], 'train.jsonl'),
                                     ChatTokenizer(load_tokenizer(dpo_env['data_dir'])), 40, 32)
    with torch.no_grad():
        chosen = [hand_completion_logps(model, p, c) for p, c, _ in pairs]
    assert len(pairs) == 40 and step1['logps/chosen'] == pytest.approx(sum(chosen) / 40, abs=1e-4)
    assert_logged_to_wandb(tmp_path)


@pytest.mark.slow
def test_step0_precomputed_reference_is_cached_and_reused(tmp_path, dpo_env):
    """precompute_ref_logps: ln 2 at step 0 (to 1e-4: the cache was computed with other batches' padding), the
    cache file is written in out_dir and a second run reads it instead of recomputing."""
    out = tmp_path / 'pre'
    p = dpo(dpo_env, out, '--precompute_ref_logps=True', '--eval_only=True')
    assert 'precomputed log-probs' in p.stdout and 'reference log-probs from' not in p.stdout
    assert_step0_identities(evals(out)[0], tol=1e-4, exact_ties=False)
    caches = glob.glob(str(out / 'ref_logps_*.pt'))
    assert len(caches) == 1
    cache = load(caches[0])
    assert cache['train'].shape == (40, 2) and cache['val'].shape == (8, 2) and (cache['val'] < 0).all()
    p = dpo(dpo_env, out, '--precompute_ref_logps=True', '--eval_only=True')
    assert f'reference log-probs from {caches[0]}' in p.stdout
    assert_step0_identities(evals(out)[1], tol=1e-4, exact_ties=False)


@pytest.mark.slow
@pytest.mark.comparison
def test_gradient_accumulation_and_ddp_match_one_big_batch(tmp_path, dpo_env, two_sources):
    """Sums are normalized by the whole batch (two sources weighted 1 and 0.5: by its loss weight): 4 pairs x 1 =
    1 x 4 = 2 x 2 = 2 ranks (torchrun, gloo) x 2 pairs give the same train metrics at every step (RPO's NLL
    included; each source's too), the same gradient norm at the first (same weights: the accumulated gradient
    itself) and the same eval metrics of the final weights.
    rel=1e-5, abs=1e-5: the runs add the same float32 terms in other orders (other micro-batch shapes, other BLAS
    kernels on other CPUs), which moves a sum of n terms by at most ~n * 2^-24 of its terms' size: ~1e-6 relative
    for the log-prob sums (completions of <= 8 tokens, means over 4 pairs), ~1e-6 absolute for the rewards (beta x
    the difference of two log-prob sums of ~25); measured: <= 2e-6 on logps, <= 3e-7 on rewards, also with one
    run on SSE kernels. A wrong normalization is off by > 1e-3. The weights are not compared one by one: Adam
    divides each gradient by its own root mean square, so a weight whose gradient is rounding noise (~1e-9 against
    Adam's eps 1e-8) moves by up to ~lr either way, differently on each CPU; with a gradient ~0 such weights hardly
    change any metric, and a small lr keeps their second-order effect on the later steps far below the tolerance."""
    common = ['--max_iters=3', '--eval_interval=100', '--rpo_alpha=0.5', '--learning_rate=1e-3', two_sources]
    runs = {(4, 1, 1): tmp_path / 'big', (1, 4, 1): tmp_path / 'acc4', (2, 2, 1): tmp_path / 'acc2',
            (2, 1, 2): tmp_path / 'ddp'}
    for (bs, accum, ranks), out in runs.items():
        dpo(dpo_env, out, f'--batch_size={bs}', f'--gradient_accumulation_steps={accum}', *common, ranks=ranks)
    big, big_evals = train_metrics(runs[4, 1, 1]), evals(runs[4, 1, 1])
    assert sorted(big) == [1, 2, 3] and big[3]['loss'] != big[1]['loss'] and big[3]['rewards/margins'] != 0
    assert [e['step'] for e in big_evals] == [0, 3]
    for shape, out in runs.items():
        other = train_metrics(out)
        assert sorted(other) == [1, 2, 3]
        for step in big:
            assert {k for k in other[step] if k in SOURCE_METRICS} == {k for k in big[step] if k in SOURCE_METRICS}
            for k in TRAIN_METRICS + ('grad_norm',) * (step == 1) + tuple(k for k in SOURCE_METRICS if k in big[step]):
                assert other[step][k] == pytest.approx(big[step][k], rel=1e-5, abs=1e-5), (shape, step, k)
        for e, other_e in zip(big_evals, evals(out), strict=True):
            assert other_e == pytest.approx(e, rel=1e-5, abs=1e-5), shape
    weights, start = load(runs[4, 1, 1] / 'ckpt.pt')['model'], load(dpo_env['sft'])['model']
    assert max((weights[k] - start[k]).abs().max().item() for k in weights) > 1e-3  # it trained


def assert_same_state(a, b, where='state'):
    """Nested dicts/lists of tensors and numbers equal exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f'{where}.{k}')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f'{where}[{i}]')
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path, dpo_env, two_sources):
    """4 steps straight = 2 steps, then resumed to 4 (two weighted sources, dropout, packing, accumulation): train
    metrics (each source's too), weights, optimizer state and sampler state all equal exactly. Each source's eval
    metrics and exact match are logged; the eval loss weighs each source's by its weight and pairs."""
    common = ['--dropout=0.1', '--pack=True', '--gradient_accumulation_steps=2', '--batch_size=2',
              '--eval_interval=2', '--exact_match_examples=2', two_sources]
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    dpo(dpo_env, straight, '--max_iters=4', *common)
    dpo(dpo_env, split, '--max_iters=2', *common)
    assert load(split / 'ckpt.pt')['iter_num'] == 2
    p = dpo(dpo_env, split, '--max_iters=4', '--init_from=resume', *common)  # nanoGPT's: the run's own origin
    assert 'resuming' in p.stdout + p.stderr
    a, b = train_metrics(straight), train_metrics(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert all(a[s][k] == b[s][k] for s in a for k in TRAIN_METRICS), (a, b)
    assert all({k: v for k, v in a[s].items() if k in SOURCE_METRICS} == {k: v for k, v in b[s].items()
                                                                           if k in SOURCE_METRICS} for s in a)
    assert sum(k in a[s] for s in a for k in SOURCE_METRICS) >= 18  # most steps hold both sources
    assert evals(straight)[1:] == evals(split)[1:]
    pairs = {'a': 4, 'b': 4}  # each source's val pairs (eval_pairs=8 takes them all)
    for e in evals(straight):
        assert e['eval/loss'] == pytest.approx((pairs['a'] * e['eval/loss/a'] + 0.5 * pairs['b'] * e['eval/loss/b'])
                                               / (pairs['a'] + 0.5 * pairs['b']), rel=1e-6)
    held_out = [e for e in read_log(straight) if 'eval/exact_match' in e]
    assert len(held_out) == 3 and all('eval/exact_match/a' in e and 'eval/exact_match/b' in e for e in held_out)
    assert 'step 4: eval loss ' in p.stdout and re.search(r'step 4: eval loss [\d.]+ \(a [\d.]+, b [\d.]+\)', p.stdout)
    ca, cb = load(straight / 'ckpt.pt'), load(split / 'ckpt.pt')
    assert ca['iter_num'] == cb['iter_num'] == 4
    # the checkpoint's config is what the user passed; what the run derived is stored beside it
    assert (ca['config']['init_from'], cb['config']['init_from']) == (dpo_env['sft'], 'resume')
    assert ca['run']['init_from'] == cb['run']['init_from'] == os.path.abspath(dpo_env['sft'])
    assert ca['config']['device'] == 'cpu' and ca['config']['data_dir'] == dpo_env['data_dir']
    assert ca['data_dir'] == os.path.abspath(dpo_env['data_dir'])
    assert (cb['config']['batch_size'], cb['batch_size'], cb['gradient_accumulation_steps']) == (2, 2, 2)
    for key in ('model', 'optimizer', 'train_batches', 'best_val_loss', 'reference_hash'):
        assert_same_state(ca[key], cb[key], key)


@pytest.mark.slow
def test_bf16_run_with_16_bit_reference_starts_at_exact_ties_and_resumes_bit_exactly(tmp_path, dpo_env):
    """--dtype=bfloat16: the reference's Linear weights are bf16 (frozen_model), the policy's
    float32, yet at step 0 every margin is exactly 0 (the same log-probs under autocast); stopped
    after step 2 and continued (the reference rebuilt so), the run is the straight one's bit for
    bit."""
    common = ['--dtype=bfloat16', '--eval_interval=2', '--batch_size=2']
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    dpo(dpo_env, straight, '--max_iters=4', *common)
    dpo(dpo_env, split, '--max_iters=2', *common)
    p = dpo(dpo_env, split, '--max_iters=4', *common)
    assert 'resuming' in p.stdout + p.stderr
    step0, step1 = evals(straight)[0], train_metrics(straight)[1]
    assert_step0_identities(step0)
    assert step0['eval/rewards/chosen'] == step0['eval/rewards/rejected'] == step1['rewards/margins'] == 0
    a, b = train_metrics(straight), train_metrics(split)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and a[4]['rewards/margins'] != 0  # it trained
    assert all(a[s][k] == b[s][k] for s in a for k in TRAIN_METRICS), (a, b)
    assert evals(straight)[1:] == evals(split)[1:]


@pytest.mark.slow
def test_resume_refuses_changed_data_reference_or_cache(tmp_path, dpo_env):
    """Resuming checks what the run began with: other training pairs (same count), a reference no longer where
    the checkpoint names it, an unreadable reference cache: exit 2 naming the file, the checkpoint untouched."""
    reference, pairs, out = tmp_path / 'sft.pt', tmp_path / 'pairs', tmp_path / 'run'
    shutil.copy(dpo_env['sft'], reference)
    shutil.copytree(dpo_env['pairs'], pairs)
    common = [f'--init_from={reference}', f'--dpo_data={pairs}', '--eval_interval=2', '--precompute_ref_logps=True']
    dpo(dpo_env, out, '--max_iters=2', *common)
    saved = (out / 'ckpt.pt').read_bytes()
    train = pairs / 'train.jsonl'
    lines = train.read_text().splitlines()
    train.write_text('\n'.join([lines[1], lines[0], *lines[2:]]) + '\n')  # the same pairs, in another order
    cache = glob.glob(str(out / 'ref_logps_*.pt'))[0]
    cases = [(lambda: None, [str(train), 'is not the training data the run in', 'it has changed since']),
             (lambda: shutil.copytree(dpo_env['pairs'], pairs, dirs_exist_ok=True), None),  # restored: resumes
             (lambda: open(cache, 'wb').close(), [cache, 'Delete it']),
             (lambda: os.replace(reference, tmp_path / 'moved.pt'), [str(reference), 'no longer exists'])]
    for change, messages in cases:
        change()
        p = dpo(dpo_env, out, '--max_iters=2', *common, check=False)
        if messages is None:
            assert p.returncode == 0 and 'resuming' in p.stdout + p.stderr, p.stderr
            saved = (out / 'ckpt.pt').read_bytes()  # its final save
            continue
        assert_user_error(p)
        assert all(m in p.stderr for m in messages), (messages, p.stderr)
        assert (out / 'ckpt.pt').read_bytes() == saved


@pytest.mark.slow
def test_bad_inputs_are_clear_errors_and_keep_checkpoints(tmp_path, dpo_env):
    """A missing init_from, a pretrained (not fine-tuned) init_from, a malformed pair and out-of-range settings:
    exit 2 with a message naming the file (and line) or key, no traceback, and the out_dir's checkpoint
    untouched, nothing new written."""
    bad = tmp_path / 'bad'
    bad.mkdir()
    write_jsonl(bad / 'train.jsonl', [{'prompt': 'What is 1+1?', 'chosen': '2', 'rejected': '3'},
                                      {'prompt': 'What is 1+1?', 'chosen': '2'}])
    write_jsonl(bad / 'val.jsonl', [{'prompt': 'What is 1+1?', 'chosen': '2', 'rejected': '3'}])
    missing = tmp_path / 'nowhere' / 'ckpt.pt'
    cases = [([f'--init_from={missing}'], [str(missing), 'is not a checkpoint file']),
             ([f'--init_from={dpo_env["base"]}'], [dpo_env['base'], 'fine-tune it first']),
             ([f"--dpo_data={{'tasks': ('{dpo_env['pairs']}', 1.0), 'bad': ('{bad}', 0.5)}}"],
              ["dpo_data source 'bad': ", f'{bad / "train.jsonl"}:2:', '"rejected"']),
             (['--eval_pairs=0'], ['eval_pairs=0', 'at least 1']),
             (['--max_prompt_length=0'], ['max_prompt_length=0', 'at least 1']),
             (['--max_prompt_length=40'], ['max_prompt_length=40', 'room for a completion']),
             (['--loss_type=ipo', '--label_smoothing=0.1'], ['label_smoothing', "loss_type='ipo'"]),
             (['--use_lora=True', '--lora_bias=lora_only', '--parallel=fsdp'], ["lora_bias='lora_only'", 'sharded'])]
    for i, (args, messages) in enumerate(cases):
        out = tmp_path / f'out{i}'
        out.mkdir()
        (out / 'ckpt.pt').write_bytes(b'an earlier run')
        p = dpo(dpo_env, out, '--resume=False', *args, check=False)
        assert_user_error(p)
        assert all(m in p.stderr for m in messages), (messages, p.stderr)
        assert set(os.listdir(out)) - {'run.lock'} == {'ckpt.pt'} and (out / 'ckpt.pt').read_bytes() == b'an earlier run'


@pytest.mark.slow
def test_rpo_adds_alpha_times_chosen_nll_and_ipo_starts_at_its_target(step0, tmp_path, dpo_env):
    """rpo_alpha: the step-0 loss is the plain loss plus alpha * the chosen completions' per-token NLL; length-
    normalized IPO at step 0 (h = 0) is (1 / (2 beta))^2."""
    dpo(dpo_env, tmp_path / 'rpo', '--rpo_alpha=0.7', '--eval_only=True')
    plain, rpo = step0['eval'], evals(tmp_path / 'rpo')[0]
    assert rpo['eval/nll/chosen'] == pytest.approx(plain['eval/nll/chosen'], abs=1e-6) and plain['eval/nll/chosen'] > 0
    assert rpo['eval/loss'] == pytest.approx(plain['eval/loss'] + 0.7 * plain['eval/nll/chosen'], abs=1e-5)
    dpo(dpo_env, tmp_path / 'ipo', '--loss_type=ipo', '--beta=0.25', '--ipo_length_normalize=True', '--eval_only=True')
    ipo = evals(tmp_path / 'ipo')[0]
    assert ipo['eval/loss'] == pytest.approx((1 / (2 * 0.25)) ** 2, abs=1e-5)
    assert ipo['eval/rewards/margins'] == 0 and ipo['eval/rewards/accuracies'] == 0.0


@pytest.mark.slow
@pytest.mark.comparison
@pytest.mark.parametrize('fault, extra, said', [
    ('oom@1', (), 'step 1: out of memory, retrying with micro-batch 2 x 2 accumulation'),
    ('evaloom@0', (), 'eval: out of memory, retrying with micro-batch 2 x 2 accumulation'),
    ('evaloom@0', ('--precompute_ref_logps=True',), 'reference log-probs: out of memory, retrying 2 pairs at a time')])
def test_oom_halves_micro_batch_and_keeps_the_run(tmp_path, dpo_env, fault, extra, said):
    """As train.py's: an out-of-memory error in a step or an eval (evaloom@0: the step-0 eval, the first to meet
    the micro-batch) halves the micro-batch for both, the same global batch of 4 pairs; in the precomputed
    reference's pass (the first batch split at step 0 there) it halves the pairs scored at a time, the training
    keeping its micro-batch. The run logs what a run that fit logs, to the accumulation test's tolerance."""
    ref, oom = tmp_path / 'ref', tmp_path / 'oom'
    common = ['--max_iters=3', '--eval_interval=2', '--learning_rate=1e-3', *extra]
    dpo(dpo_env, ref, *common)
    p = dpo(dpo_env, oom, *common, faults=fault)
    assert said in p.stdout
    ckpt = load(oom / 'ckpt.pt')
    assert (ckpt['batch_size'], ckpt['gradient_accumulation_steps']) == ((4, 1) if extra else (2, 2))
    fit, halved = train_metrics(ref), train_metrics(oom)
    assert sorted(halved) == sorted(fit) == [1, 2, 3]
    for step in fit:
        assert halved[step].keys() == fit[step].keys()
        for k in (k for k in TRAIN_METRICS if k in fit[step]):  # no 'kl' without the reference's logits
            assert halved[step][k] == pytest.approx(fit[step][k], rel=1e-5, abs=1e-5), (step, k)
    assert [e['step'] for e in evals(oom)] == [0, 2, 3]
    for e, other in zip(evals(ref), evals(oom), strict=True):
        assert other == pytest.approx(e, rel=1e-5, abs=1e-5)


def test_reference_pass_error_leaves_the_policy_in_train_mode():
    """With LoRA the reference is the policy itself, scored in eval mode: an out-of-memory error there (which
    the step retries) must not leave the policy training in eval mode."""
    class OutOfMemory(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise torch.OutOfMemoryError('injected')

    policy = OutOfMemory().train()
    batch = dict.fromkeys(('x', 'positions', 'mask', 'rows', 'cols'))
    with pytest.raises(torch.OutOfMemoryError):
        reference_logps(policy, batch, 1, contextlib.nullcontext())
    assert policy.training


@pytest.mark.slow
def test_sigterm_saves_and_exits_143(tmp_path, dpo_env):
    """SIGTERM mid-run: the step finishes, ckpt.pt is saved at that step, exit 143; the run then resumes."""
    out = tmp_path / 'out'
    sigterm_after_steps(dpo_args(dpo_env, out, '--max_iters=100000', '--eval_interval=100000'), out, 'lr')
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] >= 3 and ckpt['iter_num'] == max(train_metrics(out))
    p = dpo(dpo_env, out, f'--max_iters={ckpt["iter_num"] + 1}', '--eval_interval=100000')
    assert f'resuming from {out / "ckpt.pt"} at step {ckpt["iter_num"]}' in p.stdout + p.stderr


@pytest.mark.slow
def test_relaunch_after_sigkill_continues_the_run(tmp_path, dpo_env):
    out = tmp_path / 'out'
    args = dpo_args(dpo_env, out, '--max_iters=150', '--eval_interval=10', '--lr_decay_iters=150', '--eval_pairs=4')
    killed_at, output, steps = kill_and_relaunch(args, out, step_key='lr')
    assert killed_at >= 10 and f'resuming from {out / "ckpt.pt"} at step {killed_at}\n' in output
    assert steps == list(range(1, 151)) and load(out / 'ckpt.pt')['iter_num'] == 150
