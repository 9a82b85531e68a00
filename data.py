"""
Corpus preparation, tokenizers and batch sampling.

Prepare a dataset once; training then reads random windows of the token files:

    python data.py                  # default corpus: the Python standard library's own sources,
                                    # BPE tokenizer (4096 tokens), cached in data/stdlib
    python data.py --input=../shared/data/tinyshakespeare.txt --out_dir=data/shakespeare_char --tokenizer=char
    python data.py --input=https://example.com/book.txt --out_dir=data/book --tokenizer=bpe --vocab_size=2048

A prepared dataset folder holds train.bin and val.bin (token ids, uint16 when the vocabulary fits,
else uint32, read with np.memmap), meta.json (tokenizer kind, vocab size, dtype, token counts,
tokenizer hash) and, for bpe, tokenizer.model (sentencepiece).
"""

import argparse
import hashlib
import io
import itertools
import json
import os
import random
import re
import sysconfig
import time
import urllib.request

import numpy as np
import sentencepiece as spm
import torch

from configurator import UserError, install_excepthook, require_writable_folder

DEFAULT_DATA_DIR = os.path.join('data', 'stdlib')
# folders of the standard library that are not library code (test suites, installed packages)
STDLIB_SKIP = {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__'}
BPE_SEED = 1337
BPE_MAX_LINES = 200_000  # lines of text the BPE tokenizer trains on


def token_dtype(vocab_size):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


# -----------------------------------------------------------------------------
# reading the corpus

def read_text(path):
    with open(path, 'rb') as f:
        raw = f.read()
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start}). "
                        f"Convert it to UTF-8, e.g. iconv -f latin1 -t utf-8 {path}.") from None


def text_files(folder):
    """Every non-empty UTF-8 text file under folder (recursively, skipping hidden names), sorted by path.
    Files that are not UTF-8 text (binary, or text in another encoding) are left out and named in one line."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith('.')]
        paths += [os.path.join(dirpath, f) for f in filenames if not f.startswith('.')]
    texts, skipped = [], []
    for path in sorted(paths):
        with open(path, 'rb') as f:
            raw = f.read()
        try:
            text = raw.decode('utf-8')
        except UnicodeDecodeError:  # another encoding (latin-1, ...) or binary
            text = None
        if text is None or '\0' in text:  # a NUL: binary, or UTF-16
            skipped.append(os.path.relpath(path, folder))
        elif text:
            texts.append(text)
    if skipped:
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        print(f"skipped {len(skipped)} of {len(paths)} files in {folder} that are not UTF-8 text (binary or another "
              f"encoding; convert text files with iconv): {', '.join(skipped[:5])}{more}")
    return texts


def download(url):
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.read().decode('utf-8')
    except (OSError, UnicodeDecodeError) as e:  # URLError and timeouts are OSErrors
        raise UserError(f"could not download {url}: {e}. Check the address and the connection, or "
                        f"download the file yourself and pass its path with --input=FILE.") from None


def read_documents(input):
    """The corpus as a list of documents (one per file): a text file, a folder of text files, or a URL."""
    if input.startswith(('http://', 'https://')):
        docs = [download(input)]
    elif os.path.isfile(input):
        docs = [read_text(input)]
    elif os.path.isdir(input):
        docs = text_files(input)
    else:
        raise UserError(f"input {input!r} does not exist (looked relative to {os.getcwd()}). Pass a "
                        f"text file, a folder of text files or an http(s) URL with --input=...")
    if not any(docs):
        raise UserError(f"input {input!r} holds no text (a folder is searched for non-empty UTF-8 "
                        f"text files). Pass a corpus with some text in it.")
    return docs


def stdlib_documents():
    """The .py sources of the running Python's standard library, without test suites, sorted by path."""
    root = sysconfig.get_paths()['stdlib']
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP]
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith('.py')]
    docs = []
    for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        with open(path, encoding='utf-8', errors='replace') as f:
            text = f.read()
        if text:  # many __init__.py are empty
            docs.append(text)
    return docs


def split_documents(docs, val_fraction):
    """Cut the concatenated text at (1 - val_fraction) of its characters: the first part is train,
    the rest val (nanoGPT's shakespeare_char split). The document spanning the cut is split in two."""
    cut = int(sum(map(len, docs)) * (1 - val_fraction))
    train, val, pos = [], [], 0
    for doc in docs:
        if pos + len(doc) <= cut:
            train.append(doc)
        elif pos >= cut:
            val.append(doc)
        else:
            train.append(doc[:cut - pos])
            val.append(doc[cut - pos:])
        pos += len(doc)
    return train, val


# -----------------------------------------------------------------------------
# tokenizers

class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of the corpus's characters."""

    def __init__(self, chars):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self.eos_id = None

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

    def decode(self, ids):
        return ''.join(self.chars[i] for i in ids)

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

    def encode(self, text):
        return self.sp.encode(text)

    def encode_documents(self, docs):
        """All documents as one id array with eos_id between documents, encoded on all cores."""
        ids = self.sp.encode(docs, num_threads=os.cpu_count())
        separated = itertools.chain.from_iterable([self.eos_id] * (i > 0) + d for i, d in enumerate(ids))
        return np.fromiter(separated, dtype=np.int64)

    def decode(self, ids):
        return self.sp.decode(list(ids))

    def identity(self):
        return {'vocab_size': self.vocab_size, 'hash': hashlib.sha256(self.model_bytes).hexdigest()}


def train_bpe(docs, vocab_size):
    """Train a sentencepiece BPE model on the lines of docs; returns the model file's bytes."""
    lines = [line for doc in docs for line in doc.split('\n') if line]
    if len(lines) > BPE_MAX_LINES:  # a seeded sample: fast, and sentencepiece's own sample isn't reproducible
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
            num_threads=4, minloglevel=2)  # fixed: the model file records it, and its hash must not vary
    except RuntimeError as e:  # e.g. "Vocabulary size is too high (4096). Please set it to a value <= 1234."
        raise UserError(f"could not train a {vocab_size}-token BPE tokenizer: {e} "
                        f"Pick another --vocab_size (byte fallback alone needs 258 tokens).") from None
    return model.getvalue()


# -----------------------------------------------------------------------------
# preparing a dataset folder

def read_meta(data_dir):
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.exists(path):
        raise UserError(f"{data_dir} is not a prepared dataset (no meta.json in it). Prepare it first: "
                        f"python data.py --input=<text file, folder or URL> --out_dir={data_dir} "
                        f"--tokenizer=char (or bpe), or plain `python data.py` for the default corpus "
                        f"in {DEFAULT_DATA_DIR}.")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise UserError(f"{path} is corrupt ({e}); prepare the dataset again with data.py.") from None


def dataset_file(data_dir, name):
    """The path of one of a prepared dataset's files; a clear error if it is missing."""
    path = os.path.join(data_dir, name)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing, so {data_dir} is an incomplete dataset; prepare it again with data.py.")
    return path


def write_dataset(docs, out_dir, tokenizer='char', vocab_size=4096, val_fraction=0.1, source=''):
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be between 0 and 1 (got {val_fraction}), e.g. 0.1.")
    if tokenizer not in ('char', 'bpe'):
        raise UserError(f"unknown tokenizer {tokenizer!r}: use 'char' or 'bpe'.")
    t0 = time.time()
    train_docs, val_docs = split_documents(docs, val_fraction)
    meta = {'tokenizer': tokenizer, 'source': source, 'documents': len(docs),
            'characters': sum(map(len, docs)), 'val_fraction': val_fraction}
    if tokenizer == 'char':
        tok = CharTokenizer(sorted(set(''.join(docs))))  # whole text, like nanoGPT
        meta['chars'] = tok.chars
    else:
        model_bytes = train_bpe(train_docs, vocab_size)  # train split only: val stays unseen
        tok = BPETokenizer(model_bytes)
    # only now that the tokenizer stands is an existing dataset in out_dir replaced
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, 'meta.json')
    if os.path.exists(meta_path):
        os.remove(meta_path)  # meta.json is written last and marks a complete dataset
    if tokenizer == 'bpe':
        with open(os.path.join(out_dir, 'tokenizer.model'), 'wb') as f:
            f.write(model_bytes)
    dtype = token_dtype(tok.vocab_size)
    for split, split_docs in (('train', train_docs), ('val', val_docs)):
        ids = tok.encode_documents(split_docs).astype(dtype)
        ids.tofile(os.path.join(out_dir, f'{split}.bin'))
        meta[f'{split}_tokens'] = len(ids)
    meta.update(vocab_size=tok.vocab_size, dtype=np.dtype(dtype).name, eos_id=tok.eos_id,
                hash=tok.identity()['hash'])
    with open(meta_path + '.tmp', 'w') as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    os.replace(meta_path + '.tmp', meta_path)
    print(f"prepared {out_dir} in {time.time() - t0:.1f}s: {meta['characters']:,} characters, "
          f"{tokenizer} vocab {tok.vocab_size}, train {meta['train_tokens']:,} tokens, "
          f"val {meta['val_tokens']:,} tokens")
    return out_dir


def prepare(input, out_dir, tokenizer='char', vocab_size=4096, val_fraction=0.1):
    """Tokenize a text file, a folder of text files or an http(s) URL into out_dir."""
    input = str(input)
    require_writable_folder(out_dir)  # before reading and tokenizing: a bad out_dir fails at once
    return write_dataset(read_documents(input), out_dir, tokenizer, vocab_size, val_fraction, source=input)


def prepare_default(data_dir=DEFAULT_DATA_DIR, vocab_size=4096):
    """The default corpus (stdlib sources, BPE), prepared once; reused while the stdlib is unchanged."""
    docs = stdlib_documents()
    digest = hashlib.sha256('\0'.join(docs).encode()).hexdigest()
    source = f"Python {sysconfig.get_python_version()} standard library, {len(docs)} files, sha256 {digest}"
    if os.path.exists(os.path.join(data_dir, 'meta.json')):
        meta = read_meta(data_dir)
        if (meta.get('source'), meta.get('tokenizer'), meta.get('vocab_size')) == (source, 'bpe', vocab_size):
            return data_dir
    print(f"preparing the default corpus (the Python standard library's sources) in {data_dir}, once")
    require_writable_folder(data_dir, 'data_dir')
    return write_dataset(docs, data_dir, 'bpe', vocab_size, 0.1, source)


def load_tokenizer(data_dir):
    meta = read_meta(data_dir)
    if meta['tokenizer'] == 'char':
        return CharTokenizer(meta['chars'])
    with open(dataset_file(data_dir, 'tokenizer.model'), 'rb') as f:
        return BPETokenizer(f.read())


# -----------------------------------------------------------------------------
# batch sampling

class TokenBatches:
    """Random block_size windows of a token .bin file, drawn from a seeded generator.

    DDP: every rank builds this with the same seed and calls sample_offsets for the whole global
    batch (world_size * grad_accum * micro_batch offsets), so all ranks draw the same offsets and
    the generator state is the same everywhere (any rank's state_dict resumes all). Rank r takes
    the contiguous slice offsets.tensor_split(world_size)[r] and splits it into grad_accum
    micro-batches: its micro-step k is global micro-batch r * grad_accum + k, so 2 ranks x
    grad_accum A train on exactly the samples of 1 process x grad_accum 2A."""

    def __init__(self, bin_path, block_size, seed):
        self.bin_path = bin_path
        self.block_size = block_size
        self.dtype = np.dtype(read_meta(os.path.dirname(bin_path) or '.')['dtype'])
        self.n_tokens = os.path.getsize(dataset_file(*os.path.split(bin_path))) // self.dtype.itemsize
        if self.n_tokens < block_size + 1:
            raise UserError(f"{bin_path} has {self.n_tokens} tokens, fewer than block_size + 1 = "
                            f"{block_size + 1}. Use a smaller --block_size or a bigger corpus.")
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def sample_offsets(self, n):
        self.batches_drawn += 1
        return torch.randint(self.n_tokens - self.block_size, (n,), generator=self.generator)

    def get(self, offsets, device='cpu'):
        """(x, y) int64 (len(offsets), block_size); y[:, t] is the token after x[:, t]."""
        # a fresh memmap per call: a long-lived one keeps growing in memory (nanoGPT's note)
        data = np.memmap(self.bin_path, dtype=self.dtype, mode='r')
        windows = np.stack([data[i:i + self.block_size + 1] for i in offsets.tolist()])
        windows = torch.from_numpy(windows.astype(np.int64))
        x, y = to_device([windows[:, :-1].contiguous(), windows[:, 1:].contiguous()], device)
        return x, y

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])
        self.batches_drawn = state['batches_drawn']


def eval_offsets(n_tokens, block_size, n, seed=1234):
    """The same n window starts at every evaluation, so successive val losses compare."""
    if n_tokens < block_size + 1:
        raise UserError(f"the eval split has {n_tokens} tokens, fewer than block_size + 1 = "
                        f"{block_size + 1}. Use a smaller --block_size or a bigger corpus.")
    return torch.randint(n_tokens - block_size, (n,), generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------
# supervised fine-tuning (train.py training_type='sft' | 'lora'): chat examples from JSONL
#
# Chat template. Every example becomes a conversation of turns, each written as
#     <|role|> content <|end|>        role: system | user | assistant
# with the special tokens <|system|> <|user|> <|assistant|> <|end|> added after the base vocabulary
# (an existing model's embedding grows to fit). The loss is on the assistant turns only: their
# content and the <|end|> that closes them (the end-of-sequence token, so the model learns to stop).
# Content is always encoded as plain text, so a message containing "<|user|>" cannot forge a turn.
# The three JSONL formats map to turns as:
#     {"prompt": P, "response": R}                   -> user P, assistant R
#     {"instruction": I, "input": X, "output": O}     -> user I + "\n\n" + X (just I if X is empty), assistant O
#     {"messages": [{"role": ..., "content": ...}]}   -> as given (at least one assistant turn)

CHAT_ROLES = ('system', 'user', 'assistant')
CHAT_SPECIAL_TOKENS = ('<|system|>', '<|user|>', '<|assistant|>', '<|end|>')
NUMBER_TASKS_DIR = os.path.join('data', 'number_tasks')


class ChatTokenizer:
    """A base tokenizer plus the chat template's special tokens, numbered after its vocabulary."""

    def __init__(self, base):
        self.base = base
        self.special = {token: base.vocab_size + i for i, token in enumerate(CHAT_SPECIAL_TOKENS)}
        self.vocab_size = base.vocab_size + len(CHAT_SPECIAL_TOKENS)
        self.eos_id = self.special['<|end|>']

    def encode(self, text):
        return self.base.encode(text)

    def decode(self, ids):
        names = {i: token for token, i in self.special.items()}
        pieces, run = [], []
        for i in ids:
            if i in names:
                pieces += [self.base.decode(run), names[i]]
                run = []
            else:
                run.append(i)
        return ''.join(pieces) + self.base.decode(run)

    def identity(self):
        base = self.base.identity()
        digest = hashlib.sha256((base['hash'] + ''.join(CHAT_SPECIAL_TOKENS)).encode()).hexdigest()
        return {'vocab_size': self.vocab_size, 'hash': digest}

    def encode_chat(self, messages):
        """Token ids and labels of a conversation: labels are the ids of the assistant turns' content
        and closing <|end|>, -100 everywhere else."""
        ids, labels = [], []
        for m in messages:
            content = self.encode(m['content'])
            ids += [self.special[f"<|{m['role']}|>"], *content, self.eos_id]
            labels += [-100] + (content + [self.eos_id] if m['role'] == 'assistant' else [-100] * (len(content) + 1))
        return ids, labels

    def encode_prompt(self, messages):
        """The conversation so far, then <|assistant|>: the prompt that generates the next assistant turn."""
        return self.encode_chat(messages)[0] + [self.special['<|assistant|>']]

    def prompt_and_answer(self, messages):
        """(prompt ids, reference text) of a conversation's last assistant turn, for exact-match evaluation."""
        last = max(i for i, m in enumerate(messages) if m['role'] == 'assistant')
        return self.encode_prompt(messages[:last]), messages[last]['content']


def string_field(value, key):
    if not isinstance(value, str):
        raise ValueError(f'"{key}" must be a string, got {type(value).__name__}')
    return value


def message_list(value, key):
    """value checked to be a list of {"role", "content"} messages (roles of the template); ValueError if not."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError(f'"{key}" must be a list of {{"role": ..., "content": ...}} objects, got '
                         f'{json.dumps(value)[:80]}')
    for m in value:
        if m.get('role') not in CHAT_ROLES:
            raise ValueError(f"message role {m.get('role')!r} in \"{key}\" is not one of {', '.join(CHAT_ROLES)}")
        string_field(m.get('content'), 'content')
    return [{'role': m['role'], 'content': m['content']} for m in value]


def chat_messages(record):
    """A JSONL record in any of the three formats as a list of {'role', 'content'}; ValueError if malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if 'messages' in record:
        messages = message_list(record['messages'], 'messages')
        if not any(m['role'] == 'assistant' for m in messages):
            raise ValueError('"messages" has no assistant turn, so there is nothing to learn')
        return messages
    if 'prompt' in record and 'response' in record:
        return [{'role': 'user', 'content': string_field(record['prompt'], 'prompt')},
                {'role': 'assistant', 'content': string_field(record['response'], 'response')}]
    if 'instruction' in record and 'output' in record:
        user = string_field(record['instruction'], 'instruction')
        if string_field(record.get('input', ''), 'input'):
            user += '\n\n' + record['input']
        return [{'role': 'user', 'content': user},
                {'role': 'assistant', 'content': string_field(record['output'], 'output')}]
    raise ValueError(f"unknown format (keys {sorted(record)}); use {{\"prompt\", \"response\"}}, Alpaca "
                     f"{{\"instruction\", \"input\", \"output\"}} or "
                     f"{{\"messages\": [{{\"role\", \"content\"}}, ...]}}")


def read_jsonl(path, parse, skip_malformed):
    """(results, skipped): parse(record) of every non-blank line of a JSONL file. A line that is not
    JSON, not UTF-8 (or holds a lone surrogate such as \\ud800), or that parse rejects (ValueError,
    UserError) is an error naming path:line, or with skip_malformed skipped and counted."""
    results, skipped = [], 0
    with open(path, 'rb') as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode('utf-8-sig' if line_no == 1 else 'utf-8'))  # a BOM is allowed
                json.dumps(record, ensure_ascii=False).encode('utf-8')  # lone surrogates are not text
                results.append(parse(record))
            except (ValueError, RecursionError, UserError) as e:  # bad JSON or UTF-8 is a ValueError; deep nesting recurses
                if not skip_malformed:
                    raise UserError(f"{path}:{line_no}: {str(e).rstrip('.')}. Fix the line, or set skip_malformed=True to skip "
                                    f"malformed lines (they are counted).") from None
                skipped += 1
    return results, skipped


def load_sft_split(path, tokenizer, max_length, overlong='truncate', skip_malformed=False):
    """Read and tokenize one JSONL split (one example per line, blank lines ignored): returns
    (conversations, examples), examples as (ids, labels). A malformed line is an error naming
    path:line, or with skip_malformed skipped and counted. An example longer than max_length tokens
    is cut to its first max_length tokens (overlong='truncate'; dropped if no response token is
    left) or dropped (overlong='drop'). The counts are printed; no examples left is an error."""
    if overlong not in ('truncate', 'drop'):
        raise UserError(f"overlong={overlong!r} is not supported; use 'truncate' or 'drop'.")
    if not os.path.isfile(path):
        raise UserError(f"SFT data file {path} does not exist. Point sft_data at a folder holding train.jsonl "
                        f"and val.jsonl (test.jsonl optional), or leave it '' for the embedded number tasks.")
    conversations, examples, truncated, dropped = [], [], 0, 0

    def parse(record):
        messages = chat_messages(record)
        return messages, *tokenizer.encode_chat(messages)  # a char tokenizer rejects unknown characters
    parsed, skipped = read_jsonl(path, parse, skip_malformed)
    for messages, ids, labels in parsed:
        conversations.append(messages)
        if len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
            if overlong == 'drop' or all(label == -100 for label in labels[1:]):
                dropped += 1
                continue
            truncated += 1
        examples.append((ids, labels))
    print(f"{path}: {len(examples):,} examples ({truncated} truncated and {dropped} dropped at max_length="
          f"{max_length} by overlong={overlong!r}, {skipped} malformed lines skipped)")
    if not examples:
        raise UserError(f"{path} holds no usable examples ({skipped} malformed lines skipped, {dropped} longer "
                        f"than max_length={max_length} dropped). Each line must be one JSON example, e.g. "
                        f"{{\"prompt\": \"What is 2+2?\", \"response\": \"4\"}}; raise max_length if they are "
                        f"too long.")
    return conversations, examples


def to_device(tensors, device):
    """CPU tensors moved to device; to CUDA through pinned memory, so the copy overlaps compute."""
    if torch.device(device).type == 'cuda':
        return [t.pin_memory().to(device, non_blocking=True) for t in tensors]
    return [t.to(device) for t in tensors]


def pack_rows(items, lengths, capacity):
    """Items grouped into rows of at most capacity tokens: first fit, longest first."""
    rows, room = [], []
    for n, i in sorted(zip(lengths, items), key=lambda pair: -pair[0]):
        r = next((r for r, free in enumerate(room) if free >= n), None)
        if r is None:
            rows.append([i])
            room.append(capacity - n)
        else:
            rows[r].append(i)
            room[r] -= n
    return rows


def build_rows(rows, inputs, targets, pad_id, device='cpu'):
    """Tensors (B, T) for rows of sequences (each row a list of indices into inputs/targets), right-
    padded to the longest row: x (pad_id on padding), y (-100 on padding), doc_ids (the sequence's
    place in its row, -1 on padding) and seq (the sequence's index, -1 on padding)."""
    T = max(sum(len(inputs[i]) for i in row) for row in rows)
    x, y = torch.full((len(rows), T), pad_id), torch.full((len(rows), T), -100)
    doc_ids, seq = torch.full((len(rows), T), -1), torch.full((len(rows), T), -1)
    for r, row in enumerate(rows):
        t = 0
        for d, i in enumerate(row):
            n = len(inputs[i])
            x[r, t:t + n], y[r, t:t + n], doc_ids[r, t:t + n], seq[r, t:t + n] = inputs[i], targets[i], d, i
            t += n
    return to_device((x, y, doc_ids, seq), device)


class SFTBatches:
    """Batches of tokenized chat examples: (ids, labels) pairs.

    Like TokenBatches, every rank draws the indices of the whole global batch (same seed, same draws)
    and takes its own contiguous slice. Examples come in a shuffled order, reshuffled every epoch.
    Length bucketing: bucket_batches global batches' worth of examples at a time are sorted by length
    and cut into global batches of similar lengths, served in random order, so a micro-batch (padded
    to its longest example) carries little padding. With pack=True several examples share a row of up
    to max_length tokens, and doc_ids keep attention inside each example."""

    def __init__(self, examples, seed, pad_id, max_length, pack=False, bucket_batches=1):
        self.inputs = [torch.tensor(ids[:-1]) for ids, _ in examples]  # position t predicts labels[t + 1]
        self.targets = [torch.tensor(labels[1:]) for _, labels in examples]
        self.lengths = torch.tensor([len(ids) - 1 for ids, _ in examples])
        self.label_counts = torch.tensor([int((targets != -100).sum()) for targets in self.targets])
        self.pad_id, self.max_length, self.pack, self.bucket_batches = pad_id, max_length, pack, bucket_batches
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(examples), generator=self.generator)
        self.position = 0       # next place in order
        self.pending = []       # global batches of the current bucket, not yet served
        self.batches_drawn = 0

    def _take(self, n, max_len):
        """The next n indices of the shuffled order that are at most max_len long; a new shuffle each epoch."""
        taken = []
        while n:
            if self.position == len(self.order):
                self.order = torch.randperm(len(self.lengths), generator=self.generator)
                self.position = 0
            rest = self.order[self.position:]
            fits = (self.lengths[rest] <= max_len).nonzero().flatten()[:n]
            self.position += int(fits[-1]) + 1 if len(fits) == n else len(rest)
            taken.append(rest[fits])
            n -= len(fits)
        return torch.cat(taken)

    def sample(self, n, max_len=None):
        """Indices of the next global batch of n examples; max_len (a length curriculum) skips longer ones."""
        if not self.pending or len(self.pending[-1]) != n:  # (a resumed run may use another global batch)
            pool = self._take(n * self.bucket_batches, self.max_length if max_len is None else max_len)
            batches = pool[self.lengths[pool].argsort(stable=True)].split(n)
            self.pending = [batches[i] for i in torch.randperm(len(batches), generator=self.generator)]
        self.batches_drawn += 1
        return self.pending.pop()

    def count_tokens(self, indices):
        return int(self.lengths[indices].sum())

    def count_labels(self, indices):
        """Positions with a label (the ones that go through the output layer)."""
        return int(self.label_counts[indices].sum())

    def _rows(self, indices):
        if not self.pack:
            return [[i] for i in indices]
        return pack_rows(indices, [len(self.inputs[i]) for i in indices], self.max_length)

    def get(self, indices, device='cpu'):
        """(x, y, doc_ids) for the examples at indices, right-padded to the longest row (y is -100 on
        padding and prompts). doc_ids (B, T) numbers the examples of each packed row (-1 on padding);
        None without packing, where no mask is needed: causal attention never sees the padding after a token."""
        x, y, doc_ids, _ = build_rows(self._rows(indices.tolist()), self.inputs, self.targets, self.pad_id, device)
        return x, y, doc_ids if self.pack else None

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'order': self.order, 'position': self.position,
                'pending': list(self.pending), 'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])
        self.order, self.position = state['order'], state['position']
        self.pending, self.batches_drawn = list(state['pending']), state['batches_drawn']


def addition_working(a, b, carry=True, units_slip=0, tens_slip=0):
    """a + b worked column by column, units first: '8+6=14, 4+2+1=7, so 74'. The other arguments
    make the slips of DPO's rejected answers (a carry forgotten, a column off by one), worked on
    consistently; None if a slip takes a column below 0 (or the units above 9 + 9)."""
    units = a % 10 + b % 10 + units_slip
    carried = units >= 10 and carry
    tens = a // 10 + b // 10 + carried + tens_slip
    if not 0 <= units <= 18 or tens < 0:
        return None
    return f"{a % 10}+{b % 10}={units}, {a // 10}+{b // 10}{'+1' * carried}={tens}, so {10 * tens + units % 10}"


def subtraction_working(a, b, borrow=True, units_slip=0, tens_slip=0):
    """a - b (a >= b) worked column by column, units first, borrowing ten: '12-7=5, 5-2-1=2, so 25'.
    With borrow=False the slip of taking the smaller units digit from the larger instead; None if a
    slip takes a column outside 0-9 (units) or below 0 (tens)."""
    needs_borrow = a % 10 < b % 10
    if needs_borrow and not borrow:
        units_text, units = f"{b % 10}-{a % 10}", b % 10 - a % 10
    else:
        units_text, units = f"{a % 10 + 10 * needs_borrow}-{b % 10}", a % 10 + 10 * needs_borrow - b % 10
    borrowed = needs_borrow and borrow
    units, tens = units + units_slip, a // 10 - b // 10 - borrowed + tens_slip
    if not 0 <= units <= 9 or tens < 0:
        return None
    return f"{units_text}={units}, {a // 10}-{b // 10}{'-1' * borrowed}={tens}, so {10 * tens + units}"


def digit_copies(answer, other):
    """answer with one digit replaced by a digit of other: the slip of a model that mixes up two numbers."""
    return [answer[:i] + d + answer[i + 1:] for i in range(len(answer)) for d in sorted(set(other)) if d != answer[i]]


def number_task(rng):
    """A question of the embedded instruction set, its answer, and typical wrong answers, one of six
    kinds: two-digit addition and subtraction, reversing digits, the larger of two numbers, counting
    digits, and the next number. Each checks a skill the pretrained model lacks: following the
    instruction. Sums and differences are worked column by column, units first: written in one go,
    most significant digit first, they were beyond the default model (README: 14 of 172 right).
    The wrong answers (DPO's rejected completions) are the slips a model makes: off by one or ten,
    the wrong operation or number, a digit lost, swapped or copied from the other number, a carry or
    borrow forgotten."""
    a, b = rng.randrange(100), rng.randrange(100)
    high, low = max(a, b), min(a, b)
    x, y = (rng.randrange(10 ** rng.randint(1, 4)) for _ in range(2))
    digits = str(rng.randrange(10 ** rng.randint(2, 6)))
    slips = [dict(units_slip=1), dict(units_slip=-1), dict(tens_slip=1), dict(tens_slip=-1)]
    sum_slips = [addition_working(a, b, **slip) for slip in [dict(carry=False), *slips]]
    difference_slips = [subtraction_working(high, low, **slip) for slip in [dict(borrow=False), *slips]]
    return rng.choice([
        (f"What is {a}+{b}?", addition_working(a, b), [w for w in sum_slips if w] + [subtraction_working(high, low)]),
        (f"What is {high}-{low}?", subtraction_working(high, low),
         [w for w in difference_slips if w] + [addition_working(high, low)]),
        (f"Reverse the digits of {digits}.", digits[::-1], [digits, digits[:0:-1], digits[::-1] + digits[0]]),
        (f"Which is larger, {x} or {y}?", str(max(x, y)), [min(x, y), max(x, y) + 1, max(x, y) - 1,
                                                           *digit_copies(str(max(x, y)), str(min(x, y)))]),
        (f"How many digits does {digits} have?", str(len(digits)), [len(digits) + 1, len(digits) - 1]),
        (f"What comes after {x}?", str(x + 1), [x, x + 2, x - 1, x + 11]),
    ])


def task_split(question):
    """'test' for a tenth of all questions, 'val' for another tenth, else 'train', by a hash of the
    text: a question lies in one split only, whatever the seed or the sizes."""
    h = int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % 10
    return 'test' if h == 0 else 'val' if h == 1 else 'train'


def plausible_wrong(answer, mistakes, rng):
    """A wrong answer for DPO's rejected completion: one of the task's typical mistakes, or (for a
    plain number) a digit of the answer changed by one or two neighbouring digits swapped; never the
    answer, never negative. A worked answer's slips are all in mistakes: a digit changed at random
    would break its working rather than make a slip."""
    while True:
        if rng.random() < 0.5 or not answer.isdigit():
            wrong = str(rng.choice(mistakes))
        else:
            i = rng.randrange(len(answer))
            if rng.random() < 0.5:
                wrong = answer[:i] + str((int(answer[i]) + rng.choice((-1, 1))) % 10) + answer[i + 1:]
            else:
                i = min(i, len(answer) - 2)
                wrong = answer[:i] + answer[i + 1:i + 2] + answer[i:i + 1] + answer[i + 2:]
        if wrong and wrong != answer and not wrong.startswith('-'):
            return wrong


def prepare_number_tasks(out_dir=NUMBER_TASKS_DIR, n_train=10_000, n_eval=500, seed=0, preferences=False):
    """The embedded SFT task, a verifiable instruction set (number_task): questions and answers as
    {"prompt", "response"} JSONL in out_dir/train.jsonl, val.jsonl and test.jsonl, disjoint splits.
    With preferences=True, DPO's version: {"prompt", "chosen", "rejected"} pairs, chosen the answer and
    rejected a plausible wrong answer. Written once; reused while the parameters are unchanged."""
    sizes = {'train': n_train, 'val': n_eval, 'test': n_eval}
    meta = {'task': 'number_preferences' if preferences else 'number_tasks', 'sizes': sizes, 'seed': seed,
            'version': 3}  # 3: sums and differences worked column by column; the kinds of wrong answers
    meta_path = os.path.join(out_dir, 'meta.json')
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            if json.load(f) == meta:
                return out_dir
    rng, wrong_rng = random.Random(seed), random.Random(seed + 1)
    splits = {split: {} for split in sizes}  # question -> (answer, mistakes): no duplicates within a split either
    while any(len(splits[s]) < sizes[s] for s in sizes):
        question, answer, mistakes = number_task(rng)
        split = task_split(question)
        if len(splits[split]) < sizes[split]:
            splits[split][question] = answer, mistakes
    os.makedirs(out_dir, exist_ok=True)
    for split, pairs in splits.items():
        with open(os.path.join(out_dir, f'{split}.jsonl'), 'w') as f:
            for q, (a, mistakes) in pairs.items():
                record = {'prompt': q, 'chosen': a, 'rejected': plausible_wrong(a, mistakes, wrong_rng)} \
                    if preferences else {'prompt': q, 'response': a}
                f.write(json.dumps(record) + '\n')
    with open(meta_path, 'w') as f:  # written last: marks a complete task folder
        json.dump(meta, f)
    return out_dir


# -----------------------------------------------------------------------------
# preference pairs (train_dpo.py): a prompt with a chosen and a rejected completion
#
# JSONL formats, one pair per line:
#     {"prompt": P, "chosen": C, "rejected": R}   P: a string (one user turn) or a list of messages;
#                                                  C, R: strings, or [{"role": "assistant", "content": ...}]
#     {"chosen": [messages], "rejected": [messages]}   implicit prompt: whole conversations, the same up
#                                                      to their last turn, which is the assistant's reply
#     {"chosen": "\n\nHuman: ...\n\nAssistant: ...", "rejected": "..."}   Anthropic HH: whole transcripts
#                                                      as strings, read as the implicit prompt's messages
# The prompt is rendered with the chat template up to its final <|assistant|> (as SFT's prompts are);
# a completion is the reply's content and the <|end|> that closes it (the EOS token).

PREFERENCES_DIR = os.path.join('data', 'number_preferences')
HH_TURN = re.compile(r'(?:^|\n\n)(Human|Assistant):')  # where an Anthropic HH transcript's turns begin


def hh_transcript(text, key):
    """An Anthropic HH transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") as user/assistant messages,
    each content stripped of the blanks around it; ValueError if text is not one."""
    parts = HH_TURN.split(text)  # text before the first turn, then (role, content) pairs
    if parts[0].strip() or len(parts) == 1:
        raise ValueError(f'"{key}" is a string with no "prompt" beside it, so it must be a whole Anthropic HH '
                         f'transcript "\\n\\nHuman: ...\\n\\nAssistant: ..." (or give a "prompt" key and "{key}" as '
                         f'the reply alone); got {json.dumps(text)[:80]}')
    return [{'role': 'user' if role == 'Human' else 'assistant', 'content': content.strip()}
            for role, content in zip(parts[1::2], parts[2::2])]


def preference_pair(record):
    """(prompt messages, chosen text, rejected text) of a JSONL record; ValueError if malformed.
    Without "prompt", chosen and rejected are whole conversations (message lists, or Anthropic HH
    transcripts as strings) that must be the same up to their last turn: the prompt is the turns
    before it, the completions the last turn of each."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if 'chosen' not in record or 'rejected' not in record:
        raise ValueError(f'a preference pair needs "chosen" and "rejected" (and usually "prompt"); got keys '
                         f'{sorted(record)}')
    chosen, rejected = record['chosen'], record['rejected']
    if 'prompt' in record:
        prompt = record['prompt']
        if not isinstance(prompt, (str, list)):
            raise ValueError(f'"prompt" must be a string or a list of {{"role": ..., "content": ...}} messages, '
                             f'got {json.dumps(prompt)[:80]}')
        prompt = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else message_list(prompt, 'prompt')
    else:  # implicit prompt: the turns before the last, which chosen and rejected must share
        conversations = []
        for key, value in (('chosen', chosen), ('rejected', rejected)):
            if not isinstance(value, (str, list)):
                raise ValueError(f'"{key}" with no "prompt" beside it must be a whole conversation: an Anthropic HH '
                                 f'transcript string "\\n\\nHuman: ...\\n\\nAssistant: ..." or a list of '
                                 f'{{"role": ..., "content": ...}} messages; got {json.dumps(value)[:80]}')
            conversations.append(hh_transcript(value, key) if isinstance(value, str) else message_list(value, key))
        chosen, rejected = conversations
        same = ('with no "prompt", "chosen" and "rejected" must be the same conversation up to their last turn, '
                'the assistant\'s reply; but')
        if len(chosen) != len(rejected) or not chosen:
            raise ValueError(f'{same} chosen has {len(chosen)} turns and rejected {len(rejected)}')
        if chosen[-1]['role'] != 'assistant' or rejected[-1]['role'] != 'assistant':
            raise ValueError(f'{same} the last turn is a {chosen[-1]["role"]} turn in chosen, a '
                             f'{rejected[-1]["role"]} turn in rejected')
        shared = 0
        while shared < len(chosen) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if shared < len(chosen) - 1:
            raise ValueError(f'{same} they differ at turn {shared + 1} of {len(chosen)} (chosen: '
                             f'{json.dumps(chosen[shared]["content"])[:40]}, rejected: '
                             f'{json.dumps(rejected[shared]["content"])[:40]})')
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if prompt and prompt[-1]['role'] == 'assistant':
        raise ValueError("the prompt ends with an assistant turn; chosen and rejected are the assistant's reply "
                         "to the prompt's last user turn")

    def reply(value, key):
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f'"{key}" must be the reply as a string (the usual form) or as [{{"role": "assistant", '
                             f'"content": ...}}]; got {json.dumps(value)[:80]}')
        messages = message_list(value, key)
        if len(messages) != 1 or messages[0]['role'] != 'assistant':
            raise ValueError(f'"{key}" must be one assistant reply: a string or [{{"role": "assistant", '
                             f'"content": ...}}], got {len(messages)} message(s) after the prompt')
        return messages[0]['content']
    return prompt, reply(chosen, 'chosen'), reply(rejected, 'rejected')


def encode_pair(tokenizer, prompt, chosen, rejected):
    """Token ids (prompt, chosen completion, rejected completion). Each completion is tokenized
    together with its prompt and split at the prompt's length, after checking that the prompt's
    tokens are unchanged by what follows them."""
    prompt_ids = tokenizer.encode_prompt(prompt)
    completions = []
    for reply in (chosen, rejected):
        ids = tokenizer.encode_chat(prompt + [{'role': 'assistant', 'content': reply}])[0]
        if ids[:len(prompt_ids)] != prompt_ids:
            raise ValueError("the prompt's tokens change when a completion follows it; the chat template must "
                             "end the prompt on a special token")
        completions.append(ids[len(prompt_ids):])
    return prompt_ids, *completions


def load_preference_split(path, tokenizer, max_length, max_prompt_length, skip_malformed=False):
    """Read and tokenize one JSONL split of preference pairs: returns (references, pairs).
    references: (full prompt ids, chosen text) per pair, for exact-match evaluation. pairs: (prompt,
    chosen, rejected) token ids fitted to max_length: the prompt keeps its last max_prompt_length
    tokens, each completion its first max_length - len(prompt); a pair with a completion left empty, or
    with chosen == rejected (as given, or once cut), is dropped. A malformed line is an error naming
    path:line, or with skip_malformed skipped and counted."""
    if not os.path.isfile(path):
        raise UserError(f"preference data file {path} does not exist. Point dpo_data at a folder holding "
                        f"train.jsonl and val.jsonl (test.jsonl optional), or leave it '' for the embedded pairs.")
    references, pairs, prompts_cut, completions_cut, dropped, identical = [], [], 0, 0, 0, 0

    def parse(record):
        prompt, chosen, rejected = preference_pair(record)
        return chosen, *encode_pair(tokenizer, prompt, chosen, rejected)
    parsed, skipped = read_jsonl(path, parse, skip_malformed)
    for chosen, prompt_ids, chosen_ids, rejected_ids in parsed:
        references.append((prompt_ids, chosen))
        if len(prompt_ids) > max_prompt_length:
            prompt_ids, prompts_cut = prompt_ids[-max_prompt_length:], prompts_cut + 1
        room = max_length - len(prompt_ids)
        if room < 1:
            dropped += 1
            continue
        if max(len(chosen_ids), len(rejected_ids)) > room:
            chosen_ids, rejected_ids, completions_cut = chosen_ids[:room], rejected_ids[:room], completions_cut + 1
        if chosen_ids == rejected_ids:  # no preference to learn (identical, or alike up to where they were cut)
            identical += 1
            continue
        pairs.append((prompt_ids, chosen_ids, rejected_ids))
    print(f"{path}: {len(pairs):,} pairs ({prompts_cut} prompts cut to max_prompt_length={max_prompt_length}, "
          f"{completions_cut} completions cut and {dropped} pairs dropped at max_length={max_length}, "
          f"{identical} pairs dropped with chosen == rejected, {skipped} malformed lines skipped)")
    if not pairs:
        raise UserError(f"{path} holds no usable preference pairs ({skipped} malformed lines skipped, {dropped} "
                        f"dropped because max_prompt_length={max_prompt_length} leaves no room in max_length="
                        f"{max_length}, {identical} with chosen == rejected). Each line must be one JSON pair, e.g. "
                        f"{{\"prompt\": \"What is 2+2?\", \"chosen\": \"4\", \"rejected\": \"5\"}}; raise "
                        f"max_length or lower max_prompt_length.")
    return references, pairs


class PreferenceBatches:
    """Batches of preference pairs for DPO. Like SFTBatches, every rank draws the pair indices of the
    whole global batch (same seed, same draws, a new shuffle each epoch) and takes its own slice.
    get() serves chosen and rejected completions in one batch, so one forward pass scores both."""

    def __init__(self, pairs, seed, pad_id, max_length, pack=False):
        self.pairs = pairs
        self.inputs, self.targets = [], []  # padded layout: chosen sequences of all pairs, then rejected ones
        for completion in (1, 2):
            for pair in pairs:
                prompt, reply = pair[0], pair[completion]
                self.inputs.append(torch.tensor((prompt + reply)[:-1]))  # position t predicts token t + 1
                self.targets.append(torch.tensor(([-100] * len(prompt) + reply)[1:]))
        self.n_pairs = len(pairs)
        self.completion_tokens = torch.tensor([[len(c), len(r)] for _, c, r in pairs])  # (pairs, 2)
        self.lengths = torch.tensor([len(x) for x in self.inputs]).view(2, -1).sum(0)  # input tokens per pair
        self.pad_id, self.max_length, self.pack = pad_id, max_length, pack
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(self.n_pairs, generator=self.generator)
        self.position = 0
        self.batches_drawn = 0

    def sample(self, n):
        """Pair indices of the next global batch of n pairs, in shuffled order; a new shuffle each epoch."""
        taken = []
        while n:
            if self.position == self.n_pairs:
                self.order, self.position = torch.randperm(self.n_pairs, generator=self.generator), 0
            taken.append(self.order[self.position:self.position + n])
            self.position += len(taken[-1])
            n -= len(taken[-1])
        self.batches_drawn += 1
        return torch.cat(taken)

    def count_tokens(self, indices):
        return int(self.lengths[indices].sum())

    def get(self, indices, device='cpu'):
        """The n pairs at indices as a dict of tensors: x (B, T) tokens; positions (B, T) and mask
        (B, 1, T, T) (None when padded: plain causal attention); rows, cols (N,) the positions whose
        logits are scored, targets (N,) the completion tokens they predict, and owners (N,) the
        sequence each belongs to: the k-th pair's chosen completion is k, its rejected one n + k.
        Padded: the chosen sequences, then the rejected ones, one per row, right-padded.
        Packed (pack=True, padding-free): each pair is laid out once as prompt, chosen, rejected. Both
        completions attend to the prompt and to themselves only and continue its positions, and the
        prompt's last position scores the first token of both, so the prompt is computed once and
        every completion token sees exactly what it would see in its own row. Pairs fill rows of up
        to 2 * max_length tokens, first fit."""
        if not self.pack:
            sequences = indices.tolist() + [i + self.n_pairs for i in indices.tolist()]
            x, y, _, seq = build_rows([[s] for s in range(len(sequences))], [self.inputs[s] for s in sequences],
                                      [self.targets[s] for s in sequences], self.pad_id, device)
            rows, cols = (y != -100).nonzero(as_tuple=True)
            return dict(x=x, positions=None, mask=None, rows=rows, cols=cols, targets=y[rows, cols],
                        owners=seq[rows, cols])
        n, units = len(indices), []
        for k, i in enumerate(indices.tolist()):
            prompt, chosen, rejected = self.pairs[i]
            p, c = len(prompt), len(chosen) - 1  # a completion's last token is only a target
            tokens = prompt + chosen[:-1] + rejected[:-1]
            positions = list(range(p)) + list(range(p, p + c)) + list(range(p, p + len(rejected) - 1))
            branch = [0] * p + [1] * c + [2] * (len(rejected) - 1)
            scored = [(p - 1 + t, target, k) for t, target in enumerate(chosen)]
            scored += [(p - 1, rejected[0], n + k)]
            scored += [(p + c + t, target, n + k) for t, target in enumerate(rejected[1:])]
            units.append((tokens, positions, branch, scored))
        packed = pack_rows(range(n), [len(u[0]) for u in units], 2 * self.max_length)
        T = max(sum(len(units[u][0]) for u in row) for row in packed)
        x = torch.full((len(packed), T), self.pad_id)
        positions, branch = (torch.zeros(len(packed), T, dtype=torch.long) for _ in range(2))
        unit = torch.full((len(packed), T), -1)  # which pair a position holds; -1 on padding
        scored = []
        for r, row in enumerate(packed):
            t = 0
            for u in row:
                tokens, pos, br, score = units[u]
                x[r, t:t + len(tokens)] = torch.tensor(tokens)
                positions[r, t:t + len(tokens)], branch[r, t:t + len(tokens)] = torch.tensor(pos), torch.tensor(br)
                unit[r, t:t + len(tokens)] = u
                scored += [(r, t + offset, target, owner) for offset, target, owner in score]
                t += len(tokens)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        same_branch = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
        mask = ((unit[:, :, None] == unit[:, None, :]) & causal & same_branch)[:, None]
        rows, cols, targets, owners = torch.tensor(scored).T
        tensors = dict(x=x, positions=positions, mask=mask, rows=rows, cols=cols, targets=targets, owners=owners)
        return dict(zip(tensors, to_device(tensors.values(), device)))

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'order': self.order, 'position': self.position,
                'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        if len(state['order']) != self.n_pairs:
            raise UserError(f"the checkpoint's sampler drew from {len(state['order'])} training pairs, the data now "
                            f"has {self.n_pairs}: the training data changed. Restore it, or start a new run.")
        self.generator.set_state(state['generator'])
        self.order, self.position, self.batches_drawn = state['order'], state['position'], state['batches_drawn']


# -----------------------------------------------------------------------------

def main(argv=None):
    install_excepthook()
    parser = argparse.ArgumentParser(
        description="Tokenize a corpus into OUT_DIR/{train,val}.bin + meta.json. Without --input, "
                    "prepares the default corpus (Python stdlib sources, BPE) in data/stdlib.",
        allow_abbrev=False)
    parser.add_argument('--input', help="text file, folder of text files (recursive, sorted) or http(s) URL")
    parser.add_argument('--out_dir', help=f"dataset folder to write (without --input: {DEFAULT_DATA_DIR})")
    parser.add_argument('--tokenizer', choices=['char', 'bpe'],
                        help="char: one token per character (the default); bpe: sentencepiece BPE "
                             "(the default corpus's)")
    parser.add_argument('--vocab_size', type=int, default=4096, help="bpe vocabulary size (default: 4096)")
    parser.add_argument('--val_fraction', type=float, default=0.1,
                        help="last fraction of the characters kept for validation (default: 0.1)")
    args = parser.parse_args(argv)
    if args.input is None:
        if args.tokenizer == 'char':
            parser.error("the default corpus uses --tokenizer=bpe; pass --input=... for another corpus")
        prepare_default(args.out_dir or DEFAULT_DATA_DIR, args.vocab_size)
    elif args.out_dir is None:
        parser.error("--out_dir is required with --input, e.g. --out_dir=data/mycorpus")
    else:
        prepare(args.input, args.out_dir, args.tokenizer or 'char', args.vocab_size, args.val_fraction)


if __name__ == '__main__':
    main()
