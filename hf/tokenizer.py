"""
A published Hugging Face model folder's own tokenizer and chat template, token-identical to
transformers (AutoTokenizer + apply_chat_template) without depending on it: tokenizer.json runs in
the tokenizers library, the Jinja chat template is rendered in the environment transformers renders
it in, and the special tokens and stop tokens come from the same config files.

load_hf_tokenizer(folder) returns an HFTokenizer. A base model's folder has no chat template
(tokenizer.chat_template is None): wrap it in tokenizer.ChatTokenizer to give it nanotrain's own.
"""

import functools
import hashlib
import json
import os
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from configurator import UserError
from hf.tokenizer_json import as_transformers_llama, from_sentencepiece
from lm.tokenizer import function_name

# the named special tokens transformers reads from tokenizer_config.json and passes to the template
SPECIAL_TOKEN_NAMES = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token', 'mask_token')
# as transformers detects {% generation %} markers
GENERATION_TAG = re.compile(r'\{%-?\s*generation\s*-?%\}')
# the tokenizer classes whose tokenizer.model transformers converts as from_sentencepiece does, and
# the tokenizer_config.json settings that conversion reads
SENTENCEPIECE_CLASSES = ('LlamaTokenizer', 'LlamaTokenizerFast')
# model types whose AutoTokenizer class wins over a
# tokenizer_class LlamaTokenizer (transformers 5.24)
LLAMA_CLASS_OVERRIDDEN = ('mistral', 'qwen2')
CONVERSION_SETTINGS = ('legacy', 'add_prefix_space', 'add_bos_token', 'add_eos_token', 'added_tokens_decoder')
ADDITIONAL_TEMPLATES = 'additional_chat_templates'  # named templates beside chat_template.jinja (transformers')


def read_json(folder, name):
    """One of the folder's JSON config files as a dict; None if the folder has no such file."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding='utf-8') as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError includes a file that is not UTF-8
        raise UserError(f"{path} is corrupt ({e}); download the model folder again.") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object; download the model folder again.")
    return value


def token_text(value):
    """A special token as written in the configs: a string or an AddedToken dict {"content": ...}."""
    return value['content'] if isinstance(value, dict) else value


def read_special_tokens(tokenizer_config, special_tokens_map):
    """{name: token text} of the named special tokens, e.g. {'bos_token': '<s>', 'eos_token': '</s>'}.
    Like transformers 5, special_tokens_map.json counts only when tokenizer_config.json has no
    "added_tokens_decoder" (it is the legacy format), and then it overrides tokenizer_config.json."""
    tokens = {name: token_text(tokenizer_config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    if 'added_tokens_decoder' not in tokenizer_config:
        tokens.update({name: token_text(v) for name, v in special_tokens_map.items() if name in SPECIAL_TOKEN_NAMES})
    return {name: token for name, token in tokens.items() if token is not None}


def read_chat_template(folder, tokenizer_config, name='default'):
    """(template text, the file it came from), (None, None) for a base model. chat_template.jinja wins
    over tokenizer_config.json's "chat_template" (as in transformers), then a processor's chat_template.json.
    A list of named templates [{"name": ..., "template": ...}] (or additional_chat_templates/NAME.jinja beside
    chat_template.jinja) gives the one named name: 'default', or 'tool_use', which transformers renders a
    conversation with tools with, (None, None) where the folder names none."""
    path = os.path.join(folder, 'chat_template.jinja')
    if os.path.isfile(path):
        if name != 'default':
            path = os.path.join(folder, ADDITIONAL_TEMPLATES, f'{name}.jinja')
            if not os.path.isfile(path):
                return None, None
        with open(path, encoding='utf-8') as f:
            return f.read(), path
    source, template = os.path.join(folder, 'tokenizer_config.json'), tokenizer_config.get('chat_template')
    if template is None:
        processor_config = read_json(folder, 'chat_template.json') or {}
        source, template = os.path.join(folder, 'chat_template.json'), processor_config.get('chat_template')
    if isinstance(template, list):
        named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
        if named.get(name, '') is None:  # {"name": "default"} alone is no base model: an entry lost its text
            raise UserError(f"{source}: the chat template named {name!r} has no \"template\" text; restore it (the "
                            f"folder's download), or name another template \"{name}\".")
        if 'default' not in named:
            raise UserError(f"{source} holds named chat templates {sorted(map(str, named))} but no \"default\" one; "
                            f"nanotrain uses the default template: name one of them \"default\".")
        template = named.get(name)
    elif name != 'default':
        return None, None
    if template is not None and not isinstance(template, str):
        raise UserError(f"{source}: \"chat_template\" must be the template text or a list of {{\"name\", \"template\"}}, "
                        f"not {type(template).__name__}.")
    return (template, source) if template is not None else (None, None)


def generation_eos_ids(folder):
    """The ids generation stops at: generation_config.json's eos_token_id (an id or a list, each one
    stops), else config.json's, as transformers' generate uses them."""
    generation_config = read_json(folder, 'generation_config.json')
    name = 'generation_config.json' if generation_config is not None else 'config.json'
    config = generation_config if generation_config is not None else read_json(folder, 'config.json') or {}
    ids = config.get('eos_token_id')
    ids = [] if ids is None else [ids] if not isinstance(ids, list) else ids
    if not all(type(i) is int and i >= 0 for i in ids):
        raise UserError(f"{folder}/{name}: eos_token_id={json.dumps(config['eos_token_id'])} must be a token id or a "
                        f"list of them (whole numbers >= 0); the file is corrupt or was edited: download the model "
                        f"folder again.")
    return ids


class GenerationMarkers(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} around the text the model generates, as transformers'
    AssistantTracker: while spans is a list, each marked block's (start, end) character span is appended."""
    tags = {'generation'}

    def __init__(self, environment):
        super().__init__(environment)
        # the rendered pieces so far and the spans, while tracking
        self.rendered = self.spans = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(['name:endgeneration'], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method('_mark'), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        text = caller()
        if self.spans is not None:
            start = len(''.join(self.rendered))
            self.spans.append((start, start + len(text)))
        return text


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own: Jinja's built-in escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


def compile_chat_template(template, source):
    """The template compiled in transformers' environment (chat_template_utils._compile_jinja_template)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[GenerationMarkers, jinja2.ext.loopcontrols])
    env.filters['tojson'] = tojson
    env.globals['raise_exception'] = raise_exception
    env.globals['strftime_now'] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template in {source} is not valid Jinja (line {e.lineno}: {e.message}).") from None


def byte_level_chars():
    """GPT-2's byte-level alphabet read back: {the character a token writes a byte as: that byte}; printable
    bytes stand for themselves, the others for the characters from U+0100 on, in byte order (bytes_to_unicode)."""
    kept = [*range(ord('!'), ord('~') + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + k): b for k, b in enumerate(moved)}}


BYTE_LEVEL_CHARS = byte_level_chars()


RENDER_GLOBALS = ('raise_exception', 'strftime_now')  # what every render has (compile_chat_template)


class HFTokenizer:
    """A Hugging Face folder's tokenizer.json, special tokens and chat template (None for a base model).
    template_variables are passed to every render, e.g. {'date_string': '26 Jul 2024'} (Llama 3.x) or
    {'enable_thinking': False} (Qwen3)."""

    def __init__(self, folder, template_variables=None):
        self.folder = folder
        tokenizer_config = read_json(folder, 'tokenizer_config.json') or {}
        self.special_tokens = read_special_tokens(tokenizer_config, read_json(folder, 'special_tokens_map.json') or {})
        path = os.path.join(folder, 'tokenizer.json')
        if os.path.isfile(path):
            with open(path, 'rb') as f:
                self.tokenizer_bytes = f.read()
            try:
                self.tokenizer = Tokenizer.from_str(self.tokenizer_bytes.decode('utf-8'))
            except Exception as e:  # the Rust side raises plain Exception for malformed files
                raise UserError(f"{path} is corrupt ({e}); download the model folder again.") from None
            if rebuilt_as_llama(folder, tokenizer_config, self.tokenizer_bytes):
                as_transformers_llama(self.tokenizer, tokenizer_config, self.special_tokens)
                recipe = {name: tokenizer_config.get(name) for name in CONVERSION_SETTINGS}
                self.tokenizer_bytes += json.dumps(recipe, sort_keys=True).encode()
        else:
            self.tokenizer, self.tokenizer_bytes = read_sentencepiece_folder(folder, tokenizer_config, self.special_tokens)
        # as transformers: a folder may ask for special-token
        # text in a text to be read as plain text
        self.tokenizer.encode_special_tokens = bool(tokenizer_config.get('split_special_tokens', False))
        # ids count up to the model's embedding rows, which may outnumber the tokens (Qwen2.5 pads
        # them to a multiple of 128): nanotrain's chat tokens (ChatTokenizer) then go after the
        # rows, not into them
        model_rows = (read_json(folder, 'config.json') or {}).get('vocab_size', 0)
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), model_rows)
        self.template_variables = {**self.special_tokens, **(template_variables or {})}
        self.chat_template, self.template_source = read_chat_template(folder, tokenizer_config)
        self.template = None if self.chat_template is None else compile_chat_template(self.chat_template, self.template_source)
        # transformers renders a conversation with tools with the folder's "tool_use" template, where it names one
        self.tool_chat_template, self.tool_template_source = read_chat_template(folder, tokenizer_config, 'tool_use')
        self.tool_template = (None if self.tool_chat_template is None else
                              compile_chat_template(self.tool_chat_template, self.tool_template_source))
        reads = self.template_reads() if template_variables else set()  # parsed only where there are some
        unread = set(template_variables or {}) - reads
        if unread:  # a misspelt name (enable_thinkng) would render as if it were not given
            given = reads - {'messages', 'tools', 'documents', 'add_generation_prompt', *self.special_tokens,
                             *RENDER_GLOBALS}
            raise UserError(f"chat_template_variables {sorted(unread)}: " + (
                f"the chat template of {folder} reads no such variable (it reads "
                f"{', '.join(sorted(given)) or 'none besides the conversation'}); leave them out or spell them so."
                if self.template is not None else f"{folder} has no chat template to render them; leave them out."))
        # text of the first ordinary token, which any vocabulary
        # can encode (a character tokenizer may not know 'a')
        added = self.tokenizer.get_added_tokens_decoder()
        self.probe_text = self.decode([next(i for i in range(self.vocab_size) if i not in added)])
        # the tokens tokenizer.json's post-processor puts before a text (Llama's and Mistral's BOS),
        # as transformers' tokenizer(text) gives them; a chat template writes its own
        with_specials = self.tokenizer.encode(self.probe_text, add_special_tokens=True).ids
        self.document_prefix = with_specials[:with_specials.index(self.encode(self.probe_text)[0])]
        tokenizer_eos = self.token_id('eos_token')
        self.stop_ids = generation_eos_ids(folder)
        if tokenizer_eos is not None and tokenizer_eos not in self.stop_ids:
            self.stop_ids.append(tokenizer_eos)
        self.eos_id = (self.stop_ids or [None])[0] if self.template is None else self.end_of_turn_id()
        pad = self.token_id('pad_token')
        self.pad_id = pad if pad is not None else self.eos_id

    def token_id(self, name):
        """The id of a named special token ('eos_token', ...), None if the configs name none."""
        token = self.special_tokens.get(name)
        if token is None:
            return None
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise UserError(f"{self.folder}: the {name} {token!r} named in tokenizer_config.json is not a token of "
                            f"tokenizer.json; the folder's tokenizer files do not belong together.")
        return i

    def added_token_id(self, text):
        """The id of text if tokenizer.json holds it as an added token (one piece, never split), else None."""
        return next((i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.content == text),
                    None)

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_bytes(self, i):
        """The bytes token i stands for (part of a character's UTF-8 where the tokenizer splits one; OpenAI's
        log-probs give them): a byte-level token's characters read back as GPT-2 wrote bytes, a byte-fallback
        token ('<0xE2>') its byte, others their text with sentencepiece's U+2581 a space; added tokens their text."""
        token = self.tokenizer.id_to_token(i)
        if token is None:  # a model row past the tokenizer's tokens
            return b''
        added, byte_level = self.token_kinds
        if i in added:
            return token.encode()
        if byte_level:
            return bytes(BYTE_LEVEL_CHARS[c] for c in token)
        if re.fullmatch(r'<0x[0-9A-F]{2}>', token):
            return bytes([int(token[3:5], 16)])
        return token.replace('\u2581', ' ').encode()

    @functools.cached_property
    def token_kinds(self):
        """(the added tokens' ids, whether the decoder is byte-level), read once for token_bytes: its JSON says
        ByteLevel (GPT-2's, Llama 3's, Qwen's) or sentencepiece's steps (Replace, ByteFallback, ...)."""
        decoder = self.tokenizer.decoder
        return (set(self.tokenizer.get_added_tokens_decoder()),
                decoder is not None and b'"ByteLevel"' in decoder.__getstate__())

    def decode(self, ids, skip_special=False):
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def template_reads(self):
        """The names the chat templates (the plain and the tools one) read that they do not set themselves."""
        return {name for template, text in ((self.template, self.chat_template),
                                            (self.tool_template, self.tool_chat_template)) if template is not None
                for name in jinja2.meta.find_undeclared_variables(template.environment.parse(text))}

    def identity(self):
        """The tokens, special tokens and chat template; not the template_variables a run renders with (the
        checkpoint records those: chat_template_variables)."""
        recipe = json.dumps([self.chat_template, self.special_tokens] + [self.tool_chat_template] * bool(self.tool_template),
                            sort_keys=True)
        digest = hashlib.sha256(self.tokenizer_bytes + recipe.encode()).hexdigest()
        return {'vocab_size': self.vocab_size, 'hash': digest}

    # --- the chat template

    def template_for(self, tools):
        """(text, compiled template, its file) a conversation renders with: with tools, the folder's tool_use
        template where it names one (as transformers picks it), else its default."""
        if tools is not None and self.tool_template is not None:
            return self.tool_chat_template, self.tool_template, self.tool_template_source
        return self.chat_template, self.template, self.template_source

    def render(self, messages, add_generation_prompt=False, spans=None, tools=None):
        """The conversation as text, apply_chat_template(tokenize=False, tools=tools). With a spans list (a
        template with {% generation %} markers) the character spans of the generated text are appended to it."""
        if self.template is None:
            raise UserError(f"{self.folder} has no chat template (a base model): wrap its tokenizer in "
                            f"tokenizer.ChatTokenizer to fine-tune it on nanotrain's own chat format.")
        _, template, source = self.template_for(tools)
        variables = dict(self.template_variables, messages=messages, tools=tools, documents=None,
                         add_generation_prompt=add_generation_prompt)
        markers = template.environment.extensions[GenerationMarkers.identifier]
        try:
            if spans is None:
                return template.render(variables)
            markers.rendered, markers.spans = [], spans
            for piece in template.generate(variables):
                markers.rendered.append(piece)
            return ''.join(markers.rendered)
        except jinja2.TemplateError as e:
            raise UserError(f"the chat template of {self.folder} ({source}) rejects this "
                            f"conversation: {e.message}") from None
        # Python's own, from a filter or test on a value the template did not expect (length of a null)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            raise UserError(f"the chat template of {self.folder} ({source}) fails on this conversation "
                            f"({type(e).__name__}: {e}); check the messages' fields against what it reads") from None
        finally:
            markers.rendered = markers.spans = None

    def end_of_turn_id(self):
        """The stop token that closes an assistant turn in this template, e.g. <|eot_id|> or <|im_end|>."""
        probe_chat = [{'role': 'user', 'content': self.probe_text}, {'role': 'assistant', 'content': self.probe_text}]
        prompt = self.render(probe_chat[:1], add_generation_prompt=True)
        text = self.render(probe_chat)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        start = encoding.char_to_token(len(prompt)) if text.startswith(prompt) else None
        stops = set(self.stop_ids)
        found = [i for i in encoding.ids[start or 0:] if i in stops]
        if not found:
            raise UserError(f"the chat template of {self.folder} ({self.template_source}) ends an assistant turn "
                            f"with none of the stop tokens {self.stop_ids} (generation_config.json's eos_token_id "
                            f"and the tokenizer's eos_token): name the end-of-turn token's id in generation_config.json.")
        return found[0]

    def assistant_token_ranges(self, messages, text, encoding, tools=None):
        """[(first, end)) token ranges of the assistant turns in the rendered conversation."""
        template_text, _, source = self.template_for(tools)
        # the template marks them: as transformers' return_assistant_tokens_mask
        if GENERATION_TAG.search(template_text):
            spans = []
            self.render(messages, spans=spans, tools=tools)
            ranges = []
            for start, end in spans:  # every token that overlaps the span
                inside = [t for t, (s, e) in enumerate(encoding.offsets) if s < end and e > start]
                if inside:
                    ranges.append((inside[0], inside[-1] + 1))
            return ranges
        ranges = []
        for i, m in enumerate(messages):
            if m['role'] != 'assistant':
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            if not text.startswith(prompt):
                raise UserError(
                    f"the chat template of {self.folder} ({source}) renders the conversation before "
                    f"assistant turn {i} differently once that turn follows (with add_generation_prompt it is not a "
                    f"prefix of the whole conversation; e.g. Mistral's template drops a system message unless the "
                    f"last turn is the user's), so the tokens to train on cannot be found. Reshape the data (e.g. "
                    f"merge the system message into the first user message) or give the template "
                    f"{{% generation %}}...{{% endgeneration %}} markers around the assistant text.")
            first = encoding.char_to_token(len(prompt))
            if first is None:
                continue
            end = next((t for t in range(first, len(encoding.ids)) if encoding.ids[t] in self.stop_ids), None)
            if end is None:
                raise UserError(f"the chat template of {self.folder} ({source}) does not close "
                                f"assistant turn {i} with a stop token {self.stop_ids}.")
            # through the end-of-turn token: the model learns to stop
            ranges.append((first, end + 1))
        return ranges

    def encode_chat(self, messages, tools=None):
        """Token ids and labels of a conversation: labels are the ids of the assistant turns (from after
        the generation prompt through their end-of-turn token), -100 everywhere else."""
        text = self.render(messages, tools=tools)
        self.check_tools_written(messages, tools, text)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = encoding.ids
        labels = [-100] * len(ids)
        for first, end in self.assistant_token_ranges(messages, text, encoding, tools):
            labels[first:end] = ids[first:end]
        return ids, labels

    def encode_prompt(self, messages, tools=None):
        """The conversation so far plus the generation prompt that starts the next assistant turn."""
        text = self.render(messages, add_generation_prompt=True, tools=tools)
        self.check_tools_written(messages, tools, text, add_generation_prompt=True)
        return self.encode(text)

    def check_tools_written(self, messages, tools, text, add_generation_prompt=False):
        """A UserError if text, the render, is the same without the tools or without the tool calls: a template
        without tool support ignores them, and the model would learn empty turns, or calls to tools it was never
        shown."""
        bare = [{k: v for k, v in m.items() if k != 'tool_calls'} for m in messages]
        calls = [call for m in messages for call in m.get('tool_calls') or []]
        for kind, items, (plain_messages, plain_tools) in (('tools', tools or [], (messages, None)),
                                                           ('tool calls', calls, (bare, tools))):
            try:
                same = bool(items) and self.render(plain_messages, add_generation_prompt, tools=plain_tools) == text
            except UserError:  # the template needs them: it reads them
                same = False
            if same:
                names = [function_name(item, kind) for item in items]
                raise UserError(f"the chat template of {self.folder} ({self.template_for(tools)[2]}) renders the "
                                f"conversation the same without its {kind} ({', '.join(names)}): it has no tool "
                                f"support, so the model would learn from turns without them. Fine-tune a model "
                                f"whose template writes tools and tool calls (Qwen2.5, Qwen3, Llama 3.1+, Mistral "
                                f"v0.3), or write them into the turns' text and drop \"tools\" and \"tool_calls\".")

    def reply_text(self, messages, tools=None):
        """The last turn of messages, an assistant's, as the template writes it after the generation prompt
        and before its end-of-turn token: the text a model answering the conversation before it generates."""
        prompt = self.render(messages[:-1], add_generation_prompt=True, tools=tools)
        text = self.render(messages, tools=tools)
        if not text.startswith(prompt):
            raise UserError(f"the chat template of {self.folder} ({self.template_for(tools)[2]}) renders the "
                            f"conversation before its last turn differently once that turn follows, so the reply's "
                            f"text cannot be found.")
        reply = text[len(prompt):]
        ends = [reply.find(stop) for stop in (self.decode([i]) for i in self.stop_ids) if stop and stop in reply]
        return reply[:min(ends)] if ends else reply


def rebuilt_as_llama(folder, tokenizer_config, tokenizer_json):
    """Whether transformers 5's AutoTokenizer reads this folder's tokenizer.json as a LlamaTokenizer, which
    rebuilds its spaces (tokenizer_json.as_transformers_llama): tokenizer_class LlamaTokenizer(Fast), no
    custom code, not a byte-level BPE (Llama 3 style), and not a Mistral model (that file is read as is)."""
    return (str(tokenizer_config.get('tokenizer_class')).removesuffix('Fast') == 'LlamaTokenizer'
            and 'auto_map' not in tokenizer_config and b'"ByteLevel"' not in tokenizer_json
            and (read_json(folder, 'config.json') or {}).get('model_type') not in LLAMA_CLASS_OVERRIDDEN)


def read_sentencepiece_folder(folder, tokenizer_config, special_tokens):
    """(tokenizers.Tokenizer, the bytes its identity hashes) of a folder that has a sentencepiece
    tokenizer.model but no tokenizer.json, converted as transformers' LlamaTokenizer converts it."""
    path = os.path.join(folder, 'tokenizer.model')
    if not os.path.isfile(path):
        raise UserError(f"{os.path.join(folder, 'tokenizer.json')} is missing, and so is a sentencepiece tokenizer.model. "
                        f"Point at a Hugging Face model folder with its tokenizer files.")
    # AutoTokenizer picks the class from tokenizer_config.json, else from config.json's model_type
    tokenizer_class = tokenizer_config.get('tokenizer_class')
    model_type = (read_json(folder, 'config.json') or {}).get('model_type')
    if tokenizer_class not in SENTENCEPIECE_CLASSES and not (tokenizer_class is None and model_type in ('llama', 'mistral')):
        raise UserError(f"{path}: nanotrain converts a sentencepiece tokenizer.model the way transformers' "
                        f"LlamaTokenizer does (Llama 2, Mistral v0.1), not for tokenizer_class {tokenizer_class} "
                        f"(model_type {model_type}). Give the folder its "
                        f"tokenizer.json: AutoTokenizer.from_pretrained(folder).save_pretrained(folder) in transformers.")
    with open(path, 'rb') as f:
        model_bytes = f.read()
    try:
        tokenizer = from_sentencepiece(model_bytes, tokenizer_config, special_tokens, source=path)
    except (ValueError, IndexError, KeyError) as e:  # a truncated or foreign file
        raise UserError(f"{path} is not a sentencepiece model ({e!r}); download the model folder again.") from None
    recipe = {name: tokenizer_config.get(name) for name in CONVERSION_SETTINGS}
    return tokenizer, model_bytes + json.dumps(recipe, sort_keys=True).encode()


def load_hf_tokenizer(folder, template_variables=None):
    """The tokenizer of a Hugging Face model folder (tokenizer.json, tokenizer_config.json, ...)."""
    if not os.path.isdir(folder):
        raise UserError(f"{folder} is not a folder; point at a Hugging Face model folder (with tokenizer.json).")
    return HFTokenizer(folder, template_variables)
