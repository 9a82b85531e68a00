"""lm/metrics.py against sacreBLEU's and rouge-score's own outputs
(tests/fixtures/metrics/expected.json, written by tests/fixtures/make_metrics_fixtures.py in their
environment), pass@k against exact combinatorics and a count over every draw, and exact match's
normalisation, the one chat models are scored with in training too."""
import itertools
import json
import math
import os
from fractions import Fraction

import pytest

from conftest import hf_fixture
from configurator import UserError
from hf.tokenizer import load_hf_tokenizer
from lm import metrics
from lm.heldout_eval import score_answers

with open(os.path.join(os.path.dirname(__file__), 'fixtures', 'metrics', 'expected.json')) as f:
    EXPECTED = json.load(f)
CASES, CORPORA = EXPECTED['cases'], EXPECTED['corpora']
# Ours repeats the libraries' float operations on the same integer counts in their order: the
# values are bit-equal here; 1e-9 (scores up to 100) leaves room for another libm's log/exp ulp.
TOL = 1e-9


@pytest.mark.comparison
@pytest.mark.parametrize('case', CASES, ids=[c['name'] for c in CASES])
def test_case_matches_libraries(case):
    hyp, refs = case['hypothesis'], case['references']
    assert metrics.tokenize_13a(hyp) == case['tokens_13a']
    assert metrics.tokenize_rouge(hyp) == case['tokens_rouge']
    assert metrics.corpus_bleu([hyp], [refs]) == pytest.approx(case['bleu_corpus'], abs=TOL, rel=0)
    assert metrics.sentence_bleu(hyp, refs) == pytest.approx(case['bleu_sentence'], abs=TOL, rel=0)
    assert metrics.sentence_chrf(hyp, refs) == pytest.approx(case['chrf'], abs=TOL, rel=0)
    for kind, value in metrics.rouge_scores(hyp, refs).items():
        assert value == pytest.approx(case[kind], abs=TOL, rel=0), kind


@pytest.mark.comparison
@pytest.mark.parametrize('corpus', CORPORA,
                         ids=[f"{c['cases'][0]}+{len(c['cases'])}" for c in CORPORA])
def test_corpus_matches_libraries(corpus):
    cases = [c for c in CASES if c['name'] in corpus['cases']]
    hyps, refs = [c['hypothesis'] for c in cases], [c['references'] for c in cases]
    assert metrics.corpus_bleu(hyps, refs) == pytest.approx(corpus['bleu'], abs=TOL, rel=0)
    assert metrics.corpus_chrf(hyps, refs) == pytest.approx(corpus['chrf'], abs=TOL, rel=0)
    for kind, value in metrics.rouge(hyps, refs).items():
        assert value == pytest.approx(corpus[kind], abs=TOL, rel=0), kind


def test_fixtures_cover_the_hostile_cases():
    names = {c['name'] for c in CASES}
    assert 30 <= len(CASES) <= 60 and len(names) == len(CASES)
    assert any(c['hypothesis'] == '' for c in CASES) and any('' in c['references'] for c in CASES)
    assert any(len(c['references']) > 2 for c in CASES)
    assert any(len(c['hypothesis']) > 2000 for c in CASES)
    assert not all(c['bleu_corpus'] == c['bleu_sentence'] for c in CASES)  # effective order shows


def test_single_reference_string_is_one_reference():
    assert metrics.sentence_bleu('a b c', 'a b d') == metrics.sentence_bleu('a b c', ['a b d'])
    assert metrics.corpus_chrf(['abc'], ['abd']) == metrics.corpus_chrf(['abc'], [['abd']])


def test_inputs_are_checked():
    with pytest.raises(ValueError, match='2 hypotheses but 1 references'):
        metrics.corpus_bleu(['a', 'b'], ['a'])
    with pytest.raises(ValueError, match='no examples'):
        metrics.rouge([], [])
    with pytest.raises(ValueError, match='no reference'):
        metrics.corpus_chrf(['a'], [[]])


def test_exact_match_normalisation():
    assert metrics.normalize_answer('  12 +\t5\n=  17 ') == '12 + 5 = 17'
    assert metrics.normalize_answer(' Paris ', lowercase=True) == 'paris'
    preds = [' 108', 'Paris', 'the answer is 5', '1,000', 'b']
    refs = ['108', ['London', 'paris'], '5', '1000', ['a', ' b ']]
    assert metrics.exact_match(preds, refs) == 2 / 5  # case, extra words and number formats count
    assert metrics.exact_match(preds, refs, lowercase=True) == 3 / 5


def exact_pass_at_k(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.comparison
def test_pass_at_k_equals_exact_combinatorics():
    for n in range(1, 41):
        for c in range(n + 1):
            for k in range(1, n + 1):
                # each of the c factors 1 - k/i is off by two roundings (<= 2^-53), which moves a
                # product of numbers <= 1 by no more; c - 1 products and 1 - P add one each
                tol = (3 * c + 1) * 2.0 ** -53
                exact = float(exact_pass_at_k(n, c, k))
                assert metrics.pass_at_k(n, c, k) == pytest.approx(exact, abs=tol, rel=0)


@pytest.mark.comparison
def test_pass_at_k_equals_count_over_every_draw():
    for n in range(1, 9):
        for c in range(n + 1):
            correct = set(range(c))  # which samples are correct does not matter, only how many
            for k in range(1, n + 1):
                draws = list(itertools.combinations(range(n), k))
                share = Fraction(sum(bool(correct.intersection(d)) for d in draws), len(draws))
                assert metrics.pass_at_k(n, c, k) == pytest.approx(float(share), abs=1e-15, rel=0)


def test_pass_at_k_edges():
    assert metrics.pass_at_k(10, 0, 5) == 0.0
    assert metrics.pass_at_k(10, 10, 1) == 1.0
    assert metrics.pass_at_k(10, 6, 5) == 1.0  # k > n - c: every draw of 5 holds a correct sample
    assert metrics.pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)
    assert metrics.pass_at_k(200, 1, 200) == 1.0
    assert 0 < metrics.pass_at_k(1000, 1, 1) < 1  # large n: the product form overflows nothing
    mean = metrics.mean_pass_at_k([(10, 0), (10, 10), (4, 2)], 2)
    assert mean == pytest.approx((0 + 1 + 5 / 6) / 3, abs=1e-15)
    for n, c, k in [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)]:
        with pytest.raises(ValueError):
            metrics.pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        metrics.mean_pass_at_k([], 1)


class CharTokenizer:
    """Characters as ids; 0 ends a turn."""
    eos_id = 0

    def encode(self, text):
        return [ord(ch) for ch in text]

    def decode(self, ids):
        return ''.join(map(chr, ids))


def test_chat_exact_match_uses_the_same_normaliser():
    tokenizer = CharTokenizer()
    # within the one token more than the reference that the model may generate
    answers = {'q1': '6+2=8,\n9+1=10, so 108', 'q2': '5', 'q3': 'Paris'}
    prompts = [('q1', '6+2=8, 9+1=10, so 108'), ('q2', ' 5 '), ('q3', 'paris')]
    generated = [tokenizer.encode(answers[q]) + [tokenizer.eos_id] for q, _ in prompts]
    refs = [ref for _, ref in prompts]
    accuracy = score_answers(['exact_match'], generated, refs, tokenizer)['exact_match']
    assert accuracy == pytest.approx(2 / 3)
    assert metrics.exact_match([answers[q] for q, _ in prompts], refs) == pytest.approx(accuracy)


def test_metrics_by_name_are_the_functions():
    preds, refs = ['the cat sat on the mat', 'hello world'], [['the cat sat on a mat'], ['hello', 'hello world']]
    names = list(metrics.METRICS)
    scores = metrics.corpus_scores(names, preds, refs)
    assert scores['bleu'] == metrics.corpus_bleu(preds, refs)
    assert scores['chrf'] == metrics.corpus_chrf(preds, refs)
    assert scores['rouge_l'] == metrics.rouge(preds, refs)['rougeL']
    assert scores['rouge2'] == metrics.rouge(preds, refs)['rouge2']
    assert scores['exact_match'] == 0.5
    one = metrics.example_scores(names, preds[1], refs[1])
    assert one['exact_match'] == 1.0 and one['bleu'] == metrics.sentence_bleu(preds[1], refs[1])
    assert one['rouge1'] == 1.0
    with pytest.raises(ValueError, match="unknown metric 'blue'.*bleu"):
        metrics.corpus_scores(['blue'], preds, refs)


def test_metric_names_parse_from_a_comma_list():
    assert metrics.parse_metric_names(' bleu, rouge_l,,bleu ') == ['bleu', 'rouge_l']
    assert metrics.parse_metric_names('') == []
    with pytest.raises(ValueError, match="unknown metric 'blue'"):
        metrics.parse_metric_names('exact_match,blue')


def test_standard_errors_as_lm_eval_computes_them():
    """mean_stderr is the sample std (Bessel's) over sqrt(n); the bootstrap of a mean metric approaches the same
    (binomial: sqrt(p (1 - p) / n), here within 10% with 1000 resamples); a corpus of identical examples has
    no spread; fewer than two examples have no standard error."""
    values = [1, 0, 1, 1, 0, 1, 1, 1]
    mean = sum(values) / 8
    assert metrics.mean_stderr(values) == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / 7 / 8))
    assert metrics.mean_stderr([1.0]) is None
    predictions = ['a'] * 120 + ['b'] * 80
    references = [['a']] * 200
    p = 0.6
    hits = [[int(metrics.exact_match([h], [r]))] for h, r in zip(predictions, references)]  # each example's count
    boot = metrics.bootstrap_stderr(hits, lambda counts: counts[0] / 200)
    assert boot == pytest.approx(math.sqrt(p * (1 - p) / 200), rel=0.1)
    assert boot == metrics.bootstrap_stderr(hits, lambda counts: counts[0] / 200)  # seeded
    counts, score = metrics.CORPUS_STATISTICS['bleu']
    assert metrics.bootstrap_stderr([counts('the cat sat', ['the cat sat'])] * 5, score, iters=50) == 0
    errors = metrics.corpus_stderrs(['exact_match', 'bleu', 'rouge1'], predictions[:10], references[:10])
    assert errors['exact_match'] == metrics.mean_stderr([1.0] * 10) == 0 and errors['bleu'] == 0


def test_a_reply_that_calls_tools_splits_into_its_text_and_calls():
    """reply_and_calls (serve.py's tool_calls) on each call turn of chat_tools.json as its template writes it and a
    model's tokens decode (special tokens left out: Mistral's [TOOL_CALLS]): the turn's calls in order, and its
    text where the template writes it (Qwen's; Llama's and Mistral's leave it out); calls to other names stay."""
    with open(os.path.join(os.path.dirname(__file__), 'fixtures', 'hf', 'expected', 'chat_tools.json')) as f:
        cases = [c for c in json.load(f) if 'error' not in c and c['model'] != 'smollm2']
    seen = set()
    for case in cases:
        tokenizer = load_hf_tokenizer(hf_fixture(case['model']))
        names = {tool['function']['name'] for tool in case['tools']}
        for i, m in enumerate(case['messages']):
            if not m.get('tool_calls'):
                continue
            try:
                reply = tokenizer.reply_text(case['messages'][:i + 1], case['tools'])
            except UserError:  # Mistral's template writes a turn before the last differently: no reply to find
                assert case['model'] == 'mistral'
                continue
            text = tokenizer.decode(tokenizer.tokenizer.encode(reply, add_special_tokens=False).ids, skip_special=True)
            arguments = [c['function']['arguments'] for c in m['tool_calls']]
            calls = [(c['function']['name'], json.dumps(json.loads(a) if isinstance(a, str) else a, sort_keys=True))
                     for c, a in zip(m['tool_calls'], arguments)]
            content = m['content'] if m['content'] and m['content'] in reply else None
            assert metrics.reply_and_calls(text, names) == (content, calls), (case['model'], case['case'], text)
            seen.add((case['model'], content is not None, len(calls)))
    assert {('qwen3', True, 1), ('qwen2', True, 1), ('llama', False, 1), ('mistral', False, 2)} <= seen
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert metrics.reply_and_calls(text, {'get_weather'}) == (text, [])


def test_tool_calls_are_read_as_each_template_writes_them():
    """tool_calls_in on transformers' renders of the fixtures' real templates (chat_tools.json) gives the calls
    of the messages they rendered: Qwen's <tool_call> objects, Llama's "parameters", Mistral's [TOOL_CALLS] list
    (its ids ignored), arguments given as a JSON string; tool_call_match scores call for call in any order."""
    with open(os.path.join(os.path.dirname(__file__), 'fixtures', 'hf', 'expected', 'chat_tools.json')) as f:
        cases = [c for c in json.load(f) if 'text' in c and c['model'] != 'smollm2']  # smollm2 writes no calls
    for case in cases:
        calls = []
        for m in case['messages']:
            for call in m.get('tool_calls') or []:
                args = call['function']['arguments']
                calls.append((call['function']['name'], json.dumps(json.loads(args) if isinstance(args, str) else args,
                                                                   sort_keys=True)))
        prompt_end = case['text'].index(case['messages'][0]['content'] if case['messages'][0]['role'] != 'system'
                                        else case['messages'][1]['content'])  # after the tools' schemas
        assert metrics.tool_calls_in(case['text'][prompt_end:]) == sorted(calls), (case['model'], case['case'])
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    spaced = '<tool_call>{"arguments":{"unit":"C","city":"Oslo"},"name":"get_weather"}</tool_call>'
    clock = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
    predictions = [spaced, clock + weather, weather.replace('Oslo', 'Lima'), 'It is 18C.', 'It is 18C.', '{"name": 1}']
    references = [weather, [weather + clock], weather, 'Sunny.', weather, 'Fine.']
    assert metrics.tool_call_match(predictions, references) == pytest.approx(4 / 6)
    assert metrics.example_scores(['tool_calls'], spaced, [weather]) == {'tool_calls': 1.0}
