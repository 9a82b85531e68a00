"""export.py on models nanotrain trained itself: each architecture maps to the Hugging Face family that computes
the same function (hf_checkpoint.hf_model) and reads back as the same model with the same logits; a LoRA run's
merged.pt exports; models no family computes (config/speedrun_cpu.py's, logit_softcap) are refused, naming the
settings, with nothing written. (transformers' own logits on these families: the Arcee fixtures of test_hf_model.py;
by hand, the numbers in the README.)"""

import json
import os
import shutil

import pytest
import torch

from configurator import UserError
from conftest import ROOT, assert_user_error, run
from data import prepare
from hf.checkpoint import gpt_config, hf_model, load_hf_checkpoint, read_hf_weights, save_hf_model
from hf.tokenizer import load_hf_tokenizer
from lm.lora import apply_lora, lora_state_dict, save_merged
from lm.tokenizer import ChatTokenizer, load_tokenizer
from model import GPT, GPTConfig, mlp_hidden_size
from run.checkpoint import save_checkpoint


TINY = dict(block_size=32, n_layer=2, n_head=4, n_embd=32)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)
# nanotrain model settings -> (architecture, its activation: Arcee's hidden_act, GPT-2's activation_function)
FAMILIES = [
    ({}, 'ArceeForCausalLM', 'gelu'),  # the default model: rope, rmsnorm, gelu, tied
    (dict(mlp='relu2', tie_embeddings=False, bias=True, n_kv_head=2), 'ArceeForCausalLM', 'relu2'),
    (dict(mlp='gelu_tanh', rope_scaling=LLAMA3), 'ArceeForCausalLM', 'gelu_pytorch_tanh'),
    (dict(mlp='swiglu', n_kv_head=2, tie_embeddings=False, rope_theta=5e5), 'LlamaForCausalLM', 'silu'),
    (dict(mlp='swiglu', qkv_bias=True), 'Qwen2ForCausalLM', 'silu'),
    (dict(mlp='swiglu', qk_norm=True, head_dim=16, n_kv_head=2), 'Qwen3ForCausalLM', 'silu'),
    (dict(pos_emb='learned', norm='layernorm', mlp='gelu_tanh'), 'GPT2LMHeadModel', 'gelu_pytorch_tanh'),
    (dict(pos_emb='learned', norm='layernorm', mlp='gelu', bias=True, norm_eps=1e-6), 'GPT2LMHeadModel', 'gelu'),
]
IDS = ['arcee_gelu', 'arcee_relu2', 'arcee_gelu_tanh', 'llama', 'qwen2', 'qwen3', 'gpt2', 'gpt2_gelu']


def model_args(**settings):
    return GPTConfig(**{**TINY, 'vocab_size': 70, **settings}).__dict__.copy()


def resolved(args):
    """The GPTConfig fields that define the function, with 0 = 'the usual value' spelled out (config.json does)."""
    c = GPTConfig(**args)
    rms = c.norm == 'rmsnorm'
    return dict(args, n_kv_head=c.kv_heads, head_dim=c.head_size, mlp_hidden=mlp_hidden_size(c),
                norm_eps=c.norm_eps or (1e-6 if rms else 1e-5), dropout=0.0, zero_init_proj=False)


def random_gpt(args, seed=0):
    """A GPT of args whose norms and biases are not at their init (1 and 0), so that dropping one shows."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def read_back(folder):
    with open(os.path.join(folder, 'config.json')) as f:
        hf = json.load(f)
    return hf, GPT.from_state_dict(GPTConfig(**gpt_config(hf, folder)), read_hf_weights(folder, hf)).eval()


@pytest.mark.parametrize('settings,arch,activation', FAMILIES, ids=IDS)
def test_each_architecture_exports_as_the_family_that_computes_it(tmp_path, settings, arch, activation):
    args = model_args(**settings)
    model = random_gpt(args)
    hf, state = hf_model(model.state_dict(), args)
    assert hf['architectures'] == [arch] and hf['torch_dtype'] == 'float32'
    assert hf.get('hidden_act', hf.get('activation_function')) == activation
    save_hf_model(state, hf, str(tmp_path), None, {})
    _, exported = read_back(str(tmp_path))
    loaded = exported.config.__dict__
    if arch == 'GPT2LMHeadModel':  # GPT-2 has every bias: a model without them gets zeros, the same function
        assert loaded['bias'] and all(not v.any() for k, v in exported.state_dict().items() if k not in state)
        loaded = dict(loaded, bias=args['bias'])
    assert resolved(loaded) == resolved(args)
    x = torch.randint(0, args['vocab_size'], (2, args['block_size']), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the same float32 weights (written and read back unchanged) through the same GPT code: the same kernels on
        # the same numbers, so bit-identical on one machine; GPT-2's added zero biases add exact zeros
        assert torch.equal(exported(x)[0], model(x)[0])


@pytest.mark.parametrize('settings,named', [
    (dict(qk_norm=True, tie_embeddings=False), ['qk_norm=True', "mlp='gelu'"]),  # config/speedrun_cpu.py's model
    (dict(logit_softcap=15.0), ['logit_softcap=15.0']),
    (dict(norm='layernorm'), ["norm='layernorm' with pos_emb='rope'"]),
    (dict(pos_emb='learned'), ["norm='rmsnorm' with pos_emb='learned'"]),
    (dict(pos_emb='learned', norm='layernorm', mlp='swiglu', n_kv_head=2), ["mlp='swiglu'", 'n_kv_head=2']),
    (dict(mlp='relu2', qkv_bias=True), ['qkv_bias=True']),
])
def test_models_no_family_computes_are_refused_naming_the_settings(settings, named):
    with pytest.raises(UserError) as e:
        hf_model({}, model_args(**settings))
    assert all(s in str(e.value) for s in named) and 'Models that export' in str(e.value)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp('export')
    (root / 'corpus.txt').write_text("What is 12+34? 46. Reverse 123: 321.\n" * 20)
    return prepare(str(root / 'corpus.txt'), str(root / 'data'), tokenizer='char')


def checkpoint(path, data_dir, model, tokenizer, **fields):
    """A checkpoint of the shape train.py writes (the fields export.py reads)."""
    save_checkpoint(str(path), dict(kind='gpt', model=model.state_dict(), model_args=model.model_args(),
                                    tokenizer=tokenizer.identity(), data_dir=os.path.abspath(data_dir),
                                    config={'training_type': 'from_scratch'}, **fields))


def test_export_py_writes_the_default_model_as_arcee(tmp_path, data_dir):
    tokenizer = load_tokenizer(data_dir)
    model = random_gpt(model_args(vocab_size=tokenizer.vocab_size))
    checkpoint(tmp_path / 'ckpt.pt', data_dir, model, tokenizer)
    p = run(['export.py', str(tmp_path / 'ckpt.pt'), str(tmp_path / 'hf')])
    assert 'ArceeForCausalLM' in p.stdout
    assert {'config.json', 'model.safetensors', 'generation_config.json', 'tokenizer_config.json'} <= set(
        os.listdir(tmp_path / 'hf'))
    hf, exported = read_back(str(tmp_path / 'hf'))
    assert hf['hidden_act'] == 'gelu' and hf['tie_word_embeddings']
    x = torch.randint(0, tokenizer.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(x)[0], model(x)[0])  # as in the test above
    text = "Reverse 321: 123.\n"
    assert load_hf_tokenizer(str(tmp_path / 'hf')).encode(text) == tokenizer.encode(text)


@pytest.mark.slow
def test_a_lora_runs_merged_model_exports_and_its_adapters_alone_do_not(tmp_path, data_dir):
    chat = ChatTokenizer(load_tokenizer(data_dir))  # a fine-tune: the chat template's tokens after the base's
    base = random_gpt(model_args(vocab_size=chat.vocab_size, mlp='swiglu'))
    checkpoint(tmp_path / 'base.pt', data_dir, base, chat)
    apply_lora(base, r=4, lora_alpha=8, target_modules='all-linear')
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith('lora_B'):  # B starts at zero: make the adapters change the function
                p.copy_(0.1 * torch.randn_like(p))
    save_merged(str(tmp_path), base, True, model_args=base.model_args(), config={'training_type': 'lora'},
                tokenizer=chat.identity(), data_dir=os.path.abspath(data_dir))
    run(['export.py', str(tmp_path / 'merged.pt'), str(tmp_path / 'hf')])
    hf, exported = read_back(str(tmp_path / 'hf'))
    assert hf['architectures'] == ['LlamaForCausalLM'] and hf['vocab_size'] == chat.vocab_size
    x = torch.randint(0, chat.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the adapters folded into the weights: equal up to float32 rounding of the fold
        torch.testing.assert_close(exported(x)[0], base(x)[0], atol=1e-5, rtol=0)
    chat_turns = [{'role': 'user', 'content': 'What is 12+34?'}, {'role': 'assistant', 'content': '46.'}]
    exported_tokenizer = load_hf_tokenizer(str(tmp_path / 'hf'))  # the chat template and its tokens came along
    assert exported_tokenizer.encode_chat(chat_turns) == chat.encode_chat(chat_turns)
    assert exported_tokenizer.stop_ids == [chat.eos_id]
    save_checkpoint(str(tmp_path / 'ckpt.pt'), dict(kind='lora', model=lora_state_dict(base), config={},
                                                    base_checkpoint=str(tmp_path / 'base.pt'), base_hash='',
                                                    model_args={}, data_dir='', tokenizer={}))
    p = run(['export.py', str(tmp_path / 'ckpt.pt'), str(tmp_path / 'adapter')], check=False)
    assert_user_error(p, 'Export merged.pt')
    assert not (tmp_path / 'adapter').exists()


@pytest.mark.slow
def test_export_py_refuses_speedrun_cpus_model_and_a_missing_tokenizer_writing_nothing(tmp_path, data_dir):
    with open(os.path.join(ROOT, 'config', 'speedrun_cpu.py')) as f:
        settings = {}
        exec(f.read(), {}, settings)
    tokenizer = load_tokenizer(data_dir)
    fields = GPTConfig.__dataclass_fields__
    args = dict({k: v for k, v in settings.items() if k in fields}, vocab_size=tokenizer.vocab_size)
    checkpoint(tmp_path / 'speedrun.pt', data_dir, GPT(GPTConfig(**args)), tokenizer)
    p = run(['export.py', str(tmp_path / 'speedrun.pt'), str(tmp_path / 'out' / 'hf')], check=False)
    assert_user_error(p, 'qk_norm=True')
    assert not (tmp_path / 'out').exists()
    checkpoint(tmp_path / 'moved.pt', tmp_path / 'gone', random_gpt(model_args(vocab_size=tokenizer.vocab_size)),
               tokenizer)  # its dataset folder moved away since
    p = run(['export.py', str(tmp_path / 'moved.pt'), str(tmp_path / 'out' / 'hf')], check=False)
    assert_user_error(p, 'no longer exists')
    assert not (tmp_path / 'out').exists()
    p = run(['export.py', str(tmp_path / 'moved.pt'), str(tmp_path / 'out' / 'hf'), '--dtype=fp8'], check=False)
    assert_user_error(p, '--dtype=fp8: write the weights in one of float32, bfloat16, float16')
    assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_export_into_a_folder_it_cannot_create_or_write_is_explained_leaving_nothing(tmp_path, data_dir):
    import resource
    import signal
    tokenizer = load_tokenizer(data_dir)
    ckpt = str(tmp_path / 'ckpt.pt')
    checkpoint(ckpt, data_dir, random_gpt(model_args(vocab_size=tokenizer.vocab_size)), tokenizer)
    (tmp_path / 'somefile').write_text('')
    for dest, says in [('/dev/null/x', '/dev/null is a file, not a folder'),
                       (str(tmp_path / 'somefile' / 'sub'), 'somefile is a file, not a folder'),
                       ('/proc/x', 'cannot write the export into /proc (')]:
        p = run(['export.py', ckpt, dest], check=False)
        assert_user_error(p, says)

    # as a full disk: the tokenizer (written first, by the tokenizers library) or the weights
    for limit in (64, 4096):
        def file_size_limit():  # Python ignores SIGXFSZ (so do we, to be sure): the write fails with EFBIG
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        p = run(['export.py', ckpt, str(tmp_path / 'new' / 'hf')], check=False, preexec_fn=file_size_limit)
        assert_user_error(p, 'File too large', 'ulimit -f')
        assert ('tokenizer.json' in p.stderr) == (limit == 64), p.stderr
        assert 'Traceback' not in p.stderr and sorted(os.listdir(tmp_path)) == ['ckpt.pt', 'somefile']  # no temp folder


def test_llama_biases_load_only_as_the_pair_nanotrains_bias_is():
    hf, _ = hf_model({}, model_args(mlp='swiglu', bias=True))
    assert (hf['attention_bias'], hf['mlp_bias']) == (True, True) and gpt_config(hf, 'llama')['bias']
    with pytest.raises(UserError, match='attention_bias=True, mlp_bias=False is not supported'):
        gpt_config(dict(hf, mlp_bias=False), 'llama')


@pytest.mark.slow
def test_a_runs_chat_template_variables_are_the_exported_templates_defaults(tmp_path):
    """A Qwen3 fine-tune rendered with enable_thinking=False exports a template that transformers (and vLLM) render
    that way without being told; the text and ids are transformers' on the same export (exports.json, written by
    tests/fixtures/make_export_fixtures.py), and a caller's own enable_thinking still wins."""
    fixtures = os.path.join(os.path.dirname(__file__), 'fixtures', 'hf')
    with open(os.path.join(fixtures, 'expected', 'exports.json'), encoding='utf-8') as f:
        expected = next(e for e in json.load(f) if e['base'] == 'qwen3')
    ckpt = load_hf_checkpoint(os.path.join(fixtures, 'qwen3'))
    save_checkpoint(str(tmp_path / 'ckpt.pt'), dict(ckpt, chat_template_variables=expected['chat_template_variables'],
                                                    config={'training_type': 'sft'}))
    run(['export.py', str(tmp_path / 'ckpt.pt'), str(tmp_path / 'hf')])
    with open(tmp_path / 'hf' / 'tokenizer_config.json', encoding='utf-8') as f:
        template = json.load(f)['chat_template']
    assert template == expected['chat_template'], 'not the one transformers rendered (if intended: re-run the fixture)'
    exported = load_hf_tokenizer(str(tmp_path / 'hf'))  # no variables, as transformers renders it
    thinking = load_hf_tokenizer(str(tmp_path / 'hf'), {'enable_thinking': True})
    for case in expected['cases']:
        text = exported.render(case['messages'], case['add_generation_prompt'])
        assert text == case['text'] and exported.encode(text) == case['ids'], case['case']
        assert thinking.render(case['messages'], case['add_generation_prompt']) == case['thinking_text']


def test_a_folders_named_templates_are_exported_with_the_runs_variables(tmp_path):
    """additional_chat_templates/tool_use.jinja (transformers' layout of a tool_use template) goes into the export
    beside chat_template.jinja, each given the run's chat_template_variables as defaults, so the export renders a
    conversation with tools as the run did."""
    folder = tmp_path / 'qwen2'
    shutil.copytree(os.path.join(os.path.dirname(__file__), 'fixtures', 'hf', 'qwen2'), folder)
    config = json.loads((folder / 'tokenizer_config.json').read_text())
    (folder / 'chat_template.jinja').write_text(config.pop('chat_template'))
    (folder / 'tokenizer_config.json').write_text(json.dumps(config))
    (folder / 'additional_chat_templates').mkdir()
    tool_use = "{{ 'tools: ' + tools | map(attribute='function.name') | join(',') + style + '\\n' }}"
    (folder / 'additional_chat_templates' / 'tool_use.jinja').write_text(tool_use + (folder / 'chat_template.jinja').read_text())
    save_checkpoint(str(tmp_path / 'ckpt.pt'), dict(load_hf_checkpoint(str(folder)), config={'training_type': 'sft'},
                                                    chat_template_variables={'style': ' (brief)'}))
    run(['export.py', str(tmp_path / 'ckpt.pt'), str(tmp_path / 'hf')])
    assert sorted(os.listdir(tmp_path / 'hf' / 'additional_chat_templates')) == ['tool_use.jinja']
    turns, tools = [{'role': 'user', 'content': 'Hi'}], [{'type': 'function', 'function': {'name': 'get_weather'}}]
    trained = load_hf_tokenizer(str(folder), {'style': ' (brief)'})
    exported = load_hf_tokenizer(str(tmp_path / 'hf'))  # no variables, as transformers renders it
    assert exported.render(turns, tools=tools) == trained.render(turns, tools=tools)
    assert exported.render(turns, tools=tools).startswith('tools: get_weather (brief)\n')
    assert exported.render(turns) == trained.render(turns)
