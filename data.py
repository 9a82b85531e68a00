"""
Prepare a pretraining corpus once: tokenize it into the token files train.py reads random windows of
(train.py's TokenBatches; the tokenizers are in lm/tokenizer.py, fine-tuning's chat data in lm/chat_data.py).

    python data.py                  # default corpus: the Python standard library's own sources,
                                    # BPE tokenizer (4096 tokens), cached in data/stdlib
    python data.py --input=../shared/data/tinyshakespeare.txt --out_dir=data/shakespeare_char --tokenizer=char
    python data.py --input=https://example.com/book.txt --out_dir=data/book --tokenizer=bpe --vocab_size=2048
    python data.py --input=corpus.jsonl --out_dir=data/mine   # one {"text": ...} document a line

A prepared dataset folder holds train.bin and val.bin (token ids, uint16 when the vocabulary fits,
else uint32, read with np.memmap), meta.json (tokenizer kind, vocab size, dtype, token counts,
tokenizer hash) and, for bpe, tokenizer.model (sentencepiece).
"""

import argparse
import hashlib
import json
import os
import shlex
import sysconfig
import time
import urllib.request

import numpy as np

from configurator import UserError, install_excepthook, require_writable_folder
from lm.tokenizer import DEFAULT_DATA_DIR, BPETokenizer, CharTokenizer, read_meta, train_bpe

# folders of the standard library that are not library code (test suites, installed packages)
STDLIB_SKIP = {'test', 'tests', 'idle_test', 'site-packages', 'dist-packages', '__pycache__'}


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
        converted = shlex.quote(os.path.splitext(path)[0] + '.utf8.txt')
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {e.start}). If it is text in another encoding, "
                        f"convert it and pass the result, e.g. `iconv -f latin1 -t utf-8 {shlex.quote(str(path))} > "
                        f"{converted}` then --input={converted}; a binary file is no corpus.") from None


def jsonl_documents(path, text):
    """The documents of a .jsonl corpus: each line's "text" (the layout of Hugging Face datasets' to_json and
    TRL's language-modeling rows), one document a line; a line without it names the file and line."""
    docs = []
    # lines end at \n (\r\n too) only: U+2028 or U+0085 inside a string is text (str.splitlines would cut there)
    for line_no, line in enumerate(text.removeprefix('\ufeff').split('\n'), 1):  # a byte-order mark is allowed
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        if not (isinstance(row, dict) and isinstance(row.get('text'), str)):
            raise UserError(f"{path}:{line_no} is not a JSON object with a \"text\" string; each line of a .jsonl "
                            f"corpus must be {{\"text\": ...}}, one document. Fix the line, or rename the file to "
                            f".txt to read it whole as plain text.")
        docs.append(row['text'])
    return docs


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
        elif path.endswith('.jsonl'):
            texts += jsonl_documents(path, text)
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
    """The corpus as a list of documents (one per file; a .jsonl file's one per line, its "text"): a text
    file, a folder of text files, or a URL."""
    if input.startswith(('http://', 'https://')):
        docs = [download(input)]
    elif os.path.isfile(input):
        docs = jsonl_documents(input, read_text(input)) if input.endswith('.jsonl') else [read_text(input)]
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
# preparing a dataset folder

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
    # only now that the tokenizer stands is an existing dataset in out_dir replaced, if it has the same one
    check_replaceable(out_dir, tok, source)
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


def check_replaceable(out_dir, tok, source):
    """A UserError unless a dataset whose tokenizer is tok (prepared from source) may be written to out_dir: the
    folder holds no dataset (no meta.json), or one with the same tokenizer. The models trained on a dataset read
    and write text through its tokenizer, which they find in its folder (their data_dir): preparing another
    corpus or tokenizer over it would leave them unreadable, so that takes the user's own deleting."""
    path = os.path.join(out_dir, 'meta.json')
    if not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError, RecursionError):  # a corrupt dataset, which read_meta tells to prepare again
        return
    try:
        same = old['hash'] == tok.identity()['hash']
        what = f"{old.get('source') or 'another corpus'} ({old['tokenizer']} tokenizer, {old['vocab_size']} tokens)"
    except (KeyError, TypeError):
        raise UserError(f"{out_dir} holds a meta.json that is not a data.py dataset's, so nothing is written there. "
                        f"Prepare the corpus into another folder.") from None
    if same:
        return
    if source == old.get('source') or source.startswith('Python ') and old.get('source', '').startswith('Python '):
        change = "with other settings" if source == old.get('source') else "from this Python's standard library"
    else:
        change = f"from {source}"
    raise UserError(f"{out_dir} holds a dataset prepared from {what}; preparing it {change} would replace its "
                    f"tokenizer, and every model trained on that dataset reads and writes text through it (they find "
                    f"it in {out_dir}). Nothing was written. Prepare into another folder, or move {out_dir} aside "
                    f"first (a model trained on it then takes --data_dir=<its new place>) or delete it if no such "
                    f"model is kept.")


def prepare(input, out_dir, tokenizer='char', vocab_size=4096, val_fraction=0.1):
    """Tokenize a text file, a folder of text files or an http(s) URL into out_dir."""
    input = str(input)
    # before reading and tokenizing: a bad out_dir fails at once (and a folder made to check it is removed
    # again, so a run refused meanwhile leaves none behind; write_dataset makes it)
    require_writable_folder(out_dir, keep=False)
    return write_dataset(read_documents(input), out_dir, tokenizer, vocab_size, val_fraction, source=input)


def prepare_default(data_dir=DEFAULT_DATA_DIR, vocab_size=4096, key='data_dir'):
    """The default corpus (stdlib sources, BPE), prepared once; reused while the stdlib is unchanged. key: the
    flag that names data_dir, for messages (data.py's --out_dir; '' for a script that prepares it by default)."""
    docs = stdlib_documents()
    digest = hashlib.sha256('\0'.join(docs).encode()).hexdigest()
    source = f"Python {sysconfig.get_python_version()} standard library, {len(docs)} files, sha256 {digest}"
    if os.path.exists(os.path.join(data_dir, 'meta.json')):
        meta = read_meta(data_dir)
        if (meta.get('source'), meta.get('tokenizer'), meta.get('vocab_size')) == (source, 'bpe', vocab_size):
            return data_dir
    print(f"preparing the default corpus (the Python standard library's sources) in {data_dir}, once")
    require_writable_folder(data_dir, key or 'data_dir', fix=None if key else (
        "Prepare the default corpus in a folder you can write, `python data.py --out_dir=DIR`, and pass "
        "--data_dir=DIR."))
    return write_dataset(docs, data_dir, 'bpe', vocab_size, 0.1, source)


# -----------------------------------------------------------------------------

def main(argv=None):
    install_excepthook()
    parser = argparse.ArgumentParser(
        description="Tokenize a corpus into OUT_DIR/{train,val}.bin + meta.json. Without --input, "
                    "prepares the default corpus (Python stdlib sources, BPE) in data/stdlib.",
        allow_abbrev=False)
    parser.add_argument('--input', help="text file, folder of text files (recursive, sorted) or http(s) URL; "
                                        ".jsonl files: a {\"text\": ...} document a line")
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
        prepare_default(args.out_dir or DEFAULT_DATA_DIR, args.vocab_size, 'out_dir')
    elif args.out_dir is None:
        parser.error("--out_dir is required with --input, e.g. --out_dir=data/mycorpus")
    else:
        prepare(args.input, args.out_dir, args.tokenizer or 'char', args.vocab_size, args.val_fraction)


if __name__ == '__main__':
    main()
