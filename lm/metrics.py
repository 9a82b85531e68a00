"""
Generation metrics as users know them: plain functions over lists of strings, each computed as
the tool that defines it computes it, without depending on that tool (tests/test_metrics.py checks
each against the tool's own output on committed fixtures, tests/fixtures/metrics/expected.json).
References: per example one string or a list of strings (several references).

- exact_match: the share of predictions equal to one of their references after normalize_answer:
  ends stripped, every inner run of whitespace one space, lowercased on request (off by default);
  nothing else (punctuation, articles, number formats all count). lm/heldout_eval.py scores chat
  models with the same normaliser.
- corpus_bleu, sentence_bleu: sacreBLEU 2.x's BLEU with its defaults, on its 0-100 scale: the 13a
  tokenizer (mteval-v13a, as WMT uses), 1- to 4-grams, each n-gram's count clipped by its largest
  count in any one reference, the brevity penalty against the closest reference length (the
  shorter on a tie), 'exp' smoothing (the k-th order with no match counts 1 / 2^k matches). The
  corpus score sums the counts over all examples (sacrebleu.corpus_bleu); the sentence score is one
  example's with effective order: orders the hypothesis is too short for are left out
  (sacrebleu.sentence_bleu).
- corpus_chrf, sentence_chrf: sacreBLEU's chrF with its defaults, 0-100: character 1- to 6-grams
  with whitespace removed, no word n-grams, F-beta with beta 2 (recall twice as important) of the
  precision and recall averaged over the orders both sides have; per example the reference with
  the best chrF, counts summed over the corpus.
- rouge, rouge_scores: ROUGE-1, ROUGE-2 and ROUGE-L F1 as Google's rouge-score computes them, 0-1:
  lowercased, every run of characters other than [a-z0-9] a space (so text without ASCII letters or
  digits has no tokens and scores 0), no stemming; per example the best reference
  (RougeScorer.score_multi), the corpus score the mean over examples.
- tool_call_match: the share of predictions whose tool calls (each JSON object naming a function with its
  arguments, as chat templates write calls) equal a reference's, arguments compared as JSON values: ours,
  stricter than BFCL's AST checker (no type coercion, no optional arguments left out).
- pass_at_k: the unbiased pass@k estimator of Chen et al. 2021 (Evaluating Large Language Models
  Trained on Code): from n samples of which c are correct, 1 - C(n-c, k) / C(n, k), computed as
  their product so that no binomial overflows; mean_pass_at_k averages it over problems.
"""
import json
import math
import random
import re
from collections import Counter

import numpy as np

BLEU_ORDER = 4
CHRF_ORDER = 6
CHRF_BETA = 2
ROUGE_KINDS = ('rouge1', 'rouge2', 'rougeL')
# mteval-v13a's language-dependent rules as sacreBLEU writes them, applied in this order
TOKENIZE_13A = [
    (re.compile(r'([\{-\~\[-\` -\&\(-\+\:-\@\/])'), r' \1 '),  # ASCII symbols but ' , - . apart
    (re.compile(r'([^0-9])([\.,])'), r'\1 \2 '),  # . and , apart unless between digits, so that
    (re.compile(r'([\.,])([^0-9])'), r' \1 \2'),  # 1,000.5 stays one token
    (re.compile(r'([0-9])(-)'), r'\1 \2 '),  # a dash after a digit apart: 3-4 is three tokens
]
XML_ENTITIES = [('&quot;', '"'), ('&amp;', '&'), ('&lt;', '<'), ('&gt;', '>')]  # sacreBLEU's order
NON_ALPHANUMERIC = re.compile(r'[^a-z0-9]+')


def normalize_answer(text, lowercase=False):
    """text with its ends stripped and every inner run of whitespace made one space; lowercased
    too when asked. Punctuation, articles and number formats are left as they are."""
    text = ' '.join(text.split())
    return text.lower() if lowercase else text


def examples(hypotheses, references):
    """(hypothesis, list of references) pairs; references per example one string or a list."""
    if len(hypotheses) != len(references):
        raise ValueError(f'{len(hypotheses)} hypotheses but {len(references)} references')
    if not hypotheses:
        raise ValueError('no examples to score')
    pairs = [(hyp, [refs] if isinstance(refs, str) else list(refs))
             for hyp, refs in zip(hypotheses, references)]
    if any(not refs for _, refs in pairs):
        raise ValueError('an example has no reference')
    return pairs


def exact_match(predictions, references, lowercase=False):
    """Share of predictions equal, after normalize_answer, to one of their references."""
    hits = sum(normalize_answer(pred, lowercase) in {normalize_answer(r, lowercase) for r in refs}
               for pred, refs in examples(predictions, references))
    return hits / len(predictions)


def tool_calls_in(text):
    """The tool calls a text writes, as a sorted list of (name, arguments as canonical JSON): every JSON object
    in it with a "name" and "arguments" (Qwen's and Mistral's templates; as a JSON string too, OpenAI's form) or
    "parameters" (Llama 3.x's), alone or in a list (Mistral's [TOOL_CALLS] [...]); other keys (ids) ignored."""
    return sorted(call for _, _, calls in json_calls(text) for call in calls)


def json_calls(text):
    """(start, end, calls) of each JSON value in text that writes tool calls (tool_calls_in's), in order."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i] not in '{[':
            i += 1
            continue
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        calls = [key for key in map(call_key, value if isinstance(value, list) else [value]) if key]
        if calls:
            found.append((i, end, calls))
        i = end
    return found


def reply_and_calls(text, names):
    """(the text around them or None, calls) of an answer that calls the tools named names (serve.py's reply):
    the calls as tool_calls_in reads them, in order, those to other names left in the text; the text without
    them, the <tool_call> tags left empty (Qwen's) and an empty <think></think> (Qwen3's, not thinking), stripped."""
    spans = [(start, end, calls) for start, end, calls in json_calls(text) if all(n in names for n, _ in calls)]
    kept, at = [], 0
    for start, end, _ in spans:
        kept.append(text[at:start])
        at = end
    rest = re.sub(r'<tool_call>\s*</tool_call>|<think>\s*</think>', '', ''.join(kept) + text[at:]).strip()
    return rest or None, [call for _, _, calls in spans for call in calls]


def call_key(call):
    """(name, arguments as canonical JSON) of a call written {"name", "arguments" (an object, or one as a JSON
    string) or "parameters"}; None for anything else."""
    args = call.get('arguments', call.get('parameters')) if isinstance(call, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if args is None or not isinstance(call.get('name'), str):
        return None
    return call['name'], json.dumps(args, sort_keys=True)


def tool_call_match(predictions, references):
    """Share of predictions that write the same tool calls as one of their references (tool_calls_in: names and
    arguments as JSON values, in any order, however spaced); a reference with no calls is matched by a
    prediction with none (the choice not to call)."""
    hits = sum(tool_calls_in(pred) in [tool_calls_in(r) for r in refs] for pred, refs in examples(predictions, references))
    return hits / len(predictions)


def tokenize_13a(text):
    """sacreBLEU's default tokenizer (13a): the tokens of text."""
    text = text.rstrip().replace('<skipped>', '').replace('-\n', '').replace('\n', ' ')
    for entity, char in XML_ENTITIES:
        text = text.replace(entity, char)
    text = f' {text} '
    for pattern, replacement in TOKENIZE_13A:
        text = pattern.sub(replacement, text)
    return text.split()


def word_ngrams(tokens, orders):
    """Counts of the n-grams of tokens, as tuples, for each n in orders."""
    return Counter(tuple(tokens[i:i + n]) for n in orders for i in range(len(tokens) - n + 1))


def bleu_statistics(hypothesis, references):
    """One example's BLEU counts, which sacreBLEU sums over a corpus: [hypothesis length, closest
    reference length, matches of each order, hypothesis n-grams of each order]."""
    hyp = tokenize_13a(hypothesis)
    refs = [tokenize_13a(ref) for ref in references]
    orders = range(1, BLEU_ORDER + 1)
    clip = Counter()
    for ref in refs:
        clip |= word_ngrams(ref, orders)  # the larger count: one reference's at most is earned
    ref_len = min((len(ref) for ref in refs), key=lambda n: (abs(len(hyp) - n), n))
    matches, totals = [0] * BLEU_ORDER, [0] * BLEU_ORDER
    for ngram, count in word_ngrams(hyp, orders).items():
        totals[len(ngram) - 1] += count
        matches[len(ngram) - 1] += min(count, clip[ngram])
    return [len(hyp), ref_len] + matches + totals


def bleu_from_statistics(stats, effective_order):
    """BLEU (0-100) of summed bleu_statistics with 'exp' smoothing: sacreBLEU's
    BLEU.compute_bleu, operation for operation so that the floats agree."""
    hyp_len, ref_len = stats[:2]
    matches, totals = stats[2:2 + BLEU_ORDER], stats[2 + BLEU_ORDER:]
    if not any(matches):
        return 0.0
    brevity = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    precisions = [0.0] * BLEU_ORDER
    smooth, order = 1.0, BLEU_ORDER
    for n in range(BLEU_ORDER):
        if totals[n] == 0:
            break  # without effective order the empty orders keep precision 0: BLEU 0
        if effective_order:
            order = n + 1
        if matches[n] == 0:
            smooth *= 2
            precisions[n] = 100. / (smooth * totals[n])
        else:
            precisions[n] = 100. * matches[n] / totals[n]
    logs = [math.log(p) if p != 0.0 else -9999999999 for p in precisions[:order]]  # their floor
    return brevity * math.exp(sum(logs) / order)


def summed(statistics):
    """Element-wise sum of equal-length count lists."""
    return [sum(column) for column in zip(*statistics)]


def corpus_bleu(hypotheses, references):
    """sacrebleu.corpus_bleu(hypotheses, reference streams) with its defaults, 0-100."""
    pairs = examples(hypotheses, references)
    stats = summed(bleu_statistics(*pair) for pair in pairs)
    return bleu_from_statistics(stats, effective_order=False)


def sentence_bleu(hypothesis, references):
    """sacrebleu.sentence_bleu(hypothesis, references) with its defaults, 0-100."""
    pair = examples([hypothesis], [references])[0]
    return bleu_from_statistics(bleu_statistics(*pair), effective_order=True)


def char_ngrams(text):
    """Counts of the character n-grams of text without its whitespace, one Counter per order."""
    text = ''.join(text.split())
    orders = range(1, CHRF_ORDER + 1)
    return [Counter(text[i:i + n] for i in range(len(text) - n + 1)) for n in orders]


def chrf_from_statistics(stats):
    """chrF (0-100) of [hypothesis n-grams, reference n-grams, matches] per order: sacreBLEU's
    CHRF._compute_f_score without eps smoothing, operation for operation."""
    factor = CHRF_BETA ** 2
    precision, recall, orders = 0.0, 0.0, 0
    for n_hyp, n_ref, n_match in zip(stats[0::3], stats[1::3], stats[2::3]):
        if n_hyp > 0 and n_ref > 0:  # an order one side is too short for is not averaged
            precision += n_match / n_hyp
            recall += n_match / n_ref
            orders += 1
    if orders:
        precision, recall = precision / orders, recall / orders
    if precision + recall == 0:
        return 0.0
    return 100 * ((1 + factor) * precision * recall / ((factor * precision) + recall))


def chrf_pair_statistics(hyp_ngrams, ref_ngrams):
    """[hypothesis n-grams, reference n-grams, matches] per order, of char_ngrams outputs."""
    stats = []
    for hyp, ref in zip(hyp_ngrams, ref_ngrams):
        matches = sum(min(count, ref[ngram]) for ngram, count in hyp.items())
        # sacreBLEU counts no hypothesis n-grams of an order the reference has none of
        stats += [sum(hyp.values()) if ref else 0, sum(ref.values()), matches]
    return stats


def chrf_statistics(hypothesis, references):
    """One example's chrF counts against its best reference (the first of the best on a tie)."""
    hyp = char_ngrams(hypothesis)
    best, best_score = None, -1.0
    for ref in references:
        stats = chrf_pair_statistics(hyp, char_ngrams(ref))
        score = chrf_from_statistics(stats)
        if score > best_score:
            best, best_score = stats, score
    return best


def corpus_chrf(hypotheses, references):
    """sacrebleu.corpus_chrf(hypotheses, reference streams) with its defaults, 0-100."""
    pairs = examples(hypotheses, references)
    return chrf_from_statistics(summed(chrf_statistics(*pair) for pair in pairs))


def sentence_chrf(hypothesis, references):
    """sacrebleu.sentence_chrf(hypothesis, references) with its defaults, 0-100."""
    return corpus_chrf([hypothesis], [references])


def tokenize_rouge(text):
    """rouge-score's default tokenizer, no stemming: lowercase, split at runs of non-[a-z0-9]."""
    return NON_ALPHANUMERIC.sub(' ', text.lower()).split()


def f1(precision, recall):
    """rouge-score's F-measure (0 when both are 0)."""
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge_n(ref, hyp, n):
    """ROUGE-N F1 of token lists: the overlapping n-gram count over each side's n-gram count."""
    ref_ngrams, hyp_ngrams = word_ngrams(ref, [n]), word_ngrams(hyp, [n])
    overlap = sum(min(count, hyp_ngrams[ngram]) for ngram, count in ref_ngrams.items())
    precision = overlap / max(sum(hyp_ngrams.values()), 1)
    return f1(precision, overlap / max(sum(ref_ngrams.values()), 1))


def lcs_length(a, b):
    """Length of the longest common subsequence of two lists (dynamic programming, two rows)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l(ref, hyp):
    """ROUGE-L F1 of token lists: the longest common subsequence over each side's length."""
    if not ref or not hyp:
        return 0.0
    common = lcs_length(ref, hyp)
    return f1(common / len(hyp), common / len(ref))


def rouge_scores(prediction, references):
    """{'rouge1', 'rouge2', 'rougeL'}: each F1 against the reference that maximises it, as
    RougeScorer(kinds).score_multi(references, prediction) gives."""
    hyp = tokenize_rouge(prediction)
    refs = [tokenize_rouge(ref) for ref in examples([prediction], [references])[0][1]]
    return {'rouge1': max(rouge_n(ref, hyp, 1) for ref in refs),
            'rouge2': max(rouge_n(ref, hyp, 2) for ref in refs),
            'rougeL': max(rouge_l(ref, hyp) for ref in refs)}


def rouge(predictions, references):
    """Corpus ROUGE-1/2/L F1: the mean over examples of rouge_scores."""
    scores = [rouge_scores(pred, refs) for pred, refs in examples(predictions, references)]
    return {kind: sum(s[kind] for s in scores) / len(scores) for kind in ROUGE_KINDS}


def pass_at_k(n, c, k):
    """Chance that k of n samples (c of them correct), drawn without replacement, hold a correct
    one: 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i) (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f'pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}')
    if n - c < k:
        return 1.0  # every draw of k holds a correct sample
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(counts, k):
    """pass@k averaged over problems; counts: (n samples, c correct) per problem."""
    if not counts:
        raise ValueError('no problems to score')
    return float(np.mean([pass_at_k(n, c, k) for n, c in counts]))


def rouge_kind(kind):
    """The corpus and the one-example score of one ROUGE kind, for METRICS."""
    return (lambda preds, refs: rouge(preds, refs)[kind], lambda pred, refs: rouge_scores(pred, refs)[kind])


# the names eval.py and train.py's eval_metrics take: corpus score and one example's score
METRICS = {
    'exact_match': (exact_match, lambda pred, refs: exact_match([pred], [refs])),
    'bleu': (corpus_bleu, sentence_bleu),
    'chrf': (corpus_chrf, sentence_chrf),
    'rouge1': rouge_kind('rouge1'),
    'rouge2': rouge_kind('rouge2'),
    'rouge_l': rouge_kind('rougeL'),
    'tool_calls': (tool_call_match, lambda pred, refs: tool_call_match([pred], [refs])),
}


def check_metric_names(names):
    """names (a list) if each is a key of METRICS, else ValueError naming the unknown ones and the choices."""
    unknown = [name for name in names if name not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric {', '.join(map(repr, unknown))}; choose from {', '.join(METRICS)}")
    return names


def parse_metric_names(value):
    """The metric names of a comma-separated value (blanks and duplicates dropped; may be none), each checked
    by check_metric_names."""
    return check_metric_names(list(dict.fromkeys(name.strip() for name in value.split(',') if name.strip())))


def corpus_scores(names, predictions, references):
    """{name: corpus score} for each metric name (METRICS), over all examples."""
    return {name: METRICS[name][0](predictions, references) for name in check_metric_names(names)}


def example_scores(names, prediction, references):
    """{name: score} of one prediction against its reference(s): sentence BLEU/chrF, the example's
    ROUGE F1, 1.0 or 0.0 for exact match; for comparing two checkpoints example by example."""
    return {name: METRICS[name][1](prediction, references) for name in check_metric_names(names)}


def sample_std(values):
    """The sample standard deviation (Bessel's), lm-eval's sample_stddev."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def mean_stderr(values):
    """lm-eval's standard error of a mean: the sample standard deviation over sqrt(n); None for fewer than
    two values."""
    return sample_std(values) / math.sqrt(len(values)) if len(values) >= 2 else None


# the corpus metrics that sum each example's counts: (one example's counts, the score of summed counts)
CORPUS_STATISTICS = {'bleu': (bleu_statistics, lambda stats: bleu_from_statistics(stats, effective_order=False)),
                     'chrf': (chrf_statistics, chrf_from_statistics)}


def bootstrap_stderr(statistics, score, iters=1000, seed=1234):
    """The standard error of a corpus score (BLEU, chrF) by the bootstrap, as lm-eval estimates it: the sample
    standard deviation of score(summed counts) over iters resamples of the examples with replacement (seeded).
    statistics: each example's counts, computed once; a resample only sums them."""
    rng = random.Random(seed)
    n = len(statistics)
    draws = np.array([[rng.randrange(n) for _ in range(n)] for _ in range(iters)])
    sums = np.array(statistics)[draws].sum(1)  # integer counts: the same sums in any order
    return sample_std([score(s.tolist()) for s in sums])


def corpus_stderrs(names, predictions, references):
    """{name: standard error} of corpus_scores': BLEU and chrF (corpus statistics, not means over examples)
    by the bootstrap, the others (means of each example's score) by mean_stderr."""
    out = {}
    for name in check_metric_names(names):
        if name in CORPUS_STATISTICS:
            counts, score = CORPUS_STATISTICS[name]
            out[name] = bootstrap_stderr([counts(*pair) for pair in examples(predictions, references)], score)
        else:
            one = METRICS[name][1]
            out[name] = mean_stderr([one(p, r) for p, r in zip(predictions, references)])
    return out
