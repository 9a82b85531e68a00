"""train.py on published models (the Hugging Face fixtures of tests/fixtures/hf): SFT in the model's own
chat template that lowers val loss and resumes bit-exactly, LoRA with Hugging Face target names exported
back to a folder, a base model without a chat template (nanotrain's template, its token rows trained),
and export.py's errors."""

import json
import math
import os
import shutil

import pytest
import torch

from safetensors.torch import load_file, save_file

from conftest import (HF_TINY, assert_user_error, fine_tune, hf_fixture, load, load_gpt, read_json_file, read_log, run,
                      train_losses, val_losses)
from hf.checkpoint import load_hf_checkpoint, peft_name, save_chat_tokenizer, save_hf_model
from hf.tokenizer import load_hf_tokenizer
from lm.chat_data import load_sft_split
from loading import load_for_generation
from starting_model import hf_source, run_tokenizer
from lm.tokenizer import chat_tokenizer
from model import GPT, GPTConfig
from tasks.number_tasks import prepare_number_tasks



@pytest.mark.slow
@pytest.mark.parametrize('training_type', ['sft', 'lora'])
def test_fine_tuning_a_chat_model_learns_and_resumes_bit_exactly(tmp_path, task, training_type):
    full = tmp_path / 'full'
    lr = '--learning_rate=3e-3' if training_type == 'sft' else '--learning_rate=3e-2'
    p = fine_tune(full, task, 'smollm2', lr, training_type=training_type)
    losses = val_losses(full)
    assert losses[-1] < losses[0] - 0.3, losses
    assert 'exact_match' in p.stdout
    ckpt = load(full / 'ckpt.pt')
    assert ckpt['hf_config']['architectures'] == ['LlamaForCausalLM']
    assert ckpt['model_args']['vocab_size'] == load_hf_checkpoint(hf_fixture('smollm2'))['model_args']['vocab_size']

    part = tmp_path / 'part'
    fine_tune(part, task, 'smollm2', lr, '--max_iters=4', training_type=training_type)
    fine_tune(part, task, 'smollm2', lr, training_type=training_type)  # the same run, continued to step 8
    assert train_losses(part) == train_losses(full)
    resumed = load(part / 'ckpt.pt')['model']
    assert all(torch.equal(resumed[k], v) for k, v in ckpt['model'].items())


@pytest.mark.slow
def test_lora_with_hugging_face_names_exports_a_merged_folder(tmp_path, task):
    out = tmp_path / 'lora'
    fine_tune(out, task, 'llama', '--lora_target_modules=q_proj,v_proj', '--learning_rate=1e-2',
              training_type='lora')
    adapters = load(out / 'ckpt.pt')['model']
    assert sorted({k.split('.', 3)[-1] for k in adapters}) == ['attn.q.lora_A', 'attn.q.lora_B', 'attn.v.lora_A',
                                                              'attn.v.lora_B']
    merged = load(out / 'merged.pt')
    run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'exported')])
    exported = load_gpt(str(tmp_path / 'exported'))
    reference = GPT(GPTConfig(**merged['model_args'])).eval()
    reference.load_state_dict(merged['model'])
    x = torch.randint(0, merged['model_args']['vocab_size'], (2, 16))
    with torch.no_grad():
        assert torch.equal(exported(x)[0], reference(x)[0])  # fp32 weights written and read back unchanged
    base = load_gpt(hf_fixture('llama')).state_dict()
    changed = [k for k, v in base.items() if not torch.equal(v, merged['model'][k])]
    assert changed and all('.attn.q.' in k or '.attn.v.' in k for k in changed)
    # the adapters checkpoint loads (sample.py, eval.py) as merged.pt: the published base, adapters folded in
    loaded = load_for_generation(str(out / 'ckpt.pt')).model.state_dict()
    assert set(loaded) == set(merged['model'])
    for k, v in merged['model'].items():  # W + s B A, perhaps on another thread count: float32 tolerance
        torch.testing.assert_close(loaded[k], v)

    run(['export.py', str(out / 'ckpt.pt'), str(tmp_path / 'adapter')])  # the adapters alone, in PEFT's format
    peft = load_file(str(tmp_path / 'adapter' / 'adapter_model.safetensors'))
    assert sorted(peft) == sorted(load_file(hf_fixture('peft_llama/adapter_model.safetensors')))
    assert all(torch.equal(peft[peft_name(k, merged['hf_config'])], v) for k, v in adapters.items())


@pytest.mark.slow
def test_base_model_without_template_uses_nanotrains_and_trains_its_token_rows(tmp_path, task):
    out = tmp_path / 'gpt2'
    fine_tune(out, task, 'gpt2', '--learning_rate=1e-2', '--lora_target_modules=c_attn', training_type='lora')
    base_vocab = load_hf_checkpoint(hf_fixture('gpt2'))['model_args']['vocab_size']
    merged = load(out / 'merged.pt')
    assert merged['model_args']['vocab_size'] == base_vocab + 4  # <|system|> <|user|> <|assistant|> <|end|>
    assert val_losses(out)[-1] < val_losses(out)[0]
    # exported with nanotrain's template in Jinja and its tokens in tokenizer.json: the same ids and loss mask
    run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'exported')])
    exported = load_hf_tokenizer(str(tmp_path / 'exported'))
    trained = chat_tokenizer(load_hf_tokenizer(hf_fixture('gpt2')))
    chat = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2+3?'},
            {'role': 'assistant', 'content': '5'}, {'role': 'user', 'content': 'And 4+4?'},
            {'role': 'assistant', 'content': '8'}]
    assert exported.encode_chat(chat) == trained.encode_chat(chat)
    assert exported.eos_id == trained.eos_id and exported.stop_ids == [trained.eos_id]
    assert torch.equal(load_gpt(str(tmp_path / 'exported')).state_dict()['lm_head.weight'],
                       merged['model']['lm_head.weight'])


@pytest.mark.slow
def test_bad_hugging_face_runs_are_clear_errors(tmp_path, task):
    p = run(['train.py', f'--init_from={hf_fixture("llama")}', f'--out_dir={tmp_path / "pre"}', *HF_TINY], check=False)
    assert_user_error(p, "training_type='sft'")
    p = fine_tune(tmp_path / 'long', task, 'mistral', '--block_size=512', '--max_length=512', check=False)
    assert_user_error(p, 'lower block_size')
    p = run(['export.py', str(tmp_path / 'missing.pt'), str(tmp_path / 'x')], check=False)
    assert_user_error(p, 'not a checkpoint file')


@pytest.mark.slow
def test_padded_vocabulary_fine_tunes_and_grows_after_its_rows(tmp_path, task):
    # Qwen2.5's embedding has more rows than its tokenizer has tokens; a base model's chat tokens go after the rows
    for name in ('qwen2', 'gpt2'):
        folder = tmp_path / name
        shutil.copytree(hf_fixture(name), folder)
        config = json.loads((folder / 'config.json').read_text())
        state = load_hf_checkpoint(str(folder))
        rows = config['vocab_size'] + 11
        (folder / 'config.json').write_text(json.dumps(dict(config, vocab_size=rows)))
        padded = {k: torch.cat([v, v[:11]]) if v.size(0) == rows - 11 and k.endswith(('wte.weight', 'lm_head.weight'))
                  else v for k, v in state['model'].items()}
        for f in os.listdir(folder):
            if f.endswith(('.safetensors', '.bin')):
                os.remove(folder / f)
        save_hf_model(padded, dict(config, vocab_size=rows), str(folder / 'padded'), str(folder))
        for f in os.listdir(folder / 'padded'):
            shutil.move(str(folder / 'padded' / f), str(folder / f))
        out = tmp_path / f'out-{name}'
        run(['train.py', '--training_type=sft', f'--init_from={folder}', f'--out_dir={out}', f'--sft_data={task}',
             *HF_TINY, '--max_iters=2', '--eval_interval=2', '--lr_decay_iters=2'])
        grown = 0 if name == 'qwen2' else 4  # gpt2 has no chat template: nanotrain's 4 chat tokens are added
        assert load(out / 'ckpt.pt')['model_args']['vocab_size'] == rows + grown
    # the chat tokens cannot follow the padded rows in gpt2's tokenizer.json: refused, and nothing is left behind
    p = run(['export.py', str(out / 'ckpt.pt'), str(tmp_path / 'exported')], check=False)
    assert_user_error(p, 'more embedding rows than its tokenizer')
    assert not os.path.exists(tmp_path / 'exported') and not list(tmp_path.glob('exported.*'))


@pytest.mark.slow
@pytest.mark.parametrize('reference', ['frozen copy', 'lora'])
def test_dpo_on_a_published_chat_model_starts_at_ln2_and_exports(tmp_path, reference):
    # policy == reference at step 0 (a frozen copy, or the model with zero-initialised adapters disabled):
    # every margin is 0 and the loss is ln 2 exactly up to float32 rounding of equal log-probs
    pairs = prepare_number_tasks(str(tmp_path / 'pairs'), n_train=24, n_eval=8, seed=1, preferences=True)
    out = tmp_path / 'dpo'
    lora = ['--use_lora=True', '--lora_target_modules=q_proj,v_proj'] if reference == 'lora' else []
    run(['train_dpo.py', f'--init_from={hf_fixture("qwen2")}', f'--out_dir={out}', f'--dpo_data={pairs}',
         '--device=cpu', '--dtype=float32', '--tensorboard=False', '--max_length=128', '--max_prompt_length=112',
         '--batch_size=4', '--eval_pairs=8', '--exact_match_examples=0', '--log_interval=1', '--warmup_iters=0',
         '--max_iters=2', '--eval_interval=2', *lora])
    step0 = next(e for e in read_log(out) if e.get('step') == 0 and 'eval/loss' in e)
    assert step0['eval/loss'] == pytest.approx(math.log(2), abs=1e-6)
    assert step0['eval/rewards/margins'] == pytest.approx(0, abs=1e-6)
    exported = tmp_path / 'exported'
    run(['export.py', str(out / ('merged.pt' if lora else 'ckpt.pt')), str(exported)])
    assert load_gpt(str(exported)).config.qkv_bias  # a Qwen2 again


@pytest.mark.slow
def test_a_fine_tune_of_a_published_model_is_fine_tuned_further_and_its_adapters_need_a_published_base(tmp_path,
                                                                                                    task):
    # init_from a nanotrain checkpoint of a published model: its shape and tokenizer come with it
    fine_tune(tmp_path / 'sft', task, 'smollm2', '--max_iters=2', '--eval_interval=2', '--lr_decay_iters=2')
    out = tmp_path / 'lora'
    run(['train.py', '--training_type=lora', f'--init_from={tmp_path / "sft" / "ckpt.pt"}', f'--out_dir={out}',
         f'--sft_data={task}', '--lora_target_modules=q_proj', *HF_TINY, '--max_iters=2', '--eval_interval=2',
         '--lr_decay_iters=2'])
    run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'merged')])
    assert load_gpt(str(tmp_path / 'merged')).config.n_kv_head == 1
    p = run(['export.py', str(out / 'ckpt.pt'), str(tmp_path / 'adapter')], check=False)
    assert_user_error(p, 'must name a Hugging Face base')
    assert not (tmp_path / 'adapter').exists()
    p = run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'merged' / 'config.json')], check=False)
    assert_user_error(p, 'not an empty folder')


def test_plain_text_and_nanotrains_template_open_with_the_bos_transformers_adds(tmp_path):
    # transformers' tokenizer(text) runs tokenizer.json's post-processor: Llama and Mistral prepend their BOS
    for name, prefix in (('llama', [400]), ('mistral', [1]), ('gpt2', [])):
        tokenizer = load_hf_tokenizer(hf_fixture(name))
        assert tokenizer.document_prefix == prefix
        assert prefix + tokenizer.encode('Hello world') == tokenizer.tokenizer.encode('Hello world').ids
    base = tmp_path / 'llama_base'  # the llama fixture without its chat template: a base model
    shutil.copytree(hf_fixture('llama'), base)
    config = json.loads((base / 'tokenizer_config.json').read_text())
    (base / 'tokenizer_config.json').write_text(json.dumps({k: v for k, v in config.items() if k != 'chat_template'}))
    chat = chat_tokenizer(load_hf_tokenizer(str(base)))
    conversation = [{'role': 'user', 'content': 'What is 2+3?'}, {'role': 'assistant', 'content': '5'}]
    ids, labels = chat.encode_chat(conversation)
    assert ids[0] == 400 and labels[0] == -100 and ids.count(400) == 1
    out = tmp_path / 'exported'  # export writes nanotrain's template with the BOS in Jinja: the same ids
    shutil.copytree(base, out)
    save_chat_tokenizer(load_hf_tokenizer(str(base)), str(out), None)
    assert load_hf_tokenizer(str(out)).encode_chat(conversation) == (ids, labels)


@pytest.mark.slow
def test_a_folder_without_its_tokenizer_config_keeps_the_chat_tokens_its_tokenizer_holds(tmp_path, task):
    # a folder export.py wrote for a model fine-tuned in nanotrain's template, less the tokenizer_config.json that
    # names the template: the four chat tokens are in its tokenizer.json and its weights (ids 401-404)
    folder = tmp_path / 'chat_model'
    shutil.copytree(hf_fixture('arcee'), folder)
    os.remove(folder / 'tokenizer_config.json')
    spec = json.loads((folder / 'tokenizer.json').read_text())
    tokens = ['<|system|>', '<|user|>', '<|assistant|>', '<|end|>']
    spec['added_tokens'] += [dict(spec['added_tokens'][0], id=401 + i, content=t) for i, t in enumerate(tokens)]
    (folder / 'tokenizer.json').write_text(json.dumps(spec))
    weights = load_file(str(folder / 'model.safetensors'))
    weights['model.embed_tokens.weight'] = torch.cat([weights['model.embed_tokens.weight']] * 2)[:405]
    save_file(weights, str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    config = json.loads((folder / 'config.json').read_text())
    (folder / 'config.json').write_text(json.dumps(dict(config, vocab_size=405)))
    chat = chat_tokenizer(load_hf_tokenizer(str(folder)))
    assert chat.vocab_size == 405 and chat.eos_id == 404 and chat.special['<|user|>'] == 402  # no second copies
    p = run(['train.py', '--training_type=sft', f'--init_from={folder}', f'--out_dir={tmp_path / "out"}',
             f'--sft_data={task}', *HF_TINY, '--max_iters=1', '--lr_decay_iters=1', '--exact_match_examples=0'])
    assert f"{folder} has no chat template" in p.stdout and '4 of these tokens already' in p.stdout, p.stdout
    assert load(tmp_path / 'out' / 'ckpt.pt')['model_args']['vocab_size'] == 405


@pytest.mark.slow
@pytest.mark.parametrize('training_type', ['sft', 'lora'])
def test_a_run_whose_model_folder_has_moved_names_the_folder_and_continues_from_its_new_place(tmp_path, task, training_type):
    folder = tmp_path / 'model'
    shutil.copytree(hf_fixture('smollm2'), folder)
    out = tmp_path / 'run'
    steps = ['--max_iters=2', '--eval_interval=2', '--lr_decay_iters=2']
    run(['train.py', f'--training_type={training_type}', f'--init_from={folder}', f'--out_dir={out}',
         f'--sft_data={task}', *HF_TINY, *steps])
    folder.rename(tmp_path / 'elsewhere')
    p = run(['train.py', f'--training_type={training_type}', f'--init_from={folder}', f'--out_dir={out}',
             f'--sft_data={task}', *HF_TINY, '--max_iters=4', '--lr_decay_iters=4'], check=False)
    assert_user_error(p)
    assert f'{folder}' in p.stderr and 'no longer exists' in p.stderr and 'Put' in p.stderr
    # told where it is now, the run continues from there, and its checkpoint names the new place
    run(['train.py', f'--training_type={training_type}', f'--init_from={tmp_path / "elsewhere"}', f'--out_dir={out}',
         f'--sft_data={task}', *HF_TINY, '--max_iters=4', '--lr_decay_iters=4'])
    assert sorted(train_losses(out)) == [1, 2, 3, 4]  # one history: steps 1-2, then 3-4
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 4
    assert ckpt['base_checkpoint' if training_type == 'lora' else 'data_dir'] == str(tmp_path / 'elsewhere')


@pytest.mark.slow
def test_a_published_model_learns_a_tool_call_in_its_own_template(tmp_path):
    """SFT rows with tools and an assistant turn that calls one (OpenAI's form: "tools" as a JSON string, the
    call's content null, its arguments an object): Qwen2.5's template shows the tools and writes the call, the
    model learns it, and the held-out exact match scores the call as the template writes it."""
    folder = tmp_path / 'qwen2'  # the fixture, with room for the tools' system prompt (~550 tokens)
    shutil.copytree(hf_fixture('qwen2'), folder)
    config = json.loads((folder / 'config.json').read_text())
    (folder / 'config.json').write_text(json.dumps(dict(config, max_position_embeddings=1024)))
    weather = {'type': 'function', 'function': {'name': 'get_weather', 'description': 'The current weather in a city.',
               'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}
    call = {'id': 'call_1', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Oslo'}}}
    row = {'tools': json.dumps([weather]), 'messages': [{'role': 'user', 'content': 'Weather in Oslo?'},
                                                       {'role': 'assistant', 'content': None, 'tool_calls': [call]}]}
    data = tmp_path / 'data'
    data.mkdir()
    (data / 'train.jsonl').write_text(json.dumps(row) + '\n')
    (data / 'val.jsonl').write_text(json.dumps(row) + '\n')
    out = tmp_path / 'out'
    p = run(['train.py', '--training_type=sft', f'--init_from={folder}', f'--out_dir={out}', f'--sft_data={data}',
             *HF_TINY, '--batch_size=2', '--block_size=1024', '--max_length=1024', '--learning_rate=1e-2',
             '--max_iters=40', '--lr_decay_iters=40', '--eval_interval=40', '--exact_match_examples=1',
             '--eval_metrics=exact_match,tool_calls'])
    assert '0 truncated' in p.stdout and 'step 0: exact_match 0.0%, tool_calls 0.0%' in p.stdout
    assert 'step 40: exact_match 100.0%, tool_calls 100.0% on 1 held-out prompts' in p.stdout, p.stdout[-2000:]
    # eval.py scores the same row alike; a conversation may also end with the tool's result, which the model answers
    answered = dict(row, messages=row['messages'] + [{'role': 'tool', 'content': '18C'}], reference='18C in Oslo.')
    (data / 'test.jsonl').write_text(json.dumps(row) + '\n' + json.dumps(answered) + '\n')
    run(['eval.py', f'--init_from={out / "ckpt.pt"}', f'--eval_data={data / "test.jsonl"}', '--device=cpu',
         f'--out={tmp_path / "eval.json"}', '--metrics=exact_match,tool_calls'])
    called, result = read_json_file(tmp_path / 'eval.json')['examples']
    assert called['references'] == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>']
    assert called['scores'] == {'exact_match': 1.0, 'tool_calls': 1.0} and result['scores']['exact_match'] == 0.0
    assert result['prompt'].endswith('<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    # sample.py shows the tools of a JSON file in the prompt, as the row did
    (tmp_path / 'tools.json').write_text(json.dumps([weather]))
    p = run(['sample.py', f'--init_from={out / "ckpt.pt"}', '--device=cpu', '--start=Weather in Oslo?',
             f'--tools={tmp_path / "tools.json"}', '--temperature=0', '--max_new_tokens=60'])
    assert '"required": ["city"]}}}\n</tools>' in p.stdout
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in p.stdout
    (tmp_path / 'tools.json').write_text('{"get_weather": {}}')
    p = run(['sample.py', f'--init_from={out / "ckpt.pt"}', '--device=cpu', f'--tools={tmp_path / "tools.json"}'],
            check=False)
    assert_user_error(p, 'tools=', '"tools" must be a list')
    p = run(['sample.py', f'--init_from={hf_fixture("gpt2")}', '--device=cpu', f'--tools={tmp_path / "tools.json"}'],
            check=False)
    assert_user_error(p, 'tools=...: a base model has no chat template')


def test_sample_takes_a_system_turn():
    """sample.py --system: the chat template's system turn (Qwen2.5's default one replaced); a base model has none."""
    p = run(['sample.py', f'--init_from={hf_fixture("qwen2")}', '--device=cpu', '--start=Hi', '--system=Be brief.',
             '--max_new_tokens=1'])
    assert '<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>' in p.stdout
    assert 'You are Qwen' not in p.stdout
    p = run(['sample.py', f'--init_from={hf_fixture("gpt2")}', '--device=cpu', '--system=Be brief.'], check=False)
    assert_user_error(p, 'system=...: a base model has no chat template')


def test_plain_text_rows_fine_tune_a_published_model_as_its_tokenizer_reads_them(tmp_path):
    """{"text"} rows on Llama 3's fixture: BOS (its tokenizer.json's post-processor), the text with its special
    tokens read as tokens, and the end of turn, as transformers' tokenizer(text) + EOS gives them (TRL's
    language-modeling rows); a run on them alone learns, with no held-out answers, and samples from a val text."""
    texts = ['The cat sat on the mat.', 'A <|eot_id|> is one token.']
    data = tmp_path / 'data'
    data.mkdir()
    for split in ('train', 'val'):
        (data / f'{split}.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts * 8))
    tokenizer = load_hf_tokenizer(hf_fixture('llama'))
    _, examples = load_sft_split(str(data / 'val.jsonl'), tokenizer, 128)
    for text, (ids, labels) in zip(texts, examples):
        assert ids == tokenizer.tokenizer.encode(text).ids + [tokenizer.eos_id]  # add_special_tokens: BOS
        assert labels == [-100] + ids[1:]
    assert examples[1][0].count(tokenizer.eos_id) == 2
    out = tmp_path / 'out'
    p = run(['train.py', '--training_type=sft', f'--init_from={hf_fixture("llama")}', f'--out_dir={out}',
             f'--sft_data={data}', *HF_TINY, '--learning_rate=3e-3'])
    losses = val_losses(out)
    assert losses[-1] < losses[0] - 0.3, losses
    assert ': exact_match' not in p.stdout and '--- sample' in p.stdout


def test_chat_template_variables_reach_the_template_and_the_checkpoint(tmp_path, task):
    """--chat_template_variables renders a published model's template with them (Qwen3 without thinking: the empty
    <think> block becomes part of the prompt, not of the trained answer); the checkpoint records them, and a run or
    sample that starts from it renders with them unless it names its own."""
    out = tmp_path / 'qwen3'
    fine_tune(out, task, 'qwen3', "--chat_template_variables={'enable_thinking': False}", '--max_iters=2')
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['chat_template_variables'] == {'enable_thinking': False}
    assert hf_source(ckpt)['chat_template_variables'] == {'enable_thinking': False}
    assert hf_source(ckpt, {'enable_thinking': True})['chat_template_variables'] == {'enable_thinking': True}
    _, tokenizer = run_tokenizer('', ckpt, str(out / 'ckpt.pt'), hf_source(ckpt)['chat_template_variables'])
    turns = [{'role': 'user', 'content': 'What is 2+3?'}, {'role': 'assistant', 'content': '5'}]
    ids, labels = tokenizer.encode_chat(turns)
    assert tokenizer.decode([i for i, label in zip(ids, labels) if label != -100]) == '5<|im_end|>'
    assert tokenizer.decode(tokenizer.encode_prompt(turns[:1])).endswith('<think>\n\n</think>\n\n')
    # the template's default: the empty <think> block is trained as the answer's start
    thinking = load_hf_tokenizer(hf_fixture('qwen3'))
    ids, labels = thinking.encode_chat(turns)
    assert thinking.decode([i for i, label in zip(ids, labels) if label != -100]).startswith('<think>')
