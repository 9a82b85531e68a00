"""lm/heldout_eval.py: held-out prompts answered in batches as the path it replaced answered them one at a
time (GPT.generate per prompt), exact match as strict as before, the metrics of --eval_metrics at every eval
in log.jsonl and TensorBoard, corpus scores under DDP equal to one process's, a bad metric name refused."""
import contextlib
import glob

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from configurator import UserError
from conftest import assert_user_error, logged, read_log, run, sft, sft_args, sft_mixture, torchrun
from lm import metrics
from lm.generate import generate_batch
from lm import heldout_eval
from lm.heldout_eval import HeldOut, answer_batches, heldout_answers, report_heldout, score_answers
from model import GPT, GPTConfig

PROMPTS = [[5, 9, 1], [7], [3, 3, 8, 2, 11, 30, 4], [12, 6], [1, 2, 3, 4], [20]]  # lengths differ: padding


class Letters:
    """Token i is the character chr(97 + i); eos_id ends a turn."""

    def __init__(self, eos_id):
        self.eos_id = eos_id

    def encode(self, text):
        return [ord(ch) - 97 for ch in text]

    def decode(self, ids):
        return ''.join(chr(97 + i) for i in ids)


def sharp_model():
    """tests/test_generate.py's tiny float64 GPT with 20x its init weights: answers depend on the prompt, and
    float64 keeps padding's kernels from flipping a greedy choice."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(block_size=32, vocab_size=32, n_layer=2, n_head=2, n_embd=16))
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(20 if p.dim() == 2 else 1)
    return m.double()


def old_answer(m, prompt, max_new_tokens, eos_id):
    """The replaced path: one prompt through GPT.generate, greedy, up to and with the end of turn."""
    out = m.generate(torch.tensor([prompt]), max_new_tokens, temperature=0, eos_id=eos_id)[0, len(prompt):].tolist()
    return out[:out.index(eos_id) + 1] if eos_id in out else out


def old_exact_match(answers, references, tokenizer):
    """The replaced path's score: the end of turn generated (within the reference's tokens + 1) right after
    the normalised reference."""
    end, norm = tokenizer.eos_id, metrics.normalize_answer
    return sum(end in out and norm(tokenizer.decode(out[:out.index(end)])) == norm(ref)
               for out, ref in zip(answers, references)) / len(answers)


@pytest.mark.comparison
def test_batched_answers_equal_one_prompt_at_a_time():
    m = sharp_model().eval()
    free = generate_batch(m, PROMPTS, 12)
    tok = Letters(eos_id=free[0][2])  # a token the model produces: some answers stop, others run on
    # row 0 stops right after its reference (row 1's, spaced, is normalised), row 2 runs on past its own
    before_end = [free[r][:free[r].index(tok.eos_id)] if tok.eos_id in free[r] else free[r][:3] for r in (0, 1)]
    references = [tok.decode(before_end[0]), f' {tok.decode(before_end[1])}  ', tok.decode(free[2][:3]), 'x', 'ab', 'q']
    prompts = list(zip(PROMPTS, references))
    exact = HeldOut(tok, prompts, ['exact_match'], batch_size=4, max_length=20)
    got = heldout_answers(m, exact, contextlib.nullcontext())
    want = [old_answer(m, p, len(ref) + 1, tok.eos_id) for p, ref in prompts]
    assert got == want
    assert any(a[-1] == tok.eos_id for a in got) and any(a[-1] != tok.eos_id for a in got)
    assert score_answers(['exact_match'], got, references, tok)['exact_match'] == old_exact_match(want, references, tok)
    # free-form metrics: answers run on to max_length (prompt included) but exact match is scored as before
    both = exact._replace(metrics=['bleu', 'exact_match'])
    longer = heldout_answers(m, both, contextlib.nullcontext())
    assert longer == [old_answer(m, p, max(len(ref) + 1, 20 - len(p)), tok.eos_id) for p, ref in prompts]
    scores = score_answers(['bleu', 'exact_match'], longer, references, tok)
    assert scores['exact_match'] == old_exact_match(want, references, tok) >= 1 / 6  # row 0 at least
    texts = [tok.decode(a[:-1] if a[-1] == tok.eos_id else a) for a in longer]
    assert scores['bleu'] == metrics.corpus_bleu(texts, references)
    assert m.training is False and list(scores) == ['bleu', 'exact_match']


@pytest.mark.comparison
def test_a_batch_out_of_memory_is_answered_in_halves(monkeypatch):
    """On a device with room for one prompt at a time (a larger batch raises torch.OutOfMemoryError) the batches
    are answered in halves, with the answers of batches that fit; one prompt that does not fit is a UserError;
    either way a training model is left in train mode (the scripts answer at their evals, before saving)."""
    m = sharp_model()
    tok = Letters(eos_id=generate_batch(m.eval(), PROMPTS, 12)[0][2])
    held_out = HeldOut(tok, [(p, 'ab') for p in PROMPTS], ['bleu', 'exact_match'], batch_size=4, max_length=20)
    fit = heldout_answers(m.train(), held_out, contextlib.nullcontext())

    refused = []

    def room_for(n):
        def generate(model, prompts, *args, **kwargs):
            if len(prompts) > n:
                refused.append(len(prompts))
                raise torch.OutOfMemoryError('injected')
            return generate_batch(model, prompts, *args, **kwargs)
        return generate
    monkeypatch.setattr(heldout_eval, 'generate_batch', room_for(1))
    assert heldout_answers(m, held_out, contextlib.nullcontext()) == fit and m.training
    assert refused == [4, 2]  # the first batch finds the size; the later ones start from it
    monkeypatch.setattr(heldout_eval, 'generate_batch', room_for(0))
    with pytest.raises(UserError, match='out of memory answering one held-out prompt'):
        heldout_answers(m, held_out, contextlib.nullcontext())
    assert m.training


def test_exact_match_is_strict_and_uses_the_metrics_normaliser():
    """As before batching: normalize_answer's whitespace and case rules, and the end of turn within the
    reference's tokens + 1, even when a free-form metric let the answer run longer."""
    tok = Letters(eos_id=31)
    references = ['ab c', ' d ', 'paris', 'ab', 'ab']
    texts = ['ab\tc', 'd', 'Paris', 'ab ', 'abxyz']  # hit, hit, miss (case), miss (stops late), miss
    answers = [tok.encode(t) + [31] for t in texts[:4]] + [tok.encode(texts[4])]  # the last never stops
    assert score_answers(['exact_match'], answers, references, tok)['exact_match'] == 2 / 5
    assert metrics.exact_match(texts, references) == 3 / 5  # the plain metric: 'ab ' is 'ab'
    tok.stop_ids = [30]  # a published model's other stop token (generation_config.json) ends an answer too
    answers[1] = tok.encode(texts[1]) + [30]
    assert score_answers(['exact_match'], answers, references, tok)['exact_match'] == 2 / 5
    del tok.stop_ids
    assert score_answers(['exact_match'], answers, references, tok)['exact_match'] == 1 / 5


def test_each_source_is_scored_apart(monkeypatch, capsys):
    """With named sources (train.py's sft_data), each source's prompts are scored on their own as well as all
    together: eval/<metric>/<source> beside eval/<metric>, on the same log line."""
    tok = Letters(eos_id=31)
    references = ['ab', 'cd', 'ef', 'gh', 'ij']
    texts = ['ab', 'cx', 'ef', 'gh', 'ix']  # a: 2 of 3 right; b: 1 of 2
    monkeypatch.setattr(heldout_eval, 'heldout_answers', lambda model, held_out, autocast: [
        tok.encode(t) + [31] for t in texts])
    held_out = HeldOut(tok, [([0], ref) for ref in references], ['exact_match', 'chrf'], 4, 20,
                       sources=['a', 'b', 'a', 'b', 'a'])
    events = []
    report_heldout(None, held_out, None, 7, events.append)
    scores = {source: score_answers(['exact_match', 'chrf'], [tok.encode(texts[i]) + [31] for i in mine],
                                    [references[i] for i in mine], tok) for source, mine in [('a', [0, 2, 4]),
                                                                                              ('b', [1, 3])]}
    assert events == [{'step': 7, 'eval/exact_match': 3 / 5, 'eval/chrf': pytest.approx(metrics.corpus_chrf(
        texts, references)), 'eval/exact_match/a': 2 / 3, 'eval/chrf/a': scores['a']['chrf'],
        'eval/exact_match/b': 1 / 2, 'eval/chrf/b': scores['b']['chrf']}]
    assert scores['a']['chrf'] != scores['b']['chrf']
    assert 'step 7: exact_match 60.0% (a 66.7%, b 50.0%), chrf ' in capsys.readouterr().out
    report_heldout(None, held_out._replace(sources=()), None, 8, events.append)  # one unnamed source: as before
    assert set(events[-1]) == {'step', 'eval/exact_match', 'eval/chrf'}


def test_batches_fit_the_block_and_batch_size():
    rows = [([0] * n, budget) for n, budget in [(3, 5), (10, 2), (4, 19), (1, 1), (6, 6), (2, 3)]]
    batches = answer_batches(rows, batch_size=3, block_size=22)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    assert [len(rows[b[0]][0]) for b in batches] == sorted(len(rows[b[0]][0]) for b in batches)  # shortest first
    for b in batches:
        assert len(b) <= 3 and max(len(rows[i][0]) for i in b) + max(rows[i][1] for i in b) - 1 <= 22
    assert len(batches) == 3  # (1, 2, 3); then 4+19 cannot take 6; (6, 10) fit


# -- train.py and train_dpo.py -------------------------------------------------------------------

METRICS = '--eval_metrics=exact_match,bleu,chrf,rouge_l'
KEYS = [f'eval/{metric}{source}' for metric in ('exact_match', 'bleu', 'chrf', 'rouge_l')
        for source in ('', '/arithmetic', '/digits')]


@pytest.fixture(scope='module')
def tuned(sft_env, tmp_path_factory):
    """An SFT run of the two sources of sft_mixture scoring four metrics every 2 steps, each source's too, with
    TensorBoard: each source's test prompts (4 and 8)."""
    out = tmp_path_factory.mktemp('tuned')
    p = sft(sft_env, out, '--max_iters=4', '--eval_interval=2', '--lr_decay_iters=4', '--exact_match_examples=12',
            '--tensorboard=True', METRICS, sft_mixture(sft_env))
    return out, p.stdout


@pytest.mark.slow
def test_eval_metrics_logged_recorded_and_in_tensorboard_at_every_eval(tuned):
    out, stdout = tuned
    for key in KEYS:
        assert sorted(logged(out, key)) == [0, 2, 4], key
    assert [e['step'] for e in read_log(out) if 'val_loss' in e] == [0, 2, 4]
    # one line per eval
    assert 'step 2: exact_match 0.0% (arithmetic 0.0%, digits 0.0%), bleu ' in stdout and ', rouge_l ' in stdout
    events = EventAccumulator(glob.glob(str(out / 'tb' / 'events.*'))[0])
    events.Reload()
    for key in KEYS:
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [0, 2, 4]
        assert [s.value for s in scalars] == pytest.approx([logged(out, key)[s] for s in (0, 2, 4)], rel=1e-6)


@pytest.mark.slow
@pytest.mark.comparison
def test_ddp_corpus_scores_equal_one_process(tuned, sft_env, tmp_path):
    """The tuned run's final weights scored again by 2 ranks (gloo), which answer alternate batches (5 here:
    the free-form answers run to max_length = block_size, so only prompts of about one length share a batch)
    and gather the answers: the corpus scores are the single process's of its last eval bit for bit (each
    batch is computed as one process computes it, one thread each)."""
    out = tuned[0]
    run([*torchrun(2), *sft_args(sft_env, tmp_path, '--eval_only=True', f'--init_from={out / "ckpt.pt"}',
                                 '--exact_match_examples=12', METRICS, sft_mixture(sft_env))])
    one, two = read_log(out)[-1], read_log(tmp_path)[-1]
    assert one['step'] == 4 and {k: one[k] for k in KEYS} == {k: two[k] for k in KEYS}
    assert one['eval/chrf'] > 0  # summed counts: the mean of the ranks' chrF would differ


@pytest.mark.slow
def test_unknown_metric_is_a_user_error(tmp_path):
    # train.py checks its fine-tuning keys when it fine-tunes (pretraining scores no held-out answers)
    for script in (['train.py', '--training_type=sft'], ['train_dpo.py']):
        p = run([*script, f'--out_dir={tmp_path}', '--eval_metrics=exact_match,blue'], check=False)
        assert_user_error(p, "eval_metrics='exact_match,blue'", "unknown metric 'blue'", 'bleu, chrf')
