"""Supervised fine-tuning: chat template, JSONL parsing, the embedded number tasks, SFT batching (bucketing,
packing, curriculum), packed attention, vocabulary growth, and train.py with training_type='sft'
through subprocesses (resume, accumulation/DDP parity, errors)."""

import json
import math
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from configurator import UserError
from lm import chat_data
from lm.chat_data import SFTBatches, load_sft_split
from conftest import (ANSWERS, CHARS, assert_logged_to_wandb, assert_user_error, char_tokenizer, checked_answer,
                      kill_and_relaunch, load, logged, read_log, real_torchrun, run, sft, sft_args, sft_mixture,
                      torch_saved, torchrun, train_losses, val_losses, wandb_calls, wandb_env, write_jsonl)
from data import prepare
from losses import combine_losses, target_weights, term_weights
from lm.tokenizer import ChatTokenizer, load_tokenizer, prompt_and_answer
from model import GPT, GPTConfig
from run.run_folder import sources_data_hash, training_data_hash
from tasks.number_tasks import addition_working, digit_copies, prepare_number_tasks, subtraction_working

# -- chat template -----------------------------------------------------------------------------

def test_chat_template_ids_and_labels():
    tok = char_tokenizer()
    user, assistant, end = (tok.special[t] for t in ('<|user|>', '<|assistant|>', '<|end|>'))
    ids, labels = tok.encode_chat(chat_data.chat_messages({'prompt': 'What is 1+2?', 'response': '3'}))
    assert ids == [user, *tok.encode('What is 1+2?'), end, assistant, *tok.encode('3'), end]
    assert labels == [-100] * (len(ids) - 2) + [*tok.encode('3'), end]  # the response and its end only
    assert tok.decode(ids) == '<|user|>What is 1+2?<|end|><|assistant|>3<|end|>'


def test_three_formats():
    alpaca = chat_data.chat_messages({'instruction': 'Add', 'input': '1 and 2', 'output': '3'})
    assert alpaca == [{'role': 'user', 'content': 'Add\n\n1 and 2'}, {'role': 'assistant', 'content': '3'}]
    assert chat_data.chat_messages({'instruction': 'Add', 'input': '', 'output': '3'})[0]['content'] == 'Add'
    messages = [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'hi'},
                {'role': 'assistant', 'content': 'a'}, {'role': 'user', 'content': 'more'},
                {'role': 'assistant', 'content': 'bc'}]
    tok = char_tokenizer()
    ids, labels = tok.encode_chat(chat_data.chat_messages({'messages': messages}))
    learned = [i for i, label in zip(ids, labels) if label != -100]
    assert tok.decode(learned) == 'a<|end|>bc<|end|>'  # every assistant turn, nothing else
    prompt, answer = prompt_and_answer(tok, messages)
    assert answer == 'bc' and tok.decode(prompt) == '<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>a<|end|>' \
                                                   '<|user|>more<|end|><|assistant|>'


def test_trl_prompt_completion_rows():
    """TRL's prompt-completion rows: two texts are a user and an assistant turn (as prompt/response); two
    conversations are one, the completion's assistant turns learned; mixed, a completion without an assistant turn
    or another type is refused naming it."""
    tok = char_tokenizer()
    plain = chat_data.chat_messages({'prompt': 'What is 1+2?', 'response': '3'})
    assert chat_data.chat_messages({'prompt': 'What is 1+2?', 'completion': '3'}) == plain
    conversation = chat_data.chat_messages({'prompt': [{'role': 'system', 'content': 'be brief'},
                                                       {'role': 'user', 'content': 'hi'}],
                                            'completion': [{'role': 'assistant', 'content': 'a'}]})
    ids, labels = tok.encode_chat(conversation)
    assert tok.decode([i for i, label in zip(ids, labels) if label != -100]) == 'a<|end|>'
    for record, says in [({'prompt': 'hi', 'completion': [{'role': 'assistant', 'content': 'a'}]}, 'got str and list'),
                         ({'prompt': 'hi', 'completion': 5}, 'got str and int'),
                         ({'prompt': [{'role': 'user', 'content': 'hi'}],
                           'completion': [{'role': 'user', 'content': 'a'}]}, '"completion" has no assistant turn')]:
        with pytest.raises(ValueError, match=re.escape(says)):
            chat_data.chat_messages(record)
    with pytest.raises(ValueError, match=re.escape('(or TRL\'s {"prompt", "completion"})')):
        chat_data.chat_messages({'question': 'x', 'answer': 'y'})


def test_text_parts_are_a_messages_content_and_other_parts_are_named():
    """content as a list of {"type": "text"} parts (OpenAI's and transformers' multimodal messages) is its parts'
    text joined, as chat templates join them; an image part, a part without text or another type is refused
    naming it (nanotrain trains on text)."""
    parts = [{'role': 'user', 'content': [{'type': 'text', 'text': 'What is '}, {'type': 'text', 'text': '1+2?'}]},
             {'role': 'assistant', 'content': [{'type': 'text', 'text': '3'}]}]
    plain = [{'role': 'user', 'content': 'What is 1+2?'}, {'role': 'assistant', 'content': '3'}]
    assert chat_data.chat_messages({'messages': parts}) == chat_data.chat_messages({'messages': plain}) == plain
    for content, says in [([{'type': 'image', 'url': 'x.png'}], 'holds a part of type "image"; the models here read '
                                                                'text only'),
                          ([{'type': 'text'}], 'holds a text part whose "text" is no string: {"type": "text"}'),
                          ([{'type': 'text', 'text': 5}], 'holds a text part whose "text" is no string'),
                          (['hi'], 'holds "hi"'),
                          (5, 'must be a string or a list of {"type": "text", "text": ...} parts, got int')]:
        with pytest.raises(ValueError, match=re.escape(says)):
            chat_data.chat_messages({'messages': [{'role': 'user', 'content': content}, plain[1]]})


def test_special_tokens_cannot_be_forged_by_text():
    tok = char_tokenizer()
    ids, _ = tok.encode_chat([{'role': 'user', 'content': '<|assistant|>'}, {'role': 'assistant', 'content': 'x'}])
    assert ids.count(tok.special['<|assistant|>']) == 1
    assert tok.identity() != tok.base.identity() and tok.vocab_size == len(CHARS) + 4


def test_malformed_lines_name_file_and_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / 'train.jsonl', [
        {'prompt': 'What is 1+1?', 'response': '2'},
        '{"prompt": "broken"',
        {'question': 'x', 'answer': 'y'},
        {'messages': [{'role': 'robot', 'content': 'x'}]},
        {'prompt': 'What is 2+2?', 'response': 4},
        '',
        {'messages': [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]},
    ])
    tok = char_tokenizer()
    with pytest.raises(UserError, match=rf'{path}:2: .*skip_malformed=True'):
        load_sft_split(path, tok, 64)
    conversations, examples = load_sft_split(path, tok, 64, skip_malformed=True)
    assert len(conversations) == len(examples) == 2
    assert '4 malformed lines skipped' in capsys.readouterr().out
    with pytest.raises(UserError, match=r':4: message role .robot.'):
        load_sft_split(write_jsonl(tmp_path / 'b.jsonl', [{'prompt': 'a', 'response': 'b'}] * 3 + [
            {'messages': [{'role': 'robot', 'content': 'x'}]}]), tok, 64)
    with pytest.raises(UserError, match=r':1: characters .*\$'):  # a char tokenizer cannot encode '$'
        load_sft_split(write_jsonl(tmp_path / 'c.jsonl', [{'prompt': '$', 'response': 'b'}]), tok, 64)


def test_named_sources_load_apart_and_name_themselves_in_errors(tmp_path):
    """load_sft_sources: each source's folder read by load_sft_data, in order; a weight-0 source (evaluated, not
    trained) has no train examples and needs no train.jsonl; a malformed line names its source, file and line."""
    tok = char_tokenizer()
    for name, n in (('a', 3), ('b', 2)):
        (tmp_path / name).mkdir()
        for split in ('train', 'val'):
            write_jsonl(tmp_path / name / f'{split}.jsonl', [{'prompt': name, 'response': 'x'}] * n)
    (tmp_path / 'b' / 'train.jsonl').unlink()
    (train_a, val_a, held_a), (train_b, val_b, held_b) = chat_data.load_sft_sources(
        [('a', str(tmp_path / 'a'), 1.0), ('b', str(tmp_path / 'b'), 0.0)], tok, 64)
    assert (len(train_a), len(val_a), len(held_a), len(train_b), len(val_b)) == (3, 3, 3, 0, 2)
    examples, sources = chat_data.concatenated([train_a + val_a, val_b])
    assert len(examples) == 8 and sources.tolist() == [0] * 6 + [1] * 2
    with pytest.raises(UserError, match=r"^sft_data source 'b': SFT data file .*/b/train.jsonl does not exist"):
        chat_data.load_sft_sources([('a', str(tmp_path / 'a'), 1.0), ('b', str(tmp_path / 'b'), 0.5)], tok, 64)
    bad = write_jsonl(tmp_path / 'b' / 'val.jsonl', [{'prompt': 'b', 'response': 'x'}, '{"prompt": 1}'])
    with pytest.raises(UserError, match=rf"^sft_data source 'b': {bad}:2: "):
        chat_data.load_sft_sources([('a', str(tmp_path / 'a'), 1.0), ('b', str(tmp_path / 'b'), 0.0)], tok, 64)
    write_jsonl(tmp_path / 'b' / 'train.jsonl', [{'prompt': 'b', 'response': 'x'}])
    with pytest.raises(UserError, match=rf"^{bad}:2: "):  # one folder: as before
        chat_data.load_sft_sources([(None, str(tmp_path / 'b'), 1.0)], tok, 64)


def test_empty_dataset_is_an_error(tmp_path):
    with pytest.raises(UserError, match='no usable examples'):
        load_sft_split(write_jsonl(tmp_path / 'e.jsonl', ['']), char_tokenizer(), 64)
    with pytest.raises(UserError, match='does not exist'):
        load_sft_split(str(tmp_path / 'missing.jsonl'), char_tokenizer(), 64)


def test_overlong_examples_truncate_or_drop(tmp_path, capsys):
    # 'What is 1+1?' + 2 = 18 tokens with the template; a long response; a long prompt with no room for a response
    path = write_jsonl(tmp_path / 't.jsonl', [{'prompt': 'What is 1+1?', 'response': '2'},
                                              {'prompt': 'hi', 'response': 'x' * 30},
                                              {'prompt': 'y' * 30, 'response': 'z'}])
    _, examples = load_sft_split(path, char_tokenizer(), 20, overlong='truncate')
    assert len(examples) == 2 and all(len(ids) <= 20 for ids, _ in examples)
    assert '1 truncated and 1 dropped' in capsys.readouterr().out
    _, examples = load_sft_split(path, char_tokenizer(), 20, overlong='drop')
    assert len(examples) == 1 and '0 truncated and 2 dropped' in capsys.readouterr().out


def test_plain_text_rows_learn_every_token_and_hold_nothing_out(tmp_path, capsys):
    """TRL's language-modeling rows {"text"}: the text and the end of turn (where generation stops), every token
    a target; they give no held-out conversation, mix with chat rows, and a row that also holds a conversation
    is read as that conversation."""
    tok = char_tokenizer()
    chat = {'prompt': 'What is 1+1?', 'response': '2'}
    path = write_jsonl(tmp_path / 't.jsonl', [{'text': 'abc 12'}, chat, dict(chat, text='ignored')])
    conversations, examples = load_sft_split(path, tok, 64)
    assert examples[0] == (tok.encode('abc 12') + [tok.eos_id],) * 2
    assert examples[1] == examples[2] == tok.encode_chat(chat_data.chat_messages(chat))
    assert [messages for messages, _ in conversations] == [chat_data.chat_messages(chat)] * 2
    assert '3 examples, 1 of the lines plain texts (' in capsys.readouterr().out
    for bad, message in (({'text': ''}, '"text" is empty'), ({'text': 7}, '"text" must be a string'),
                         ({'txt': 'a'}, 'or a plain {"text"}')):
        with pytest.raises(UserError, match=f':1: .*{re.escape(message)}'):
            load_sft_split(write_jsonl(tmp_path / 'bad.jsonl', [bad]), tok, 64)


def test_train_on_prompt_learns_every_token(sft_env, tmp_path):
    """--train_on_prompt=True: every token of an example after its first is a target (its prompt's and the
    template's too, as TRL trains "messages" rows and torchtune's train_on_input), in training and in val loss."""
    tok = char_tokenizer()
    _, examples = load_sft_split(os.path.join(sft_env['task'], 'val.jsonl'), tok, 48)
    batches = SFTBatches(chat_data.every_token(examples[:4]), 0, tok.eos_id, 48)
    x, y, _, _ = batches.get(torch.arange(4))
    for row, (ids, _) in enumerate(examples[:4]):
        assert y[row, :len(ids) - 1].tolist() == ids[1:] and (y[row, len(ids) - 1:] == -100).all()
    runs = {}
    for flag in ('False', 'True'):
        sft(sft_env, tmp_path / flag, f'--train_on_prompt={flag}', '--max_iters=1', '--lr_decay_iters=1',
            '--eval_interval=1', '--exact_match_examples=0')
        runs[flag] = val_losses(tmp_path / flag)
    assert runs['True'][0] != runs['False'][0]  # val loss over every token, from the same model


# -- the embedded number tasks ------------------------------------------------------------------

def test_number_task_working_and_its_slips():
    assert addition_working(48, 26) == '8+6=14, 4+2+1=7, so 74'
    assert addition_working(3, 40) == '3+0=3, 0+4=4, so 43'
    assert subtraction_working(52, 27) == '12-7=5, 5-2-1=2, so 25'
    assert subtraction_working(9, 3) == '9-3=6, 0-0=0, so 6'
    # DPO's rejected answers: one slip, the rest worked on from it
    assert addition_working(48, 26, carry=False) == '8+6=14, 4+2=6, so 64'
    assert addition_working(48, 26, units_slip=1) == '8+6=15, 4+2+1=7, so 75'
    assert addition_working(41, 26, units_slip=-1) == '1+6=6, 4+2=6, so 66'
    assert addition_working(48, 26, tens_slip=-1) == '8+6=14, 4+2+1=6, so 64'
    assert subtraction_working(52, 27, borrow=False) == '7-2=5, 5-2=3, so 35'
    assert subtraction_working(52, 27, units_slip=1) == '12-7=6, 5-2-1=2, so 26'
    assert addition_working(0, 0, tens_slip=-1) is None and subtraction_working(50, 50, units_slip=-1) is None
    assert digit_copies('965', '791') == ['165', '765', '915', '975', '995', '961', '967', '969']
    question = re.fullmatch(ANSWERS[0][0], 'What is 48+26?')
    for slip in [dict(carry=False), dict(units_slip=1), dict(tens_slip=1)]:  # the checker below catches each
        with pytest.raises(AssertionError):
            checked_answer(0, question, addition_working(48, 26, **slip))
    for a in range(100):
        for b in range(100):
            high, low = max(a, b), min(a, b)
            assert checked_answer(0, re.fullmatch(ANSWERS[0][0], f'What is {a}+{b}?'), addition_working(a, b)) == str(a + b)
            assert checked_answer(1, re.fullmatch(ANSWERS[1][0], f'What is {high}-{low}?'),
                                  subtraction_working(high, low)) == str(high - low)


def test_number_tasks_are_correct_disjoint_and_cached(tmp_path):
    out = prepare_number_tasks(str(tmp_path / 'a'), n_train=300, n_eval=30)
    splits, kinds = {}, set()
    for split in ('train', 'val', 'test'):
        with open(os.path.join(out, f'{split}.jsonl')) as f:
            rows = [json.loads(line) for line in f]
        assert len(rows) == (300 if split == 'train' else 30)
        for r in rows:
            matches = [(kind, re.fullmatch(pattern, r['prompt'])) for kind, (pattern, _) in enumerate(ANSWERS)]
            kind, match = next((kind, match) for kind, match in matches if match)
            assert checked_answer(kind, match, r['response']) == str(ANSWERS[kind][1](*match.groups()))
            kinds.add(kind)
        splits[split] = {r['prompt'] for r in rows}
        assert len(splits[split]) == len(rows)  # no duplicates
    assert kinds == set(range(len(ANSWERS)))
    assert not splits['train'] & splits['val'] and not splits['train'] & splits['test']
    assert not splits['val'] & splits['test']
    for split in ('train', 'val', 'test'):  # the kinds' folders, two sources of a mixture: the same lines, by kind
        lines = open(os.path.join(out, f'{split}.jsonl')).read().splitlines()
        sums = [line for line in lines if re.fullmatch(ANSWERS[0][0] + '|' + ANSWERS[1][0], json.loads(line)['prompt'])]
        assert 0 < len(sums) < len(lines)
        assert open(os.path.join(out, 'arithmetic', f'{split}.jsonl')).read().splitlines() == sums
        assert open(os.path.join(out, 'digits', f'{split}.jsonl')).read().splitlines() == [
            line for line in lines if line not in sums]
    before = os.path.getmtime(os.path.join(out, 'train.jsonl'))
    prepare_number_tasks(str(tmp_path / 'a'), n_train=300, n_eval=30)
    assert os.path.getmtime(os.path.join(out, 'train.jsonl')) == before  # reused
    again = prepare_number_tasks(str(tmp_path / 'b'), n_train=300, n_eval=30)
    assert open(os.path.join(again, 'test.jsonl')).read() == open(os.path.join(out, 'test.jsonl')).read()
    # an earlier version's are written over (its meta.json says so), a user's own task files in the folder never
    with open(os.path.join(again, 'meta.json')) as f:
        meta = json.load(f)
    with open(os.path.join(again, 'meta.json'), 'w') as f:
        json.dump(dict(meta, version=meta['version'] - 1), f)
    prepare_number_tasks(str(tmp_path / 'b'), n_train=300, n_eval=30)
    os.makedirs(tmp_path / 'mine')
    (tmp_path / 'mine' / 'train.jsonl').write_text('{"prompt": "my task", "response": "mine"}\n')
    with pytest.raises(UserError, match='holds task files the embedded number tasks did not write'):
        prepare_number_tasks(str(tmp_path / 'mine'), n_train=300, n_eval=30)
    assert os.listdir(tmp_path / 'mine') == ['train.jsonl']


# -- batching ------------------------------------------------------------------------------------

def examples_of_lengths(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(10, (n,), generator=g).tolist()
        labels = [-100] * (n // 2) + ids[n // 2:]
        out.append((ids, labels))
    return out


def test_padding_and_labels():
    examples = examples_of_lengths([5, 9, 3])
    batches = SFTBatches(examples, seed=0, pad_id=99, max_length=16)
    x, y, doc_ids, sources = batches.get(torch.tensor([0, 1, 2]))
    assert doc_ids is None and x.shape == y.shape == (3, 8)  # the longest example has 9 tokens: 8 positions
    for row, (ids, labels) in enumerate(examples):
        n = len(ids) - 1
        assert x[row, :n].tolist() == ids[:-1] and y[row, :n].tolist() == labels[1:]
        assert (x[row, n:] == 99).all() and (y[row, n:] == -100).all()
    assert batches.count_labels(torch.tensor([0, 2])) == int((y[[0, 2]] != -100).sum())  # MFU's output-layer count
    assert (sources == 0).all()  # one source


def test_bucketing_cuts_padding_and_each_epoch_sees_every_example_once():
    lengths = torch.randint(3, 40, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    examples = examples_of_lengths(lengths)

    def padding(bucket_batches):
        batches = SFTBatches(examples, seed=0, pad_id=0, max_length=40, bucket_batches=bucket_batches)
        drawn = [batches.sample(16) for _ in range(16)]  # one epoch
        assert sorted(torch.cat(drawn).tolist()) == list(range(256))
        return sum(batches.get(b)[0].numel() - batches.count_tokens(b) for b in drawn)

    assert padding(8) < 0.5 * padding(1)


def test_sampling_resumes_exactly_from_state_dict():
    examples = examples_of_lengths(torch.randint(3, 20, (50,), generator=torch.Generator().manual_seed(2)).tolist())
    a = SFTBatches(examples, seed=3, pad_id=0, max_length=20, bucket_batches=3)
    for _ in range(7):
        a.sample(8)
    state = a.state_dict()
    expected = [a.sample(8).tolist() for _ in range(10)]
    b = SFTBatches(examples, seed=99, pad_id=0, max_length=20, bucket_batches=3)
    b.load_state_dict(torch.load(torch_saved(state), weights_only=True))
    assert [b.sample(8).tolist() for _ in range(10)] == expected


def test_curriculum_limit_skips_longer_examples():
    lengths = list(range(3, 43))
    batches = SFTBatches(examples_of_lengths(lengths), seed=0, pad_id=0, max_length=42)
    for limit in (5, 12, 30):
        drawn = batches.sample(8, limit)
        assert (batches.lengths[drawn] <= limit).all()


def test_packing_fills_rows_and_numbers_documents():
    lengths = [10, 7, 5, 3, 3, 2]
    batches = SFTBatches(examples_of_lengths(lengths), seed=0, pad_id=0, max_length=12, pack=True)
    rows = batches.rows(torch.arange(6))
    # positions (length - 1) 9, 6, 4, 2, 2, 1 into 12, longest first, each into the row it fills most (best fit):
    # 9 | 6 | 4 joins 6 (room 6 beats 3) | 2 fills it | 2 and 1 fill 9's row; first fit would give [9, 2, 1], [6, 4, 2]
    assert rows.tolist() == [[0, 4, 5], [1, 2, 3]]
    x, y, doc_ids, _ = batches.get(rows)
    assert x.shape == (2, 12) and (doc_ids >= 0).all()  # both rows full
    assert (y != -100).sum() == sum((torch.tensor(l[1:]) != -100).sum() for _, l in examples_of_lengths(lengths))
    for row in doc_ids:
        real = row[row >= 0].tolist()
        assert real == sorted(real)  # documents are contiguous runs
        assert (row[len(real):] == -1).all()
    with pytest.raises(UserError, match='bucket_batches=2 with pack=True'):
        SFTBatches(examples_of_lengths(lengths), seed=0, pad_id=0, max_length=12, pack=True, bucket_batches=2)


def test_packed_epochs_fill_rows_with_every_example_once():
    """pack=True: a global batch is n rows of up to max_length tokens, filled with whole examples (as TRL's and
    torchtune's packing), and every epoch trains every example exactly once; the rows of an epoch hold no other
    epoch's examples. Before, a global batch was n examples: a few dozen tokens where rows hold 512."""
    lengths = torch.randint(4, 25, (600,), generator=torch.Generator().manual_seed(4)).tolist()
    batches = SFTBatches(examples_of_lengths(lengths), seed=1, pad_id=0, max_length=64, pack=True)
    drawn, seen, epochs = [], [], []
    while len(epochs) < 2:
        rows = batches.sample(8)
        assert rows.shape[0] == 8 and (batches.lengths[rows.clamp(min=0)] * (rows >= 0)).sum(1).max() <= 64
        drawn.append(rows)
        for row in rows.tolist():
            seen += [i for i in row if i >= 0]
            if len(seen) >= len(lengths):  # an epoch's examples end with a row
                assert len(seen) == len(lengths) and sorted(seen) == list(range(len(lengths)))
                epochs.append(seen)
                seen = []
    assert epochs[0] != epochs[1]  # reshuffled
    fill = [batches.count_tokens(rows) / (8 * 64) for rows in drawn]
    # measured: 0.993 (0.975 at least): only the rows ending an epoch run part-empty
    assert sum(fill) / len(fill) > 0.97, fill
    x, y, doc_ids, _ = batches.get(drawn[0])
    assert x.shape[1] <= 64 and int((doc_ids >= 0).sum()) == batches.count_tokens(drawn[0])
    assert batches.count_labels(drawn[0]) == int((y != -100).sum())
    # a length curriculum (a limit that only grows) packs only the examples it allows
    curriculum = SFTBatches(examples_of_lengths(lengths), seed=1, pad_id=0, max_length=64, pack=True)
    for limit in (6, 6, 15, 15):
        rows = curriculum.sample(8, limit)
        assert (curriculum.lengths[rows[rows >= 0]] <= limit).all()


@pytest.mark.comparison
@pytest.mark.parametrize('pos_emb', ['rope', 'learned'])
def test_packed_rows_give_the_logits_of_separate_examples(pos_emb):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=10, n_layer=2, n_head=2, n_embd=16, pos_emb=pos_emb)).eval()
    examples = examples_of_lengths([9, 5, 4, 3])
    packed = SFTBatches(examples, seed=0, pad_id=0, max_length=16, pack=True)
    rows = packed.rows(torch.arange(4))
    x, _, doc_ids, _ = packed.get(rows)
    logits, _ = model(x, doc_ids=doc_ids)
    assert len(rows) < 4
    for r, row in enumerate(rows.tolist()):
        t = 0
        for i in row:
            if i < 0:
                continue
            alone, _ = model(torch.tensor([examples[i][0][:-1]]))
            n = alone.size(1)
            torch.testing.assert_close(logits[r, t:t + n], alone[0], rtol=1e-5, atol=1e-5)
            t += n
    unmasked, _ = model(x)
    assert not torch.allclose(unmasked, logits, atol=1e-3)  # the mask matters


LOSS_WEIGHTS = {'ce': 1.0, 'z_loss': 0.1}


def step_gradient(model, batches, micro_batches, token_weight, source_weight):
    """The gradient of one step as train.py's train_step takes it: each micro-batch's loss terms over the labelled
    positions (losses.term_weights: a position's loss weight is its token's times its source's; the z-loss counts
    positions alike), divided by the whole step's totals, computed by the model chunk by chunk (forward with
    weights), the micro-batches' gradients added."""
    model.zero_grad()
    data = [batches.get(rows) for rows in micro_batches]
    weights = [torch.stack([target_weights(y, token_weight) * source_weight[sources], (y != -100).double()])
               for _, y, _, sources in data]
    totals = sum(torch.zeros(2, 2, dtype=torch.float64).index_add_(1, sources.flatten(), w.flatten(1))
                 for (_, _, _, sources), w in zip(data, weights))
    for (x, y, doc_ids, sources), w in zip(data, weights):
        _, terms = model(x, y, doc_ids=doc_ids, logits_at=y != -100, weights=term_weights(w, totals, LOSS_WEIGHTS))
        combine_losses({name: term for name, (term, _) in terms.items()}, LOSS_WEIGHTS).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def formula_gradient(model, batches, examples, token_weight, source_weight):
    """The gradient of sum(w_token w_source CE) / sum(w_token w_source) + 0.1 mean(log(Z)^2) over the labelled
    positions of the examples, one a row, in float64 throughout."""
    model.zero_grad()
    x, y, _, sources = batches.get(examples)
    logits, _ = model(x)
    at = y != -100
    w = token_weight[y[at]] * source_weight[sources[at]]
    ce = F.cross_entropy(logits[at], y[at], reduction='none')
    ((ce * w).sum() / w.sum() + 0.1 * torch.logsumexp(logits[at], -1).square().mean()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.comparison
def test_packed_step_has_the_gradient_of_its_examples_however_split():
    """A packed global batch of two sources' examples, weighted 1 and 0.3, has the gradient of the loss's formula
    over the same examples (each position weighted by its token and its source, over the whole step's weight), that
    of the same examples unpacked (one a row, padded), and that of its rows split as train.py splits them over ranks
    and micro-batches (tensor_split, then unflatten): 1 x 4 = 4 x 1 = 2 ranks x 2 accumulation. Every token is divided
    by the whole step's weight, so a row holding three examples weighs as they would apart. float64 weights (the loss
    terms are float32, as in train.py): the sides add the same float32 per-token losses (float32's eps 1.2e-7) in
    other orders and shapes, so the gradients differ by ~1e-7 of their norm (1e-5 allowed: ~100 terms a sum); a
    micro-batch normalized by its own weight, or the sources unweighted, are off by > 1e-2."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=10, n_layer=2, n_head=2, n_embd=16)).double()
    lengths = torch.randint(4, 14, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    examples, sources = examples_of_lengths(lengths), torch.arange(40) % 3 == 0
    packed = SFTBatches(examples, seed=0, pad_id=0, max_length=32, pack=True, sources=sources.long())
    token_weight = torch.rand(10, generator=torch.Generator().manual_seed(6), dtype=torch.float64) + 0.5
    source_weight = torch.tensor([1.0, 0.3], dtype=torch.float64)
    rows = packed.sample(4)
    assert (rows >= 0).sum(1).min() >= 2 and sources[rows[rows >= 0]].unique().tolist() == [False, True]
    whole = step_gradient(model, packed, [rows], token_weight, source_weight)
    examples_of_rows = rows[rows >= 0]
    unpacked = SFTBatches(examples, seed=0, pad_id=0, max_length=32, sources=sources.long())
    formula = formula_gradient(model, unpacked, examples_of_rows, token_weight, source_weight)
    assert (formula - whole).norm() <= 1e-5 * whole.norm()
    alone = step_gradient(model, unpacked, [examples_of_rows], token_weight, source_weight)
    assert (alone - whole).norm() <= 1e-5 * whole.norm()
    for world_size, accumulation, micro in [(1, 4, 1), (2, 2, 1), (2, 1, 2)]:
        shares = [rows.tensor_split(world_size)[rank].unflatten(0, (accumulation, micro)) for rank in range(world_size)]
        split = step_gradient(model, packed, [m for share in shares for m in share], token_weight, source_weight)
        assert (split - whole).norm() <= 1e-5 * whole.norm()
    own = sum(step_gradient(model, packed, [m], token_weight, source_weight) for m in rows.split(1)) / 4
    assert (own - whole).norm() > 1e-2 * whole.norm()  # each micro-batch normalized by its own weight
    unweighted = step_gradient(model, packed, [rows], token_weight, torch.ones(2, dtype=torch.float64))
    assert (unweighted - whole).norm() > 1e-2 * whole.norm()


@pytest.mark.parametrize('pack', [False, True])
def test_sources_are_drawn_as_one_set_and_each_position_knows_its_source(pack):
    """Several sources' examples are drawn as one set (a weight scales the loss, not the draw): every epoch trains
    every example of every source once, a global batch holds each source in about its share of the examples, packed
    rows mix them, and get() gives each position its example's source."""
    lengths = torch.randint(4, 25, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    sources = torch.tensor([0] * 200 + [1] * 60 + [2] * 40)
    batches = SFTBatches(examples_of_lengths(lengths), seed=1, pad_id=0, max_length=64, pack=pack, sources=sources)
    seen, shares, mixed = [], [], 0
    while len(seen) < 300:
        drawn = batches.sample(10)
        examples = drawn[drawn >= 0]
        seen += examples.tolist()
        shares.append(torch.bincount(sources[examples], minlength=3) / len(examples))
        x, y, doc_ids, position_sources = batches.get(drawn)
        for r, row in enumerate(drawn.reshape(len(drawn), -1).tolist()):
            row = [i for i in row if i >= 0]
            assert position_sources[r, :sum(lengths[i] - 1 for i in row)].tolist() == [
                int(sources[i]) for i in row for _ in range(lengths[i] - 1)]
            mixed += len(set(sources[row].tolist())) > 1
    assert sorted(seen[:300]) == list(range(300))  # one epoch (an epoch's last row ends it): each example once
    share = torch.stack(shares).mean(0)
    # measured: exact unpacked (batches of 10 examples, one epoch), 0.012 off packed (rows hold 2-10 examples)
    assert ((share - torch.tensor([200, 60, 40]) / 300).abs() < 0.05).all(), share
    assert mixed > 0 if pack else mixed == 0


def test_a_continued_run_must_train_on_the_sources_it_began_with(tmp_path):
    """sources_data_hash: the same named sources, in order, each train.jsonl unchanged; one folder after sources
    (or sources after one folder) is refused too."""
    paths = {}
    for name in ('a', 'b'):
        (tmp_path / name).mkdir()
        paths[name] = write_jsonl(tmp_path / name / 'train.jsonl', [{'prompt': name, 'response': 'x'}])
    ckpt = {'train_data_hash': sources_data_hash(paths, None, 'out', 'sft_data')}
    assert sources_data_hash(paths, ckpt, 'out', 'sft_data') == ckpt['train_data_hash']
    with pytest.raises(UserError, match=r"began training on the sources \['a', 'b'\].*now trains on the sources \['b', 'a'\]"):
        sources_data_hash(dict(reversed(paths.items())), ckpt, 'out', 'sft_data')
    with pytest.raises(UserError, match=r"began training on the sources \['a', 'b'\], and sft_data now names one"):
        training_data_hash(paths['a'], ckpt, 'out', 'sft_data')
    with pytest.raises(UserError, match='began training on one folder'):
        sources_data_hash(paths, {'train_data_hash': ckpt['train_data_hash']['a']}, 'out', 'sft_data')
    write_jsonl(tmp_path / 'b' / 'train.jsonl', [{'prompt': 'b', 'response': 'y'}])
    with pytest.raises(UserError, match=rf"{paths['b']} \(source 'b'\) has changed since"):
        sources_data_hash(paths, ckpt, 'out', 'sft_data')


def test_packed_sampling_resumes_exactly_and_reads_the_earlier_format():
    """The rows after a state_dict round trip are the rows straight on, through epochs' ends (468 tokens an epoch:
    25 global batches of 4 rows of 16 hold ~3 epochs). A state as earlier versions wrote it (pending: global batches
    of examples, served from the end) serves those batches, in that order."""
    examples = examples_of_lengths(torch.randint(3, 12, (80,), generator=torch.Generator().manual_seed(7)).tolist())
    a = SFTBatches(examples, seed=3, pad_id=0, max_length=16, pack=True)
    for _ in range(9):
        a.sample(4)
    state = a.state_dict()
    assert len(state['carry']) and len(state['pending'])  # mid-window: a row carried to the next one, rows waiting
    expected = [a.sample(4).tolist() for _ in range(16)]
    b = SFTBatches(examples, seed=99, pad_id=0, max_length=16, pack=True)
    b.load_state_dict(torch.load(torch_saved(state), weights_only=True))
    assert [b.sample(4).tolist() for _ in range(16)] == expected
    old = dict(state, pending=[torch.tensor([5, 6]), torch.tensor([1, 2])])
    c = SFTBatches(examples, seed=99, pad_id=0, max_length=16)
    c.load_state_dict(old)
    assert c.sample(2).tolist() == [1, 2] and c.sample(2).tolist() == [5, 6]


def test_resize_vocab_keeps_old_tokens_and_adds_distinct_rows():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(20, (2, 8))
    before, _ = model(x)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.resize_vocab(24)
    after, _ = model(x)
    assert model.lm_head.weight is model.transformer.wte.weight and model.config.vocab_size == 24
    assert torch.equal(after[..., :20], before)  # old tokens' logits unchanged
    new = model.transformer.wte.weight[20:]
    assert torch.cdist(new, new).fill_diagonal_(1).min() > 0.01  # distinct
    twin = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=16))
    twin.load_state_dict(base_state)
    twin.resize_vocab(24)
    assert torch.equal(twin.transformer.wte.weight, model.transformer.wte.weight)  # the same base grows the same


# -- train.py ------------------------------------------------------------------------------------

FOUNDATION_FIELDS = {'kind', 'model', 'model_args', 'optimizer', 'scaler', 'iter_num', 'best_val_loss',
                     'evals_without_improvement', 'config', 'tokenizer', 'data_dir', 'rng', 'train_batches',
                     'batch_size', 'gradient_accumulation_steps'}


@pytest.mark.slow
def test_sft_trains_reports_exact_match_and_resumes_bit_exactly(tmp_path, sft_env):
    """Packing, a length curriculum, token weights, z-loss, dropout and accumulation, in a run counted in epochs
    (run/epochs.py: 3 passes over 40 examples, the first short: its rows are the few the curriculum allows then):
    the plan printed and kept, the epoch in every event, evals every
    eval_interval steps and at each epoch's end (eval_every_epochs=1), the lr at min_lr where the last epoch ends.
    Stopped mid-epoch 2 (SIGTERM) and relaunched, the run is the straight one bit for bit (bucketing and max_iters
    extended: test_lora's resume). With --wandb_log=True (a stand-in wandb package) every number of log.jsonl went to
    W&B at its step, with the config, and the relaunch resumed the same W&B run."""
    task = tmp_path / 'task'
    task.mkdir()
    write_jsonl(task / 'train.jsonl', open(f"{sft_env['task']}/train.jsonl").read().splitlines()[:40])
    for split in ('val', 'test'):
        shutil.copy(f"{sft_env['task']}/{split}.jsonl", task)
    common = [f'--sft_data={task}', '--num_train_epochs=3', '--eval_every_epochs=1', '--eval_interval=4',
              '--dropout=0.1', '--gradient_accumulation_steps=2', '--pack=True', '--bucket_batches=1',
              '--curriculum_iters=2', "--token_weights={'digits': (1.5, ['1', '2', '3'])}",
              "--loss_weights={'ce': 1.0, 'z_loss': 1e-3}", '--wandb_log=True']
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    p = sft(sft_env, straight, *common, env_extra=wandb_env())
    assert '40 examples' in p.stdout and 'exact_match' in p.stdout
    assert '8 packed rows of up to 48 tokens (384) per step' in p.stdout
    plan = load(straight / 'ckpt.pt')['epoch_steps']
    steps = sum(plan)
    assert len(plan) == 3 and plan[1] > 2 and f'num_train_epochs=3: 3 epoch(s) of {plan[0]}, ' in p.stdout
    assert f'a step (an epoch\'s last takes what is left): {steps} steps, the lr decaying to min_lr' in p.stdout
    tokens = logged(straight, 'tokens_per_step')
    assert sorted(tokens) == list(range(1, steps + 1)) and all(0 < t <= 384 for t in tokens.values()), tokens
    events = read_log(straight)
    train = [e for e in events if 'train_loss' in e]
    ends = [plan[0], plan[0] + plan[1], steps]
    assert [e['epoch'] for e in train] == [k + (s - start) / plan[k] for k, start in enumerate([0, *ends[:2]])
                                           for s in range(start + 1, ends[k] + 1)]
    assert [e['step'] for e in events if 'eval/exact_match' in e] == sorted({0, *ends, *range(4, steps + 1, 4)})
    assert [e.get('epoch') for e in events if 'val_loss' in e and e['step'] in ends] == [1.0, 2.0, 3.0]
    progress = (steps - 1 - 2) / (steps - 2)  # the last step's lr, after 2 warmup steps: just above min_lr
    assert train[-1]['lr'] == pytest.approx(1e-3 + 0.5 * (1 + math.cos(math.pi * progress)) * (1e-2 - 1e-3))
    assert all('train_ce' in e and 'train_z_loss' in e for e in train)
    assert_logged_to_wandb(straight)

    p = run(['tests/faults.py', f'term@{plan[0]}', *sft_args(sft_env, split, *common)], env_extra=wandb_env(),
            check=False)
    assert p.returncode == 143 and load(split / 'ckpt.pt')['iter_num'] == plan[0] + 1  # stopped mid-epoch 2
    p = sft(sft_env, split, *common, env_extra=wandb_env())
    assert 'resuming' in p.stdout + p.stderr
    a, b = train_losses(straight), train_losses(split)
    assert sorted(b) == list(range(1, steps + 1)) and all(a[s] == b[s] for s in a), (a, b)
    wa, wb = load(straight / 'ckpt.pt')['model'], load(split / 'ckpt.pt')['model']
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert_logged_to_wandb(split, launches=2)
    first, relaunch = (c for c in wandb_calls(split) if c['call'] == 'init')
    assert (first['id'], first['resume']) == (None, None) and relaunch['resume'] == 'allow'
    assert relaunch['id'] == load(split / 'ckpt.pt')['wandb_run_id'] and relaunch['name'] == 'split'

    ckpt = load(straight / 'ckpt.pt')
    assert FOUNDATION_FIELDS <= set(ckpt) and ckpt['kind'] == 'gpt'
    base = load(sft_env['base'])
    assert ckpt['model_args']['vocab_size'] == base['model_args']['vocab_size'] + 4  # grown by the chat tokens
    assert ckpt['tokenizer'] == ChatTokenizer(load_tokenizer(sft_env['data_dir'])).identity()


@pytest.mark.slow
def test_two_weighted_sources_log_apart_and_resume_bit_exactly(tmp_path, sft_env):
    """Two weighted sources, packing, a length curriculum, token weights, z-loss, dropout and accumulation, all resumed
    exactly (bucketing: test_lora's resume); each source's train and val loss and exact match logged under its name."""
    common = ['--dropout=0.1', '--lr_decay_iters=8', '--eval_interval=4', '--gradient_accumulation_steps=2',
              '--pack=True', '--bucket_batches=1', '--curriculum_iters=6', sft_mixture(sft_env),
              "--token_weights={'digits': (1.5, ['1', '2', '3'])}", "--loss_weights={'ce': 1.0, 'z_loss': 1e-3}"]
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    p = sft(sft_env, straight, '--max_iters=8', *common)
    assert re.search(r'sft_data: arithmetic 71 examples, [\d.]+% of the response tokens, loss weight 1: [\d.]+% of the '
                     r'loss; digits 129 examples, [\d.]+% of the response tokens, loss weight 0.5', p.stdout), p.stdout
    assert re.search(r'step 8: loss [\d.]+ \(arithmetic [\d.]+, digits [\d.]+\), lr', p.stdout), p.stdout
    assert re.search(r'step 8: val loss [\d.]+ \(arithmetic [\d.]+, digits [\d.]+\), perplexity', p.stdout)
    assert re.search(r'step 8: exact_match [\d.]+% \(arithmetic [\d.]+%, digits [\d.]+%\) on 8 held-out', p.stdout)
    assert '8 packed rows of up to 48 tokens (384) per step' in p.stdout
    tokens = logged(straight, 'tokens_per_step')
    assert sorted(tokens) == list(range(1, 9)) and all(40 < t <= 384 for t in tokens.values()), tokens
    sft(sft_env, split, '--max_iters=4', *common)
    p = sft(sft_env, split, '--max_iters=8', *common)
    assert 'resuming' in p.stdout + p.stderr
    a, b = train_losses(straight), train_losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 9)) and all(a[s] == b[s] for s in a), (a, b)
    wa, wb = load(straight / 'ckpt.pt')['model'], load(split / 'ckpt.pt')['model']
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for key in ('train_loss/arithmetic', 'train_loss/digits', 'val_loss/digits', 'eval/exact_match/arithmetic'):
        assert logged(straight, key) == logged(split, key), key  # the same mixture order: the same sources' losses

    events = read_log(straight)
    # val_loss weighs each source's by its loss weight and its tokens: those of its first 8 val examples
    tok = ChatTokenizer(load_tokenizer(sft_env['data_dir']))
    tokens = {source: sum(sum(label != -100 for label in labels[1:]) for _, labels in load_sft_split(
        os.path.join(sft_env['task'], source, 'val.jsonl'), tok, 48)[1][:8]) for source in ('arithmetic', 'digits')}
    for e in (e for e in events if 'val_loss' in e):
        weighted = {'arithmetic': tokens['arithmetic'], 'digits': 0.5 * tokens['digits']}
        assert e['val_loss'] == pytest.approx(sum(weighted[s] * e[f'val_loss/{s}'] for s in weighted)
                                              / sum(weighted.values()), rel=1e-5)
    for key in ('eval/exact_match', 'eval/exact_match/arithmetic', 'eval/exact_match/digits', 'val_loss/arithmetic',
                'val_loss/digits'):
        assert [e['step'] for e in events if key in e] == [0, 4, 8], key
    steps = [e for e in events if 'train_loss' in e]
    assert all('train_ce' in e and 'train_z_loss' in e for e in steps)
    # the logged steps that held the source (the curriculum keeps the long sums out of the first 4 steps)
    for source in ('arithmetic', 'digits'):
        held = [e for e in steps if f'train_loss/{source}' in e]
        assert len(held) >= 4 and all(e[f'train_loss/{source}'] == pytest.approx(
            e[f'train_ce/{source}'] + 1e-3 * e[f'train_z_loss/{source}'], rel=1e-5) for e in held)


@pytest.mark.slow
@pytest.mark.comparison
def test_accumulation_and_ddp_match_one_big_batch(tmp_path, sft_env):
    """The loss is normalized by the whole global batch's loss weight (token weights x two sources' weights): 4 x 1 =
    1 x 4 = 2 ranks x (1 x 2) give the same train loss at every step, the same gradient norm at the first (same
    weights: the accumulated gradient itself) and the same val loss of the final weights (each source's first 8 val
    examples: eval_iters x batch_size = 8); the same holds for each source's losses. With a loss term added as a user
    adds one (tests/entropy_term.py: a function and its LOSS_TERMS entry, train.py unchanged): checked, trained on
    and logged. Packed (a global batch of 4 rows of up to 48 tokens, split over ranks and micro-batches by rows;
    unpacked, one example a row, the same split: test_lora's DDP test).
    rtol=1e-5: the runs add the same float32 terms in other orders (other micro-batch shapes, other BLAS kernels
    on other CPUs), which moves a sum of n terms by at most ~n * 2^-24 relative, ~1e-5 for the <= 4 x 48 positions of a
    global batch (measured: <= 5e-7, also with one run on SSE kernels); a micro-batch normalized by its own weight
    is off by > 1e-2. The weights are not compared one by one: Adam divides each gradient by its own root mean
    square, so a weight whose gradient is rounding noise (~1e-9 against Adam's eps 1e-8) moves by up to ~lr either
    way, differently on each CPU; with a gradient ~0 such weights hardly change any loss, and a small lr keeps their
    second-order effect on the later steps and the final val loss far below the tolerance."""
    common = ['--max_iters=3', '--eval_interval=3', '--lr_decay_iters=3', '--exact_match_examples=0',
              '--learning_rate=1e-3', '--min_lr=1e-4', "--token_weights={'digits': (2.0, ['1', '5', '9'])}",
              '--pack=True', '--bucket_batches=1', sft_mixture(sft_env, 1.0, 0.25),
              "--loss_weights={'ce': 1.0, 'entropy_bonus': 0.05}"]
    big, accumulated, ddp = tmp_path / 'big', tmp_path / 'accumulated', tmp_path / 'ddp'
    run(['tests/entropy_term.py', *sft_args(sft_env, big, '--batch_size=4', '--gradient_accumulation_steps=1',
                                            *common)])
    run(['tests/entropy_term.py', *sft_args(sft_env, accumulated, '--batch_size=1', '--gradient_accumulation_steps=4',
                                            '--eval_iters=8', *common)])
    run([*torchrun(2), 'tests/entropy_term.py', *sft_args(sft_env, ddp, '--batch_size=1',
                                                          '--gradient_accumulation_steps=2', '--eval_iters=8', *common)])
    for key, steps in [('train_loss', [1, 2, 3]), ('grad_norm', [1]), ('val_loss', [0, 3]),
                       ('train_entropy_bonus', [1, 2, 3]), ('train_loss/digits', [1, 2, 3]),
                       ('train_entropy_bonus/arithmetic', [1, 3]), ('val_loss/arithmetic', [0, 3]),  # 2: no sums
                       ('val_loss/digits', [0, 3])]:
        a, b, c = (logged(out, key) for out in (big, accumulated, ddp))
        assert sorted(a) == sorted(b) == sorted(c) and set(steps) <= set(a), (key, a, b, c)
        assert all(b[s] == pytest.approx(a[s], rel=1e-5) and c[s] == pytest.approx(a[s], rel=1e-5)
                   for s in steps), (key, a, b, c)
    for e in read_log(big):  # the added term is in each loss the step took
        for source in ('/arithmetic', '/digits', ''):
            if f'train_loss{source}' in e:
                assert e[f'train_loss{source}'] == pytest.approx(e[f'train_ce{source}'] + 0.05 * e[
                    f'train_entropy_bonus{source}'], rel=1e-5) and e[f'train_entropy_bonus{source}'] < 0


@pytest.mark.slow
def test_sft_bad_inputs_are_clear_errors(tmp_path, sft_env):
    bad = tmp_path / 'bad'
    bad.mkdir()
    write_jsonl(bad / 'train.jsonl', [{'prompt': 'What is 1+1?', 'response': '2'}, '{"prompt": 1}'])
    write_jsonl(bad / 'val.jsonl', [{'prompt': 'What is 1+1?', 'response': '2'}])
    # a named source's malformed line: its name, file and line
    p = sft(sft_env, tmp_path / 'a', f"--sft_data={{'tasks': ('{sft_env['task']}', 1.0), 'bad': ('{bad}', 0.5)}}",
            check=False)
    assert_user_error(p, "sft_data source 'bad': ", f'{bad / "train.jsonl"}:2:')
    # a base model trained with another tokenizer
    (tmp_path / 'other.txt').write_text(''.join(CHARS) * 40)  # covers the task, but a larger vocabulary
    other = prepare(str(tmp_path / 'other.txt'), str(tmp_path / 'other'), 'char')
    p = sft(sft_env, tmp_path / 'b', f'--data_dir={other}', check=False)
    assert_user_error(p, 'tokenizer', 'vocab_size')
    cases = [(['--eval_only=True', '--init_from=scratch'], 'eval_only=True needs a trained model'),
             (["--loss_weights={'ce': -1.0, 'z_loss': 0.0}"], 'finite numbers >= 0'),
             (["--token_weights={'g': (-2.0, ['a'])}"], 'finite weight >= 0'),
             (["--token_weights={'g': (2.0, ['Q'])}"], "token_weights['g']: 'Q'"),  # not in this char vocabulary
             (["--sft_data={'a': ('x', -1.0)}"], "sft_data['a'] = ('x', -1.0) must be (folder, weight)")]
    for i, (args, message) in enumerate(cases):
        p = sft(sft_env, tmp_path / f'c{i}', *args, check=False)
        assert_user_error(p, message)
        assert not (tmp_path / f'c{i}' / 'ckpt.pt').exists()


@pytest.mark.slow
def test_resume_refuses_changed_data_and_pretraining_a_chat_model(tmp_path, sft_env):
    """An SFT run resumed on another train.jsonl (even in another order) stops with exit 2, its checkpoint untouched;
    a chat model cannot be continued as pretraining; a TTS checkpoint is refused by kind."""
    tasks, out = tmp_path / 'tasks', tmp_path / 'run'
    shutil.copytree(sft_env['task'], tasks)
    sft(sft_env, out, f'--sft_data={tasks}', '--max_iters=2', '--eval_interval=2', '--exact_match_examples=0')
    saved = (out / 'ckpt.pt').read_bytes()
    lines = (tasks / 'train.jsonl').read_text().splitlines()
    (tasks / 'train.jsonl').write_text('\n'.join(lines[1:] + lines[:1]) + '\n')
    p = sft(sft_env, out, f'--sft_data={tasks}', '--max_iters=4', check=False)
    assert_user_error(p, f"train.jsonl is not the training data the run in {out} began with (sft_data={str(tasks)!r} "
                         f"then): it has changed since, or it is another file")
    assert (out / 'ckpt.pt').read_bytes() == saved
    p = run(['train.py', f'--out_dir={tmp_path / "pre"}', f'--data_dir={sft_env["data_dir"]}',
             f'--init_from={out / "ckpt.pt"}', '--max_iters=1', '--device=cpu', '--tensorboard=False'], check=False)
    assert_user_error(p, "is a chat model (training_type='sft')")
    torch.save(dict(kind='tts'), tmp_path / 'tts.pt')
    p = sft(sft_env, tmp_path / 'c', f'--init_from={tmp_path / "tts.pt"}', check=False)
    assert_user_error(p, "is a 'tts' checkpoint, not a GPT's; point --init_from at a train.py checkpoint")
    assert not (tmp_path / 'c').exists()  # the refused run's out_dir is gone


@pytest.mark.slow
@pytest.mark.parametrize('training_type, ranks', [('sft', 1), ('lora', 1), ('sft', 2)])
def test_relaunch_after_sigkill_continues_the_run(tmp_path, sft_env, training_type, ranks):
    """The README's fine-tuning commands set init_from to the base model; relaunched after a kill -9 (under torchrun
    too, the real one: the suite's one successful launch of it), they continue the run in out_dir rather than start
    it again over its checkpoints."""
    out = tmp_path / 'out'
    args = sft_args(sft_env, out, '--max_iters=120', '--eval_interval=10', '--lr_decay_iters=120',
                    '--exact_match_examples=0', training_type=training_type)
    if ranks > 1:
        args = [*real_torchrun(ranks), *args]
    killed_at, output, steps = kill_and_relaunch(args, out)
    assert killed_at >= 10 and f'resuming from {out / "ckpt.pt"} at step {killed_at}\n' in output
    assert steps == list(range(1, 121)) and load(out / 'ckpt.pt')['iter_num'] == 120


def test_the_number_tasks_are_written_whole(tmp_path, monkeypatch):
    """Two runs preparing the embedded tasks at once in a fresh tree must never read a half-written file: each
    file is written under a temporary name and renamed into place, meta.json last."""
    import builtins
    import tasks.number_tasks
    renamed = []

    def only_temporaries(path, mode='r', *args, **kwargs):
        assert 'w' not in mode or str(path).endswith('.tmp'), f"{path} written in place"
        return builtins.open(path, mode, *args, **kwargs)
    monkeypatch.setattr(tasks.number_tasks, 'open', only_temporaries, raising=False)

    def replace(a, b):
        renamed.append(os.path.relpath(b, tmp_path / 'tasks'))
        os.rename(a, b)
    monkeypatch.setattr(tasks.number_tasks.os, 'replace', replace)
    out = prepare_number_tasks(str(tmp_path / 'tasks'), n_train=20, n_eval=4)
    assert renamed == [os.path.join(kind, f'{split}.jsonl') for split in ('train', 'val', 'test')
                       for kind in ('', 'arithmetic', 'digits')] + ['meta.json']
    assert len(open(os.path.join(out, 'train.jsonl')).read().splitlines()) == 20
    assert sorted(os.listdir(out)) == ['arithmetic', 'digits', 'meta.json', 'test.jsonl', 'train.jsonl', 'val.jsonl']
