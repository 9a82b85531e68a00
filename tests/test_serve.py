"""serve.py: a model behind OpenAI's chat completions and completions API, answers checked against the model's
greedy tokens computed here, streams against whole answers, and what a client may send wrong."""
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from conftest import HF_TINY, ROOT, assert_user_error, greedy_answer, hf_fixture, run, script_env
from lm.generate import stop_tokens
from loading import load_for_generation

QUESTION = [{'role': 'user', 'content': 'Hello there'}]


def start_server(folder, *args, launcher=('serve.py',)):
    """serve.py on folder at a free port: (process, base URL), once it says it is serving."""
    log = tempfile.TemporaryFile()  # its request log: a pipe nobody reads would fill and stop it
    p = subprocess.Popen([sys.executable, *launcher, f'--init_from={folder}', '--device=cpu', '--port=0', *args],
                         cwd=ROOT, env=script_env(), stdout=subprocess.PIPE, stderr=log)
    seen = b''
    while not re.search(rb'serving .* at \S+/v1 ', seen):
        # the pipe's own bytes: a buffered readline would take lines select() then no longer sees
        ready, _, _ = select.select([p.stdout], [], [], 120)
        more = os.read(p.stdout.fileno(), 4096) if ready else b''
        if not more:
            p.kill()
            p.wait()
            log.seek(0)
            raise AssertionError(f'serve.py did not start: {seen.decode()}{log.read().decode()}')
        seen += more
    return p, re.search(r'at (http://\S+/v1)', seen.decode()).group(1)


@pytest.fixture(scope='module')
def chat_server():
    p, url = start_server(hf_fixture('qwen2'))
    yield url
    p.kill()
    p.wait()


def post(url, body, raw=None):
    """(status, JSON answer) of a POST of body (raw: these bytes as they are)."""
    data = raw if raw is not None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(url, body):
    """The JSON events of a streamed answer, checked to end with [DONE]."""
    with urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(body).encode()), timeout=120) as r:
        assert r.headers['Content-Type'] == 'text/event-stream'
        lines = [line for line in r.read().decode().split('\n\n') if line]
    assert all(line.startswith('data: ') for line in lines) and lines[-1] == 'data: [DONE]', lines
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_a_chat_answer_is_the_models_greedy_answer(chat_server):
    loaded = load_for_generation(hf_fixture('qwen2'))
    conversation = QUESTION + [{'role': 'assistant', 'content': 'Hi.'}, {'role': 'user', 'content': 'How are you?'}]
    want = greedy_answer(loaded, conversation, 12)
    prompt = loaded.tokenizer.encode_prompt(conversation)
    out = loaded.model.generate(torch.tensor([prompt]), 12, temperature=0)[0, len(prompt):].tolist()
    drawn = min([out.index(s) for s in stop_tokens(loaded.tokenizer) if s in out], default=len(out))
    status, answer = post(chat_server + '/chat/completions', dict(messages=conversation, temperature=0, max_tokens=12))
    assert status == 200 and answer['object'] == 'chat.completion' and answer['id'].startswith('chatcmpl-')
    (choice,) = answer['choices']
    assert choice['message'] == {'role': 'assistant', 'content': want}
    assert answer['usage'] == dict(prompt_tokens=len(prompt), completion_tokens=drawn, total_tokens=len(prompt) + drawn)
    assert choice['finish_reason'] == ('length' if drawn == 12 else 'stop')
    # the same, streamed: the role first, then pieces that join into it, then the finish reason and the usage
    chunks = events(chat_server + '/chat/completions', dict(messages=conversation, temperature=0, max_tokens=12,
                                                            stream=True, stream_options={'include_usage': True}))
    assert all(c['object'] == 'chat.completion.chunk' and c['id'] == chunks[0]['id'] for c in chunks)
    assert chunks[0]['choices'][0]['delta'] == {'role': 'assistant', 'content': ''}
    pieces = [c['choices'][0]['delta'].get('content', '') for c in chunks[1:-2]]
    assert len(pieces) > 1 and ''.join(pieces) == want
    assert chunks[-2]['choices'][0]['finish_reason'] == choice['finish_reason'] and chunks[-1]['choices'] == []
    assert chunks[-1]['usage'] == answer['usage']


def test_stop_strings_end_the_answer_streamed_or_not(chat_server):
    """A stop string ends the answer before it, also when it spans pieces (a stream holds back its possible start)."""
    want = greedy_answer(load_for_generation(hf_fixture('qwen2')), QUESTION, 12)
    stop = next(want[i:i + 2] for i in range(1, len(want) - 1) if want[i] != want[i + 1])  # a pair of tokens
    body = dict(messages=QUESTION, temperature=0, max_tokens=12, stop=[stop, 'never'])
    _, answer = post(chat_server + '/chat/completions', body)
    assert answer['choices'][0]['message']['content'] == want[:want.index(stop)]
    assert answer['choices'][0]['finish_reason'] == 'stop'
    chunks = events(chat_server + '/chat/completions', dict(body, stream=True))
    assert ''.join(c['choices'][0]['delta'].get('content', '') for c in chunks) == want[:want.index(stop)]


def test_completions_continue_a_text(chat_server):
    """/v1/completions continues the text as the tokenizer opens one (sample.py on a base model)."""
    loaded = load_for_generation(hf_fixture('qwen2'))
    ids = loaded.tokenizer.document_prefix + loaded.tokenizer.encode('Once upon')
    out = loaded.model.generate(torch.tensor([ids]), 6, temperature=0)[0, len(ids):].tolist()
    _, answer = post(chat_server + '/completions', dict(prompt='Once upon', temperature=0, max_tokens=6))
    assert answer['object'] == 'text_completion' and answer['choices'][0]['text'] == loaded.tokenizer.decode(out)
    chunks = events(chat_server + '/completions', dict(prompt='Once upon', temperature=0, max_tokens=6, stream=True))
    assert ''.join(c['choices'][0]['text'] for c in chunks) == answer['choices'][0]['text']


def test_completions_take_openais_four_prompt_forms(chat_server):
    """"prompt" as a text, texts, token ids or lists of them: choice p * n + k the kth answer to prompt p, each the
    model's greedy continuation; the usage counts each prompt once; an id outside the vocabulary is refused."""
    loaded = load_for_generation(hf_fixture('qwen2'))
    texts = ['Once upon', 'The sky']
    ids = [loaded.tokenizer.document_prefix + loaded.tokenizer.encode(t) for t in texts]
    want = [loaded.tokenizer.decode(loaded.model.generate(torch.tensor([i]), 5, temperature=0)[0, len(i):].tolist())
            for i in ids]
    for prompt, answers in ((texts, want), (ids, want), (ids[1], want[1:]), (texts[1], want[1:])):
        status, answer = post(chat_server + '/completions', dict(prompt=prompt, temperature=0, max_tokens=5, n=2))
        assert status == 200 and [c['index'] for c in answer['choices']] == list(range(2 * len(answers)))
        assert [c['text'] for c in answer['choices']] == [a for a in answers for _ in range(2)]
        assert answer['usage']['prompt_tokens'] == sum(len(i) for i in (ids if len(answers) == 2 else ids[1:]))
    chunks = events(chat_server + '/completions', dict(prompt=texts, temperature=0, max_tokens=5, stream=True))
    assert [''.join(c['choices'][0]['text'] for c in chunks if c['choices'][0]['index'] == k) for k in (0, 1)] == want
    order = [c['choices'][0]['index'] for c in chunks if c['choices'][0]['text']]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # drawn together, one batch: their pieces mingle
    for prompt in ([], [[]], ['text', [10 ** 6]], [True], '', ['a'] * 65, None):
        status, answer = post(chat_server + '/completions', dict(prompt=prompt))
        assert status == 400 and answer['error']['param'] == 'prompt' and 'must be a text' in answer['error']['message']


def logprobs_here(loaded, ids):
    """The log-prob of each of ids[1:] given the ids before it, the most likely token there and its log-prob,
    computed here: the model's logits over the whole text at once, log-softmax in float64."""
    logprobs = torch.log_softmax(loaded.model(torch.tensor([ids[:-1]]))[0][0].double(), dim=-1)
    best = logprobs.max(-1)
    chosen = logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return chosen.tolist(), best.indices.tolist(), best.values.tolist()


def test_echo_and_logprobs_score_texts_as_lm_eval_reads_them(chat_server):
    """lm-eval's local-completions loglikelihood request (token ids, max_tokens 1, logprobs 1, echo): each prompt
    token's log-prob after the first (None), as the model gives it over the whole text, its top alternative the
    argmax; lm-eval's reading (the sum from the context on, greedy where each token is its top one) follows; the
    drawn token is the greedy one. max_tokens 0 scores the prompt alone; a text prompt is echoed as sent."""
    loaded = load_for_generation(hf_fixture('qwen2'))
    context = loaded.tokenizer.encode('Once upon a time')
    greedy = logprobs_here(loaded, context + [0])[1][-1]
    requests = [context + loaded.tokenizer.encode(' there'), context + [greedy]]  # lm-eval's batch form
    status, answer = post(chat_server + '/completions', dict(prompt=requests, temperature=0, max_tokens=1, logprobs=1,
                                                              seed=1234, echo=True))
    assert status == 200 and len(answer['choices']) == 2
    flags = []
    for ids, choice in zip(requests, answer['choices']):
        drawn = logprobs_here(loaded, ids + [0])[1][-1]  # the greedy next token, scored last
        want, best, most = logprobs_here(loaded, ids + [drawn])
        scores = choice['logprobs']
        assert scores['token_logprobs'][0] is None and scores['top_logprobs'][0] is None
        assert scores['token_logprobs'][1:] == pytest.approx(want, abs=1e-4)
        assert scores['tokens'] == [loaded.tokenizer.decode([i]) for i in ids + [drawn]]
        assert choice['text'] == loaded.tokenizer.decode(ids) + loaded.tokenizer.decode([drawn])
        for i, (lp, top) in enumerate(zip(scores['token_logprobs'][1:], scores['top_logprobs'][1:])):
            assert loaded.tokenizer.decode([best[i]]) in top and max(top.values()) == pytest.approx(most[i], abs=1e-4)
            assert scores['tokens'][i + 1] in top and top[scores['tokens'][i + 1]] == lp
        assert scores['text_offset'] == [sum(map(len, scores['tokens'][:k])) for k in range(len(scores['tokens']))]
        ctxlen = len(context)  # lm-eval's parse_logprobs
        loglik = sum(scores['token_logprobs'][ctxlen:-1])
        is_greedy = all(lp == max(top.values()) for lp, top in zip(scores['token_logprobs'][ctxlen:-1],
                                                                   scores['top_logprobs'][ctxlen:-1]))
        assert loglik == pytest.approx(sum(want[ctxlen - 1:-1]), abs=1e-4)
        assert is_greedy == all(ids[k + 1] == best[k] for k in range(ctxlen - 1, len(ids) - 1))
        flags.append(is_greedy)
    assert flags[1]  # the model's own next token reads as greedy
    status, alone = post(chat_server + '/completions', dict(prompt='Once upon a time', max_tokens=0, echo=True,
                                                             logprobs=0))
    (choice,) = alone['choices']
    assert status == 200 and choice['text'] == 'Once upon a time' and alone['usage']['completion_tokens'] == 0
    assert choice['logprobs']['token_logprobs'][1:] == pytest.approx(logprobs_here(loaded, context)[0], abs=1e-4)
    assert [len(top) for top in choice['logprobs']['top_logprobs'][1:]] == [1] * (len(context) - 1)  # its own
    long = (context * 40)[:257]  # the whole context and one more, scored 128 positions at a time
    _, scored = post(chat_server + '/completions', dict(prompt=[long, long[:1]], max_tokens=0, echo=True, logprobs=1))
    assert scored['choices'][0]['logprobs']['token_logprobs'][1:] == pytest.approx(logprobs_here(loaded, long)[0],
                                                                                   abs=1e-4)
    assert scored['choices'][1]['logprobs']['token_logprobs'] == [None]
    status, plain = post(chat_server + '/completions', dict(prompt='Once upon a time', max_tokens=0))
    assert status == 400 and plain['error']['param'] == 'max_tokens'  # nothing to give without echo
    chunks = events(chat_server + '/completions', dict(prompt='Once upon a time', max_tokens=3, temperature=0,
                                                       echo=True, logprobs=2, stream=True))
    _, whole = post(chat_server + '/completions', dict(prompt='Once upon a time', max_tokens=3, temperature=0,
                                                       echo=True, logprobs=2))
    assert ''.join(c['choices'][0]['text'] for c in chunks) == whole['choices'][0]['text']
    assert [c['choices'][0]['logprobs'] for c in chunks if c['choices'][0]['logprobs']] == [
        whole['choices'][0]['logprobs']]


def test_text_offsets_point_into_the_choices_text():
    """text_offset: where each token's text starts in the choice's text. A BOS adds no text (the echoed text has
    none), and a token that holds part of a character (U+FFFD alone) starts where the character does, so the
    offsets of the tokens after it still point at their text (summed token lengths drift by one a part)."""
    p, url = start_server(hf_fixture('mistral'))  # a BOS opens its texts; bytes of a character are tokens
    try:
        loaded = load_for_generation(hf_fixture('mistral'))
        text = 'Emoji 🌊 and 日本語 text'
        status, answer = post(url + '/completions', dict(prompt=text, max_tokens=6, temperature=0, logprobs=1,
                                                          echo=True))
        (choice,) = answer['choices']
        tokens, offsets = choice['logprobs']['tokens'], choice['logprobs']['text_offset']
        prompt = [1] + loaded.tokenizer.encode(text)
        answer_ids = loaded.tokenizer.encode(choice['text'][len(text):])  # to count its tokens
        assert status == 200 and choice['text'].startswith(text) and tokens[0] == '<s>' and offsets[0] == 0
        for k in range(len(prompt)):  # where the text of the tokens before it ends, a part-character left out
            assert offsets[k] == len(loaded.tokenizer.decode(prompt[:k], skip_special=True).rstrip('\ufffd'))
        whole = [k for k, t in enumerate(tokens) if k and '\ufffd' not in t]
        assert len(whole) > 8 and len(tokens) > len(prompt) + 1, (tokens, answer_ids)
        for k in whole:
            assert choice['text'][offsets[k]:].startswith(tokens[k]), (k, tokens[k], offsets[k])
        assert offsets[len(prompt)] == len(text)  # the answer's first token: after the prompt's text
    finally:
        p.kill()
        p.wait()


# serve.py scoring at most 64 positions a forward pass
SMALL_SCORING_PASSES = """
import sys
sys.argv = ['serve.py', *sys.argv[1:]]
source = open('serve.py').read().replace('SCORED_POSITIONS = 16384', 'SCORED_POSITIONS = 64')
exec(compile(source, 'serve.py', 'exec'), {'__name__': '__main__', '__file__': 'serve.py'})
"""


@pytest.mark.parametrize('launcher', [('serve.py',), ('-c', SMALL_SCORING_PASSES)], ids=['one pass', 'passes of 64'])
def test_prompts_of_mixed_lengths_are_scored_together(launcher):
    """Several prompts' log-probs, their rows right-padded in one forward pass (or in passes of 64 positions, the
    longest first), each as the model gives it over its own text alone."""
    loaded = load_for_generation(hf_fixture('qwen2'))
    prompts = [loaded.tokenizer.encode(t) for t in ('Once upon a time', 'a b', 'The sky ' * 12, 'Hello there')]
    p, url = start_server(hf_fixture('qwen2'), launcher=launcher)
    try:
        _, answer = post(url + '/completions', dict(prompt=prompts, echo=True, max_tokens=0, logprobs=2))
        for ids, choice in zip(prompts, answer['choices']):
            assert choice['logprobs']['token_logprobs'][1:] == pytest.approx(logprobs_here(loaded, ids)[0], abs=1e-4)
    finally:
        p.kill()
        p.wait()


@pytest.mark.cuda
def test_a_gpu_serves_the_answers_and_log_probs_the_cpu_serves(chat_server):
    """On a GPU (float32), a request's batch of answers and their log-probs equal the CPU server's."""
    body = dict(prompt=['Once upon a time', 'The sky', 'Hello there, my'], n=2, max_tokens=8, temperature=0,
                logprobs=2, echo=True)
    _, want = post(chat_server + '/completions', body)
    p, url = start_server(hf_fixture('qwen2'), '--device=cuda', '--dtype=float32')
    try:
        _, answer = post(url + '/completions', body)
    finally:
        p.kill()
        p.wait()
    assert [c['text'] for c in answer['choices']] == [c['text'] for c in want['choices']]
    for got, expected in zip(answer['choices'], want['choices']):
        assert got['logprobs']['token_logprobs'][1:] == pytest.approx(expected['logprobs']['token_logprobs'][1:],
                                                                      abs=1e-3)


def test_chat_logprobs_give_each_answer_tokens_log_prob(chat_server):
    """"logprobs": true with "top_logprobs": k: each token of the answer, its log-prob given the prompt and the
    answer before it (the model's, over the whole text), k alternatives best first; streamed, the same in one
    event after the text."""
    loaded = load_for_generation(hf_fixture('qwen2'))
    body = dict(messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    status, answer = post(chat_server + '/chat/completions', body)
    (choice,) = answer['choices']
    content = choice['logprobs']['content']
    assert status == 200 and len(content) == answer['usage']['completion_tokens'] > 0
    assert ''.join(t['token'] for t in content) == choice['message']['content']
    assert b''.join(bytes(t['bytes']) for t in content).decode('utf-8', 'replace') == choice['message']['content']
    prompt = loaded.tokenizer.encode_prompt(QUESTION)
    ids = prompt + loaded.tokenizer.encode(choice['message']['content'])
    want, best, _ = logprobs_here(loaded, ids)
    assert [t['logprob'] for t in content] == pytest.approx(want[len(prompt) - 1:], abs=1e-4)
    for t, top in zip(content, best[len(prompt) - 1:]):
        assert [a['logprob'] for a in t['top_logprobs']] == sorted([a['logprob'] for a in t['top_logprobs']],
                                                                   reverse=True)
        assert len(t['top_logprobs']) == 3 and t['top_logprobs'][0] == dict(token=t['token'], logprob=t['logprob'],
                                                                           bytes=t['bytes'])
        assert t['token'] == loaded.tokenizer.decode([top])  # greedy: the token is its top one
    chunks = events(chat_server + '/chat/completions', dict(body, stream=True))
    assert [c['choices'][0]['logprobs'] for c in chunks if c['choices'][0]['logprobs']] == [choice['logprobs']]
    _, none = post(chat_server + '/chat/completions', dict(body, logprobs=False, top_logprobs=None))
    assert none['choices'][0]['logprobs'] is None


def test_tokenize_and_detokenize_give_the_models_tokens(chat_server):
    """vLLM's /tokenize (a text as /v1/completions opens it, or without its opening tokens; "messages" through
    the template), /detokenize and /tokenizer_info, which lm-eval reads as its remote tokenizer."""
    loaded = load_for_generation(hf_fixture('qwen2'))
    server = chat_server[:-len('/v1')]
    text = 'Once upon a time'
    _, tokens = post(server + '/tokenize', dict(prompt=text))
    ids = loaded.tokenizer.document_prefix + loaded.tokenizer.encode(text)
    assert tokens == dict(count=len(ids), max_model_len=256, tokens=ids)
    _, bare = post(server + '/tokenize', dict(prompt=text, add_special_tokens=False))
    assert bare['tokens'] == loaded.tokenizer.encode(text)
    _, chat = post(server + '/tokenize', dict(messages=QUESTION))
    assert chat['tokens'] == loaded.tokenizer.encode_prompt(QUESTION)
    _, back = post(server + '/detokenize', dict(tokens=ids))
    assert back == {'prompt': loaded.tokenizer.decode(ids)}
    with urllib.request.urlopen(server + '/tokenizer_info', timeout=60) as r:
        info = json.loads(r.read())
    assert info['eos_token'] == loaded.tokenizer.special_tokens['eos_token'] and info['model_max_length'] == 256
    assert info['chat_template'] == loaded.tokenizer.chat_template
    _, eos = post(server + '/tokenize', dict(prompt=info['eos_token'], add_special_tokens=False))
    assert eos['tokens'] == [loaded.tokenizer.token_id('eos_token')]  # how lm-eval finds the id
    for path, body, param in (('/tokenize', dict(prompt=5), 'prompt'), ('/tokenize', dict(messages='x'), 'messages'),
                              ('/detokenize', dict(tokens=[-1]), 'tokens'), ('/detokenize', {}, 'tokens')):
        status, answer = post(server + path, body)
        assert status == 400 and answer['error']['param'] == param, answer


# lm/chat_page.html's script run by node against the server, over a stand-in for the browser's document: two
# turns typed and sent, then what the page shows, as JSON
PAGE_IN_NODE = r"""
const vm = require('vm');
const [base, lines] = [process.argv[1], JSON.parse(process.argv[2])];
const made = {};
function element(id) {
  return {id, value: '', textContent: '', className: '', children: [], scrollTop: 0, scrollHeight: 0, listeners: {},
          addEventListener(type, f) { this.listeners[type] = f; }, focus() {},
          appendChild(child) { this.children.push(child); child.parent = this; },
          insertBefore(child, next) {
            this.children.splice(this.children.indexOf(next), 0, child);
            child.parent = this;
          },
          remove() { this.parent.children.splice(this.parent.children.indexOf(this), 1); }};
}
const document = {getElementById: (id) => made[id] || (made[id] = element(id)), createElement: () => element()};
(async () => {
  const page = await (await fetch(base + '/')).text();
  const scripts = [...page.matchAll(/<script[^>]*>([\s\S]*?)<\/script>/g)].map((m) => m[1]);
  document.getElementById('model').textContent = scripts[0];
  document.getElementById('temperature').value = '0';
  document.getElementById('max_tokens').value = '12';
  const context = vm.createContext({document, TextDecoder, AbortController, console,
                                    fetch: (path, options) => fetch(base + path, options)});
  vm.runInContext(scripts[1], context);
  for (const line of lines) await vm.runInContext('ask', context)(line);
  console.log(JSON.stringify({name: made.name.textContent,
                              turns: made.log.children.map((d) => [d.className, d.textContent])}));
})();
"""


def node_runs_pages():
    """Whether a node here can run the page's script: one with fetch (node 18 and later)."""
    return shutil.which('node') is not None and subprocess.run(
        ['node', '-e', 'process.exit(typeof fetch === "function" ? 0 : 1)'], capture_output=True).returncode == 0


def test_the_browser_page_holds_a_conversation(chat_server):
    """GET / is a page that talks with the model: its script (run by node, where there is one) streams each answer
    from /v1/chat/completions into the page, the conversation so far sent each turn; the model's name reaches it
    as JSON that no text can end early."""
    server = chat_server[:-len('/v1')]
    with urllib.request.urlopen(server + '/', timeout=60) as r:
        page = r.read().decode()
        assert r.status == 200 and r.headers['Content-Type'] == 'text/html; charset=utf-8'
    model_json = re.search(r'<script id="model" type="application/json">(.*?)</script>', page).group(1)
    assert json.loads(model_json) == dict(name=hf_fixture('qwen2'), chat=True) and 'MODEL_JSON' not in page
    if not node_runs_pages():
        pytest.skip('no node 18 or later here to run the page\'s script')
    loaded = load_for_generation(hf_fixture('qwen2'))
    first = greedy_answer(loaded, QUESTION, 12)
    second = greedy_answer(loaded, QUESTION + [{'role': 'assistant', 'content': first},
                                               {'role': 'user', 'content': 'And you?'}], 12)
    shown = subprocess.run(['node', '-e', PAGE_IN_NODE, server, json.dumps(['Hello there', 'And you?'])],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == dict(name=hf_fixture('qwen2'), turns=[
        ['turn user', 'Hello there'], ['turn assistant', first], ['turn user', 'And you?'], ['turn assistant', second]])
    # past the context (256 tokens) the oldest exchange is left out, and the page says so
    long = ' '.join(['word'] * 40)
    assert 150 < len(loaded.tokenizer.encode_prompt([{'role': 'user', 'content': long}])) < 240
    later = greedy_answer(loaded, [{'role': 'user', 'content': long + '?'}], 12)
    shown = subprocess.run(['node', '-e', PAGE_IN_NODE, server, json.dumps([long + '.', long + '?'])],
                           capture_output=True, text=True, timeout=120)
    turns = json.loads(shown.stdout)['turns']
    assert turns[2][0] == 'turn system' and 'oldest exchange is left out' in turns[2][1], shown.stderr
    assert turns[3:] == [['turn user', long + '?'], ['turn assistant', later]]


def test_sampling_follows_the_seed_and_n(chat_server):
    body = dict(messages=QUESTION, temperature=1.0, max_tokens=10, seed=7, n=3)
    _, first = post(chat_server + '/chat/completions', body)
    _, again = post(chat_server + '/chat/completions', body)
    texts = [c['message']['content'] for c in first['choices']]
    assert [c['index'] for c in first['choices']] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c['message']['content'] for c in again['choices']]


def test_requests_at_once_are_answered_in_turn(chat_server):
    want = greedy_answer(load_for_generation(hf_fixture('qwen2')), QUESTION, 12)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(post(chat_server + '/chat/completions', dict(
        messages=QUESTION, temperature=0, max_tokens=12)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(status, a['choices'][0]['message']['content']) for status, a in answers] == [(200, want)] * 4


def test_a_client_that_leaves_mid_stream_leaves_the_server_serving(chat_server):
    host, port = re.match(r'http://([^:]+):(\d+)', chat_server).groups()
    body = json.dumps(dict(messages=QUESTION, max_tokens=180, stream=True)).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                  + f'Content-Length: {len(body)}\r\n\r\n'.encode() + body)
        seen = b''
        while b'data: ' not in seen:  # the headers, the first event, then gone
            chunk = s.recv(4096)
            assert chunk, seen
            seen += chunk
    status, answer = post(chat_server + '/chat/completions', dict(messages=QUESTION, temperature=0, max_tokens=4))
    assert status == 200 and answer['choices'][0]['message']['content']


@pytest.mark.parametrize('body, says, param', [
    (dict(messages=[{'role': 'robot', 'content': 'x'}]), "message role 'robot'", 'messages'),
    (dict(messages=[]), '"messages" is empty', 'messages'),
    (dict(messages='Hello'), '"messages" must be a list', 'messages'),
    (dict(messages=QUESTION, max_tokens=10 ** 6), "this model's context is 256 tokens", 'messages'),
    (dict(messages=QUESTION, temperature=3), '"temperature" must be a float in [0, 2]', 'temperature'),
    (dict(messages=QUESTION, n=0), '"n" must be an integer in [1, 16]', 'n'),
    (dict(messages=QUESTION, max_tokens='10'), '"max_tokens" must be an integer >= 1', 'max_tokens'),
    (dict(messages=QUESTION, stop=[1]), '"stop" must be a string or a list of up to 16 strings', 'stop'),
    (dict(messages=QUESTION, stop=['x'] * 17), '"stop" must be a string or a list of up to 16 strings', 'stop'),
    (dict(messages=QUESTION, stop='x' * 1001), 'each at most 1000 characters', 'stop'),
    (dict(messages=[{'role': 'user', 'content': 'Hi \ud800'}]), 'holds a lone surrogate escape', None),
    (dict(messages=[{'role': 'user', 'content': [{'type': 'text', 'text': 5}]}]),
     'holds a text part whose "text" is no string', 'messages'),
    (dict(messages=QUESTION, top_logprobs=2), '"top_logprobs" needs "logprobs": true', 'top_logprobs'),
    (dict(messages=QUESTION, logprobs=True, top_logprobs=21), '"top_logprobs" must be an integer in [0, 20]',
     'top_logprobs'),
    (dict(messages=QUESTION, logprobs=1), '"logprobs" must be a bool', 'logprobs'),
    (dict(messages=QUESTION, echo=True), '"echo" is a field of /v1/completions', 'echo'),
    (dict(messages=QUESTION, max_tokens=0), '"max_tokens" must be an integer >= 1', 'max_tokens'),
    (dict(messages=QUESTION, tools=[{'type': 'function'}]), 'each of "tools" must be', 'tools'),
    ([1, 2], 'the body must be a JSON object', None),
])
def test_a_malformed_request_is_refused_as_the_api_refuses_it(chat_server, body, says, param):
    status, answer = post(chat_server + '/chat/completions', body)
    assert status == 400 and says in answer['error']['message'], answer
    assert answer['error']['type'] == 'invalid_request_error' and answer['error']['param'] == param
    if 'context' in says:
        assert answer['error']['code'] == 'context_length_exceeded'


def test_bytes_that_are_not_json_and_unknown_paths(chat_server):
    for raw in (b'{"messages": ', b'\xff\xfe', b'[' * 100_000, b'{"messages": [], "temperature": NaN}',
                b'{"top_p": -Infinity}'):
        status, answer = post(chat_server + '/chat/completions', None, raw=raw)
        assert status == 400 and answer['error']['message'].startswith('the body is not JSON'), answer
    for url in (chat_server + '/completions', chat_server[:-len('/v1')] + '/tokenize'):  # the surrogate, elsewhere
        status, answer = post(url, dict(prompt='Hi \ud800'))
        assert status == 400 and 'lone surrogate' in answer['error']['message'], answer
    for method in ('DELETE', 'PUT', 'OPTIONS'):  # methods http.server refuses: the API's error object too
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(chat_server + '/models', method=method), timeout=60)
        assert refused.value.code == 501
        assert 'serve.py answers GET /' in json.loads(refused.value.read())['error']['message']
    with socket.create_connection(re.match(r'http://([^:]+):(\d+)', chat_server).groups(), timeout=60) as s:
        s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n')
        assert b' 400 ' in s.recv(4096).split(b'\r\n')[0]  # no Content-Length
    status, answer = post(chat_server + '/chat/completion', dict(messages=QUESTION))
    assert status == 404 and '/v1/chat/completions' in answer['error']['message']
    with urllib.request.urlopen(chat_server + '/models', timeout=60) as r:
        assert [m['id'] for m in json.loads(r.read())['data']] == [hf_fixture('qwen2')]


def test_a_client_that_trickles_its_request_is_dropped_after_request_timeout():
    """The socket's timeout bounds each read only: a client sending a byte a second would hold the server (and the
    clients waiting their turn) for as long as it likes; request_timeout bounds the whole request."""
    p, url = start_server(hf_fixture('gpt2'), '--request_timeout=3')
    try:
        host, port = re.match(r'http://([^:]+):(\d+)', url).groups()
        with socket.create_connection((host, int(port)), timeout=60) as slow:
            slow.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{')
            done = threading.Event()

            def trickle():
                while not done.wait(1):
                    try:
                        slow.sendall(b' ')
                    except OSError:  # dropped
                        return
            threading.Thread(target=trickle, daemon=True).start()
            started = time.monotonic()
            status, answer = post(url + '/completions', dict(prompt='Hello', max_tokens=1))
            waited = time.monotonic() - started
            done.set()
        assert status == 200 and waited < 20, waited  # 3 s, and its own answer; trickling on, 100 s
    finally:
        p.kill()
        p.wait()


def test_a_base_model_continues_texts_only_and_a_taken_port_is_refused(tmp_path):
    p, url = start_server(hf_fixture('gpt2'), '--model_name=my-gpt2')
    try:
        status, answer = post(url + '/chat/completions', dict(messages=QUESTION))
        assert status == 400 and 'my-gpt2 is a base model' in answer['error']['message']
        status, answer = post(url + '/completions', dict(prompt='Hello', max_tokens=3))
        assert status == 200 and answer['model'] == 'my-gpt2' and answer['usage']['completion_tokens'] <= 3
        if node_runs_pages():  # the page continues the text typed
            loaded = load_for_generation(hf_fixture('gpt2'))
            ids = loaded.tokenizer.document_prefix + loaded.tokenizer.encode('Once upon')
            out = loaded.model.generate(torch.tensor([ids]), 12, temperature=0)[0, len(ids):].tolist()
            out = out[:min([out.index(s) for s in stop_tokens(loaded.tokenizer) if s in out], default=len(out))]
            shown = subprocess.run(['node', '-e', PAGE_IN_NODE, url[:-len('/v1')], json.dumps(['Once upon'])],
                                   capture_output=True, text=True, timeout=120)
            assert json.loads(shown.stdout)['turns'] == [['turn assistant', 'Once upon' + loaded.tokenizer.decode(
                out, skip_special=True)]], shown.stderr
        port = url.rsplit(':', 1)[1].split('/')[0]
        assert_user_error(run(['serve.py', f'--init_from={hf_fixture("gpt2")}', '--device=cpu', f'--port={port}'],
                              check=False), f'cannot listen on 127.0.0.1:{port}', '--port')
        assert_user_error(run(['serve.py', f'--init_from={hf_fixture("gpt2")}', '--host='], check=False),
                          "host='' must be an address")  # not every interface, unasked
    finally:
        p.kill()
        p.wait()


# serve.py with the first two generations' prefill failing as a GPU out of memory fails
FIRST_ANSWER_FAILS = """
import runpy, sys, torch
import lm.generate as generate
fills, failed = generate.prefill, []
def prefill(*args, **kwargs):
    failed.append(1)
    if len(failed) == 2:
        generate.prefill = fills
    raise torch.OutOfMemoryError('CUDA out of memory (injected)')
generate.prefill = prefill
sys.argv = ['serve.py', *sys.argv[1:]]
runpy.run_path('serve.py', run_name='__main__')
"""


def test_a_request_the_server_fails_is_a_500_and_it_goes_on_serving():
    """A fault of the server's is a 500, or a stream's last event (no [DONE]); the next request is answered."""
    error = dict(message='the server failed: OutOfMemoryError: CUDA out of memory (injected)', type='server_error',
                 param=None, code=None)
    p, url = start_server(hf_fixture('qwen2'), launcher=('-c', FIRST_ANSWER_FAILS))
    try:
        status, answer = post(url + '/chat/completions', dict(messages=QUESTION, max_tokens=4))
        assert status == 500 and answer['error'] == error
        body = json.dumps(dict(messages=QUESTION, max_tokens=4, stream=True)).encode()
        with urllib.request.urlopen(urllib.request.Request(url + '/chat/completions', data=body), timeout=60) as r:
            assert r.read().decode().split('\n\n')[-2:] == ['data: ' + json.dumps({'error': error}), '']
        status, answer = post(url + '/chat/completions', dict(messages=QUESTION, max_tokens=4))
        assert status == 200 and answer['choices'][0]['message']['content']
    finally:
        p.kill()
        p.wait()


# serve.py with a model that answers every request with CALL, as Qwen2.5's template writes a call (the fixture's
# random weights write none): what a client gets for a call
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WRITES_A_CALL = f"""
import runpy, sys
import lm.generate as generate
from hf.tokenizer import load_hf_tokenizer
tokenizer = load_hf_tokenizer(sys.argv[1].split('=', 1)[1])
ids = tokenizer.tokenizer.encode({CALL!r}, add_special_tokens=False).ids + [tokenizer.eos_id]
def drawn_tokens(model, prompts, *args, **kwargs):
    yield from ({{0: i}} for i in ids)
generate.drawn_tokens = drawn_tokens
sys.argv = ['serve.py', *sys.argv[1:]]
runpy.run_path('serve.py', run_name='__main__')
"""
CITY = {'type': 'object', 'properties': {'city': {'type': 'string'}}}
TOOLS = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'The weather in a city.',
                                           'parameters': CITY}}]


def test_a_call_comes_back_as_openais_tool_calls(tmp_path):
    """With "tools", an answer that calls one is message.tool_calls (an id, the arguments a JSON string) and
    finish_reason "tool_calls", its tags gone; streamed, the calls come as tool_calls deltas after the role; the
    tools reach the template (the prompt's tokens); without "tools" the same text is content."""
    folder = tmp_path / 'qwen2'  # the fixture, with room for the tools' system prompt (~440 tokens)
    shutil.copytree(hf_fixture('qwen2'), folder)
    config = json.loads((folder / 'config.json').read_text())
    (folder / 'config.json').write_text(json.dumps(dict(config, max_position_embeddings=1024)))
    p, url = start_server(folder, launcher=('-c', WRITES_A_CALL))
    try:
        messages = [{'role': 'user', 'content': 'Weather in Oslo?'}]
        status, answer = post(url + '/chat/completions', dict(messages=messages, tools=TOOLS))
        (choice,) = answer['choices']
        (call,) = choice['message'].pop('tool_calls')
        assert status == 200 and choice['finish_reason'] == 'tool_calls' and choice['message'] == dict(
            role='assistant', content=None)
        assert call['id'].startswith('call_') and call['type'] == 'function'
        assert call['function'] == dict(name='get_weather', arguments='{"city": "Oslo"}')
        tokenizer = load_for_generation(folder).tokenizer
        assert answer['usage']['prompt_tokens'] == len(tokenizer.encode_prompt(messages, TOOLS))
        assert answer['usage']['prompt_tokens'] > len(tokenizer.encode_prompt(messages)) + 20
        chunks = events(url + '/chat/completions', dict(messages=messages, tools=TOOLS, stream=True))
        deltas = [c['choices'][0]['delta'] for c in chunks]
        (streamed,) = deltas[1]['tool_calls']
        assert deltas[0] == {'role': 'assistant', 'content': ''} and len(deltas) == 3 and deltas[2] == {}
        assert streamed['index'] == 0 and streamed['function'] == call['function']
        assert chunks[-1]['choices'][0]['finish_reason'] == 'tool_calls'
        _, plain = post(url + '/chat/completions', dict(messages=messages))
        assert plain['choices'][0] == dict(index=0, logprobs=None, finish_reason='stop',
                                           message=dict(role='assistant', content=CALL))
    finally:
        p.kill()
        p.wait()


@pytest.mark.slow
def test_a_text_opens_with_the_bos_of_a_base_model_tuned_in_nanotrains_template(tmp_path, task):
    """/v1/completions on a published base model fine-tuned in nanotrain's chat template (ChatTokenizer over its
    tokenizer): a text opens with the base's BOS, as its training texts and sample.py's base-model texts do."""
    base = tmp_path / 'llama_base'  # the llama fixture without its chat template: a base model
    shutil.copytree(hf_fixture('llama'), base)
    config = json.loads((base / 'tokenizer_config.json').read_text())
    (base / 'tokenizer_config.json').write_text(json.dumps({k: v for k, v in config.items() if k != 'chat_template'}))
    run(['train.py', '--training_type=sft', f'--init_from={base}', f'--out_dir={tmp_path / "out"}', f'--sft_data={task}',
         *HF_TINY, '--max_iters=1', '--lr_decay_iters=1', '--exact_match_examples=0'])
    loaded = load_for_generation(str(tmp_path / 'out' / 'ckpt.pt'))
    assert loaded.chat and loaded.tokenizer.base.document_prefix == [400]  # its BOS
    want = [400] + loaded.tokenizer.encode('Once upon')
    p, url = start_server(tmp_path / 'out' / 'ckpt.pt')
    try:
        _, answer = post(url + '/completions', dict(prompt='Once upon', max_tokens=1))
        assert answer['usage']['prompt_tokens'] == len(want)
        _, by_ids = post(url + '/completions', dict(prompt=want, max_tokens=3, temperature=0))
        _, by_text = post(url + '/completions', dict(prompt='Once upon', max_tokens=3, temperature=0))
        assert by_text['choices'] == by_ids['choices']
    finally:
        p.kill()
        p.wait()
