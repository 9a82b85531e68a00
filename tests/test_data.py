import functools
import hashlib
import http.server
import json
import os
import re
import threading

import numpy as np
import pytest
import torch

import data
from configurator import UserError
from lm.chat_data import read_jsonl
from lm.tokenizer import load_tokenizer, read_meta

from conftest import script_definitions

# pretraining's batches live in train.py, as nanoGPT's get_batch does
TokenBatches, eval_offsets = script_definitions('train.py', 'TokenBatches', 'eval_offsets')

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. Ünïcödé ✓\n" * 13
CODE = ''.join(f"def f{i}(x):\n    return x * {i} + 1  # twice\n\n" for i in range(150))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding='utf-8')
    return path


def tokens(data_dir, split):
    meta = read_meta(data_dir)
    return np.fromfile(data_dir / f'{split}.bin', dtype=meta['dtype']).tolist()


def make_bin(tmp_path, n_tokens, vocab_size=1000):
    """A dataset whose token at position i is i % vocab_size, so windows are easy to check."""
    (tmp_path / 'meta.json').write_text(json.dumps({'dtype': 'uint16', 'vocab_size': vocab_size}))
    (np.arange(n_tokens) % vocab_size).astype(np.uint16).tofile(tmp_path / 'train.bin')
    return str(tmp_path / 'train.bin')


# -- preparation -------------------------------------------------------------------------------

def test_char_round_trip_and_vocab(tmp_path):
    out = tmp_path / 'ds'
    data.prepare(write(tmp_path / 'in.txt', TEXT), out, 'char')
    tok = load_tokenizer(out)
    assert tok.decode(tokens(out, 'train')) + tok.decode(tokens(out, 'val')) == TEXT
    assert tok.chars == sorted(set(TEXT)) and tok.vocab_size == len(set(TEXT)) and tok.eos_id is None
    assert tok.decode(tok.encode('Speak, ✓')) == 'Speak, ✓'
    meta = read_meta(out)
    assert meta['dtype'] == 'uint16' and meta['hash'] == tok.identity()['hash']
    assert tok.identity()['hash'] == hashlib.sha256(''.join(sorted(set(TEXT))).encode()).hexdigest()


@pytest.mark.parametrize('val_fraction', [0.1, 0.25])
def test_split_boundary_at_characters(tmp_path, val_fraction):
    text = TEXT[:1003]
    out = tmp_path / 'ds'
    data.prepare(write(tmp_path / 'in.txt', text), out, 'char', val_fraction=val_fraction)
    cut = int(len(text) * (1 - val_fraction))  # nanoGPT: data[:int(n*0.9)]
    assert len(tokens(out, 'train')) == cut == read_meta(out)['train_tokens']
    tok = load_tokenizer(out)
    assert tok.decode(tokens(out, 'train')) == text[:cut] and tok.decode(tokens(out, 'val')) == text[cut:]


def test_token_dtype():
    assert data.token_dtype(65) == np.uint16 and data.token_dtype(2**16) == np.uint16
    assert data.token_dtype(2**16 + 1) == np.uint32


def test_large_char_vocab_uses_uint32(tmp_path):
    text = ''.join(map(chr, range(0x10000, 0x10000 + 70_000)))  # 70k distinct characters
    out = tmp_path / 'ds'
    data.prepare(write(tmp_path / 'in.txt', text), out, 'char')
    assert read_meta(out)['dtype'] == 'uint32'
    assert max(tokens(out, 'val')) == 69_999
    assert load_tokenizer(out).decode(tokens(out, 'val')) == text[int(len(text) * 0.9):]


def test_bpe_round_trip(tmp_path):
    out = tmp_path / 'ds'
    data.prepare(write(tmp_path / 'code.py', CODE), out, 'bpe', vocab_size=300)
    tok = load_tokenizer(out)
    assert tok.vocab_size == 300 and read_meta(out)['vocab_size'] == 300
    cut = int(len(CODE) * 0.9)
    assert tok.decode(tokens(out, 'train')) == CODE[:cut] and tok.decode(tokens(out, 'val')) == CODE[cut:]
    assert len(tokens(out, 'train')) < cut  # merges happened
    unseen = "naïve ünïcode 世界 🙂\n\tx  =  1"  # byte fallback: anything encodes exactly
    assert tok.decode(tok.encode(unseen)) == unseen
    model = (out / 'tokenizer.model').read_bytes()
    assert tok.identity() == {'vocab_size': 300, 'hash': hashlib.sha256(model).hexdigest()}
    assert read_meta(out)['hash'] == tok.identity()['hash']


def test_bpe_is_deterministic(tmp_path):
    for name in ('a', 'b'):
        data.prepare(write(tmp_path / 'code.py', CODE), tmp_path / name, 'bpe', vocab_size=300)
    assert (tmp_path / 'a' / 'tokenizer.model').read_bytes() == (tmp_path / 'b' / 'tokenizer.model').read_bytes()


def test_folder_input(tmp_path):
    folder = tmp_path / 'corpus'
    write(folder / 'b' / 'two.txt', "second file\n" * 20)
    write(folder / 'a.txt', "first file\n" * 20)
    write(folder / '.hidden.txt', "not read\n")
    write(folder / 'empty.txt', "")
    (folder / 'blob.bin').write_bytes(b'\x00\x01\x02binary')
    (folder / 'latin1.txt').write_bytes('caf\xe9'.encode('latin-1'))
    out = tmp_path / 'char'
    data.prepare(folder, out, 'char')
    tok = load_tokenizer(out)
    expected = "first file\n" * 20 + "second file\n" * 20  # sorted by path: a.txt, b/two.txt
    assert tok.decode(tokens(out, 'train')) + tok.decode(tokens(out, 'val')) == expected
    assert read_meta(out)['documents'] == 2

    out = tmp_path / 'bpe'
    data.prepare(folder, out, 'bpe', vocab_size=270)
    tok = load_tokenizer(out)
    assert tok.decode(tokens(out, 'train')) == expected[:int(len(expected) * 0.9)]
    ids = tokens(out, 'train') + tokens(out, 'val')
    assert ids.count(tok.eos_id) == 1  # a document separator between the two files
    sep = ids.index(tok.eos_id)
    assert tok.decode(ids[:sep]) == "first file\n" * 20 and tok.decode(ids[sep + 1:]) == "second file\n" * 20


def test_jsonl_input_is_a_text_document_a_line(tmp_path):
    """A .jsonl corpus (Hugging Face datasets' export, TRL's language-modeling rows): each line's "text" is a
    document, not the JSON; in a folder too; a line without "text" names the file and line."""
    rows = [{'text': 'first "doc"\nwith lines', 'id': 1}, {'text': 'second doc'}]
    corpus = write(tmp_path / 'corpus.jsonl', ''.join(json.dumps(r) + '\n' for r in rows) + '\n')
    assert data.read_documents(str(corpus)) == ['first "doc"\nwith lines', 'second doc']
    write(tmp_path / 'bom.jsonl', '\ufeff' + corpus.read_text())
    assert data.read_documents(str(tmp_path / 'bom.jsonl')) == ['first "doc"\nwith lines', 'second doc']
    write(tmp_path / 'folder' / 'a.jsonl', corpus.read_text())
    write(tmp_path / 'folder' / 'b.txt', 'third')
    assert data.read_documents(str(tmp_path / 'folder')) == ['first "doc"\nwith lines', 'second doc', 'third']
    out = tmp_path / 'ds'
    data.prepare(corpus, out, 'char')
    assert read_meta(out)['documents'] == 2 and '{' not in load_tokenizer(out).chars
    # U+2028, U+0085 in a string are text, not line ends (str.splitlines cut there); CRLF lines are lines
    odd = [{'text': 'one\u2028two\u0085three'}, {'text': 'four'}]
    write(tmp_path / 'odd.jsonl', ''.join(json.dumps(r, ensure_ascii=False) + '\r\n' for r in odd))
    assert data.read_documents(str(tmp_path / 'odd.jsonl')) == ['one\u2028two\u0085three', 'four']
    for bad in ('{"content": "x"}', '["text"]', '{"text": ', '{"text": 5}'):
        write(tmp_path / 'bad.jsonl', json.dumps({'text': 'ok'}) + '\n' + bad + '\n')
        with pytest.raises(UserError, match=re.escape('bad.jsonl:2 is not a JSON object with a "text" string')):
            data.read_documents(str(tmp_path / 'bad.jsonl'))


def test_url_input(tmp_path):
    write(tmp_path / 'site' / 'book.txt', TEXT)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / 'site'))
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f'http://127.0.0.1:{server.server_port}'
        data.prepare(f'{url}/book.txt', tmp_path / 'ds', 'char')
        tok = load_tokenizer(tmp_path / 'ds')
        assert tok.decode(tokens(tmp_path / 'ds', 'train')) + tok.decode(tokens(tmp_path / 'ds', 'val')) == TEXT
        with pytest.raises(UserError, match='could not download .*missing.txt.*404'):
            data.prepare(f'{url}/missing.txt', tmp_path / 'ds2', 'char')
    finally:
        server.shutdown()
        server.server_close()


def test_prepare_default_is_cached(tmp_path, monkeypatch):
    docs = [CODE, TEXT]
    monkeypatch.setattr(data, 'stdlib_documents', lambda: docs)
    out = tmp_path / 'stdlib'
    data.prepare_default(out, vocab_size=320)
    assert read_meta(out)['documents'] == 2 and read_meta(out)['tokenizer'] == 'bpe'
    monkeypatch.setattr(data, 'write_dataset', lambda *a: pytest.fail('cache not reused'))
    data.prepare_default(out, vocab_size=320)
    docs.append("a changed standard library\n")
    with pytest.raises(pytest.fail.Exception):
        data.prepare_default(out, vocab_size=320)


def test_stdlib_documents_skip_test_folders(monkeypatch, tmp_path):
    root = tmp_path / 'lib'
    for path in ('os.py', 'json/decoder.py', 'test/test_os.py', 'idlelib/idle_test/t.py',
                 'lib2to3/tests/data.py', 'site-packages/pkg.py', 'json/README.txt'):
        write(root / path, path)
    monkeypatch.setattr(data.sysconfig, 'get_paths', lambda: {'stdlib': str(root)})
    assert data.stdlib_documents() == ['json/decoder.py', 'os.py']


def test_cli(tmp_path, capsys):
    data.main([f'--input={write(tmp_path / "in.txt", TEXT)}', f'--out_dir={tmp_path / "ds"}', '--tokenizer=char'])
    assert read_meta(tmp_path / 'ds')['train_tokens'] == int(len(TEXT) * 0.9)
    with pytest.raises(SystemExit) as e:
        data.main([f'--input={tmp_path / "in.txt"}'])
    assert e.value.code == 2 and '--out_dir is required' in capsys.readouterr().err


# -- errors ------------------------------------------------------------------------------------

def test_folder_names_the_files_that_are_not_utf8(tmp_path, capsys):
    folder = tmp_path / 'corpus'
    write(folder / 'a.txt', "first file\n" * 20)
    write(folder / 'empty.txt', "")  # empty: nothing to read, not worth a mention
    (folder / 'blob.bin').write_bytes(b'\x00\x01\x02binary')
    (folder / 'sub').mkdir()
    for i in range(6):
        (folder / 'sub' / f'latin1_{i}.txt').write_bytes('caf\xe9'.encode('latin-1'))
    data.prepare(folder, tmp_path / 'ds', 'char')
    assert read_meta(tmp_path / 'ds')['documents'] == 1
    skipped_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith('skipped')]
    assert skipped_line == [f"skipped 7 of 9 files in {folder} that are not UTF-8 text (binary or another encoding; "
                            f"convert text files with iconv): blob.bin, {os.path.join('sub', 'latin1_0.txt')}, "
                            f"{os.path.join('sub', 'latin1_1.txt')}, {os.path.join('sub', 'latin1_2.txt')}, "
                            f"{os.path.join('sub', 'latin1_3.txt')} and 2 more"]
    only_latin1 = tmp_path / 'only_latin1'
    only_latin1.mkdir()
    (only_latin1 / 'x.txt').write_bytes('caf\xe9'.encode('latin-1'))
    with pytest.raises(UserError, match='holds no text'):
        data.prepare(only_latin1, tmp_path / 'ds2')
    assert 'skipped 1 of 1 files' in capsys.readouterr().out


def test_missing_input(tmp_path):
    with pytest.raises(UserError, match='no_such.txt.*does not exist'):
        data.prepare(tmp_path / 'no_such.txt', tmp_path / 'ds')


def test_a_dataset_is_replaced_only_by_one_with_its_tokenizer(tmp_path, monkeypatch):
    """A missing input leaves no folder behind; the same corpus prepared again replaces its dataset, another
    corpus (or the default corpus of another standard library) over it is refused with nothing written: every
    model trained on a dataset reads text through its tokenizer, found in its folder. A corrupt meta.json is
    prepared over, as its message advises; another program's is not."""
    with pytest.raises(UserError, match='does not exist'):
        data.prepare(tmp_path / 'no_such.txt', tmp_path / 'new' / 'ds')
    assert not (tmp_path / 'new').exists()
    ds = data.prepare(write(tmp_path / 'in.txt', TEXT), tmp_path / 'ds', 'char')
    data.prepare(tmp_path / 'in.txt', ds, 'char')
    before = {f: (tmp_path / 'ds' / f).read_bytes() for f in os.listdir(ds)}
    with pytest.raises(UserError, match=r"holds a dataset prepared from .*in.txt \(char tokenizer, \d+ tokens\); "
                                        r"preparing it from .*other.txt would replace its tokenizer"):
        data.prepare(write(tmp_path / 'other.txt', 'zzz'), ds, 'char')
    assert {f: (tmp_path / 'ds' / f).read_bytes() for f in os.listdir(ds)} == before
    (tmp_path / 'ds' / 'meta.json').write_text('{"tokenizer": ')
    data.prepare(tmp_path / 'other.txt', ds, 'char')
    (tmp_path / 'ds' / 'meta.json').write_text('{"name": "not a dataset"}')
    with pytest.raises(UserError, match="not a data.py dataset's"):
        data.prepare(tmp_path / 'other.txt', ds, 'char')
    monkeypatch.setattr(data, 'stdlib_documents', lambda: [CODE])
    data.prepare_default(tmp_path / 'stdlib', vocab_size=300)
    monkeypatch.setattr(data, 'stdlib_documents', lambda: [CODE, CODE.upper()])
    with pytest.raises(UserError, match="from this Python's standard library would replace its tokenizer"):
        data.prepare_default(tmp_path / 'stdlib', vocab_size=300)
    # the default corpus where it cannot be written: data.py's flag is --out_dir, train.py has none for it
    with pytest.raises(UserError, match=r"cannot be created or written .*Point --out_dir at a folder"):
        data.main([f'--out_dir={tmp_path / "in.txt" / "ds"}', '--vocab_size=300'])
    with pytest.raises(UserError, match=r"`python data.py --out_dir=DIR`, and pass --data_dir=DIR"):
        data.prepare_default(tmp_path / 'in.txt' / 'ds', 300, key='')


def test_empty_corpus(tmp_path):
    with pytest.raises(UserError, match='holds no text'):
        data.prepare(write(tmp_path / 'empty.txt', ''), tmp_path / 'ds')
    (tmp_path / 'empty_folder').mkdir()
    with pytest.raises(UserError, match='holds no text'):
        data.prepare(tmp_path / 'empty_folder', tmp_path / 'ds')


def test_not_utf8(tmp_path):
    """A file in another encoding: refused with a conversion whose result is what to pass (iconv's output goes to
    stdout: the advice redirects it), which then prepares."""
    (tmp_path / 'latin1.txt').write_bytes('caf\xe9 au lait\n'.encode('latin-1') * 50)
    with pytest.raises(UserError, match='latin1.txt is not UTF-8') as e:
        data.prepare(tmp_path / 'latin1.txt', tmp_path / 'ds', 'char')
    converted = re.search(r'> (\S+)` then --input=(\S+);', str(e.value))
    assert converted and converted[1] == converted[2] == str(tmp_path / 'latin1.utf8.txt')
    with open(converted[1], 'w', encoding='utf-8') as f:  # what iconv -f latin1 -t utf-8 writes
        f.write((tmp_path / 'latin1.txt').read_bytes().decode('latin-1'))
    data.prepare(converted[2], tmp_path / 'ds', 'char')
    assert 'é' in load_tokenizer(tmp_path / 'ds').decode(load_tokenizer(tmp_path / 'ds').encode('café'))


def test_char_encode_unknown_character(tmp_path):
    data.prepare(write(tmp_path / 'in.txt', TEXT), tmp_path / 'ds', 'char')
    with pytest.raises(UserError, match="'#@' are not in this character vocabulary"):
        load_tokenizer(tmp_path / 'ds').encode('Speak @ #')


def test_bpe_vocab_too_big(tmp_path):
    with pytest.raises(UserError, match='4096-token BPE.*vocab_size'):
        data.prepare(write(tmp_path / 'in.txt', CODE), tmp_path / 'ds', 'bpe', vocab_size=4096)


def test_a_corpus_of_only_long_lines_is_told_to_break_them(tmp_path):
    """sentencepiece skips lines over 4,192 bytes: a corpus of such lines alone left nothing to train a BPE on, and
    the old advice (another vocab_size) could not help; its lines folded, the same text prepares."""
    long_text = ('lorem ipsum dolor sit amet, ' * 400 + '\n') * 3
    with pytest.raises(UserError, match='every line of the corpus is over 4,192 bytes.*fold -s -w 1000'):
        data.prepare(write(tmp_path / 'in.txt', long_text), tmp_path / 'ds', 'bpe', vocab_size=300)
    folded = '\n'.join(line[k:k + 1000] for line in long_text.split('\n') for k in range(0, len(line), 1000))
    data.prepare(write(tmp_path / 'folded.txt', folded), tmp_path / 'ds', 'bpe', vocab_size=300)


def test_failed_prepare_keeps_the_dataset_and_missing_files_are_named(tmp_path):
    """A tokenizer that cannot be trained leaves an existing dataset in out_dir whole; an incomplete or corrupt
    dataset folder is a UserError naming the file."""
    ds = data.prepare(write(tmp_path / 'in.txt', CODE), tmp_path / 'ds', 'bpe', vocab_size=300)
    before = {f: (tmp_path / 'ds' / f).read_bytes() for f in os.listdir(ds)}
    with pytest.raises(UserError, match='vocab_size'):
        data.prepare(str(tmp_path / 'in.txt'), tmp_path / 'ds', 'bpe', vocab_size=4096)
    assert {f: (tmp_path / 'ds' / f).read_bytes() for f in os.listdir(ds)} == before
    os.remove(tmp_path / 'ds' / 'tokenizer.model')
    with pytest.raises(UserError, match='tokenizer.model is missing'):
        load_tokenizer(ds)
    os.remove(tmp_path / 'ds' / 'train.bin')
    with pytest.raises(UserError, match='train.bin is missing'):
        TokenBatches(os.path.join(ds, 'train.bin'), 8, seed=0, vocab_size=300)
    for corrupt in ('{"tokenizer": ', '{"x": ' + '[' * 100_000 + ']' * 100_000 + '}'):  # cut short; nested deep
        (tmp_path / 'ds' / 'meta.json').write_text(corrupt)
        with pytest.raises(UserError, match='meta.json is corrupt'):
            load_tokenizer(ds)
    with pytest.raises(UserError, match='cannot be created or written'):
        data.prepare(str(tmp_path / 'in.txt'), tmp_path / 'in.txt' / 'ds', 'char')


def test_jsonl_may_start_with_a_bom(tmp_path):
    (tmp_path / 'a.jsonl').write_bytes(b'\xef\xbb\xbf{"x": 1}\n{"x": 2}\n')
    assert read_jsonl(str(tmp_path / 'a.jsonl'), lambda r: r['x'], False) == ([1, 2], 0)


def test_unprepared_data_dir_says_how_to_prepare(tmp_path):
    with pytest.raises(UserError, match=r'no meta.json.*python data.py --input=.* --out_dir=.*raw'):
        load_tokenizer(tmp_path / 'raw')
    (tmp_path / 'raw').mkdir()
    (tmp_path / 'raw' / 'train.bin').write_bytes(b'\0' * 100)
    with pytest.raises(UserError, match='no meta.json'):
        TokenBatches(str(tmp_path / 'raw' / 'train.bin'), 8, seed=0, vocab_size=1000)


def test_a_cut_or_corrupt_bin_is_named(tmp_path):
    """A token file cut mid-token, or holding an id beyond the tokenizer's (an embedding lookup's IndexError, on a
    GPU a device assert): a UserError naming the file and what to do."""
    path = make_bin(tmp_path, 5000)
    with open(path, 'ab') as f:
        f.write(b'\0')
    with pytest.raises(UserError, match=r'train.bin is cut short: 10,001 bytes are not whole uint16 tokens'):
        TokenBatches(path, 16, seed=0, vocab_size=1000)
    batches = TokenBatches(make_bin(tmp_path, 5000), 16, seed=0, vocab_size=999)  # holds ids 0..999
    batches.get(torch.tensor([0, 900]))  # windows of ids up to 916
    with pytest.raises(UserError, match=r"train.bin holds token id 999 \(in the window at token 1,990\), beyond the "
                                        r"tokenizer's 999 ids"):
        batches.get(torch.tensor([0, 1990]))


def test_bin_smaller_than_block(tmp_path):
    path = make_bin(tmp_path, 16)
    TokenBatches(path, 15, seed=0, vocab_size=1000)  # 16 tokens: one window of 15 plus its target
    with pytest.raises(UserError, match='train.bin has 16 tokens, fewer than block_size \\+ 1 = 17'):
        TokenBatches(path, 16, seed=0, vocab_size=1000)
    with pytest.raises(UserError, match='fewer than block_size'):
        eval_offsets(16, 16, 4)


# -- batches -----------------------------------------------------------------------------------

def test_x_y_shift_by_one(tmp_path):
    batches = TokenBatches(make_bin(tmp_path, 5000), 32, seed=0, vocab_size=1000)
    offsets = batches.sample_offsets(8)
    x, y = batches.get(offsets)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 32)
    for row, off in zip(x.tolist(), offsets.tolist()):
        assert row == [i % 1000 for i in range(off, off + 32)]
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], (offsets + 32) % 1000)


def test_offsets_cover_the_file_and_stay_in_range(tmp_path):
    batches = TokenBatches(make_bin(tmp_path, 40), 8, seed=0, vocab_size=1000)
    offsets = batches.sample_offsets(2000)
    assert offsets.min() == 0 and offsets.max() == 40 - 8 - 1  # last window's target is the last token
    batches.get(offsets)


def test_batches_deterministic_and_resumable(tmp_path):
    path = make_bin(tmp_path, 5000)
    a, b = TokenBatches(path, 16, seed=7, vocab_size=1000), TokenBatches(path, 16, seed=7, vocab_size=1000)
    assert torch.equal(a.sample_offsets(4), b.sample_offsets(4))
    assert not torch.equal(a.sample_offsets(4), TokenBatches(path, 16, seed=8, vocab_size=1000).sample_offsets(4))
    torch.save(a.state_dict(), tmp_path / 'state.pt')
    expected = [a.get(a.sample_offsets(4)) for _ in range(3)]
    resumed = TokenBatches(path, 16, seed=0, vocab_size=1000)
    resumed.load_state_dict(torch.load(tmp_path / 'state.pt', weights_only=True))
    assert resumed.batches_drawn == 2
    for x, y in expected:
        rx, ry = resumed.get(resumed.sample_offsets(4))
        assert torch.equal(rx, x) and torch.equal(ry, y)


def test_rank_slices_match_single_process(tmp_path):
    path = make_bin(tmp_path, 5000)
    micro, accum, world = 2, 3, 2
    single = TokenBatches(path, 16, seed=3, vocab_size=1000)
    ranks = [TokenBatches(path, 16, seed=3, vocab_size=1000) for _ in range(world)]
    for step in range(2):
        # one process with grad_accum = world * accum
        global_offsets = single.sample_offsets(world * accum * micro)
        single_micro = [single.get(o)[0] for o in global_offsets.split(micro)]
        # each rank draws the same global offsets and takes its slice
        for rank, batches in enumerate(ranks):
            mine = batches.sample_offsets(world * accum * micro).tensor_split(world)[rank]
            for k, o in enumerate(mine.split(micro)):
                assert torch.equal(batches.get(o)[0], single_micro[rank * accum + k])


def test_eval_offsets_fixed_and_in_range():
    a = eval_offsets(100, 10, 500)
    assert torch.equal(a, eval_offsets(100, 10, 500)) and 0 <= a.min() and a.max() <= 100 - 10 - 1
    assert not torch.equal(a, eval_offsets(100, 10, 500, seed=1))


@pytest.mark.cuda
def test_cuda_batches_match_cpu(tmp_path):
    batches = TokenBatches(make_bin(tmp_path, 5000), 16, seed=0, vocab_size=1000)
    offsets = batches.sample_offsets(4)
    x, y = batches.get(offsets, 'cuda')
    assert x.is_cuda and torch.equal(x.cpu(), batches.get(offsets)[0]) and torch.equal(y.cpu(), batches.get(offsets)[1])
