"""eval.py's multiple-choice scores against lm-evaluation-harness's own (issue 31). tests/fixtures/lm_eval/ holds a
tiny nanotrain model that export.py wrote, hostile examples and what lm-eval 0.4.13's `hf` model made of them
(tests/fixtures/make_lm_eval_fixtures.py, run once in its own environment; lm-eval is never a dependency): per
example the arguments it scored, its token split of each (context, continuation), its logliks, acc, acc_norm and
acc_bytes, and the totals with their standard errors; and its loglikelihood_rolling of a few texts. eval.py, run as
a user runs it, must give the same acc, acc_norm and acc_bytes on every example and in total, lm-eval's standard
errors, each choice's loglik within float32 rounding of lm-eval's, and each text's too.

TOKEN_TOL bounds |eval.py's loglik - lm-eval's| per continuation token. Two float32 forwards of this 2-layer,
32-wide model by different code (transformers' Arcee in lm-eval, nanotrain's GPT in eval.py), batched differently,
maybe on other CPU kernels, sum in other orders. The largest sum is a logit: 32 products whose sizes add up to at
most 32 * 4.4 * 0.83 = 117 here (normed hidden state <= 4.4, embeddings <= 0.83; logits <= 13); reordering it moves
it by ~sqrt(32) * 2^-24 * 117 = 4e-5 (32 * 2^-24 * 117 = 2.2e-4 only if every rounding went one way), and the
earlier steps' relative errors of a few ulps move a logit by ~13 * 1e-6; a log-prob (logit - logsumexp) by up to
twice that. Measured: eval.py vs lm-eval at most 3.3e-6 per token (6.1e-5 in all on the 50-token choice) with
ATEN_CPU_CAPABILITY unset (AVX-512, AMD EPYC), avx2 and default; lm-eval's float32 vs a float64 forward 3.1e-6 per
token (expected.json). TOKEN_TOL = 1e-4 per token is ~30x the measured and above the estimate; the fixture keeps
only examples whose best two choices (raw and per character) are more than twice their summed tolerances apart,
so acc and acc_norm must match exactly.
"""
import os

import pytest
import torch

from conftest import ROOT, load_gpt, read_json_file, run
from fixtures.make_lm_eval_fixtures import with_bos

FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'lm_eval')
MODEL = os.path.join(FIXTURE, 'model')
EXPECTED = read_json_file(os.path.join(FIXTURE, 'expected.json'))
TOKEN_TOL = 1e-4  # |loglik - lm-eval's| per continuation token (the docstring's bound)
PREDICTIONS = ('pred', 'pred_norm', 'pred_bytes', 'acc', 'acc_norm', 'acc_bytes')


def tolerances(example):
    return [TOKEN_TOL * len(ids) for ids in example['continuation_ids']]


def argmax(scores):
    return max(range(len(scores)), key=lambda i: (scores[i], -i))  # the first of equal scores, as np.argmax


def test_the_fixture_was_built_for_this_tolerance_and_tells_scorings_apart():
    # the fixture's margins between choices were chosen for the tolerance the test allows
    assert EXPECTED['token_tol'] == TOKEN_TOL and EXPECTED['n'] == len(EXPECTED['examples'])
    assert EXPECTED['float64_max_abs_diff_per_token'] < TOKEN_TOL / 10
    # examples where acc != acc_norm, and where normalising by bytes, tokens or len(" " + choice) instead of the
    # choice's characters would pick another choice: a scorer that did so fails the eval.py test
    examples = EXPECTED['examples']
    assert sum(e['acc'] != e['acc_norm'] for e in examples) >= 5
    for length in (lambda e, k: len(e['choices'][k].encode()), lambda e, k: len(e['continuation_ids'][k]),
                   lambda e, k: len(' ' + e['choices'][k])):
        assert sum(argmax([ll / length(e, k) for k, ll in enumerate(e['logliks'])]) != e['pred_norm']
                   for e in examples) >= 2


@pytest.mark.comparison
def test_nanotrain_gpt_gives_lm_evals_logliks_on_its_token_splits():
    """The arithmetic alone, without eval.py: the exported folder read back as nanotrain's GPT, fed lm-eval's own
    token splits (cut from the left to max_length + 1 tokens as lm-eval cuts them), sums lm-eval's logliks. If
    this passes and the eval.py test fails, the difference is in eval.py's tokenization, split or scoring."""
    pairs = [(example, i, (context_ids + continuation_ids)[-(EXPECTED['max_length'] + 1):], len(continuation_ids))
             for example in EXPECTED['examples']
             for i, (context_ids, continuation_ids) in enumerate(zip(example['context_ids'],
                                                                     example['continuation_ids']))]
    # one forward of all of them, right-padded: in a causal model padding after a sequence changes none of its logits
    inputs = torch.zeros(len(pairs), max(len(tokens) for _, _, tokens, _ in pairs) - 1, dtype=torch.long)
    for row, (_, _, tokens, _) in enumerate(pairs):
        inputs[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
    with torch.no_grad():
        logp = load_gpt(MODEL)(inputs)[0].float().log_softmax(-1)
    for row, (example, i, tokens, n) in enumerate(pairs):
        positions = torch.arange(len(tokens) - 1 - n, len(tokens) - 1)
        got = logp[row, positions, tokens[-n:]].sum().item()
        want = example['logliks'][i]
        assert abs(got - want) <= TOKEN_TOL * n, (example['index'], example['choices'][i], got, want)


@pytest.mark.comparison
@pytest.mark.slow  # a launch of eval.py
def test_eval_py_scores_multiple_choice_as_lm_eval_does(tmp_path):
    out = tmp_path / 'result.json'
    run(['eval.py', f'--init_from={MODEL}', f'--eval_data={os.path.join(FIXTURE, "examples.jsonl")}', f'--out={out}',
         '--device=cpu'])
    result = read_json_file(out)
    assert result['task'] == 'multiple_choice' and result['n'] == EXPECTED['n'] == len(result['examples'])
    wrong = []
    for got, want in zip(result['examples'], EXPECTED['examples']):
        assert (got['index'], got['context'], got['choices'], got['label']) == (
            want['index'], want['context'], want['choices'], want['label'])
        far = [(i, g, w, tol) for i, (g, w, tol) in enumerate(zip(got['logliks'], want['logliks'], tolerances(want)))
               if not abs(g - w) <= tol]
        if far or [got[k] for k in PREDICTIONS] != [want[k] for k in PREDICTIONS]:
            wrong.append(dict(index=want['index'], context=want['context'], choices=want['choices'],
                              logliks=(got['logliks'], want['logliks']), far=far,
                              preds=[(got[k], want[k]) for k in PREDICTIONS],
                              lm_eval_arguments=want['arguments'], lm_eval_context_ids=want['context_ids'],
                              lm_eval_continuation_ids=want['continuation_ids']))
    assert not wrong, wrong  # (eval.py's, lm-eval's) per example, with lm-eval's token split of each choice
    for k in ('acc', 'acc_norm', 'acc_bytes'):
        assert result['scores'][k] == EXPECTED['scores'][k]
        assert result['stderr'][k] == pytest.approx(EXPECTED['stderr'][k], rel=1e-12)  # lm-eval's mean_stderr


@pytest.mark.comparison
@pytest.mark.slow  # a launch of eval.py
def test_eval_py_measures_perplexity_as_lm_eval_does(tmp_path):
    """Texts (one longer than the model's 128 positions: rolling windows) scored by eval.py as lm-eval's
    loglikelihood_rolling scores them: each text's loglik within TOKEN_TOL a token of lm-eval's, and word and
    byte perplexity and bits per byte within what those differences allow. Then the same model with a tokenizer
    that opens every text with a BOS, as a Llama's does (with_bos), which lm-eval encodes and scores too."""
    out = tmp_path / 'result.json'
    texts = os.path.join(FIXTURE, "texts.jsonl")
    run(['eval.py', f'--init_from={MODEL}', f'--eval_data={texts}', f'--out={out}', '--device=cpu'])
    result, want = read_json_file(out), EXPECTED['rolling']
    bos_model = with_bos(MODEL, str(tmp_path / 'model_bos'))
    run(['eval.py', f'--init_from={bos_model}', f'--eval_data={texts}', f"--out={tmp_path / 'bos.json'}",
         '--device=cpu'])
    for got, text in zip(read_json_file(tmp_path / 'bos.json')['examples'], want['bos']):
        assert text['starts_with_bos'] and abs(got['loglik'] - text['loglik']) <= TOKEN_TOL * text['n_tokens']
    assert result['task'] == 'loglikelihood_rolling' and result['n'] == len(want['texts'])
    for got, text in zip(result['examples'], want['texts']):
        assert abs(got['loglik'] - text['loglik']) <= TOKEN_TOL * text['n_tokens'], (got, text)
    assert max(t['n_tokens'] for t in want['texts']) > EXPECTED['max_length']
    n_tokens = sum(t['n_tokens'] for t in want['texts'])
    for k, value in want['scores'].items():  # exp of a sum off by n_tokens * TOKEN_TOL over >= 1 byte a token
        assert result['scores'][k] == pytest.approx(value, rel=2 * n_tokens * TOKEN_TOL), k
