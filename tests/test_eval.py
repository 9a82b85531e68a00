"""eval.py on tiny models made here: generation scored by lm/metrics, batched greedy answers equal to
model.generate's one prompt at a time, a chat model answering in its template, pass@k, multiple-choice
log-likelihoods against an independent float64 computation, acc/acc_norm, and every bad input's error.
eval.py runs in this process (runpy) so that its model and the reference share one process's kernels."""

import json
import math
import os
import re
import runpy
import sys
from collections import Counter
from unittest import mock

import pytest
import torch

from configurator import UserError
from conftest import CHARS, ROOT, assert_user_error, run, write_jsonl
from data import prepare
from lm.chat_data import chat_tools
from lm.eval_tasks import choice_predictions, fewshot_draws, generation_row, read_task, rolling_windows
from lm.metrics import corpus_scores, example_scores, normalize_answer
from lm.tokenizer import ChatTokenizer, load_tokenizer
from model import GPT, GPTConfig

METRICS = ['exact_match', 'bleu', 'chrf', 'rouge1', 'rouge2', 'rouge_l']
PROMPTS = ['What is 1+2?', 'abc', 'Which is larger, 318 or 95?', 'x', 'Reverse the digits of 4827.']
# greedy choices this far ahead of the runner-up: float32's rounding of these logits (~1e-5: eps32 * |logit| ~ 10
# through two layers) cannot flip them, on any CPU
MARGIN = 1e-3


def sharp_model(vocab_size, seed):
    """A tiny untied GPT with 20x its init weights: its greedy answers depend on the prompt (at init it repeats
    a token)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=64, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20 if p.dim() == 2 else 1)
    return model.eval()


def save(model, tokenizer, chat, data_dir, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(dict(kind='gpt', model=model.state_dict(), model_args=model.model_args(),
                    config=dict(training_type='sft' if chat else 'from_scratch'), tokenizer=tokenizer.identity(),
                    data_dir=data_dir), path)
    return path


@pytest.fixture(scope='module')
def models(tmp_path_factory):
    """A char tokenizer, a base checkpoint and a chat one (nanotrain's template) whose <|end|> row is 1.2x the
    row of a token it answers with, so that it ends some answers early."""
    root = tmp_path_factory.mktemp('eval')
    (root / 'corpus.txt').write_text(''.join(CHARS) * 4)
    data_dir = prepare(str(root / 'corpus.txt'), str(root / 'prepared'), tokenizer='char')
    tokenizer = load_tokenizer(data_dir)
    chat_tokenizer = ChatTokenizer(tokenizer)
    base = sharp_model(tokenizer.vocab_size, seed=1)
    chat = sharp_model(chat_tokenizer.vocab_size, seed=3)
    answers = [greedy(chat, chat_tokenizer.encode_prompt([{'role': 'user', 'content': p}]), 8)[0] for p in PROMPTS]
    common = Counter(t for a in answers for t in a[2:]).most_common(1)[0][0]
    with torch.no_grad():
        chat.lm_head.weight[chat_tokenizer.eos_id] = 1.2 * chat.lm_head.weight[common]
    return dict(root=root, data_dir=data_dir, tokenizer=tokenizer, chat_tokenizer=chat_tokenizer, base_model=base,
                chat_model=chat, base=save(base, tokenizer, False, data_dir, str(root / 'base' / 'ckpt.pt')),
                chat=save(chat, chat_tokenizer, True, data_dir, str(root / 'chat' / 'ckpt.pt')))


def eval_py(*args):
    """eval.py with args, in this process; its JSON output."""
    with mock.patch.object(sys, 'argv', ['eval.py', '--device=cpu', *args]):
        script = runpy.run_path(os.path.join(ROOT, 'eval.py'), run_name='__main__')
    with open(script['results_path']) as f:
        return dict(json.load(f), path=script['results_path'])


def greedy(model, prompt, n, eos_id=None):
    """(model.generate's greedy completion of prompt, alone, in float64; the smallest lead of a chosen token's
    logit over the runner-up along it)."""
    model64 = GPT(model.config).double().eval()
    model64.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = model64.generate(torch.tensor([prompt]), n, temperature=0, eos_id=eos_id)[0].tolist()
        logits, _ = model64(torch.tensor([out[:-1]]))
    top2 = logits[0, len(prompt) - 1:].topk(2, dim=-1).values
    return out[len(prompt):], float((top2[:, 0] - top2[:, 1]).min())


@pytest.mark.comparison
def test_generation_scores_and_batched_greedy_answers(models):
    """A base model continues each prompt (stopping at a row's stop string); its batched greedy answers equal
    model.generate's alone, and the scores are lm/metrics' on the predictions written."""
    rows = [dict(prompt=p, reference=r) for p, r in zip(PROMPTS, ['3', 'abc def', 'x', '', '7284'])]
    rows[1] = dict(prompt='abc', references=['def', 'd e f'], stop=['e', 'q'])
    rows[3]['reference'] = 'x y'
    data = write_jsonl(models['root'] / 'gen.jsonl', rows)
    result = eval_py(f"--init_from={models['base']}", f'--eval_data={data}', '--max_new_tokens=12', '--batch_size=3')
    assert result['task'] == 'generation' and result['n'] == len(rows)
    assert result['init_from'] == models['base']
    tokenizer = models['tokenizer']
    for row, example in zip(rows, result['examples']):
        answer, margin = greedy(models['base_model'], tokenizer.encode(row['prompt']), 12)
        assert margin > MARGIN
        text = tokenizer.decode(answer)
        assert example['prediction'] == min([text] + [text[:text.index(s)] for s in row.get('stop', []) if s in text],
                                            key=len)
        assert example['references'] == row.get('references', [row.get('reference')])
        assert example['scores'] == example_scores(METRICS, example['prediction'], example['references'])
        assert 'samples' not in example
    predictions = [e['prediction'] for e in result['examples']]
    assert result['scores'] == corpus_scores(METRICS, predictions, [e['references'] for e in result['examples']])
    assert os.path.exists(os.path.join(os.path.dirname(data), 'gen.eval.base.json'))  # the default out


@pytest.mark.comparison
def test_chat_model_answers_in_its_template_and_stops_at_end_of_turn(models):
    rows = [dict(prompt=p, reference='3') for p in PROMPTS[:3]]
    rows += [dict(messages=[{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': PROMPTS[3]}],
                  reference='x')]
    data = write_jsonl(models['root'] / 'chat.jsonl', rows)
    result = eval_py(f"--init_from={os.path.dirname(models['chat'])}", f'--eval_data={data}', '--max_new_tokens=10',
                     '--metrics=exact_match', f"--out={models['root'] / 'chat.json'}")
    tokenizer, ended = models['chat_tokenizer'], 0
    for row, example in zip(rows, result['examples']):
        messages = row.get('messages') or [{'role': 'user', 'content': row['prompt']}]
        prompt = tokenizer.encode_prompt(messages)
        answer, margin = greedy(models['chat_model'], prompt, 10, eos_id=tokenizer.eos_id)
        assert margin > MARGIN
        ended += answer[-1] == tokenizer.eos_id
        assert example['prediction'] == tokenizer.decode(answer[:-1] if answer[-1] == tokenizer.eos_id else answer)
        assert example['prompt'] == row.get('prompt', tokenizer.decode(prompt))
    assert ended >= 1 and '<|end|>' not in json.dumps([e['prediction'] for e in result['examples']])
    assert result['examples'][3]['prompt'].startswith('<|system|>Be brief.<|end|><|user|>x<|end|><|assistant|>')


@pytest.mark.comparison
def test_pass_at_k_counts_exact_matches_among_samples(models):
    rows = [dict(prompt=p) for p in PROMPTS]
    sampling = ['--num_samples=4', '--temperature=1.5', '--max_new_tokens=2', '--batch_size=2', '--seed=3']
    free = eval_py(f"--init_from={models['chat']}", f"--eval_data={write_jsonl(models['root'] / 'free.jsonl', rows)}",
                   '--metrics=', *sampling)
    assert free['scores'] == {} and all('correct' not in e for e in free['examples'])
    # the same draws again, now with references: the first example's first sample, another's second
    samples = [e['samples'] for e in free['examples']]
    for row, s in zip(rows, samples):
        row['references'] = [s[0] + ' ', 'zz']
    rows[2]['references'] = [s[1] for s in samples[2:3]]
    data = write_jsonl(models['root'] / 'passk.jsonl', rows)
    result = eval_py(f"--init_from={models['chat']}", f'--eval_data={data}', '--metrics=exact_match',
                     '--pass_k=1,2,4', *sampling)
    counts = []
    for row, example, s in zip(rows, result['examples'], samples):
        assert example['samples'] == s and example['prediction'] == s[0] and len(s) == 4
        wanted = {normalize_answer(r) for r in row['references']}
        counts.append(sum(normalize_answer(x) in wanted for x in s))
        assert example['correct'] == counts[-1] >= 1
    for k in (1, 2, 4):  # Chen et al.'s estimator, written out
        want = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts) / len(counts)
        assert result['scores'][f'pass@{k}'] == pytest.approx(want, abs=1e-12)
    assert result['scores']['exact_match'] == corpus_scores(['exact_match'], [s[0] for s in samples],
                                                            [r['references'] for r in rows])['exact_match']


def reference_loglik(model, tokenizer, context, choice):
    """log P(' ' + choice | context) in float64 over lm-eval's split (a tokenizer that adds no BOS): the
    context's trailing whitespace moved into the continuation, the input cut to the last block_size + 1 ids."""
    kept = context.rstrip()
    whole = tokenizer.encode(context + ' ' + choice)
    n = len(whole) - len(tokenizer.encode(kept))
    ids = whole[-(model.config.block_size + 1):]
    model64 = GPT(model.config).double().eval()
    model64.load_state_dict(model.state_dict())
    with torch.no_grad():
        logprobs = torch.log_softmax(model64(torch.tensor([ids[:-1]]))[0][0], dim=-1)
    return sum(float(logprobs[j - 1, ids[j]]) for j in range(len(ids) - n, len(ids)))


@pytest.mark.comparison
def test_multiple_choice_logliks_and_accuracy(models):
    rows = [dict(context='What is 1+2?', choices=['3', '4', 'three'], label=0),
            dict(context='Which is larger, 318 or 95? ', choices=['318', '95'], label=1),  # its space moves
            dict(context='abc ' * 20, choices=['def', 'd', 'abc abc'], label=2),  # longer than block_size: cut
            dict(context='x\n', choices=['yes', 'no'], label=1)]
    data = write_jsonl(models['root'] / 'mc.jsonl', rows)
    result = eval_py(f"--init_from={models['base']}", f'--eval_data={data}', '--batch_size=3')
    assert result['task'] == 'multiple_choice' and result['n'] == 4
    for row, example in zip(rows, result['examples']):
        assert {k: example[k] for k in ('context', 'choices', 'label')} == row
        want = [reference_loglik(models['base_model'], models['tokenizer'], row['context'], c) for c in row['choices']]
        # float32 against float64: each log-prob off by ~eps32 * |logit| (logits ~10): 1e-3 is far above it
        assert example['logliks'] == pytest.approx(want, abs=1e-3)
        pred, pred_norm, _ = choice_predictions(example['logliks'], row['choices'])
        assert (example['pred'], example['pred_norm']) == (pred, pred_norm)
        assert (example['acc'], example['acc_norm']) == (int(pred == row['label']), int(pred_norm == row['label']))
    assert result['scores'] == {k: sum(e[k] for e in result['examples']) / 4 for k in ('acc', 'acc_norm', 'acc_bytes')}
    for k in ('acc', 'acc_norm', 'acc_bytes'):  # lm-eval's mean_stderr: sample std / sqrt(n)
        values = [e[k] for e in result['examples']]
        mean = sum(values) / 4
        assert result['stderr'][k] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / 3 / 4))


@pytest.mark.comparison
@pytest.mark.parametrize('kind', ['generation', 'multiple_choice', 'rolling'])
def test_a_batch_out_of_memory_is_done_in_halves_with_the_same_results(models, tmp_path, monkeypatch, capsys, kind):
    """A batch of more than 2 sequences raises torch.OutOfMemoryError (as a device with room for 2 would): eval.py
    goes on 2 at a time and writes the results of a run that fit. 1e-5: float32 logits of other batch shapes
    (~eps32 * |logit| ~ 1e-5 a log-prob, summed over a few tokens); greedy answers lead by MARGIN, so equal."""
    rows = {'generation': [dict(prompt=p, reference='3') for p in PROMPTS],
            'multiple_choice': [dict(context=p, choices=['3', '4', 'abc'], label=0) for p in PROMPTS],
            'rolling': [dict(text=p * 3) for p in PROMPTS]}[kind]
    data = write_jsonl(tmp_path / f'{kind}.jsonl', rows)
    model = models['base']
    if kind == 'rolling':  # a text's first token is conditioned on EOS, which the char tokenizer lacks
        (tmp_path / 'corpus.txt').write_text(''.join(CHARS) * 4 + 'The cat sat on the mat. ' * 30)
        data_dir = prepare(str(tmp_path / 'corpus.txt'), str(tmp_path / 'bpe'), tokenizer='bpe', vocab_size=400)
        tokenizer = load_tokenizer(data_dir)
        model = save(sharp_model(tokenizer.vocab_size, seed=5), tokenizer, False, data_dir, str(tmp_path / 'ckpt.pt'))
    args = [f'--init_from={model}', f'--eval_data={data}', '--max_new_tokens=8', '--batch_size=4']
    fit = eval_py(*args, f'--out={tmp_path / "fit.json"}')
    import lm.eval_tasks
    import lm.generate
    for module, name in ((lm.generate, 'generate_batch'), (lm.eval_tasks, 'choice_logliks')):
        def limited(model, batch, *rest, work=getattr(module, name), **kwargs):
            if len(batch) > 2:
                raise torch.OutOfMemoryError('injected: room for 2')
            return work(model, batch, *rest, **kwargs)
        monkeypatch.setattr(module, name, limited)
    halved = eval_py(*args, f'--out={tmp_path / "halved.json"}')
    assert 'out of memory: 2 at a time from here on' in capsys.readouterr().out
    assert halved['n'] == fit['n'] == len(rows) and halved['scores'] == pytest.approx(fit['scores'], abs=1e-5)
    for a, b in zip(fit['examples'], halved['examples'], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == (pytest.approx(a[k], abs=1e-5) if k in ('logliks', 'loglik') or 'perplexity' in k
                            or k == 'bits_per_byte' else a[k]), k


def test_choice_predictions_are_lm_evals_argmaxes():
    # acc picks the highest sum; acc_norm divides by the choice's characters (not its tokens)
    assert choice_predictions([-2.0, -3.0], ['x', 'yyyyyy']) == (0, 1, 1)
    assert choice_predictions([-6.0, -4.0, -4.5], ['aaa', 'bb', 'ccc']) == (1, 2, 2)
    assert choice_predictions([-1.0, -1.0, -2.0], ['ab', 'ab', 'a']) == (0, 0, 0)  # a tie: the first
    # per UTF-8 byte is not per character: 'é' is 2 bytes, '東京' 6
    assert choice_predictions([-2.3, -2.0], ['café', 'cafe']) == (1, 1, 0)
    assert choice_predictions([-3.5, -3.0], ['東京', 'Tokyo']) == (1, 1, 0)


def bad(models, rows, *args, init_from='base'):
    """The UserError eval.py raises on rows (a list; strings are written as they are) and args."""
    data = models['root'] / 'bad.jsonl'
    data.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows))
    with pytest.raises(UserError) as e:
        eval_py(f'--init_from={models[init_from]}', f'--eval_data={data}', *args)
    return str(e.value)


def test_bad_input_is_a_clear_error(models):
    path = models['root'] / 'bad.jsonl'
    gen, mc = dict(prompt='abc', reference='d'), dict(context='abc', choices=['d', 'e'], label=0)
    assert f'{path}:2 is not valid JSON' in bad(models, [gen, '{"prompt": "abc",'])
    assert f'{path}:1 nests its JSON too deeply' in bad(models, ['{"x": ' + '[' * 100_000 + ']' * 100_000 + '}'])
    assert f'{path}:1 holds a lone surrogate' in bad(models, ['{"prompt": "a\\ud800", "reference": "b"}'])
    assert f"{path}:1 has keys 'question', 'answer'" in bad(models, [dict(question='a', answer='b')])
    assert 'holds no examples' in bad(models, ['', ' '])
    assert f'{path}:2 is a multiple choice example but the lines before it are generation' in bad(models, [gen, mc])
    assert f'{path}:1: "choices" must be a list of two or more' in bad(models, [dict(mc, choices=['d'])])
    assert f'{path}:1: "label" must be the 0-based index' in bad(models, [dict(mc, label=2)])
    assert f'{path}:2 has no reference' in bad(models, [gen, dict(prompt='abc')])
    assert "unknown metric 'blue'" in bad(models, [gen], '--metrics=exact_match,blue')
    assert 'each k must be from 1 to num_samples=2' in bad(models, [gen], '--num_samples=2', '--temperature=1',
                                                            '--pass_k=1,3')
    assert f'{path}:1: the prompt is 61 tokens' in bad(models, [dict(prompt='a' * 61, reference='b')],
                                                       '--max_new_tokens=8')
    assert 'not a chat model' in bad(models, [dict(messages=[{'role': 'user', 'content': 'a'}], reference='b')])
    assert 'ends with a \'assistant\' turn' in bad(models, [dict(messages=[{'role': 'assistant', 'content': 'a'}])],
                                                   init_from='chat')
    assert 'neither a BOS nor an EOS' in bad(models, [dict(mc, context='')])
    # tools: nanotrain's own template writes none; few-shot turns cannot carry them; malformed ones are named
    weather = {'type': 'function', 'function': {'name': 'get_weather'}}
    tools = dict(messages=[{'role': 'user', 'content': 'a'}], tools=[weather], reference='b')
    assert f"{path}:1: nanotrain's own chat template has no tools" in bad(models, [tools], init_from='chat')
    assert 'not for conversations with tools' in bad(models, [tools, tools], '--num_fewshot=1', init_from='chat')
    assert f'{path}:1: "tools" must be a list' in bad(models, [dict(tools, tools={'f': 1})], init_from='chat')


def test_defaults_fit_the_model_and_evaluate_the_number_tasks(models, tmp_path, monkeypatch, capsys):
    """With max_new_tokens left at 0, answers run up to 256 tokens or what the longest prompt leaves of
    block_size (said on one line); with no eval_data, the embedded number tasks' held-out split is evaluated
    (the training scripts' data/number_tasks/test.jsonl, prompt/response rows)."""
    monkeypatch.chdir(tmp_path)
    result = eval_py(f"--init_from={models['chat']}", '--max_examples=4', '--metrics=exact_match')
    assert result['eval_data'] == os.path.join('data', 'number_tasks', 'test.jsonl') and result['n'] == 4
    rows = [json.loads(line) for line in open(result['eval_data'])][:4]
    assert [e['references'] for e in result['examples']] == [[r['response']] for r in rows]
    tokenizer = models['chat_tokenizer']
    longest = max(len(tokenizer.encode_prompt([{'role': 'user', 'content': r['prompt']}])) for r in rows)
    budget = 64 + 1 - longest  # the test models' block_size is 64
    assert f'answers of up to {budget} tokens' in capsys.readouterr().out
    assert max(len(tokenizer.encode(e['prediction'])) for e in result['examples']) <= budget


def test_sft_rows_and_a_byte_order_mark_are_read(models, tmp_path):
    """The SFT data's rows are generation rows (a "response" or a final assistant turn is the reference), and a
    file that starts with a UTF-8 byte-order mark reads as the training scripts read it."""
    data = tmp_path / 'sft.jsonl'
    rows = [dict(prompt='What is 1+2?', response='3'),
            dict(messages=[{'role': 'user', 'content': 'abc'}, {'role': 'assistant', 'content': 'def'}])]
    data.write_bytes(b'\xef\xbb\xbf' + ''.join(json.dumps(r) + '\n' for r in rows).encode())
    result = eval_py(f"--init_from={models['chat']}", f'--eval_data={data}', '--max_new_tokens=3')
    assert [e['references'] for e in result['examples']] == [['3'], ['def']]
    assert result['examples'][1]['prompt'].endswith('<|user|>abc<|end|><|assistant|>')
    with pytest.raises(UserError, match='give one of "reference", "references", "response" and "completion"'):
        two = write_jsonl(tmp_path / 'two.jsonl', [dict(rows[0], reference='3')])
        eval_py(f"--init_from={models['chat']}", f'--eval_data={two}')
    # TRL's prompt-completion rows, as the training scripts read them: two texts, or two conversations as one
    trl = write_jsonl(tmp_path / 'trl.jsonl', [dict(prompt='What is 1+2?', completion='3'), dict(
        prompt=[{'role': 'user', 'content': 'abc'}], completion=[{'role': 'assistant', 'content': 'def'}])])
    result = eval_py(f"--init_from={models['chat']}", f'--eval_data={trl}', '--max_new_tokens=3')
    assert [e['references'] for e in result['examples']] == [['3'], ['def']]
    assert result['examples'][1]['prompt'].endswith('<|user|>abc<|end|><|assistant|>')
    # ShareGPT's conversations, as the training scripts read them
    share = write_jsonl(tmp_path / 'share.jsonl', [dict(conversations=[
        {'from': 'human', 'value': 'abc'}, {'from': 'gpt', 'value': 'def'}])])
    result = eval_py(f"--init_from={models['chat']}", f'--eval_data={share}', '--max_new_tokens=3')
    assert result['examples'][0]['references'] == ['def']
    assert result['examples'][0]['prompt'].endswith('<|user|>abc<|end|><|assistant|>')
    # its bare tool schemas (LLaMA-Factory's), wrapped as the training scripts wrap them
    bare = dict(conversations=[{'from': 'human', 'value': 'abc'}], tools=[{'name': 'f', 'parameters': {}}],
                reference='x')
    assert generation_row(bare, 'f:1')['tools'] == chat_tools(bare) == [
        {'type': 'function', 'function': {'name': 'f', 'parameters': {}}}]
    # content as text parts, as the training scripts read it: joined; an image part is named
    parts = write_jsonl(tmp_path / 'parts.jsonl', [dict(messages=[
        {'role': 'user', 'content': [{'type': 'text', 'text': 'ab'}, {'type': 'text', 'text': 'c'}]},
        {'role': 'assistant', 'content': [{'type': 'text', 'text': 'def'}]}])])
    result = eval_py(f"--init_from={models['chat']}", f'--eval_data={parts}', '--max_new_tokens=3')
    assert result['examples'][0]['references'] == ['def']
    assert result['examples'][0]['prompt'].endswith('<|user|>abc<|end|><|assistant|>')
    image = write_jsonl(tmp_path / 'image.jsonl', [dict(messages=[{'role': 'user', 'content': [{'type': 'image'}]}],
                                                        reference='x')])
    with pytest.raises(UserError, match=re.escape('image.jsonl:1: "content" holds a part of type "image"')):
        eval_py(f"--init_from={models['chat']}", f'--eval_data={image}')


def test_out_never_writes_over_what_it_reads_or_another_models_results(models, tmp_path):
    """--out onto the task file, the checkpoint or any file that is not this model's results on this task is
    refused and leaves the file as it was (a <out>.tmp too); the same model's results are replaced; a second model
    whose folder has the same name as the first's gets its own default results file."""
    data = write_jsonl(tmp_path / 'task.jsonl', [dict(prompt='abc', reference='d')])
    other, deep = tmp_path / 'notes.json', tmp_path / 'deep.json'
    other.write_text('{"mine": 1}')
    deep.write_text('{"x": ' + '[' * 100_000 + ']' * 100_000 + '}')  # JSON too deep to read is not ours either
    for out, message in [(data, 'which this command reads'), (models['base'], 'which this command reads'),
                         (other, 'exists and is not the results JSON'), (models['chat'], 'exists and is not'),
                         (deep, 'exists and is not the results JSON')]:
        before = open(out, 'rb').read()
        with pytest.raises(UserError) as e:
            eval_py(f"--init_from={models['base']}", f'--eval_data={data}', f'--out={out}', '--max_new_tokens=2')
        assert message in str(e.value) and open(out, 'rb').read() == before
    if os.path.isdir('/proc'):  # a folder that takes no file (Linux's /proc): said before any work
        with pytest.raises(UserError, match="in a folder that cannot be written"):
            eval_py(f"--init_from={models['base']}", f'--eval_data={data}', '--out=/proc/results.json')
    args = (f'--eval_data={data}', '--max_new_tokens=2')
    (tmp_path / 'task.eval.base.json.tmp').write_text('a file of the user\'s')  # the old temporary's name
    first = eval_py(f"--init_from={models['base']}", *args)
    assert first['path'] == str(tmp_path / 'task.eval.base.json')
    assert (tmp_path / 'task.eval.base.json.tmp').read_text() == 'a file of the user\'s'
    assert oct(os.stat(first['path']).st_mode & 0o777) == '0o644' and not list(tmp_path.glob('tmp*.tmp'))
    again = eval_py(f"--init_from={models['base']}", *args, f"--out={first['path']}")  # its own results: replaced
    assert again['path'] == first['path']
    twin = tmp_path / 'r2' / 'base' / 'ckpt.pt'  # another model in a folder of the same name
    os.makedirs(twin.parent)
    twin.write_bytes(open(models['base'], 'rb').read())
    second = eval_py(f'--init_from={twin}', *args)
    assert second['path'] == str(tmp_path / 'task.eval.base-2.json') and second['init_from'] == str(twin)
    assert json.load(open(first['path']))['init_from'] == models['base']


@pytest.mark.slow
def test_bad_input_exits_2_without_traceback(models):
    data = models['root'] / 'broken.jsonl'
    data.write_text('{"prompt": "abc"\n')
    p = run(['eval.py', f"--init_from={models['base']}", f'--eval_data={data}', '--device=cpu'], check=False)
    assert_user_error(p, f'{data}:1 is not valid JSON')


def lm_eval_rolling_windows(token_list, prefix_token, max_seq_len, context_len=1):
    """lm-evaluation-harness 0.4.13's utils.get_rolling_token_windows and make_disjoint_window, as written
    there (the reference lm/eval_tasks.rolling_windows is checked against)."""
    pred_len = max_seq_len - context_len + 1
    predicted = 0
    first_seq_len = min(max_seq_len, len(token_list))
    windows = [([prefix_token] + token_list[: first_seq_len - 1], token_list[:first_seq_len])]
    predicted += first_seq_len
    while predicted < len(token_list):
        window_pred_len = min(len(token_list) - predicted, pred_len)
        window_end = predicted + window_pred_len
        windows.append((token_list[window_end - max_seq_len - 1: window_end - 1],
                        token_list[window_end - window_pred_len: window_end]))
        predicted += window_pred_len
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in windows]


def test_rolling_windows_are_lm_evals():
    for n, max_seq_len in [(1, 4), (4, 4), (5, 4), (9, 4), (23, 5), (64, 64), (130, 64)]:
        tokens = list(range(100, 100 + n))
        assert rolling_windows(tokens, 7, max_seq_len) == lm_eval_rolling_windows(tokens, 7, max_seq_len), n
        predicted = [t for _, pred in rolling_windows(tokens, 7, max_seq_len) for t in pred]
        assert predicted == tokens  # every token once


@pytest.mark.comparison
def test_perplexity_of_texts_as_lm_evals_loglikelihood_rolling(models, tmp_path):
    """A .txt file (one text) and JSONL {"text"} rows: each text's log-likelihood summed over lm-eval's rolling
    windows, equal to a float64 computation of the same windows (a text longer than block_size included), and
    word/byte perplexity and bits per byte as lm-eval aggregates them (weighted by words and UTF-8 bytes)."""
    (tmp_path / 'corpus.txt').write_text(''.join(CHARS) * 4 + 'The cat sat on the mat. ' * 30)
    data_dir = prepare(str(tmp_path / 'corpus.txt'), str(tmp_path / 'bpe'), tokenizer='bpe', vocab_size=400)
    tokenizer = load_tokenizer(data_dir)
    model = sharp_model(tokenizer.vocab_size, seed=5)
    ckpt = save(model, tokenizer, False, data_dir, str(tmp_path / 'base' / 'ckpt.pt'))
    texts = ['The cat sat.', 'the mat on the cat, twice:  the mat on the cat.\n' * 4]
    data = write_jsonl(tmp_path / 'texts.jsonl', [dict(text=t) for t in texts])
    result = eval_py(f'--init_from={ckpt}', f'--eval_data={data}', '--batch_size=2')
    model64 = GPT(model.config).double().eval()
    model64.load_state_dict(model.state_dict())
    want = []
    for text in texts:
        tokens = tokenizer.encode(text)  # this tokenizer adds no BOS; EOS is lm-eval's prefix token
        assert len(tokens) > 64 or text == texts[0]
        total = 0.0
        for context, pred in lm_eval_rolling_windows(tokens, tokenizer.eos_id, 64):
            ids = context + pred
            with torch.no_grad():
                logprobs = torch.log_softmax(model64(torch.tensor([ids[:-1]]))[0][0], dim=-1)
            total += sum(float(logprobs[j - 1, ids[j]]) for j in range(len(ids) - len(pred), len(ids)))
        want.append(total)
    assert result['task'] == 'loglikelihood_rolling'
    # float32 against float64: ~1e-5 a token over ~100 tokens
    assert [e['loglik'] for e in result['examples']] == pytest.approx(want, abs=1e-2)
    ll, words = sum(want), sum(len(re.split(r'\s+', t)) for t in texts)
    n_bytes = sum(len(t.encode()) for t in texts)
    assert result['scores'] == pytest.approx({'word_perplexity': math.exp(-ll / words),
                                              'byte_perplexity': math.exp(-ll / n_bytes),
                                              'bits_per_byte': -ll / n_bytes / math.log(2)}, rel=1e-3)
    (tmp_path / 'one.txt').write_text(texts[1])
    single = eval_py(f'--init_from={ckpt}', f"--eval_data={tmp_path / 'one.txt'}")
    assert single['n'] == 1 and single['examples'][0]['loglik'] == pytest.approx(want[1], abs=1e-2)
    # a .txt is scored as written: its \r\n too (universal newlines made them \n), as a JSONL row of that text is
    crlf = texts[1].replace('\n', '\r\n')
    (tmp_path / 'crlf.txt').write_bytes(crlf.encode())
    as_txt = eval_py(f'--init_from={ckpt}', f"--eval_data={tmp_path / 'crlf.txt'}")
    as_row = eval_py(f'--init_from={ckpt}', f"--eval_data={write_jsonl(tmp_path / 'crlf.jsonl', [dict(text=crlf)])}")
    assert as_txt['examples'][0]['loglik'] == pytest.approx(as_row['examples'][0]['loglik'], abs=1e-4)
    assert as_txt['examples'][0]['loglik'] != pytest.approx(want[1], abs=1e-2)
    assert 'neither a BOS nor an EOS' in bad(models, [dict(text='abc')])  # a char tokenizer has neither


def test_few_shot_contexts_are_lm_evals(models, tmp_path):
    """num_fewshot=2 with a description: each multiple-choice context is description + two other rows solved
    (context, ' ', the right choice, '\\n\\n') + its own context, the rows drawn as lm-eval's sampler draws them
    (random.Random(1234).sample of 3 from the split, the row itself left out); a chat model gets the examples as
    earlier turns, the description as a system turn."""
    import random
    mc = [dict(context=f'Q{i}: 1+{i}?', choices=[str(1 + i), 'no'], label=0) for i in range(5)]
    data = write_jsonl(tmp_path / 'mc.jsonl', mc)
    result = eval_py(f"--init_from={models['base']}", f'--eval_data={data}', '--num_fewshot=2',
                     '--description=Sums.\n\n')
    rng = random.Random(1234)
    for i, example in enumerate(result['examples']):
        shots = [mc[j] for j in rng.sample(range(5), 3) if j != i][:2]
        want = 'Sums.\n\n' + ''.join(f"{s['context']} {s['choices'][0]}\n\n" for s in shots) + mc[i]['context']
        assert example['context'] == want
    gen = [dict(prompt=f'What is {i}+1?', reference=str(i + 1)) for i in range(4)]
    data = write_jsonl(tmp_path / 'gen.jsonl', gen)
    result = eval_py(f"--init_from={models['chat']}", f'--eval_data={data}', '--num_fewshot=1',
                     '--description=Be brief.', '--max_new_tokens=2', '--metrics=exact_match')
    rng = random.Random(1234)
    for i, example in enumerate(result['examples']):
        shot = [gen[j] for j in rng.sample(range(4), 2) if j != i][0]
        assert example['prompt'].startswith(f"<|system|>Be brief.<|end|><|user|>{shot['prompt']}<|end|><|assistant|>"
                                            f"{shot['reference']}<|end|><|user|>{gen[i]['prompt']}<|end|>")
    assert 'num_fewshot=4 needs that many other examples' in bad(models, [gen[0]] * 4, '--num_fewshot=4')
    # the advice fits what was read: every row read (max_examples=0, or all the file's) cannot raise max_examples
    too_many = bad(models, gen, '--num_fewshot=20')
    assert 'the task has 3 besides this one' in too_many and 'lower num_fewshot to 3 or less.' in too_many
    assert 'max_examples' not in too_many and 'max_examples' not in bad(models, gen, '--num_fewshot=20',
                                                                         '--max_examples=8')
    assert 'or raise max_examples, which reads only the file\'s first 2 rows' in bad(models, gen, '--num_fewshot=3',
                                                                                    '--max_examples=2')


def test_fewshot_draws_are_lm_evals():
    """fewshot_draws picks the rows lm-eval 0.4.13's ContextSampler picks (seed 1234; the row and its copies never
    its own example; tests/fixtures/lm_eval/fewshot.json, made by make_lm_eval_fewshot_fixture.py)."""
    with open(os.path.join(ROOT, 'tests', 'fixtures', 'lm_eval', 'fewshot.json'), encoding='utf-8') as f:
        expected = json.load(f)
    docs = expected['docs']
    rows = [dict(doc, line=i + 1) for i, doc in enumerate(docs)]
    for n, draws in expected['draws'].items():
        got = fewshot_draws(rows, int(n))
        assert [[docs.index({k: v for k, v in s.items() if k != 'line'}) for s in shots] for shots in got] == draws


def test_a_file_that_is_not_utf8_is_named_with_a_fix_for_its_kind(tmp_path):
    """A text for perplexity (.txt) in Latin-1 is told how to convert it, not to name a JSONL file of examples."""
    (tmp_path / 'latin.txt').write_bytes(b'caf\xe9\n')
    (tmp_path / 'latin.jsonl').write_bytes(b'{"prompt": "caf\xe9", "reference": "x"}\n')
    with pytest.raises(UserError, match=r"name a UTF-8 text file \(iconv -f latin1 -t utf-8 converts one\)\.$"):
        read_task(str(tmp_path / 'latin.txt'))
    with pytest.raises(UserError, match=r"name a UTF-8 JSONL file of examples\.$"):
        read_task(str(tmp_path / 'latin.jsonl'))
    # U+2028 and U+0085 inside a string are text, not line ends (str.splitlines cut the row there)
    (tmp_path / 'u2028.jsonl').write_text(json.dumps(dict(prompt='one\u2028two\u0085', reference='x'),
                                                     ensure_ascii=False) + '\r\n', encoding='utf-8')
    kind, rows = read_task(str(tmp_path / 'u2028.jsonl'))
    assert len(rows) == 1 and rows[0]['prompt'] == 'one\u2028two\u0085'
