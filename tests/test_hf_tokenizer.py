"""hf/tokenizer.py against transformers' own output (tests/fixtures/hf/expected/chat.json, written by
transformers' apply_chat_template for each fixture model folder), and its errors."""
import json
import os
import re
import shutil

import pytest

from configurator import UserError
from lm.chat_data import encode_pair, load_preference_split, load_prompt_split, load_sft_split, rl_reference
from conftest import HF_FIXTURES, hf_fixture, read_json_file
from hf.tokenizer import load_hf_tokenizer
from lm.tokenizer import ChatTokenizer, prompt_and_answer

CASES = read_json_file(os.path.join(HF_FIXTURES, 'expected', 'chat.json'))
TOOL_CASES = read_json_file(os.path.join(HF_FIXTURES, 'expected', 'chat_tools.json'))
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


@pytest.mark.parametrize('case', TOOL_CASES, ids=[f"{c['model']}-{c['case']}" for c in TOOL_CASES])
def test_tools_and_tool_calls_match_transformers(case, tmp_path):
    """Conversations with tools, calls and results (tests/fixtures/make_tool_chat_fixture.py), read from a JSONL
    line as train.py reads it: the render, ids and mask of transformers' apply_chat_template(tools=...), the reply
    to a call as its reference; a template that refuses them, or writes no tools (SmolLM2's), is an error."""
    tokenizer = fixture_tokenizer(case['model'])
    path = tmp_path / 'train.jsonl'
    path.write_text(json.dumps({'tools': case['tools'], 'messages': case['messages']}) + '\n')
    if 'error' in case:  # the template's own refusal (Llama 3.x: one call a turn)
        with pytest.raises(UserError, match=f"{path}:1: .*rejects this conversation: {re.escape(case['error'])}"):
            load_sft_split(str(path), tokenizer, 4096)
        return
    assert tokenizer.render(case['messages'], tools=case['tools']) == case['text']
    if case['model'] == 'smollm2':  # its template leaves the tools out: training on that would teach nothing
        with pytest.raises(UserError, match=f"{path}:1: .*the same without its tools \\(get_weather.*no tool support"):
            load_sft_split(str(path), tokenizer, 4096)
        return
    if case['assistant_mask'] is None:  # Mistral moves the tools and system message to the last user turn
        with pytest.raises(UserError, match='not a prefix'):
            load_sft_split(str(path), tokenizer, 4096)
        return
    (messages, tools), = load_sft_split(str(path), tokenizer, 4096)[0]
    (ids, labels), = load_sft_split(str(path), tokenizer, 4096)[1]
    assert ids == case['ids'] and [int(label != -100) for label in labels] == case['assistant_mask']
    assert tokenizer.reply_text(messages, tools) == case['reply']
    prompt, reference = prompt_and_answer(tokenizer, messages, tools)
    assert reference == (case['reply'] if messages[-1].get('tool_calls') else messages[-1]['content'])
    assert prompt == ids[:len(prompt)] and labels[len(prompt) - 1] == -100 != labels[len(prompt)]


def test_tool_rows_in_the_forms_data_sets_write(tmp_path):
    """"tools" as a JSON string (data sets whose schemas differ store it so) and a call's content left out or
    null (OpenAI's form) read as the list and ""; malformed tools and calls, and calls nanotrain's own template
    cannot write, are errors naming the line."""
    case = next(c for c in TOOL_CASES if (c['model'], c['case']) == ('qwen3', 'call_and_answer'))
    tokenizer = fixture_tokenizer('qwen3')
    calls = [dict(m) for m in case['messages']]
    del calls[2]['content']
    # a data set's columns: every message has every key, null where it has none (as transformers drops them)
    columns = [{'tool_calls': [] if m['role'] == 'user' else None, 'tool_call_id': None, 'name': None, **m}
               for m in case['messages']]
    rows = [{'tools': json.dumps(case['tools']), 'messages': calls},
            {'tools': case['tools'], 'messages': [dict(m, content=None) if m.get('tool_calls') else m for m in calls]},
            {'tools': case['tools'], 'messages': columns}]
    path = tmp_path / 'rows.jsonl'
    path.write_text(''.join(json.dumps(row) + '\n' for row in rows))
    assert [ids for ids, _ in load_sft_split(str(path), tokenizer, 4096)[1]] == [case['ids']] * 3
    plain = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
    path.write_text(json.dumps({'messages': [dict(m, tool_calls=[]) for m in plain]}) + '\n')  # a column, no calls
    assert load_sft_split(str(path), tokenizer, 4096)[1] == [tokenizer.encode_chat(plain)]
    llama = next(c for c in TOOL_CASES if (c['model'], c['case']) == ('llama', 'call_and_answer'))
    path.write_text(json.dumps({'tools': llama['tools'], 'messages': [  # its template asks 'tool_calls' in message
        {'tool_calls': None, 'tool_call_id': None, 'name': None, **m} for m in llama['messages']]}) + '\n')
    assert load_sft_split(str(path), fixture_tokenizer('llama'), 4096)[1][0][0] == llama['ids']
    user, call = case['messages'][1], case['messages'][2]
    for bad, message in (({'tools': '[{"function": '}, '"tools" is a string but not JSON'),
                         ({'tools': {'get_weather': {}}}, '"tools" must be a list'),
                         ({'tools': [{'type': 'function', 'function': {}}]}, 'each of "tools" must be'),
                         ({'messages': [user, dict(call, tool_calls={'name': 'f'})]}, '"tool_calls" must be a list of calls'),
                         ({'messages': [user, dict(call, tool_calls=[{'arguments': {}}])]}, 'each of "tool_calls"'),
                         ({'messages': [dict(user, tool_calls=call['tool_calls']), call]}, "a 'user' message"),
                         ({'messages': [user, dict(call, role='function')]}, "message role 'function'")):
        path.write_text(json.dumps({'tools': case['tools'], 'messages': case['messages'], **bad}) + '\n')
        with pytest.raises(UserError, match=f'{path}:1: {re.escape(message)}'):
            load_sft_split(str(path), tokenizer, 4096)
    path.write_text(json.dumps({'tools': case['tools'], 'messages': case['messages']}) + '\n')
    own = ChatTokenizer(fixture_tokenizer('gpt2'))
    for row in ({'tools': case['tools'], 'messages': case['messages'][:2] + case['messages'][-1:]},
                {'messages': case['messages']}):
        path.write_text(json.dumps(row) + '\n')
        with pytest.raises(UserError, match=f"{path}:1: nanotrain's own chat template has no tools"):
            load_sft_split(str(path), own, 4096)


def test_sharegpt_conversations_read_as_their_messages(tmp_path):
    """ShareGPT rows {"conversations": [{"from", "value"}]} (human, gpt, system; LLaMA-Factory's function_call and
    observation, with "tools" as a JSON string of bare or wrapped schemas) give transformers' ids for the same
    conversation in messages; a speaker nanotrain does not know, or a call that is no JSON object, is an error
    naming the line."""
    case = next(c for c in TOOL_CASES if (c['model'], c['case']) == ('qwen2', 'call_and_answer'))
    system, user, call, result, answer = case['messages']
    turns = [{'from': 'system', 'value': system['content']}, {'from': 'human', 'value': user['content']},
             {'from': 'function_call', 'value': json.dumps(call['tool_calls'][0]['function'])},
             {'from': 'observation', 'value': result['content']}, {'from': 'gpt', 'value': answer['content']}]
    path = tmp_path / 'sharegpt.jsonl'
    bare = [tool['function'] for tool in case['tools']]  # LLaMA-Factory's: the functions, unwrapped
    path.write_text(''.join(json.dumps({'conversations': turns, 'tools': json.dumps(tools)}) + '\n'
                            for tools in (case['tools'], bare)))
    examples = load_sft_split(str(path), fixture_tokenizer('qwen2'), 4096)[1]
    assert [ids for ids, _ in examples] == [case['ids']] * 2
    assert [int(label != -100) for label in examples[0][1]] == case['assistant_mask']
    for bad, message in (([dict(turns[1], **{'from': 'bot'})], '"from": "bot" in "conversations" is not one of'),
                         ([turns[1], dict(turns[2], value='get_weather(city=1)')], 'must be JSON {"name"'),
                         ([turns[1], dict(turns[2], value='[{"arguments": {}}]')], 'each of "tool_calls" must be'),
                         ([turns[1]], '"conversations" has no assistant turn')):
        path.write_text(json.dumps({'conversations': bad}) + '\n')
        with pytest.raises(UserError, match=f'{path}:1: .*{re.escape(message)}'):
            load_sft_split(str(path), fixture_tokenizer('qwen2'), 4096)


def test_preference_pairs_and_rl_prompts_carry_tools(tmp_path):
    """DPO pairs whose replies call tools (chosen: the right city, rejected: another) and RL prompts render with
    their rows' tools; a chosen call is the exact-match reference as the template writes it."""
    case = next(c for c in TOOL_CASES if (c['model'], c['case']) == ('qwen2', 'call_last'))
    tokenizer = fixture_tokenizer('qwen2')
    user, call = case['messages']
    wrong = json.loads(json.dumps(call).replace('Wellington', 'Oslo'))
    pairs = tmp_path / 'pairs.jsonl'
    pairs.write_text(json.dumps({'tools': case['tools'], 'prompt': [user], 'chosen': [call], 'rejected': [wrong]}) +
                     '\n' + json.dumps({'tools': case['tools'], 'chosen': [user, call], 'rejected': [user, wrong]}) + '\n')
    references, encoded = load_preference_split(str(pairs), tokenizer, 4096, 4096)
    prompt = case['ids'][:len(tokenizer.encode_prompt([user], case['tools']))]
    assert references == [(prompt, case['reply'])] * 2
    assert all(p == prompt for p, _, _ in encoded) and encoded[0] == encoded[1]
    chosen, rejected = encoded[0][1:]
    assert tokenizer.decode(chosen).startswith(case['reply'] + '<|im_end|>') and 'Oslo' in tokenizer.decode(rejected)
    prompts = tmp_path / 'prompts.jsonl'
    prompts.write_text(json.dumps({'tools': case['tools'], 'prompt': user['content']}) + '\n')
    (ids, _), = load_prompt_split(str(prompts), tokenizer, 4096)
    assert ids == prompt and 'get_time' in tokenizer.decode(ids)
    assert rl_reference(tokenizer, {'tools': case['tools'], 'messages': [user, call]}) == case['reply']


def test_templates_that_ignore_tools_or_calls_are_refused(tmp_path):
    """Whether a template writes a row's tools and calls is seen by rendering without them (a name check would pass
    a tool named "a", which any text holds)."""
    tools = [{'type': 'function', 'function': {'name': 'a'}}]
    turns = [{'role': 'user', 'content': 'a?'}, {'role': 'assistant', 'content': 'a',
                                                 'tool_calls': [{'type': 'function', 'function': {'name': 'a'}}]}]
    tokenizer = load_hf_tokenizer(folder_with_template(tmp_path, CHATML))
    with pytest.raises(UserError, match=r'the same without its tools \(a\): it has no tool support'):
        tokenizer.encode_chat(turns, tools)
    with pytest.raises(UserError, match=r'the same without its tool calls \(a\)'):
        tokenizer.encode_chat(turns)
    with pytest.raises(UserError, match=r'the same without its tools'):
        tokenizer.encode_prompt(turns[:1], tools)
    tools_only = "{{ tools | map(attribute='function.name') | join(',') }}" + CHATML  # writes tools, not calls
    tokenizer = load_hf_tokenizer(folder_with_template(tmp_path, tools_only))
    assert tokenizer.encode_prompt(turns[:1], tools) == tokenizer.encode(tokenizer.render(turns[:1], True, tools=tools))
    with pytest.raises(UserError, match=r'the same without its tool calls \(a\)'):
        tokenizer.encode_chat(turns, tools)


def test_a_tool_use_template_renders_conversations_with_tools(tmp_path):
    """A folder's named "tool_use" template (a list in tokenizer_config.json, or additional_chat_templates/
    tool_use.jinja beside chat_template.jinja) renders a conversation that has tools, as transformers picks it;
    the identity of a folder without one is as before, with one it differs."""
    tools_first = "{{ 'tools: ' + tools | map(attribute='function.name') | join(',') + '\\n' }}" + CHATML
    folder = folder_with_template(tmp_path, [{'name': 'default', 'template': CHATML},
                                             {'name': 'tool_use', 'template': tools_first}])
    tokenizer = load_hf_tokenizer(folder)
    turns = [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
    tools = [{'type': 'function', 'function': {'name': 'get_weather'}}]
    assert tokenizer.render(turns) == '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n'
    assert tokenizer.render(turns, tools=tools) == 'tools: get_weather\n' + tokenizer.render(turns)
    ids, labels = tokenizer.encode_chat(turns, tools)
    assert tokenizer.decode([label for label in labels if label != -100]) == 'Hello<|im_end|>'
    assert tokenizer.identity() != load_hf_tokenizer(folder_with_template(tmp_path, CHATML)).identity()
    (tmp_path / 'chat_template.jinja').write_text(CHATML)
    assert load_hf_tokenizer(folder).render(turns, tools=tools) == tokenizer.render(turns)  # the .jinja alone wins
    (tmp_path / 'additional_chat_templates').mkdir()
    (tmp_path / 'additional_chat_templates' / 'tool_use.jinja').write_text(tools_first)
    assert load_hf_tokenizer(folder).render(turns, tools=tools) == tokenizer.render(turns, tools=tools)


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
    # Python's own errors inside the template (Llama 3.x takes the length of a call list that is no list)
    llama = fixture_tokenizer('llama')
    with pytest.raises(UserError, match=r'fails on this conversation \(TypeError: .*NoneType'):
        llama.render([{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello', 'tool_calls': None}])
    with pytest.raises(UserError, match='not valid Jinja'):
        load_hf_tokenizer(folder_with_template(tmp_path, '{% for m in messages %}'))


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(UserError, match='tokenizer.json is missing'):
        load_hf_tokenizer(str(tmp_path))
    folder = folder_with_template(tmp_path, CHATML)
    for corrupt in ('{"eos_token_id": ', '{"x": ' + '[' * 100_000 + ']' * 100_000 + '}'):  # cut short; nested deep
        (tmp_path / 'generation_config.json').write_text(corrupt)
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
    # a named template that lost its text is no base model (it read as one: nanotrain's template, silently)
    (tmp_path / 'named').mkdir()
    with pytest.raises(UserError, match='the chat template named \'default\' has no "template" text'):
        load_hf_tokenizer(folder_with_template(tmp_path / 'named', [{'name': 'default'}]))


def test_a_template_variable_the_template_does_not_read_is_refused():
    """chat_template_variables render a published template; a name it never reads (enable_thinkng) rendered as if
    not given, silently: refused, naming what the template reads; a base model's folder has no template at all.
    A nanotrain model's own template reads none (loading.py)."""
    assert load_hf_tokenizer(hf_fixture('qwen3'), {'enable_thinking': False}).template_variables['enable_thinking'] \
        is False
    with pytest.raises(UserError, match=r"\['enable_thinkng'\]: the chat template of .* reads no such variable "
                                        r"\(it reads .*enable_thinking"):
        load_hf_tokenizer(hf_fixture('qwen3'), {'enable_thinkng': False})
    with pytest.raises(UserError, match="has no chat template to render them"):
        load_hf_tokenizer(hf_fixture('gpt2'), {'style': 1})
