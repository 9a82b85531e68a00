"""
Serve a model over HTTP as OpenAI's API serves one, so that OpenAI clients talk to it (the `openai` package, a
chat UI, scripts): `python serve.py --init_from=out-sft/ckpt.pt`, then
`curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'`.
A chat model (fine-tuned, or a published instruct folder) answers /v1/chat/completions through its chat template
(a request's "tools" too); any model continues a text at /v1/completions. "stream": true sends the answer as it
is drawn (server-sent events); "logprobs" and "echo" give the tokens' log-probabilities, and /tokenize,
/detokenize and /tokenizer_info (vLLM's) the model's tokens, so lm-eval's local-completions runs its tasks through
it; http://127.0.0.1:8000/ in a browser is a chat with the model. One request is served at a time (its prompts and
n answers drawn in one batch), the others wait their turn. It listens on this machine only unless --host says
otherwise, and checks no key: whoever reaches the port can use it.
"""

import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch
import torch.nn.functional as F

from configurator import POSITIVE, SEED, UserError, at_least, check_values, configure, interval
from lm.chat_data import chat_tools, message_list
from lm.generate import CompiledDecoding, drawn_tokens, stop_tokens
from lm.metrics import reply_and_calls
from lm.tokenizer import PieceDecoder, base_tokenizer, function_name
from loading import load_for_generation, model_path
from run.device import autocast_context, pick_device, pick_dtype

# -----------------------------------------------------------------------------
out_dir = 'out'              # folder of the run to serve
ckpt_name = 'ckpt.pt'        # 'ckpt.pt' (latest) or 'best.pt'; LoRA runs: ckpt.pt (adapters) or 'merged.pt'
init_from = ''               # instead of out_dir's checkpoint: a checkpoint file, a run folder or a Hugging Face folder
data_dir = ''                # tokenizer folder; '' = the one recorded in the checkpoint
chat_template_variables = {}  # published model's chat-template variables; {} = as it was fine-tuned
host = '127.0.0.1'           # address to listen on; '0.0.0.0' = every interface (no key is checked: trusted networks)
port = 8000                  # port to listen on; 0 = any free one (printed)
model_name = ''              # the model id answers carry and /v1/models lists; '' = the checkpoint's path
max_new_tokens = 512         # a request's max_tokens where it gives none (at most what the context leaves)
temperature = 1.0            # a request's temperature where it gives none (OpenAI's default); 0 = greedy
top_k = 0                    # top-k for every request (OpenAI's API has no such field); 0 = off
compile_decode = False       # decode through torch.compile over a static KV cache (CUDA graphs): ~1 min to compile
seed = 1337                  # seeds the draws of the requests that give no "seed"
request_timeout = 60         # seconds a client has to send its whole request (and may stall reading the answer)
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
dtype = 'auto'               # 'auto' = bf16 on GPUs with it, else fp16; fp32 on CPU
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('max_new_tokens',)),
    (at_least(0), ('top_k', 'temperature')),
    (POSITIVE, ('request_timeout',)),
    (interval('[0, 65535]'), ('port',)),
    ((bool, "an address, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"), ('host',)),
])

local_device = pick_device(device)
autocast = autocast_context(local_device, pick_dtype(local_device, dtype))
model, tokenizer, chat, path = load_for_generation(model_path('' if init_from == 'resume' else init_from, out_dir,
                                                              ckpt_name), data_dir, chat_template_variables,
                                                   local_device)
name = model_name or path
block_size = model.config.block_size
server_generator = torch.Generator(device=local_device).manual_seed(seed)
decoding = CompiledDecoding() if compile_decode else None
stop_ids = stop_tokens(tokenizer)
SCORED_POSITIONS = 16384  # positions a forward pass that scores log-probs holds (its rows padded to the longest)
MAX_STOPS, MAX_STOP_CHARS = 16, 1000  # a request's stop strings: each token's text is checked against them all
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'lm', 'chat_page.html')) as f:
    CHAT_PAGE = f.read()  # GET /: a conversation in the browser


class BadRequest(Exception):
    """A request refused as OpenAI's API refuses one: HTTP 400 and an error object naming the field (param)."""

    def __init__(self, message, param=None, code=None):
        super().__init__(message)
        self.param, self.code = param, code


def field(body, key, default, kind, low=None, high=None):
    """body[key] (default where it is missing or null), checked to be a kind within [low, high]."""
    value = body.get(key)
    if value is None:
        return default
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind or (low is not None and value < low) or (high is not None and value > high):
        span = f" in [{low}, {high}]" if high is not None else f" >= {low}" if low is not None else ''
        raise BadRequest(f'"{key}" must be {"an integer" if kind is int else f"a {kind.__name__}"}{span}, got '
                         f'{json.dumps(value)[:80]}', key)
    return value


def read_request(body, chat_endpoint):
    """(the prompts' ids, settings) of a request's JSON body; BadRequest where the API would refuse it."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    if body.get('suffix') not in (None, ''):
        raise BadRequest('"suffix" (a text after the insertion) is not served: the model continues a text only',
                         'suffix')
    if chat_endpoint:  # logprobs: true, top_logprobs: k alternatives
        if body.get('echo') not in (None, False):
            raise BadRequest('"echo" is a field of /v1/completions (the prompt\'s log-probs with "logprobs")', 'echo')
        wanted, top = field(body, 'logprobs', False, bool), field(body, 'top_logprobs', None, int, 0, 20)
        if top is not None and not wanted:
            raise BadRequest('"top_logprobs" needs "logprobs": true', 'top_logprobs')
        top, echo, texts = (top or 0) if wanted else None, False, None
        if not chat:
            raise BadRequest(f"{name} is a base model: it continues a text (no chat template to hold messages); "
                             f"POST the text to /v1/completions as \"prompt\".", 'messages')
        try:
            tools = chat_tools(body)
            tool_names = {function_name(tool, 'each of "tools"') for tool in tools or []}
        except (ValueError, UserError) as e:
            raise BadRequest(str(e), 'tools') from None
        try:
            messages = message_list(body.get('messages'), 'messages')
            if not messages:
                raise ValueError('"messages" is empty: give at least one user message')
            prompts = [tokenizer.encode_prompt(messages, tools)]
        except (ValueError, UserError) as e:
            raise BadRequest(str(e), 'messages') from None
    else:  # logprobs: k alternatives; echo: the prompt too
        top, echo = field(body, 'logprobs', None, int, 0, 20), field(body, 'echo', False, bool)
        tool_names = set()
        prompts, texts = completion_prompts(body.get('prompt'))
    longest = max(map(len, prompts))
    room = block_size - longest + 1  # tokens the context leaves: the last one drawn is never fed back
    asked = field(body, 'max_completion_tokens', None, int, 1)
    # max_tokens 0 with echo: the prompt's log-probs alone (lm-eval's scoring, OpenAI's legacy form)
    asked = field(body, 'max_tokens', None, int, 0 if echo else 1) if asked is None else asked
    if (1 if asked is None else asked) > room:
        raise BadRequest(f"this model's context is {block_size} tokens and the {'longest ' * (len(prompts) > 1)}"
                         f"prompt takes {longest}: "
                         + (f"max_tokens can be at most {room}" if room >= 1 else "shorten it"),
                         'messages' if chat_endpoint else 'prompt', 'context_length_exceeded')
    stop = body.get('stop')
    stop = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS
            and all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop)):
        raise BadRequest(f'"stop" must be a string or a list of up to {MAX_STOPS} strings, each at most '
                         f'{MAX_STOP_CHARS} characters; got {json.dumps(stop)[:80]}', 'stop')
    stream_options = body.get('stream_options') or {}
    if not isinstance(stream_options, dict):
        raise BadRequest('"stream_options" must be an object, e.g. {"include_usage": true}', 'stream_options')
    request_seed = field(body, 'seed', None, int, -2 ** 63, 2 ** 64 - 1)
    generator = server_generator if request_seed is None else (
        torch.Generator(device=local_device).manual_seed(request_seed))
    return prompts, dict(max_tokens=min(max_new_tokens, room) if asked is None else asked, top=top, echo=echo,
                     texts=texts,
                     temperature=field(body, 'temperature', temperature, float, 0, 2),
                     top_p=field(body, 'top_p', 1.0, float, 0, 1), n=field(body, 'n', 1, int, 1, 16),
                     stop=[s for s in stop if s], stream=field(body, 'stream', False, bool),
                     usage=field(stream_options, 'include_usage', False, bool), tools=tool_names,
                     generator=generator)


def completion_prompts(prompt):
    """(the token ids, the text) of each prompt of /v1/completions' "prompt": a text, texts, token ids or lists of
    them (OpenAI's four forms), a text opened as the tokenizer opens one (a published model's BOS)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        prompt = [prompt]
    prompts = []
    for p in prompt if isinstance(prompt, list) and 0 < len(prompt) <= 64 else [None]:
        if isinstance(p, str) and p:
            try:
                prompts.append(base_tokenizer(tokenizer).document_prefix + tokenizer.encode(p))
            except UserError as e:
                raise BadRequest(str(e), 'prompt') from None
        elif isinstance(p, list) and p and all(type(t) is int and 0 <= t < model.config.vocab_size for t in p):
            prompts.append(p)
        else:
            raise BadRequest(f'"prompt" must be a text, a list of up to 64 texts, a list of token ids (each in [0, '
                             f'{model.config.vocab_size})) or a list of such lists, none empty; got '
                             f'{json.dumps(prompt)[:80]}', 'prompt')
    return prompts, [p if isinstance(p, str) else tokenizer.decode(p, skip_special=True) for p in prompt]


class Answer:
    """One choice's answer as its tokens come: the text each adds (a character's bytes whole; text that may be a
    stop string's start held back until it is not), the tokens (a stop token left out) and why it ended."""

    def __init__(self, stop):
        self.stop, self.decoder, self.pending = stop, PieceDecoder(tokenizer), ''
        self.ids, self.text, self.finish_reason = [], '', None

    def add(self, token):
        """The text token adds to what was given, '' while held back or once the answer has ended."""
        if self.finish_reason is not None:
            return ''
        if token in stop_ids:
            return self.end('stop')
        self.ids.append(token)
        return self.release(self.decoder.add(token))

    def end(self, finish_reason='length'):
        """The text held back, as the answer ends (if it has not)."""
        if self.finish_reason is not None:
            return ''
        text = self.release(self.decoder.end(), whole=True)
        self.finish_reason = self.finish_reason or finish_reason
        return text

    def release(self, piece, whole=False):
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:  # the answer ends before the stop string
            text, self.pending, self.finish_reason = self.pending[:min(hits)], '', 'stop'
        else:
            held = 0 if whole else max([k for s in self.stop for k in range(1, min(len(s), len(self.pending) + 1))
                                        if self.pending.endswith(s[:k])], default=0)
            text, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        self.text += text
        return text


def draw(prompts, settings, answers):
    """(choice, text) pieces of a request's answers as they are drawn, all n answers to each prompt in one batch
    (lm/generate.drawn_tokens, compiled through `decoding` where set; choice p * n + k the kth to prompt p), each
    ending at a stop token, a stop string (left out) or max_tokens tokens; answers: an Answer a choice."""
    top_p = settings['top_p'] if settings['top_p'] < 1 else None
    steps = drawn_tokens(model, prompts, settings['max_tokens'], settings['temperature'], top_k or None, top_p,
                         stop_ids, settings['n'], settings['generator'], decoding=decoding)
    with torch.no_grad(), autocast:
        for drawn in steps if settings['max_tokens'] else []:  # 0: echo alone (a prompt of block_size + 1)
            for choice, token in drawn.items():
                text = answers[choice].add(token)
                if text:
                    yield choice, text
            if all(a.finish_reason is not None for a in answers):  # stop strings end answers drawn on
                return
    for choice, answer in enumerate(answers):
        text = answer.end()
        if text:
            yield choice, text


@torch.no_grad()
def scored(sequences, starts, top):
    """For each of sequences (token ids), [(log-prob, [(id, log-prob)] of the top most likely)] of its ids from
    starts[k] (>= 1) on, each given the ids before it: the model's own distribution, before temperature, top_k and
    top_p (what vLLM reports by default); the same tensor gives both, so a token the model ranks first equals its
    top one. The sequences go through the model together, right-padded (causal attention: no token reads the
    padding), longest first, SCORED_POSITIONS positions a forward pass; logits 128 positions at a time."""
    out = [[] for _ in sequences]
    order = sorted((k for k, ids in enumerate(sequences) if starts[k] < len(ids)), key=lambda k: -len(sequences[k]))
    while order:
        width = len(sequences[order[0]]) - 1
        rows_a_pass = max(1, SCORED_POSITIONS // width)
        group, order = order[:rows_a_pass], order[rows_a_pass:]
        x = torch.zeros(len(group), width, dtype=torch.long)
        rows, cols, targets = [], [], []
        for r, k in enumerate(group):
            ids, start = sequences[k], starts[k]
            x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            rows += [r] * (len(ids) - start)
            cols += range(start - 1, len(ids) - 1)
            targets += ids[start:]
        with autocast:
            h = model.hidden_states(x.to(local_device))[torch.tensor(rows, device=local_device),
                                                        torch.tensor(cols, device=local_device)]
        drawn = []
        for h_part, target in zip(h.split(128), torch.tensor(targets, device=local_device).split(128)):
            with autocast:
                logprobs = F.log_softmax(model.logits(h_part).float(), dim=-1)
            best = logprobs.topk(top, dim=-1)
            drawn += zip(logprobs.gather(1, target[:, None])[:, 0].tolist(),
                         [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())])
        for k in group:
            n = len(sequences[k]) - starts[k]
            out[k], drawn = drawn[:n], drawn[n:]
    return out


def text_offsets(ids, offset):
    """Where the text of each of ids starts in the text they decode to, which starts at offset: after the pieces a
    PieceDecoder gave before it (a BOS adds none); a token that completes a character starts where the character
    does, one after a character's first bytes that stay U+FFFD (no more came) after that U+FFFD."""
    decoder, starts = PieceDecoder(tokenizer), []
    for i in ids:
        held = decoder.held
        piece = decoder.add(i)
        starts.append(offset + (len(held) if held and piece.startswith(held) else 0))
        offset += len(piece)
    return starts


def completion_logprobs(echoed, ids, scores, offset):
    """/v1/completions' logprobs object of an answer's ids after the echoed prompt's (or none), the last
    len(scores) of them scored (the prompt's first is not: None): each token's text, log-prob, top alternatives
    {text: log-prob} (the token's own among them, as vLLM gives it) and where its text starts in the choice's text
    (the answer's at offset, the prompt text's length)."""
    pieces = [tokenizer.decode([i]) for i in echoed + ids]
    unscored = [None] * (len(pieces) - len(scores))
    starts = text_offsets(echoed, 0) + text_offsets(ids, offset)
    top = []
    for piece, (lp, alternatives) in zip(pieces[len(unscored):], scores):
        top.append({tokenizer.decode([i]): v for i, v in alternatives})
        top[-1].setdefault(piece, lp)
    return dict(tokens=pieces, token_logprobs=unscored + [lp for lp, _ in scores], top_logprobs=unscored + top,
                text_offset=starts)


def chat_logprobs(ids, scores):
    """/v1/chat/completions' logprobs object: each answer token's text, its bytes, log-prob and top alternatives (a
    token that holds part of a character reads as U+FFFD; its bytes, joined to its neighbours', make the
    character)."""
    def entry(i, lp):
        return dict(token=tokenizer.decode([i]), logprob=lp, bytes=list(tokenizer.token_bytes(i)))
    return dict(content=[dict(entry(i, lp), top_logprobs=[entry(j, v) for j, v in alternatives])
                         for i, (lp, alternatives) in zip(ids, scores)], refusal=None)


def tokenizer_request(endpoint, body):
    """vLLM's /tokenize (a text, or "messages" through the chat template) and /detokenize: the model's own tokens,
    for a client that counts or scores them (lm-eval's remote tokenizer)."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    if endpoint == '/detokenize':
        tokens = body.get('tokens')
        if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < model.config.vocab_size
                                                 for t in tokens)):
            raise BadRequest(f'"tokens" must be a list of token ids, each in [0, {model.config.vocab_size}); got '
                             f'{json.dumps(tokens)[:80]}', 'tokens')
        return {'prompt': tokenizer.decode(tokens)}
    try:
        if 'messages' in body:
            if not chat:
                raise BadRequest(f"{name} is a base model: no chat template to write messages with", 'messages')
            messages, tools = message_list(body['messages'], 'messages'), chat_tools(body)
            if field(body, 'add_generation_prompt', True, bool):
                ids = tokenizer.encode_prompt(messages, tools)
            else:
                ids = tokenizer.encode_chat(messages, tools)[0]
        elif isinstance(body.get('prompt'), str):
            opening = base_tokenizer(tokenizer).document_prefix if field(body, 'add_special_tokens', True, bool) else []
            ids = list(opening) + tokenizer.encode(body['prompt'])
        else:
            raise BadRequest(f'give "prompt", a text, or "messages"; got {json.dumps(body)[:80]}', 'prompt')
    except (ValueError, UserError) as e:
        raise BadRequest(str(e), 'messages' if 'messages' in body else 'prompt') from None
    return dict(count=len(ids), max_model_len=block_size, tokens=ids)


def tokenizer_info():
    """vLLM's /tokenizer_info: the named special tokens' texts (a published model's; nanotrain's own tokenizers
    name none a text encodes to) and the chat template a client may render itself."""
    named = getattr(base_tokenizer(tokenizer), 'special_tokens', {})
    return dict(tokenizer_class=type(tokenizer).__name__, eos_token=named.get('eos_token'),
                bos_token=named.get('bos_token'), pad_token=named.get('pad_token'),
                chat_template=getattr(tokenizer, 'chat_template', None), model_max_length=block_size)


def not_json(constant):
    raise ValueError(f"{constant} is not a JSON value")  # Python's json reads NaN and Infinity; JSON has neither


def json_body(data):
    """A request's JSON body (bytes); BadRequest where it holds a lone surrogate escape ("\\ud800"), which is no
    character: no tokenizer takes it, nor a UTF-8 answer."""
    body = json.loads(data.decode('utf-8'), parse_constant=not_json)
    try:
        json.dumps(body, ensure_ascii=False).encode('utf-8')
    except UnicodeEncodeError:
        raise BadRequest('the body holds a lone surrogate escape (such as "\\ud800"), which is no character: write '
                         'the text\'s characters, or both halves of a surrogate pair') from None
    return body


class Handler(BaseHTTPRequestHandler):
    server_version = 'nanotrain'
    timeout = request_timeout

    def setup(self):
        super().setup()
        # the socket's timeout bounds each read only (a byte every 40 s would hold the server, and the clients
        # waiting their turn): past `timeout` seconds in all, the connection is shut, which ends the read
        self.deadline = threading.Timer(self.timeout, self.drop)
        self.deadline.start()

    def drop(self):
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
            pass

    def finish(self):
        self.deadline.cancel()
        super().finish()

    def send(self, status, content_type, data):
        self.send_response(status)
        self.send_header('Content-Type', content_type)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_json(self, status, value):
        self.send(status, 'application/json', json.dumps(value).encode())

    def send_page(self):
        """The browser's page, lm/chat_page.html, told the model's name and kind in JSON no text can close."""
        model_json = json.dumps(dict(name=name, chat=bool(chat))).replace('<', '\\u003c')
        self.send(200, 'text/html; charset=utf-8', CHAT_PAGE.replace('MODEL_JSON', model_json).encode())

    def send_error_json(self, status, message, param=None, code=None):
        self.send_json(status, {'error': dict(message=message, type='invalid_request_error', param=param, code=code)})

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a method not served, a malformed request line or header) as the API's
        error object, not its HTML page."""
        self.close_connection = True
        self.send_error_json(code, f"{message or 'a request http.server refuses'}; serve.py answers GET / (a chat "
                                   f"page), /v1/models, /tokenizer_info and POST /v1/chat/completions, "
                                   f"/v1/completions, /tokenize, /detokenize")

    def do_GET(self):
        self.deadline.cancel()
        path = self.path.split('?')[0].rstrip('/')
        if path == '/v1/models':
            self.send_json(200, {'object': 'list', 'data': [
                {'id': name, 'object': 'model', 'created': int(time.time()), 'owned_by': 'nanotrain',
                 'max_model_len': block_size}]})
        elif path == '/tokenizer_info':
            self.send_json(200, tokenizer_info())
        elif path == '':
            self.send_page()
        else:
            self.send_error_json(404, f"no such path: GET {self.path}; GET / (a chat page), /v1/models or "
                                      f"/tokenizer_info, POST "
                                      f"/v1/chat/completions, /v1/completions, /tokenize or /detokenize",
                                 code='not_found')

    def do_POST(self):
        endpoint = self.path.split('?')[0].rstrip('/')
        if endpoint not in ('/v1/chat/completions', '/v1/completions', '/tokenize', '/detokenize'):
            self.send_error_json(404, f"no such path: POST {self.path}; POST /v1/chat/completions, "
                                      f"/v1/completions, /tokenize or /detokenize", code='not_found')
            return
        try:
            size = self.headers.get('Content-Length', '')
            if not (size.isascii() and size.isdigit()) or int(size) > 64 << 20:
                raise BadRequest(f"the body needs a Content-Length of at most 64 MiB, got {size[:20]!r}")
            data = self.rfile.read(int(size))
            self.deadline.cancel()  # the request is read: answering it takes what it takes
            if len(data) < int(size):  # the client left, or ran out of time
                self.close_connection = True
                return
            body = json_body(data)
            if endpoint in ('/tokenize', '/detokenize'):
                self.send_json(200, tokenizer_request(endpoint, body))
                return
            prompts, settings = read_request(body, endpoint == '/v1/chat/completions')
        except (ValueError, RecursionError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            self.send_error_json(400, f"the body is not JSON: {e}")
            return
        except BadRequest as e:
            self.send_error_json(400, str(e), e.param, e.code)
            return
        try:
            self.answer(prompts, settings, endpoint == '/v1/chat/completions')
        except Exception as e:  # a fault of the server's (out of memory, say): said, and it goes on serving
            traceback.print_exc()
            error = dict(message=f"the server failed: {type(e).__name__}: {e}", type='server_error', param=None,
                         code=None)
            if not settings['stream']:
                self.send_json(500, {'error': error})
            else:  # the stream's last event, as OpenAI's API ends a stream that fails
                self.wfile.write(f"data: {json.dumps({'error': error})}\n\n".encode())

    def answer(self, prompts, settings, chat_endpoint):
        """n answers to each prompt, choice p * n + k the kth to prompt p, as one JSON object or (stream) as
        server-sent events."""
        ident = f"{'chatcmpl' if chat_endpoint else 'cmpl'}-{uuid.uuid4().hex}"
        head = dict(id=ident, object='chat.completion' if chat_endpoint else 'text_completion',
                    created=int(time.time()), model=name)
        if settings['stream']:
            head['object'] = 'chat.completion.chunk' if chat_endpoint else 'text_completion'
            self.send_response(200)
            self.send_header('Content-Type', 'text/event-stream')
            self.send_header('Cache-Control', 'no-cache')
            self.end_headers()
        choices, n = [], settings['n']
        answers = [Answer(settings['stop']) for _ in range(len(prompts) * n)]
        echoes = [settings['texts'][index // n] if settings['echo'] else '' for index in range(len(answers))]
        live = settings['stream'] and not settings['tools']  # an answer with tools is read whole for its calls
        try:
            for index, echoed in enumerate(echoes if settings['stream'] else []):  # a stream's opening events
                if chat_endpoint:
                    self.event(head, index, {'role': 'assistant', 'content': ''}, None)
                if echoed:  # the prompt's text, which may be '' (tokens without one)
                    self.event(head, index, echoed, None)
            for index, text in draw(prompts, settings, answers):
                if live:
                    self.event(head, index, {'content': text} if chat_endpoint else text, None)
            if settings['top'] is not None:
                scores = scored([prompts[index // n] + a.ids for index, a in enumerate(answers)],
                                [1 if settings['echo'] else len(prompts[index // n]) for index in range(len(answers))],
                                settings['top'])
            for index, (answer, echoed) in enumerate(zip(answers, echoes)):
                ids = prompts[index // n]
                message, finish = {'role': 'assistant', 'content': answer.text}, answer.finish_reason
                tools = settings['tools']
                content, calls = reply_and_calls(message['content'], tools) if tools else (None, [])
                if calls:  # OpenAI's form: each call an id, its arguments a JSON string
                    message['content'], finish = content, 'tool_calls'
                    message['tool_calls'] = [dict(id=f'call_{uuid.uuid4().hex[:24]}', type='function',
                                                  function=dict(name=call, arguments=arguments))
                                             for call, arguments in calls]
                if settings['stream'] and not live:  # the content whole, then each call
                    if message['content']:
                        self.event(head, index, {'content': message['content']}, None)
                    for k, call in enumerate(message.get('tool_calls', [])):
                        self.event(head, index, {'tool_calls': [dict(call, index=k)]}, None)
                logprobs = None
                if settings['top'] is not None:  # scored once the answers are whole; in a stream, one event after
                    logprobs = chat_logprobs(answer.ids, scores[index]) if chat_endpoint else completion_logprobs(
                        ids if settings['echo'] else [], answer.ids, scores[index], len(settings['texts'][index // n]))
                    if settings['stream']:
                        self.event(head, index, {'content': ''} if chat_endpoint else '', None, logprobs)
                if settings['stream']:
                    self.event(head, index, {} if chat_endpoint else '', finish)
                choices.append(dict(index=index, logprobs=logprobs, finish_reason=finish,
                                    **({'message': message} if chat_endpoint else
                                       {'text': echoed + message['content']})))
            read, drawn = sum(map(len, prompts)), sum(len(a.ids) for a in answers)
            usage = dict(prompt_tokens=read, completion_tokens=drawn, total_tokens=read + drawn)
            if not settings['stream']:
                self.send_json(200, dict(head, choices=choices, usage=usage))
                return
            if settings['usage']:
                self.wfile.write(f"data: {json.dumps(dict(head, choices=[], usage=usage))}\n\n".encode())
            self.wfile.write(b'data: [DONE]\n\n')
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client left: its answer stops
            pass

    def event(self, head, index, delta, finish_reason, logprobs=None):
        """One server-sent event of a stream: a chat delta, or a completion's text piece."""
        choice = dict(index=index, finish_reason=finish_reason, logprobs=logprobs)
        choice.update({'delta': delta} if isinstance(delta, dict) else {'text': delta})
        self.wfile.write(f"data: {json.dumps(dict(head, choices=[choice]))}\n\n".encode())
        self.wfile.flush()


class Server(HTTPServer):
    """One request at a time, in this thread: one model, one generator, and a CUDA graph (compile_decode) replays in
    the thread that recorded it; the connections that wait queue here."""
    request_queue_size = 128


try:
    server = Server((host, port), Handler)
except OSError as e:  # the port is taken, or host is not an address of this machine
    raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --port (0 = any free one) "
                    f"or --host (127.0.0.1: this machine only).") from None
endpoints = '/v1/chat/completions, /v1/completions' if chat else '/v1/completions (a base model)'
print(f"serving {name} at http://{host}:{server.server_address[1]}/v1 ({endpoints}); Ctrl-C stops", flush=True)
try:
    server.serve_forever()
except KeyboardInterrupt:
    server.server_close()
    sys.exit(0)
