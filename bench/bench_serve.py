"""
serve.py as its clients use it, over HTTP: a request's answers drawn in one batch against the same work asked
one request at a time, on the same server in one run (the two ways alternate, each round in the other order).
SmolLM2-135M-Instruct on the CPU by default (`../shared/tools/make_smollm2_hf.py` makes the folder).

    python bench/bench_serve.py                      # writes bench/results/serve.json

The work:
- one: a single greedy answer of `long_tokens` tokens to a chat question: tokens/s alone;
- sampled: `n` sampled answers (temperature 1, `max_tokens` tokens, a seed) to one chat question: one request
  with n against n requests of one (each its own seed);
- prompts: `n` completion prompts, greedy, `max_tokens` tokens: one request against one a prompt; the texts
  must be the same both ways;
- scoring: lm-eval's loglikelihood request (token ids, `echo`, `logprobs: 1`, `max_tokens: 1`, as its
  local-completions model sends it) for `num_scored` texts: `n` a request (its `--batch_size`) against one;
  the log-probs must agree within 1e-4 (float32).
tokens/s = completion tokens / wall time (scoring: requests/s of one text each); medians over `rounds`.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch

from configurator import at_least, check_values, configure
from run.device import cpu_name

# -----------------------------------------------------------------------------
model = 'models/smollm2-135m-instruct'  # the model served: a Hugging Face folder or a checkpoint
n = 8                        # answers in one request (sampled, prompts), texts a scoring request
max_tokens = 64              # tokens an answer of the sampled and prompts work
long_tokens = 200            # tokens of the single answer
num_scored = 64              # texts the scoring work scores
rounds = 3                   # rounds of every comparison; medians reported
threads = 2                  # the server's threads (OMP_NUM_THREADS)
out = 'bench/results/serve.json'  # the JSON written
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('n', 'max_tokens', 'long_tokens', 'num_scored', 'rounds', 'threads'))])

PROMPTS = ['Once upon a time', 'The capital of France', 'def fibonacci(n):', 'In 1492,', 'My favourite food is',
           'The weather today', 'Dear Sir or Madam,', 'Water boils at', 'The best way to learn', 'Photosynthesis is',
           'import numpy as np', 'Three things to pack:', 'The train left at', 'A haiku about rain:',
           'The answer is', 'Step one:']


def start(log):
    """serve.py on model at a free port, its output into log: (process, URL), once /v1/models answers."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, 'serve.py', f'--init_from={model}', '--device=cpu', f'--port={port}'],
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), stdout=log, stderr=log)
    url = f'http://127.0.0.1:{port}'
    for _ in range(600):
        if p.poll() is not None:
            log.seek(0)
            sys.exit(f"serve.py did not start: {log.read()}")
        try:
            urllib.request.urlopen(url + '/v1/models', timeout=5).close()
            return p, url
        except OSError:  # not listening yet
            time.sleep(0.5)
    p.kill()
    sys.exit("serve.py did not answer in 300 s")


def post(url, path, body):
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=json.dumps(body).encode()),
                                    timeout=900) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # the server's own words: a request this model's context cannot hold
        sys.exit(f"POST {path} was refused: {json.loads(e.read())['error']['message']}")


def timed(work):
    """(seconds, what work returns)."""
    t = time.perf_counter()
    result = work()
    return time.perf_counter() - t, result


def main():
    log = tempfile.TemporaryFile('w+')
    p, url = start(log)
    try:
        question = [{'role': 'user', 'content': 'Tell me a short story about a cat.'}]
        texts = [f"{PROMPTS[i % len(PROMPTS)]} {i}: the sum of {i} and {2 * i} is {3 * i}." for i in range(num_scored)]
        scored = [post(url, '/tokenize', dict(prompt=t))['tokens'] for t in texts]
        post(url, '/v1/completions', dict(prompt='Hello', max_tokens=4))  # warm up

        def sampled(batched):
            if batched:
                answer = post(url, '/v1/chat/completions', dict(messages=question, n=n, seed=1, max_tokens=max_tokens,
                                                                temperature=1.0))
                return answer['usage']['completion_tokens']
            return sum(post(url, '/v1/chat/completions', dict(messages=question, seed=1 + k, max_tokens=max_tokens,
                                                              temperature=1.0))['usage']['completion_tokens']
                       for k in range(n))

        def prompts(batched):
            asked = [PROMPTS[k % len(PROMPTS)] for k in range(n)]
            answers = [post(url, '/v1/completions', dict(prompt=asked, max_tokens=max_tokens, temperature=0))] \
                if batched else [post(url, '/v1/completions', dict(prompt=a, max_tokens=max_tokens, temperature=0))
                                 for a in asked]
            return (sum(a['usage']['completion_tokens'] for a in answers),
                    [c['text'] for a in answers for c in a['choices']])

        def scoring(batched):
            size = n if batched else 1
            answers = [post(url, '/v1/completions', dict(prompt=scored[k:k + size], max_tokens=1, logprobs=1,
                                                         echo=True, temperature=0, seed=1234))
                       for k in range(0, len(scored), size)]
            return len(scored), [c['logprobs']['token_logprobs'][1:-1] for a in answers for c in a['choices']]

        works = dict(sampled=sampled, prompts=prompts, scoring=scoring)
        times = {name: {True: [], False: []} for name in works}
        seen = {name: {} for name in works}
        amounts = {name: {} for name in works}
        for work in works.values():  # first calls of each shape (allocations, caches) left out of the rounds
            work(True), work(False)
        one = []
        for r in range(rounds):
            seconds, answer = timed(lambda: post(url, '/v1/chat/completions', dict(
                messages=question, max_tokens=long_tokens, temperature=0)))
            one.append(answer['usage']['completion_tokens'] / seconds)
            for name, work in works.items():
                for batched in ((True, False) if r % 2 == 0 else (False, True)):
                    seconds, result = timed(lambda: work(batched))
                    amount, output = result if isinstance(result, tuple) else (result, None)
                    times[name][batched].append(amount / seconds)
                    amounts[name][batched], seen[name][batched] = amount, output
        results = {'one': dict(tokens_per_s=statistics.median(one), rounds=one)}
        for name in works:
            batched, alone = (statistics.median(times[name][b]) for b in (True, False))
            results[name] = dict(batched=batched, one_at_a_time=alone, ratio=batched / alone,
                                 rounds=dict(batched=times[name][True], one_at_a_time=times[name][False]),
                                 amount=amounts[name])
        results['prompts']['same_texts'] = seen['prompts'][True] == seen['prompts'][False]
        gaps = [abs(x - y) for a, b in zip(seen['scoring'][True], seen['scoring'][False]) for x, y in zip(a, b)]
        results['scoring']['largest_logprob_gap'] = max(gaps)
    finally:
        p.kill()
        p.wait()
    unit = dict(sampled='tokens/s', prompts='tokens/s', scoring='texts/s')
    print(f"serve.py on {model}, {cpu_name()}, {threads} threads, medians of {rounds} rounds:")
    print(f"  one greedy answer of {long_tokens} tokens: {results['one']['tokens_per_s']:.1f} tokens/s")
    for name in works:
        r = results[name]
        print(f"  {name}: {n} in one request {r['batched']:.1f} {unit[name]}, one a request {r['one_at_a_time']:.1f}: "
              f"{r['ratio']:.2f}x")
    print(f"  prompts' texts the same both ways: {results['prompts']['same_texts']}; scoring's largest log-prob gap "
          f"{results['scoring']['largest_logprob_gap']:.2e}")
    if not results['prompts']['same_texts'] or results['scoring']['largest_logprob_gap'] > 1e-4:
        sys.exit("batched and one-at-a-time answers differ")
    os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
    with open(out, 'w') as f:
        json.dump(dict(config=config, cpu=cpu_name(), torch=torch.__version__, date=time.strftime('%Y-%m-%d'),
                       results=results), f, indent=1)
    print(f"wrote {out}")


if __name__ == '__main__':
    main()
