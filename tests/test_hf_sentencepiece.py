"""Sentencepiece tokenizers as Hugging Face tokenizers: a published folder with only a tokenizer.model
(tests/fixtures/hf/sentencepiece, its expected.json written by transformers' AutoTokenizer) and the
tokenizer.json / tokenizer_config.json that tokenizer_json.write_tokenizer_files writes for nanotrain's own
tokenizers, read back by hf/tokenizer.py."""
import json
import os
import shutil

import pytest

from configurator import UserError
from fixtures.tokenizer_folders import base_model_folder
from hf.checkpoint import save_chat_tokenizer
from hf.tokenizer import load_hf_tokenizer
from hf.tokenizer_json import from_sentencepiece, write_tokenizer_files
from lm.tokenizer import BPETokenizer, CharTokenizer, ChatTokenizer, train_bpe

FOLDER = os.path.join(os.path.dirname(__file__), 'fixtures', 'hf', 'sentencepiece')
with open(os.path.join(FOLDER, 'expected.json'), encoding='utf-8') as f:
    EXPECTED = json.load(f)


def test_sentencepiece_folder_encodes_as_transformers():
    tokenizer = load_hf_tokenizer(FOLDER)
    assert tokenizer.vocab_size == EXPECTED['vocab_size']
    assert tokenizer.document_prefix == [1]  # add_bos_token: <s>
    for text, ids, with_specials, decoded, decoded_with_specials in zip(
            EXPECTED['texts'], EXPECTED['ids'], EXPECTED['ids_with_special_tokens'], EXPECTED['decoded'],
            EXPECTED['decoded_with_special_tokens']):
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.document_prefix + tokenizer.encode(text) == with_specials, text
        assert tokenizer.decode(ids) == decoded and tokenizer.decode(with_specials) == decoded_with_specials, text


@pytest.mark.parametrize('variant', sorted(EXPECTED['variants']))
def test_sentencepiece_settings_as_transformers(variant):
    """legacy and add_prefix_space of tokenizer_config.json change where the dummy-prefix space goes."""
    with open(os.path.join(FOLDER, 'tokenizer.model'), 'rb') as f:
        model_bytes = f.read()
    with open(os.path.join(FOLDER, 'tokenizer_config.json'), encoding='utf-8') as f:
        config = {**json.load(f), **EXPECTED['variants'][variant]['kwargs']}
    tokenizer = from_sentencepiece(model_bytes, config)
    for text, ids, decoded in zip(EXPECTED['texts'], EXPECTED['variants'][variant]['ids'],
                                  EXPECTED['variants'][variant]['decoded']):
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == decoded, text


@pytest.mark.parametrize('case', EXPECTED['chat'], ids=[c['case'] for c in EXPECTED['chat']])
def test_sentencepiece_chat_as_transformers(case):
    tokenizer = load_hf_tokenizer(FOLDER)
    if 'text' in case:
        assert tokenizer.render(case['messages'], case['add_generation_prompt']) == case['text']
    assert tokenizer.encode(tokenizer.render(case['messages'], case['add_generation_prompt'])) == case['ids']
    if case.get('assistant_mask') is not None:
        ids, labels = tokenizer.encode_chat(case['messages'])
        assert ids == case['ids']
        assert [int(label != -100) for label in labels] == case['assistant_mask']


def test_sentencepiece_identity_follows_the_settings(tmp_path):
    for name in ('tokenizer.model', 'special_tokens_map.json'):
        shutil.copy(os.path.join(FOLDER, name), tmp_path)
    with open(os.path.join(FOLDER, 'tokenizer_config.json'), encoding='utf-8') as f:
        config = json.load(f)
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({**config, 'legacy': True}))
    assert load_hf_tokenizer(str(tmp_path)).identity() != load_hf_tokenizer(FOLDER).identity()


def test_sentencepiece_folder_errors(tmp_path):
    shutil.copy(os.path.join(FOLDER, 'tokenizer.model'), tmp_path)
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'T5Tokenizer'}))
    with pytest.raises(UserError, match='T5Tokenizer'):
        load_hf_tokenizer(str(tmp_path))
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'LlamaTokenizer'}))
    (tmp_path / 'tokenizer.model').write_bytes(b'not a model')
    with pytest.raises(UserError, match='not a sentencepiece model'):
        load_hf_tokenizer(str(tmp_path))
    (tmp_path / 'tokenizer.model').unlink()
    with pytest.raises(UserError, match='tokenizer.json is missing, and so is a sentencepiece tokenizer.model'):
        load_hf_tokenizer(str(tmp_path))


# -----------------------------------------------------------------------------
# nanotrain's own tokenizers written as Hugging Face files

CORPUS = ("def add(a, b):\n    return a + b\n\n\nclass Point:\n\tx = 1\n\ty = 22\n\n"
          "Hello there, how are you? I am fine, thanks. 3.14159 and 2024-01-02, 5678.\n"
          "The quick brown fox jumps over the lazy dog.  Two  spaces.   Three.\n") * 4
HOSTILE = ["", " ", "   ", "Hello there", " Hello", "  two leading", "trailing  ", "a  b   c", "\n", "\n\n  x\n",
           "\tindent\ttabs\t", "def add(a, b):\n    return a + b\n", "1234567890 3.14", "x" * 30]
BPE_ONLY = ["naïve café — 東京 🙂", "</s>", "<unk>", "a</s>b", "<|end|>", "<|user|>hi", "\r\n", "\u2581x"]
MESSAGES = [
    [{'role': 'user', 'content': 'Hello there'}, {'role': 'assistant', 'content': 'I am fine, thanks.'}],
    [{'role': 'system', 'content': '  two leading'}, {'role': 'user', 'content': 'def add(a, b):\n'},
     {'role': 'assistant', 'content': '    return a + b\n'}, {'role': 'user', 'content': '3.14 '},
     {'role': 'assistant', 'content': ''}],
]


@pytest.fixture(scope='module')
def bpe():
    return BPETokenizer(train_bpe([CORPUS], vocab_size=360))


def written(tmp_path, tokenizer):
    generation = write_tokenizer_files(tokenizer, str(tmp_path))
    (tmp_path / 'generation_config.json').write_text(json.dumps(generation))
    return generation, load_hf_tokenizer(str(tmp_path))


@pytest.mark.parametrize('kind', ['char', 'bpe'])
def test_written_base_tokenizer_encodes_as_nanotrain(tmp_path, bpe, kind):
    tokenizer = bpe if kind == 'bpe' else CharTokenizer(sorted(set(CORPUS)))
    generation, hf = written(tmp_path, tokenizer)
    assert generation == ({'eos_token_id': 1} if kind == 'bpe' else {})
    assert hf.vocab_size == tokenizer.vocab_size and hf.document_prefix == []
    for text in HOSTILE + (BPE_ONLY if kind == 'bpe' else []):
        ids = tokenizer.encode(text)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids) == tokenizer.decode(ids), text
        assert hf.decode(ids) == text.replace('\u2581', ' '), text  # sentencepiece writes a space as '▁'
    if kind == 'char':  # a character outside the vocabulary is an error, as in nanotrain
        with pytest.raises(Exception, match='<unk>'):
            hf.encode('🙂')


@pytest.mark.parametrize('kind', ['char', 'bpe'])
def test_written_chat_tokenizer_encodes_as_nanotrain(tmp_path, bpe, kind):
    tokenizer = ChatTokenizer(bpe if kind == 'bpe' else CharTokenizer(sorted(set(CORPUS))))
    generation, hf = written(tmp_path, tokenizer)
    assert generation == {'eos_token_id': tokenizer.eos_id}
    assert hf.vocab_size == tokenizer.vocab_size and hf.eos_id == tokenizer.eos_id and hf.stop_ids == [tokenizer.eos_id]
    for messages in MESSAGES:
        assert hf.encode_chat(messages) == tokenizer.encode_chat(messages)
        assert hf.encode_prompt(messages[:-1]) == tokenizer.encode_prompt(messages[:-1])
        ids = tokenizer.encode_chat(messages)[0]
        assert hf.decode(ids) == tokenizer.decode(ids)
    for text in HOSTILE:
        assert hf.encode(text) == tokenizer.encode(text), text


def test_a_sentencepiece_base_model_exports_in_nanotrains_template(tmp_path):
    """A base model (no chat template) with only a tokenizer.model, fine-tuned in nanotrain's template: its
    exported tokenizer (the converted one plus the template's tokens) encodes as the ChatTokenizer it trained with."""
    base_folder, out = tmp_path / 'base', tmp_path / 'export'
    base_folder.mkdir()
    for name in ('tokenizer.model', 'special_tokens_map.json'):
        shutil.copy(os.path.join(FOLDER, name), base_folder)
    with open(os.path.join(FOLDER, 'tokenizer_config.json'), encoding='utf-8') as f:
        config = {k: v for k, v in json.load(f).items() if k != 'chat_template'}
    (base_folder / 'tokenizer_config.json').write_text(json.dumps(config))
    base = load_hf_tokenizer(str(base_folder))
    out.mkdir()
    save_chat_tokenizer(base, str(out), {})
    exported, chat = load_hf_tokenizer(str(out)), ChatTokenizer(base)
    turns = [{'role': 'user', 'content': ' What is  7+5?\n'}, {'role': 'assistant', 'content': '12 ünï'}]
    assert exported.encode_chat(turns) == chat.encode_chat(turns)
    assert exported.encode_prompt(turns[:1]) == chat.encode_prompt(turns[:1])


OLD_LLAMA = os.path.join(os.path.dirname(FOLDER), 'sentencepiece_json')  # tests/fixtures/make_export_fixtures.py
with open(os.path.join(OLD_LLAMA, 'expected.json'), encoding='utf-8') as f:
    OLD_LLAMA_EXPECTED = json.load(f)
with open(os.path.join(os.path.dirname(FOLDER), 'expected', 'exports.json'), encoding='utf-8') as f:
    EXPORTS = {export['base']: export for export in json.load(f)}


@pytest.mark.parametrize('variant', sorted(OLD_LLAMA_EXPECTED))
def test_an_older_llama_tokenizer_json_encodes_as_transformers_5_rebuilds_it(tmp_path, variant):
    """A Llama 2 / TinyLlama tokenizer.json with a Prepend('▁') normalizer: transformers 5's LlamaTokenizer drops
    it for a Metaspace by legacy (false: '[INST]' after <s> has no '▁'); a Mistral model's is read as is."""
    expected = OLD_LLAMA_EXPECTED[variant]
    for name in ('tokenizer.json', 'special_tokens_map.json'):
        shutil.copy(os.path.join(OLD_LLAMA, name), tmp_path)
    with open(os.path.join(OLD_LLAMA, 'tokenizer_config.json'), encoding='utf-8') as f:
        (tmp_path / 'tokenizer_config.json').write_text(json.dumps({**json.load(f), **expected['tokenizer_config']}))
    if expected['config_json'] is not None:
        (tmp_path / 'config.json').write_text(json.dumps(expected['config_json']))
    tokenizer = load_hf_tokenizer(str(tmp_path))
    for text, ids in zip(expected['texts'], expected['ids']):
        assert tokenizer.document_prefix + tokenizer.encode(text) == ids, text
    for case, chat in expected['chats'].items():
        assert tokenizer.encode(tokenizer.render(chat['messages'])) == chat['ids'], case


@pytest.mark.parametrize('base', ['sentencepiece', 'sentencepiece_json'])
def test_an_exported_chat_tokenizer_encodes_in_transformers_as_the_run_trained(tmp_path, base):
    """transformers' AutoTokenizer + apply_chat_template on save_chat_tokenizer's export of a sentencepiece base
    (its ids in exports.json) gives ChatTokenizer's ids: no message loses its leading '▁' (a LlamaTokenizer class
    in the export would rebuild the pre-tokenizer to prefix only the first)."""
    expected = EXPORTS[base]
    (tmp_path / 'base').mkdir()
    (tmp_path / 'export').mkdir()
    base_model_folder(tmp_path / 'base', os.path.join(os.path.dirname(FOLDER), base))
    tokenizer = load_hf_tokenizer(str(tmp_path / 'base'))
    save_chat_tokenizer(tokenizer, str(tmp_path / 'export'), {})
    with open(tmp_path / 'export' / 'tokenizer.json', encoding='utf-8') as f:
        spec = json.load(f)
    with open(tmp_path / 'export' / 'tokenizer_config.json', encoding='utf-8') as f:
        spec['tokenizer_config'] = json.load(f)
    for key in ('tokenizer_config', 'normalizer', 'pre_tokenizer', 'post_processor'):  # as transformers read them
        assert spec[key] == expected[key], f'{key} changed (if intended: re-run make_export_fixtures.py)'
    chat = ChatTokenizer(tokenizer)
    for case in expected['cases']:
        ids = chat.encode_prompt(case['messages']) if case['add_generation_prompt'] else \
            chat.encode_chat(case['messages'])[0]
        assert ids == case['ids'], case['case']
