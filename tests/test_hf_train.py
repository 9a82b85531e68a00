"""train.py on published models (the Hugging Face fixtures of tests/fixtures/hf): SFT in the model's own
chat template that lowers val loss and resumes bit-exactly, LoRA with Hugging Face target names exported
back to a folder, a base model without a chat template (nanotrain's template, its token rows trained),
and export.py's errors."""

import json
import math
import os
import shutil
import sys

import pytest
import torch

from safetensors.torch import load_file, save_file

from hf.checkpoint import load_hf_checkpoint, peft_name, save_chat_tokenizer, save_hf_model
from hf.tokenizer import load_hf_tokenizer
from lm.tokenizer import chat_tokenizer
from model import GPT, GPTConfig
from run.starting_model import hf_source, run_tokenizer
from tasks.number_tasks import prepare_number_tasks

sys.path.insert(0, os.path.dirname(__file__))
from test_hf_model import fixture, load_gpt  # noqa: E402
from test_train import load, read_log, run, train_losses  # noqa: E402

TINY = ['--batch_size=4', '--block_size=128', '--max_length=128', '--eval_iters=2', '--eval_interval=4',
        '--log_interval=1', '--tensorboard=False', '--sample_tokens=8', '--warmup_iters=1', '--device=cpu',
        '--dtype=float32', '--exact_match_examples=4', '--max_iters=8', '--lr_decay_iters=8']


@pytest.fixture(scope='module')
def task(tmp_path_factory):
    return prepare_number_tasks(str(tmp_path_factory.mktemp('hf') / 'task'), n_train=64, n_eval=8)


def fine_tune(out_dir, task, model, *extra, training_type='sft', **kw):
    return run(['train.py', f'--training_type={training_type}', f'--init_from={fixture(model)}',
                f'--out_dir={out_dir}', f'--sft_data={task}', *TINY, *extra], **kw)


def val_losses(out_dir):
    return [e['val_loss'] for e in read_log(out_dir) if 'val_loss' in e]


@pytest.mark.parametrize('training_type', ['sft', 'lora'])
def test_fine_tuning_a_chat_model_learns_and_resumes_bit_exactly(tmp_path, task, training_type):
    full = tmp_path / 'full'
    lr = '--learning_rate=3e-3' if training_type == 'sft' else '--learning_rate=3e-2'
    p = fine_tune(full, task, 'smollm2', lr, training_type=training_type)
    losses = val_losses(full)
    assert losses[-1] < losses[0] - 0.3, losses
    assert 'exact match' in p.stdout
    ckpt = load(full / 'ckpt.pt')
    assert ckpt['hf_config']['architectures'] == ['LlamaForCausalLM']
    assert ckpt['model_args']['vocab_size'] == load_hf_checkpoint(fixture('smollm2'))['model_args']['vocab_size']

    part = tmp_path / 'part'
    fine_tune(part, task, 'smollm2', lr, '--max_iters=4', training_type=training_type)
    fine_tune(part, task, 'smollm2', lr, training_type=training_type)  # the same run, continued to step 8
    assert train_losses(part) == train_losses(full)
    resumed = load(part / 'ckpt.pt')['model']
    assert all(torch.equal(resumed[k], v) for k, v in ckpt['model'].items())


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
    changed = [k for k, v in load_gpt(fixture('llama')).state_dict().items() if not torch.equal(v, merged['model'][k])]
    assert changed and all('.attn.q.' in k or '.attn.v.' in k for k in changed)

    run(['export.py', str(out / 'ckpt.pt'), str(tmp_path / 'adapter')])  # the adapters alone, in PEFT's format
    peft = load_file(str(tmp_path / 'adapter' / 'adapter_model.safetensors'))
    assert sorted(peft) == sorted(load_file(fixture('peft_llama/adapter_model.safetensors')))
    assert all(torch.equal(peft[peft_name(k, merged['hf_config'])], v) for k, v in adapters.items())


def test_base_model_without_template_uses_nanotrains_and_trains_its_token_rows(tmp_path, task):
    out = tmp_path / 'gpt2'
    fine_tune(out, task, 'gpt2', '--learning_rate=1e-2', '--lora_target_modules=c_attn', training_type='lora')
    base_vocab = load_hf_checkpoint(fixture('gpt2'))['model_args']['vocab_size']
    merged = load(out / 'merged.pt')
    assert merged['model_args']['vocab_size'] == base_vocab + 4  # <|system|> <|user|> <|assistant|> <|end|>
    assert val_losses(out)[-1] < val_losses(out)[0]
    # exported with nanotrain's template in Jinja and its tokens in tokenizer.json: the same ids and loss mask
    run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'exported')])
    exported, trained = load_hf_tokenizer(str(tmp_path / 'exported')), chat_tokenizer(load_hf_tokenizer(fixture('gpt2')))
    chat = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'What is 2+3?'},
            {'role': 'assistant', 'content': '5'}, {'role': 'user', 'content': 'And 4+4?'},
            {'role': 'assistant', 'content': '8'}]
    assert exported.encode_chat(chat) == trained.encode_chat(chat)
    assert exported.eos_id == trained.eos_id and exported.stop_ids == [trained.eos_id]
    assert torch.equal(load_gpt(str(tmp_path / 'exported')).state_dict()['lm_head.weight'],
                       merged['model']['lm_head.weight'])


def test_bad_hugging_face_runs_are_clear_errors(tmp_path, task):
    p = run(['train.py', f'--init_from={fixture("llama")}', f'--out_dir={tmp_path / "pre"}', *TINY], check=False)
    assert p.returncode == 2 and "training_type='sft'" in p.stderr and 'Traceback' not in p.stderr
    p = fine_tune(tmp_path / 'long', task, 'mistral', '--block_size=512', '--max_length=512', check=False)
    assert p.returncode == 2 and 'lower block_size' in p.stderr
    p = run(['export.py', str(tmp_path / 'missing.pt'), str(tmp_path / 'x')], check=False)
    assert p.returncode == 2 and 'not a checkpoint file' in p.stderr


def test_padded_vocabulary_fine_tunes_and_grows_after_its_rows(tmp_path, task):
    # Qwen2.5's embedding has more rows than its tokenizer has tokens; a base model's chat tokens go after the rows
    for name in ('qwen2', 'gpt2'):
        folder = tmp_path / name
        shutil.copytree(fixture(name), folder)
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
             *TINY, '--max_iters=2', '--eval_interval=2', '--lr_decay_iters=2'])
        grown = 0 if name == 'qwen2' else 4  # gpt2 has no chat template: nanotrain's 4 chat tokens are added
        assert load(out / 'ckpt.pt')['model_args']['vocab_size'] == rows + grown
    # the chat tokens cannot follow the padded rows in gpt2's tokenizer.json: refused, and nothing is left behind
    p = run(['export.py', str(out / 'ckpt.pt'), str(tmp_path / 'exported')], check=False)
    assert p.returncode == 2 and 'more embedding rows than its tokenizer' in p.stderr
    assert not os.path.exists(tmp_path / 'exported') and not list(tmp_path.glob('exported.*'))


@pytest.mark.parametrize('reference', ['frozen copy', 'lora'])
def test_dpo_on_a_published_chat_model_starts_at_ln2_and_exports(tmp_path, reference):
    # policy == reference at step 0 (a frozen copy, or the model with zero-initialised adapters disabled):
    # every margin is 0 and the loss is ln 2 exactly up to float32 rounding of equal log-probs
    pairs = prepare_number_tasks(str(tmp_path / 'pairs'), n_train=24, n_eval=8, seed=1, preferences=True)
    out = tmp_path / 'dpo'
    lora = ['--use_lora=True', '--lora_target_modules=q_proj,v_proj'] if reference == 'lora' else []
    run(['train_dpo.py', f'--init_from={fixture("qwen2")}', f'--out_dir={out}', f'--dpo_data={pairs}',
         '--device=cpu', '--dtype=float32', '--tensorboard=False', '--max_length=128', '--max_prompt_length=112',
         '--batch_size=4', '--eval_pairs=8', '--exact_match_examples=0', '--log_interval=1', '--warmup_iters=0',
         '--max_iters=2', '--eval_interval=2', *lora])
    step0 = next(e for e in read_log(out) if e.get('step') == 0 and 'eval/loss' in e)
    assert step0['eval/loss'] == pytest.approx(math.log(2), abs=1e-6)
    assert step0['eval/rewards/margins'] == pytest.approx(0, abs=1e-6)
    exported = tmp_path / 'exported'
    run(['export.py', str(out / ('merged.pt' if lora else 'ckpt.pt')), str(exported)])
    assert load_gpt(str(exported)).config.qkv_bias  # a Qwen2 again


def test_a_fine_tune_of_a_published_model_is_fine_tuned_further_and_its_adapters_need_a_published_base(tmp_path,
                                                                                                    task):
    # init_from a nanotrain checkpoint of a published model: its shape and tokenizer come with it
    fine_tune(tmp_path / 'sft', task, 'smollm2', '--max_iters=2', '--eval_interval=2', '--lr_decay_iters=2')
    out = tmp_path / 'lora'
    run(['train.py', '--training_type=lora', f'--init_from={tmp_path / "sft" / "ckpt.pt"}', f'--out_dir={out}',
         f'--sft_data={task}', '--lora_target_modules=q_proj', *TINY, '--max_iters=2', '--eval_interval=2',
         '--lr_decay_iters=2'])
    run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'merged')])
    assert load_gpt(str(tmp_path / 'merged')).config.n_kv_head == 1
    p = run(['export.py', str(out / 'ckpt.pt'), str(tmp_path / 'adapter')], check=False)
    assert p.returncode == 2 and 'must name a Hugging Face base' in p.stderr
    assert not (tmp_path / 'adapter').exists()
    p = run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'merged' / 'config.json')], check=False)
    assert p.returncode == 2 and 'not an empty folder' in p.stderr and 'Traceback' not in p.stderr


def test_plain_text_and_nanotrains_template_open_with_the_bos_transformers_adds(tmp_path):
    # transformers' tokenizer(text) runs tokenizer.json's post-processor: Llama and Mistral prepend their BOS
    for name, prefix in (('llama', [400]), ('mistral', [1]), ('gpt2', [])):
        tokenizer = load_hf_tokenizer(fixture(name))
        assert tokenizer.document_prefix == prefix
        assert prefix + tokenizer.encode('Hello world') == tokenizer.tokenizer.encode('Hello world').ids
    base = tmp_path / 'llama_base'  # the llama fixture without its chat template: a base model
    shutil.copytree(fixture('llama'), base)
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


def test_a_folder_without_its_tokenizer_config_keeps_the_chat_tokens_its_tokenizer_holds(tmp_path, task):
    # a folder export.py wrote for a model fine-tuned in nanotrain's template, less the tokenizer_config.json that
    # names the template: the four chat tokens are in its tokenizer.json and its weights (ids 401-404)
    folder = tmp_path / 'chat_model'
    shutil.copytree(fixture('arcee'), folder)
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
             f'--sft_data={task}', *TINY, '--max_iters=1', '--lr_decay_iters=1', '--exact_match_examples=0'])
    assert f"{folder} has no chat template" in p.stdout and '4 of these tokens already' in p.stdout, p.stdout
    assert load(tmp_path / 'out' / 'ckpt.pt')['model_args']['vocab_size'] == 405


@pytest.mark.parametrize('training_type', ['sft', 'lora'])
def test_a_run_whose_model_folder_has_moved_names_the_folder_and_continues_from_its_new_place(tmp_path, task, training_type):
    folder = tmp_path / 'model'
    shutil.copytree(fixture('smollm2'), folder)
    out = tmp_path / 'run'
    steps = ['--max_iters=2', '--eval_interval=2', '--lr_decay_iters=2']
    run(['train.py', f'--training_type={training_type}', f'--init_from={folder}', f'--out_dir={out}',
         f'--sft_data={task}', *TINY, *steps])
    folder.rename(tmp_path / 'elsewhere')
    p = run(['train.py', f'--training_type={training_type}', f'--init_from={folder}', f'--out_dir={out}',
             f'--sft_data={task}', *TINY, '--max_iters=4', '--lr_decay_iters=4'], check=False)
    assert p.returncode == 2 and 'Traceback' not in p.stderr
    assert f'{folder}' in p.stderr and 'no longer exists' in p.stderr and 'Put' in p.stderr
    # told where it is now, the run continues from there, and its checkpoint names the new place
    run(['train.py', f'--training_type={training_type}', f'--init_from={tmp_path / "elsewhere"}', f'--out_dir={out}',
         f'--sft_data={task}', *TINY, '--max_iters=4', '--lr_decay_iters=4'])
    assert sorted(train_losses(out)) == [1, 2, 3, 4]  # one history: steps 1-2, then 3-4
    ckpt = load(out / 'ckpt.pt')
    assert ckpt['iter_num'] == 4
    assert ckpt['base_checkpoint' if training_type == 'lora' else 'data_dir'] == str(tmp_path / 'elsewhere')


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
    _, tokenizer = run_tokenizer('', ckpt, str(out / 'ckpt.pt'), True, False, hf_source(ckpt)['chat_template_variables'])
    turns = [{'role': 'user', 'content': 'What is 2+3?'}, {'role': 'assistant', 'content': '5'}]
    ids, labels = tokenizer.encode_chat(turns)
    assert tokenizer.decode([i for i, label in zip(ids, labels) if label != -100]) == '5<|im_end|>'
    assert tokenizer.decode(tokenizer.encode_prompt(turns[:1])).endswith('<think>\n\n</think>\n\n')
    thinking = load_hf_tokenizer(fixture('qwen3'))  # the template's default: the empty <think> block is trained as the answer's start
    ids, labels = thinking.encode_chat(turns)
    assert thinking.decode([i for i, label in zip(ids, labels) if label != -100]).startswith('<think>')
