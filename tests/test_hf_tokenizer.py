"""hf/tokenizer.py against transformers' own output (tests/fixtures/hf/expected/chat.json, written by
transformers' apply_chat_template for each fixture model folder), and its errors."""
import json
import os
import re
import shutil

import pytest

from configurator import UserError
from lm.chat_data import encode_pair
from conftest import HF_FIXTURES, hf_fixture, read_json_file
from hf.tokenizer import load_hf_tokenizer
from lm.tokenizer import ChatTokenizer, prompt_and_answer

CASES = read_json_file(os.path.join(HF_FIXTURES, 'expected', 'chat.json'))
CHAT_MODELS = sorted({case['model'] for case in CASES})
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def fixture_tokenizer(model):
    return load_hf_tokenizer(hf_fixture(model))


def folder_with_template(tmp_path, template, model='smollm2'):
    """A copy of a fixture's tokenizer.json with its own tokenizer_config.json and chat template."""
    shutil.copy(os.path.join(hf_fixture(model), 'tokenizer.json'), tmp_path)
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|im_end|>', 'chat_template': template}))
    return str(tmp_path)


@pytest.mark.parametrize('case', CASES, ids=[f"{c['model']}-{c['case']}" for c in CASES])
def test_matches_transformers(case):
    tokenizer = fixture_tokenizer(case['model'])
    messages = case['messages']
    if 'error' in case:  # the template itself refuses the conversation (raise_exception)
        with pytest.raises(UserError, match='must alternate'):
            tokenizer.encode_chat(messages)
        return
    assert tokenizer.render(messages, case['add_generation_prompt']) == case['text']
    if case['add_generation_prompt']:
        assert tokenizer.encode_prompt(messages) == case['ids']
        return
    if case['assistant_mask'] is None:  # the template breaks the prefix property: no mask can be derived
        with pytest.raises(UserError, match=case['model']):
            tokenizer.encode_chat(messages)
        assert tokenizer.encode(case['text']) == case['ids']
        return
    ids, labels = tokenizer.encode_chat(messages)
    assert ids == case['ids']
    assert [int(label != -100) for label in labels] == case['assistant_mask']
    assert all(label in (-100, i) for i, label in zip(ids, labels))
    bos = tokenizer.special_tokens.get('bos_token')
    if bos:  # the template writes BOS; tokenizer.json's post-processor must not add a second one
        assert ids.count(tokenizer.tokenizer.token_to_id(bos)) == case['text'].count(bos)


@pytest.mark.parametrize('model', CHAT_MODELS + ['gpt2'])
def test_round_trip(model):
    tokenizer = fixture_tokenizer(model)
    text = 'Hello, wörld!\n  indented\tcode() <|im_end|> 42 ✓'
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.identity() == fixture_tokenizer(model).identity()


def test_stop_ids_from_generation_config():
    llama = fixture_tokenizer('llama')
    with open(os.path.join(HF_FIXTURES, 'llama', 'generation_config.json')) as f:
        generation_eos = json.load(f)['eos_token_id']
    assert llama.stop_ids == generation_eos  # a list: each one stops generation
    assert llama.eos_id == llama.tokenizer.token_to_id('<|eot_id|>')  # the end of an assistant turn
    qwen = fixture_tokenizer('qwen2')
    assert qwen.eos_id == qwen.tokenizer.token_to_id('<|im_end|>') and len(qwen.stop_ids) == 2
    assert qwen.pad_id == qwen.tokenizer.token_to_id('<|endoftext|>')
    assert fixture_tokenizer('mistral').eos_id == fixture_tokenizer('mistral').tokenizer.token_to_id('</s>')


def test_prompt_and_answer_and_preference_pairs():
    tokenizer = fixture_tokenizer('llama')
    messages = [{'role': 'user', 'content': 'Capital of France?'}, {'role': 'assistant', 'content': 'Paris.'}]
    prompt, answer = prompt_and_answer(tokenizer, messages)
    assert answer == 'Paris.' and prompt == tokenizer.encode_prompt(messages[:1])
    prompt_ids, chosen, rejected = encode_pair(tokenizer, messages[:1], 'Paris.', 'Lyon.')
    assert prompt_ids == prompt and chosen[-1] == rejected[-1] == tokenizer.eos_id
    assert tokenizer.decode(chosen) == 'Paris.<|eot_id|>'


def test_template_variables_and_identity():
    default = fixture_tokenizer('llama')
    dated = load_hf_tokenizer(os.path.join(HF_FIXTURES, 'llama'), {'date_string': '01 Jan 2031'})
    assert 'Today Date: 01 Jan 2031' in dated.render([{'role': 'user', 'content': 'Hi'}])
    # the same tokens and template: the variables a run renders with are recorded in its checkpoint instead
    assert dated.identity() == default.identity()
    assert load_hf_tokenizer(os.path.join(HF_FIXTURES, 'llama'), {'date_string': '01 Jan 2031'}).identity() != \
        load_hf_tokenizer(os.path.join(HF_FIXTURES, 'qwen3')).identity()


def test_base_model_has_no_template_and_wraps_in_chat_tokenizer():
    base = fixture_tokenizer('gpt2')
    assert base.chat_template is None and base.eos_id == base.tokenizer.token_to_id('<|endoftext|>')
    with pytest.raises(UserError, match='no chat template'):
        base.encode_chat([{'role': 'user', 'content': 'Hi'}])
    chat = ChatTokenizer(base)
    ids, labels = chat.encode_chat([{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}])
    assert chat.vocab_size == base.vocab_size + 4 and ids[-1] == chat.eos_id == labels[-1]
    assert chat.decode(ids) == '<|user|>Hi<|end|><|assistant|>Hello<|end|>'


def test_generation_markers_give_the_mask(tmp_path):
    # a system message that only the last user turn shows breaks the prefix property; the markers still work
    template = ("{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'assistant' %}"
                "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
                "{{ '\\n' }}{% else %}{{ '<|im_start|>user\\n' }}{% if loop.last %}{{ messages[0]['content'] }} "
                "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}")
    tokenizer = load_hf_tokenizer(folder_with_template(tmp_path, template))
    ids, labels = tokenizer.encode_chat([{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'},
                                         {'role': 'assistant', 'content': 'Hello'}, {'role': 'user', 'content': 'Bye'},
                                         {'role': 'assistant', 'content': 'See you'}])
    assert tokenizer.decode([label for label in labels if label != -100]) == 'Hello<|im_end|>See you<|im_end|>'


def test_prefix_property_is_checked(tmp_path):
    # turns numbered from the end: the prompt renders differently once the reply follows it
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + loop.revindex|string + '\\n' + m['content'] "
                "+ '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    tokenizer = load_hf_tokenizer(folder_with_template(tmp_path, template))
    with pytest.raises(UserError, match=f'{tmp_path}.*not a prefix'):
        tokenizer.encode_chat([{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}])


def test_template_sources(tmp_path):
    folder = folder_with_template(tmp_path, [{'name': 'tool_use', 'template': 'tools'}, {'name': 'default', 'template': CHATML}])
    assert load_hf_tokenizer(folder).chat_template == CHATML
    (tmp_path / 'chat_template.jinja').write_text('{{ messages[0].content }}<|im_end|>')  # wins over tokenizer_config.json
    assert load_hf_tokenizer(folder).render([{'role': 'user', 'content': 'Hi'}]) == 'Hi<|im_end|>'
    folder_with_template(tmp_path, [{'name': 'tool_use', 'template': CHATML}])
    os.remove(tmp_path / 'chat_template.jinja')
    with pytest.raises(UserError, match='no "default"'):
        load_hf_tokenizer(folder)
    folder_with_template(tmp_path, None)  # a processor's chat_template.json, and the legacy special_tokens_map.json
    (tmp_path / 'chat_template.json').write_text(json.dumps({'chat_template': CHATML}))
    (tmp_path / 'special_tokens_map.json').write_text(json.dumps({'pad_token': {'content': '<|endoftext|>'}}))
    tokenizer = load_hf_tokenizer(folder)
    assert tokenizer.chat_template == CHATML and tokenizer.pad_id == tokenizer.tokenizer.token_to_id('<|endoftext|>')


def test_template_errors(tmp_path):
    template = "{% if messages[0].role == 'system' %}{{ raise_exception('no system messages, please') }}{% endif %}" + CHATML
    tokenizer = load_hf_tokenizer(folder_with_template(tmp_path, template))
    with pytest.raises(UserError, match='rejects this conversation: no system messages, please'):
        tokenizer.encode_prompt([{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}])
    with pytest.raises(UserError, match='not valid Jinja'):
        load_hf_tokenizer(folder_with_template(tmp_path, '{% for m in messages %}'))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(UserError, match='tokenizer.json is missing'):
        load_hf_tokenizer(str(tmp_path))
    folder = folder_with_template(tmp_path, CHATML)
    (tmp_path / 'generation_config.json').write_text('{"eos_token_id": ')
    with pytest.raises(UserError, match='generation_config.json is corrupt'):
        load_hf_tokenizer(folder)
    # ids that are no ids (a string was taken as a list of its characters, none of which stops anything)
    for bad in ('"2"', '[2, "x"]', '-1', 'true', '{"id": 2}'):
        (tmp_path / 'generation_config.json').write_text(f'{{"eos_token_id": {bad}}}')
        with pytest.raises(UserError, match=re.escape(f'generation_config.json: eos_token_id={bad} must be a token')):
            load_hf_tokenizer(folder)
    for good, ids in (('2', [2]), ('[2, 3]', [2, 3]), ('null', [])):
        (tmp_path / 'generation_config.json').write_text(f'{{"eos_token_id": {good}}}')
        assert load_hf_tokenizer(folder).stop_ids[:len(ids)] == ids
    (tmp_path / 'tokenizer.json').write_text('{"model": 1}')
    with pytest.raises(UserError, match='tokenizer.json is corrupt'):
        load_hf_tokenizer(folder)
    with pytest.raises(UserError, match='not a folder'):
        load_hf_tokenizer(str(tmp_path / 'nowhere'))
