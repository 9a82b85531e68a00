"""
Tokenizers: one token per character (CharTokenizer) or sentencepiece BPE (BPETokenizer, trained by
train_bpe), the chat template's special tokens on top of either (ChatTokenizer), and the tokenizer
that a prepared dataset folder holds (load_tokenizer). data.py prepares those folders. A Hugging Face
model folder's own tokenizer and chat template: hf/tokenizer.py.
"""

import hashlib
import io
import itertools
import json
import os
import random

import numpy as np
import sentencepiece as spm

from configurator import UserError

# where plain `python data.py` prepares the default corpus
DEFAULT_DATA_DIR = os.path.join('data', 'stdlib')
BPE_SEED = 1337
BPE_MAX_LINES = 200_000  # lines of text the BPE tokenizer trains on
SENTENCEPIECE_MAX_LINE = 4192  # bytes: sentencepiece's max_sentence_length, past which it skips a line


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of the corpus's characters."""

    def __init__(self, chars):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self.eos_id = None
        self.document_prefix = []  # tokens that open a text: none

    def encode(self, text):
        missing = sorted(set(text) - self.stoi.keys())
        if missing:
            raise UserError(f"characters {''.join(missing)!r} are not in this character vocabulary "
                            f"({self.vocab_size} characters of the training corpus). "
                            f"Remove them from the text.")
        return [self.stoi[c] for c in text]

    def encode_documents(self, docs):
        # vectorized: map each character's code point to its index in the sorted vocabulary
        codes = np.frombuffer(''.join(docs).encode('utf-32-le'), dtype=np.uint32)
        chars = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        return np.searchsorted(chars, codes)

    def decode(self, ids, skip_special=False):  # no special tokens to skip
        return ''.join(self.chars[i] for i in ids)

    def token_bytes(self, i):
        """The UTF-8 bytes token i stands for."""
        return self.chars[i].encode()

    def identity(self):
        digest = hashlib.sha256(''.join(self.chars).encode()).hexdigest()
        return {'vocab_size': self.vocab_size, 'hash': digest}


class BPETokenizer:
    """sentencepiece BPE; byte fallback makes any text encodable and decoding exact."""

    def __init__(self, model_bytes):
        self.model_bytes = model_bytes
        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id()
        self.document_prefix = []  # tokens that open a text: none (eos_id separates documents)

    def encode(self, text):
        return self.sp.encode(text)

    def encode_documents(self, docs):
        """All documents as one id array with eos_id between documents, encoded on all cores."""
        ids = self.sp.encode(docs, num_threads=os.cpu_count())
        separated = itertools.chain.from_iterable([self.eos_id] * (i > 0) + d for i, d in enumerate(ids))
        return np.fromiter(separated, dtype=np.int64)

    def decode(self, ids, skip_special=False):  # sentencepiece writes its control tokens (EOS) as ''
        return self.sp.decode(list(ids))

    def token_bytes(self, i):
        """The bytes token i stands for: a byte-fallback piece's one byte (part of a character), else its text."""
        piece = self.sp.id_to_piece(i)
        if self.sp.is_byte(i):  # '<0xE2>'
            return bytes([int(piece[3:5], 16)])
        if self.sp.is_control(i) or self.sp.is_unknown(i):  # EOS: '', <unk>: its stand-in
            return self.sp.decode([i]).encode()
        return piece.replace('\u2581', ' ').encode()

    def identity(self):
        return {'vocab_size': self.vocab_size, 'hash': hashlib.sha256(self.model_bytes).hexdigest()}


def train_bpe(docs, vocab_size):
    """Train a sentencepiece BPE model on the lines of docs; returns the model file's bytes."""
    lines = [line for doc in docs for line in doc.split('\n') if line]
    if lines and all(len(line.encode('utf-8', 'surrogatepass')) > SENTENCEPIECE_MAX_LINE for line in lines):
        raise UserError(f"every line of the corpus is over {SENTENCEPIECE_MAX_LINE:,} bytes, which sentencepiece "
                        f"leaves out of a BPE's training, so none is left to train it on. Break the text into "
                        f"lines (e.g. `fold -s -w 1000 corpus.txt > lines.txt`: the model trains on the same text), "
                        f"or use --tokenizer=char.")
    # a seeded sample: fast, and sentencepiece's own sample isn't reproducible
    if len(lines) > BPE_MAX_LINES:
        lines = random.Random(BPE_SEED).sample(lines, BPE_MAX_LINES)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, model_type='bpe', vocab_size=vocab_size,
            byte_fallback=True,  # unseen characters become byte tokens instead of <unk>
            # keep text exactly as written (code: indentation, newlines, no unicode normalization)
            normalization_rule_name='identity', remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True,
            unk_id=0, bos_id=-1, eos_id=1, pad_id=-1,
            # fixed: the model file records it, and its hash must not vary
            num_threads=4, minloglevel=2)
    # e.g. "Vocabulary size is too high (4096). Please set it to a value <= 1234."
    except RuntimeError as e:
        raise UserError(f"could not train a {vocab_size}-token BPE tokenizer: {e} "
                        f"Pick another --vocab_size (byte fallback alone needs 258 tokens).") from None
    return model.getvalue()


# -----------------------------------------------------------------------------
# chat template (fine-tuning: train.py's 'sft' | 'lora' and train_dpo.py; data: lm/chat_data.py)
#
# Every example becomes a conversation of turns, each written as
#     <|role|> content <|end|>        role: system | user | assistant
# with the special tokens <|system|> <|user|> <|assistant|> <|end|> added after the base vocabulary
# (an existing model's embedding grows to fit). The loss is on the assistant turns only: their
# content and the <|end|> that closes them (the end-of-sequence token, so the model learns to stop).
# Content is always encoded as plain text, so a message containing "<|user|>" cannot forge a turn.

CHAT_ROLES = ('system', 'user', 'assistant')
CHAT_SPECIAL_TOKENS = ('<|system|>', '<|user|>', '<|assistant|>', '<|end|>')
# the same template in Jinja, for a Hugging Face folder export.py writes (there, as in every Jinja
# template, special-token text inside a message is read as that token)
CHAT_TEMPLATE_JINJA = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                       "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def function_name(value, what):
    """The function name of a tool or tool call: {"type": "function", "function": {"name": ...}} (OpenAI's and
    transformers' form) or {"name": ...}; ValueError if it has none."""
    function = value.get('function', value) if isinstance(value, dict) else None
    name = function.get('name') if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f'{what} must be {{"type": "function", "function": {{"name": ..., ...}}}}, got '
                         f'{json.dumps(value)[:80]}')
    return name


class ChatTokenizer:
    """A base tokenizer plus the chat template's special tokens, numbered after its vocabulary; those the
    base already holds keep their ids (a folder export.py wrote, without the tokenizer_config.json that
    names its template): the model was trained on them, and a second copy would be an untrained row."""

    def __init__(self, base):
        self.base = base
        # only a published model's tokenizer holds any
        held = getattr(base, 'added_token_id', lambda token: None)
        self.special, self.vocab_size = {}, base.vocab_size
        for token in CHAT_SPECIAL_TOKENS:
            self.special[token] = held(token)
            if self.special[token] is None:
                self.special[token], self.vocab_size = self.vocab_size, self.vocab_size + 1
        self.eos_id = self.special['<|end|>']

    def encode(self, text):
        return self.base.encode(text)

    def decode(self, ids, skip_special=False):
        """The text of ids, the chat template's tokens written as their names (skip_special: left out, as
        transformers' skip_special_tokens)."""
        names = {i: '' if skip_special else token for token, i in self.special.items()}
        pieces, run = [], []
        for i in ids:
            if i in names:
                pieces += [self.base.decode(run, skip_special), names[i]]
                run = []
            else:
                run.append(i)
        return ''.join(pieces) + self.base.decode(run, skip_special)

    def token_bytes(self, i):
        """The bytes token i stands for: a template token's name, else the base tokenizer's."""
        name = next((token for token, special in self.special.items() if special == i), None)
        return name.encode() if name else self.base.token_bytes(i)

    def identity(self):
        base = self.base.identity()
        digest = hashlib.sha256((base['hash'] + ''.join(CHAT_SPECIAL_TOKENS)).encode()).hexdigest()
        return {'vocab_size': self.vocab_size, 'hash': digest}

    def encode_chat(self, messages, tools=None):
        """Token ids and labels of a conversation: labels are the ids of the assistant turns' content
        and closing <|end|>, -100 everywhere else. This template has no tools: tools, tool calls and
        "tool" turns are refused."""
        if tools or any(m['role'] == 'tool' or m.get('tool_calls') for m in messages):
            raise UserError("nanotrain's own chat template has no tools (its turns are system, user and assistant "
                            "text): \"tools\", \"tool_calls\" and \"tool\" turns need a published model whose chat "
                            "template writes them (init_from= a Hugging Face folder such as Qwen2.5's, Qwen3's or "
                            "Llama 3.1's); or write the calls and results as the turns' text and drop those keys")
        ids = list(self.base.document_prefix)  # a published base model's BOS (hf/tokenizer.py)
        labels = [-100] * len(ids)
        for m in messages:
            content = self.encode(m['content'])
            ids += [self.special[f"<|{m['role']}|>"], *content, self.eos_id]
            labels += [-100] + (content + [self.eos_id] if m['role'] == 'assistant' else [-100] * (len(content) + 1))
        return ids, labels

    def encode_prompt(self, messages, tools=None):
        """The conversation so far, then <|assistant|>: the prompt that generates the next assistant turn."""
        return self.encode_chat(messages, tools)[0] + [self.special['<|assistant|>']]


def base_tokenizer(tokenizer):
    """The tokenizer under nanotrain's chat template (ChatTokenizer), else tokenizer itself: its document_prefix
    opens a text (a published base model's BOS)."""
    return getattr(tokenizer, 'base', tokenizer)


def prompt_and_answer(tokenizer, messages, tools=None):
    """(prompt ids, reference text) of a conversation's last assistant turn, for exact-match evaluation;
    tokenizer: a chat tokenizer (ChatTokenizer, or a published model's hf_tokenizer.HFTokenizer); the reference
    as reply_reference gives it."""
    last = max(i for i, m in enumerate(messages) if m['role'] == 'assistant')
    return tokenizer.encode_prompt(messages[:last], tools), reply_reference(tokenizer, messages[:last + 1], tools)


def reply_reference(tokenizer, messages, tools=None):
    """The reference text of messages' last turn, an assistant's, for exact match: its content, or for a turn
    that calls tools the calls as a published model's template writes them (HFTokenizer.reply_text)."""
    if messages[-1].get('tool_calls'):
        return tokenizer.reply_text(messages, tools)
    return messages[-1]['content']


class PieceDecoder:
    """The text of a generation's tokens a piece at a time, as they come: each piece what the tokens not yet given
    add to the decoding, held back (held: its text so far) while it ends in a character's first bytes alone
    (U+FFFD) or rewrites text already given (a decoder's clean-up), so the pieces join into the decoding. Each
    piece is decoded after the tokens of the piece before it, as vLLM decodes (a sentencepiece word's space, which
    a decoding's first token loses, is kept), not after all of them: a token costs the same at any length."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen, self.start, self.given, self.held = tokenizer, [], 0, 0, ''

    def add(self, token):
        """The text token adds, '' while held back."""
        self.seen.append(token)
        return self.piece(lambda text: not text.endswith('\ufffd'))

    def end(self):
        """The text held back, once the tokens are all in."""
        return self.piece(lambda text: True)

    def piece(self, ready):
        before = self.tokenizer.decode(self.seen[self.start:self.given], skip_special=True)
        text = self.tokenizer.decode(self.seen[self.start:], skip_special=True)
        if not (text.startswith(before) and ready(text)):
            self.held = text[len(before):] if text.startswith(before) else ''
            return ''
        self.start, self.given, self.held = self.given, len(self.seen), ''
        return text[len(before):]


def decoded_pieces(tokenizer, ids):
    """The text of ids (an iterable, read as it comes: a generation's tokens) a piece at a time (PieceDecoder)."""
    decoder = PieceDecoder(tokenizer)
    for i in ids:
        yield decoder.add(i)
    yield decoder.end()


# -----------------------------------------------------------------------------
# a prepared dataset folder (made by data.py): its meta.json, its files, its tokenizer

def read_meta(data_dir, fix=''):
    """data_dir's meta.json; fix: what to do where the folder must be a model's own (its tokenizer), since
    preparing a new one makes another tokenizer."""
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.exists(path):
        raise UserError(f"{data_dir} is not a prepared dataset (no meta.json in it). " + (fix or (
                        f"Prepare it first: python data.py --input=<text file, folder or URL> --out_dir={data_dir} "
                        f"--tokenizer=char (or bpe), or plain `python data.py` for the default corpus "
                        f"in {DEFAULT_DATA_DIR}.")))
    try:
        with open(path) as f:
            return json.load(f)
    except (ValueError, RecursionError) as e:
        raise UserError(f"{path} is corrupt ({e}); prepare the dataset again with data.py.") from None


def dataset_file(data_dir, name):
    """The path of one of a prepared dataset's files; a clear error if it is missing."""
    path = os.path.join(data_dir, name)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing, so {data_dir} is an incomplete dataset; prepare it again with data.py.")
    return path


def chat_tokenizer(tokenizer):
    """The tokenizer fine-tuning encodes conversations with: a published model's own chat template, else
    nanotrain's (ChatTokenizer) on top of tokenizer, which a published model's folder is told."""
    if getattr(tokenizer, 'chat_template', None):
        return tokenizer
    chat = ChatTokenizer(tokenizer)
    if hasattr(tokenizer, 'folder'):
        from run.runtime import log  # torch: only when a published model is loaded anyway
        added = chat.vocab_size - tokenizer.vocab_size
        held = len(CHAT_SPECIAL_TOKENS) - added
        log(f"{tokenizer.folder} has no chat template (no chat_template.jinja, no \"chat_template\" in "
            f"tokenizer_config.json): using nanotrain's, {' '.join(CHAT_SPECIAL_TOKENS)}"
            + (f" ({held} of these tokens already in its tokenizer.json, kept)" if held else ''))
    return chat


def load_tokenizer(data_dir, fix=''):
    """The tokenizer of a dataset folder prepared by data.py (a Hugging Face model's: hf/tokenizer.py); fix:
    read_meta's."""
    meta = read_meta(data_dir, fix)
    if meta['tokenizer'] == 'char':
        return CharTokenizer(meta['chars'])
    with open(dataset_file(data_dir, 'tokenizer.model'), 'rb') as f:
        return BPETokenizer(f.read())
