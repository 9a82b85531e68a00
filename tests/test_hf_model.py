"""Hugging Face checkpoints (hf/checkpoint.py): logits and greedy tokens equal to transformers' on the
fixture models of every family (tests/fixtures/make_hf_fixtures.py wrote them with transformers), sharded
and .bin weights, the export round trip, LoRA's Hugging Face target names, and clear errors for folders
that do not fit."""

import dataclasses
import json
import os
import random
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from configurator import UserError
from conftest import HF_FIXTURES, hf_fixture, load_gpt, read_json_file
from hf.checkpoint import gpt_config, hf_model, load_hf_checkpoint, peft_name, save_hf_model, save_peft_adapter
from lm.lora import apply_lora, lora_state_dict, merged_state_dict
from model import GPT, GPTConfig

FAMILIES = ['llama', 'smollm2', 'qwen2', 'qwen2_sharded', 'mistral', 'qwen3', 'gpt2', 'arcee', 'arcee_relu2']


def expected(name):
    return load_file(os.path.join(HF_FIXTURES, 'expected', f"{name.removesuffix('_sharded')}.safetensors"))


@pytest.mark.comparison
@pytest.mark.parametrize('name', FAMILIES)
def test_logits_equal_transformers(name):
    # fp32 on both sides; the same operations up to summation order (fused q/k/v matmul, attention kernel):
    # differences are a few float32 ulps of logits of size ~1, far below 1e-5
    model, want = load_gpt(hf_fixture(name)), expected(name)
    with torch.no_grad():
        logits, _ = model(want['input_ids'])
    assert want['logits'].abs().max() > 0.5  # not a degenerate model whose logits all agree anyway
    torch.testing.assert_close(logits, want['logits'], atol=1e-5, rtol=0)


@pytest.mark.comparison
@pytest.mark.parametrize('name', FAMILIES)
@pytest.mark.parametrize('use_kv_cache', [True, False])
def test_greedy_tokens_equal_transformers(name, use_kv_cache):
    model, want = load_gpt(hf_fixture(name)), expected(name)
    new_tokens = want['greedy'].size(1) - want['prompt'].size(1)
    out = model.generate(want['prompt'], new_tokens, temperature=0, use_kv_cache=use_kv_cache)
    assert out.tolist() == want['greedy'].tolist()


def test_family_shapes_come_from_config_json():
    llama = gpt_config(read_json_file(hf_fixture('llama/config.json')), 'llama')
    assert llama['n_kv_head'] < llama['n_head'] and llama['rope_scaling']['factor'] > 1 and not llama['tie_embeddings']
    assert gpt_config(read_json_file(hf_fixture('qwen2/config.json')), 'qwen2')['qkv_bias']
    qwen3 = gpt_config(read_json_file(hf_fixture('qwen3/config.json')), 'qwen3')
    assert qwen3['qk_norm'] and qwen3['head_dim'] * qwen3['n_head'] != qwen3['n_embd']
    mistral = read_json_file(hf_fixture('mistral/config.json'))
    assert gpt_config(mistral, 'mistral')['block_size'] == mistral['max_position_embeddings'] > mistral['sliding_window']
    gpt2 = gpt_config(read_json_file(hf_fixture('gpt2/config.json')), 'gpt2')
    assert (gpt2['pos_emb'], gpt2['norm'], gpt2['mlp'], gpt2['bias']) == ('learned', 'layernorm', 'gelu_tanh', True)


def test_tied_embeddings_load_as_one_parameter():
    model = load_gpt(hf_fixture('smollm2'))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not load_gpt(hf_fixture('llama')).lm_head.weight is load_gpt(hf_fixture('llama')).transformer.wte.weight


def test_sharded_and_single_file_weights_are_the_same():
    single, sharded = load_gpt(hf_fixture('qwen2')).state_dict(), load_gpt(hf_fixture('qwen2_sharded')).state_dict()
    assert len(os.listdir(hf_fixture('qwen2_sharded'))) > len(os.listdir(hf_fixture('qwen2')))
    assert single.keys() == sharded.keys() and all(torch.equal(single[k], sharded[k]) for k in single)


def stored_tensors(folder):
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith('.safetensors'):
            with safe_open(os.path.join(folder, name), framework='pt') as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        elif name.endswith('.bin'):
            tensors.update(torch.load(os.path.join(folder, name), weights_only=True))
    return {k: v for k, v in tensors.items() if not k.endswith(('attn.bias', 'attn.masked_bias'))}


@pytest.mark.parametrize('name', ['llama', 'smollm2', 'qwen2', 'mistral', 'qwen3', 'gpt2', 'arcee', 'arcee_relu2'])
def test_export_round_trip_is_bit_identical(tmp_path, name):
    source = hf_fixture(name)
    ckpt = load_hf_checkpoint(source)
    save_hf_model(ckpt['model'], ckpt['hf_config'], str(tmp_path), source, ckpt['generation_config'])
    before, after = stored_tensors(source), stored_tensors(str(tmp_path))
    assert before.keys() == after.keys()  # a tied lm_head is not written twice, as transformers saves it
    assert all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in before)
    assert read_json_file(str(tmp_path / 'config.json')) == read_json_file(os.path.join(source, 'config.json'))
    assert (tmp_path / 'tokenizer.json').read_bytes() == open(os.path.join(source, 'tokenizer.json'), 'rb').read()
    assert os.stat(tmp_path / 'model.safetensors').st_mode & 0o044 == 0o044  # readable by a server's own user


def test_export_shards_above_the_size_limit(tmp_path):
    ckpt = load_hf_checkpoint(hf_fixture('llama'))
    save_hf_model(ckpt['model'], ckpt['hf_config'], str(tmp_path), hf_fixture('llama'), max_shard_bytes=100_000)
    index = read_json_file(str(tmp_path / 'model.safetensors.index.json'))
    assert len(set(index['weight_map'].values())) > 1
    reloaded = load_gpt(str(tmp_path)).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in load_gpt(hf_fixture('llama')).state_dict().items())


def test_bfloat16_weights_load_to_float32_and_export_back_in_bfloat16(tmp_path):
    folder = tmp_path / 'bf16'
    shutil.copytree(hf_fixture('smollm2'), folder)
    tensors = load_file(str(folder / 'model.safetensors'))
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(folder / 'model.safetensors'))
    config = read_json_file(str(folder / 'config.json'))
    (folder / 'config.json').write_text(json.dumps(dict(config, dtype='bfloat16', torch_dtype='bfloat16')))
    ckpt = load_hf_checkpoint(str(folder))
    assert all(t.dtype == torch.float32 for t in ckpt['model'].values())
    assert torch.equal(ckpt['model']['transformer.wte.weight'], tensors['model.embed_tokens.weight'].bfloat16().float())
    assert all(t.dtype == torch.bfloat16 for t in load_hf_checkpoint(str(folder), as_stored=True)['model'].values())
    save_hf_model(ckpt['model'], ckpt['hf_config'], str(tmp_path / 'out'), str(folder))
    after = load_file(str(tmp_path / 'out' / 'model.safetensors'))
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], v.bfloat16()) for k, v in tensors.items())


def test_lora_accepts_hugging_face_target_names():
    model = load_gpt(hf_fixture('llama'))
    assert apply_lora(model, 4, 8, target_modules='q_proj,v_proj') == \
        [f'transformer.h.{i}.attn.{m}' for i in range(model.config.n_layer) for m in ('q', 'v')]
    gpt2 = load_gpt(hf_fixture('gpt2'))
    wrapped = apply_lora(gpt2, 4, 8, target_modules='c_attn,c_proj')
    assert sorted({w.split('.', 3)[-1] for w in wrapped}) == ['attn.k', 'attn.proj', 'attn.q', 'attn.v', 'mlp.proj']
    with pytest.raises(UserError, match='q_proj'):
        apply_lora(load_gpt(hf_fixture('llama')), 4, 8, target_modules='query')


def broken_copy(tmp_path, name='llama'):
    folder = tmp_path / name
    shutil.copytree(hf_fixture(name), folder)
    return folder


def edit_config(folder, **changes):
    config = read_json_file(str(folder / 'config.json'))
    (folder / 'config.json').write_text(json.dumps(dict(config, **changes)))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    folder = broken_copy(tmp_path)
    edit_config(folder, architectures=['GemmaForCausalLM'])
    with pytest.raises(UserError, match=r'GemmaForCausalLM is not supported.*LlamaForCausalLM.*GPT2LMHeadModel'):
        load_hf_checkpoint(str(folder))


def test_missing_unexpected_misshapen_and_truncated_weights_are_clear_errors(tmp_path):
    folder = broken_copy(tmp_path)
    weights = str(folder / 'model.safetensors')
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != 'model.layers.1.mlp.up_proj.weight'}, weights)
    with pytest.raises(UserError, match=r'lack 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight'):
        load_hf_checkpoint(str(folder))
    save_file(dict(tensors, **{'model.layers.1.mlp.extra.weight': torch.zeros(2)}), weights)
    with pytest.raises(UserError, match=r'model\.safetensors: tensor model\.layers\.1\.mlp\.extra\.weight is not'):
        load_hf_checkpoint(str(folder))
    save_file(tensors, weights)
    edit_config(folder, intermediate_size=read_json_file(str(folder / 'config.json'))['intermediate_size'] + 8)
    with pytest.raises(UserError, match=r'tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape'):
        load_hf_checkpoint(str(folder))
    shutil.copy(hf_fixture('llama/config.json'), folder / 'config.json')
    data = open(weights, 'rb').read()
    open(weights, 'wb').write(data[:len(data) // 2])
    with pytest.raises(UserError, match=r'model\.safetensors .*truncated or corrupt'):
        load_hf_checkpoint(str(folder))
    os.remove(weights)
    with pytest.raises(UserError, match='holds no weights'):
        load_hf_checkpoint(str(folder))


def test_pytorch_model_bin_in_either_torch_format_loads_as_the_safetensors(tmp_path):
    """A folder with pytorch_model.bin (an older model's weights) instead of model.safetensors: the same state,
    whether torch.save wrote it as a zip (torch >= 1.6, memory-mapped) or in the format before (which mmap cannot
    read: it was refused as 'truncated or corrupt')."""
    want = load_hf_checkpoint(hf_fixture('llama'))['model']
    for zipped in (True, False):
        folder = broken_copy(tmp_path / str(zipped))
        torch.save(load_file(folder / 'model.safetensors'), folder / 'pytorch_model.bin',
                   _use_new_zipfile_serialization=zipped)
        os.remove(folder / 'model.safetensors')
        got = load_hf_checkpoint(str(folder))['model']
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), zipped


class Planted:
    """An object whose unpickling would run code: weights_only refuses it."""
    def __reduce__(self):
        return (os.system, ('touch planted',))


def test_a_pytorch_model_bin_that_holds_no_weights_is_refused_naming_it(tmp_path):
    """A .bin of other objects (which weights_only refuses: loading them can run code), of random bytes, or of a list
    is a UserError naming the file (they were tracebacks, and train.py left its run.lock)."""
    for name, write in (('object', lambda path: torch.save({'w': Planted()}, path)),
                        *((f'bytes{seed}', lambda path, seed=seed: path.write_bytes(random.Random(seed).randbytes(1000)))
                          for seed in range(20)),  # the unpickler fails in many ways: an IndexError, a KeyError
                        ('list', lambda path: torch.save([1, 2, 3], path))):
        folder = broken_copy(tmp_path / name)
        os.remove(folder / 'model.safetensors')
        write(folder / 'pytorch_model.bin')
        with pytest.raises(UserError, match=re.escape(str(folder / 'pytorch_model.bin'))):
            load_hf_checkpoint(str(folder))
    assert not os.path.exists('planted')


def test_missing_shard_is_named(tmp_path):
    folder = broken_copy(tmp_path, 'qwen2_sharded')
    shard = sorted(f for f in os.listdir(folder) if f.startswith('model-'))[-1]
    os.remove(folder / shard)
    with pytest.raises(UserError, match=f'lists {shard}, which is missing'):
        load_hf_checkpoint(str(folder))


def test_a_malformed_shard_index_is_named_and_names_no_file_outside_its_folder(tmp_path):
    """An index whose weight_map is no mapping (was an AttributeError), or names a file outside the folder (an
    absolute path, ../): refused before any file it names is opened."""
    folder = broken_copy(tmp_path, 'qwen2_sharded')
    index = folder / 'model.safetensors.index.json'
    outside = tmp_path / 'outside.safetensors'
    shutil.copy(folder / sorted(f for f in os.listdir(folder) if f.startswith('model-'))[0], outside)
    for weight_map in (5, {}, {'a': 7}, {'a': str(outside)}, {'a': '../outside.safetensors'}):
        index.write_text(json.dumps({'metadata': {}, 'weight_map': weight_map}))
        with pytest.raises(UserError, match=re.escape(f"model.safetensors.index.json: its weight_map must map each "
                                                      f"tensor's name to a weight file in the folder, got "
                                                      f"{json.dumps(weight_map)[:100]}")):
            load_hf_checkpoint(str(folder))


@pytest.mark.comparison
def test_mistral_attends_over_its_sliding_window_as_transformers_does():
    # 100 tokens past sliding_window=64: within 1e-5 as test_logits_equal_transformers; attending over every
    # earlier token instead changes the logits past the window (and only there)
    model, want = load_gpt(hf_fixture('mistral')), expected('mistral')
    window = model.config.sliding_window
    assert window == 64 < want['input_ids_long'].size(1)
    full = GPT.from_state_dict(dataclasses.replace(model.config, sliding_window=0), model.state_dict()).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(want['input_ids_long'])[0], want['logits_long'], atol=1e-5, rtol=0)
        logits = full(want['input_ids_long'])[0]
    torch.testing.assert_close(logits[:, :window], want['logits_long'][:, :window], atol=1e-5, rtol=0)
    assert (logits[:, window:] - want['logits_long'][:, window:]).abs().amax(-1).min() > 1e-3


@pytest.mark.comparison
@pytest.mark.parametrize('use_kv_cache', [True, False])
def test_mistral_greedy_tokens_past_its_sliding_window_equal_transformers(use_kv_cache):
    # transformers' greedy (its sliding-window cache), 40 -> 100 and 80 -> 110 tokens; its top-2 logits are at
    # least 1e-2 apart at every step (make_hf_fixtures.py prints it), far beyond the 1e-5 the logits agree to
    model, want = load_gpt(hf_fixture('mistral')), expected('mistral_long')
    for key in ('', '_long'):
        prompt, tokens = want['prompt' + key], want['greedy' + key]
        out = model.generate(prompt, tokens.size(1) - prompt.size(1), temperature=0, use_kv_cache=use_kv_cache)
        assert out.tolist() == tokens.tolist(), key


def test_sliding_window_comes_from_config_json_as_transformers_reads_it():
    mistral = read_json_file(hf_fixture('mistral/config.json'))
    assert gpt_config(dict(mistral, sliding_window=None), 'm')['sliding_window'] == 0  # Mistral v0.2+: full
    assert gpt_config({k: v for k, v in mistral.items() if k != 'sliding_window'}, 'm')['sliding_window'] == 4096
    # 2 layers, the window in those layer_types names or else from layer max_window_layers on
    qwen2 = dict(read_json_file(hf_fixture('qwen2/config.json')), use_sliding_window=True, sliding_window=32)
    del qwen2['layer_types']
    for settings, window in [(dict(use_sliding_window=False), 0), (dict(max_window_layers=0), 32),
                             (dict(max_window_layers=2), 0), (dict(layer_types=['sliding_attention'] * 2), 32),
                             (dict(max_window_layers=0, layer_types=['full_attention'] * 2), 0)]:
        assert gpt_config(dict(qwen2, **settings), 'q')['sliding_window'] == window, settings
    with pytest.raises(UserError, match='window in 1 of 2 layers'):
        gpt_config(dict(qwen2, max_window_layers=1), 'q')


@pytest.mark.parametrize('settings,arch', [(dict(), 'MistralForCausalLM'), (dict(qkv_bias=True), 'Qwen2ForCausalLM'),
                                           (dict(qk_norm=True), 'Qwen3ForCausalLM')])
def test_sliding_window_exports_to_a_family_that_has_it(settings, arch):
    args = dict(block_size=128, vocab_size=64, n_layer=2, n_head=2, n_embd=32, mlp='swiglu', sliding_window=16,
                **settings)
    hf, _ = hf_model({}, args)
    assert hf['architectures'] == [arch] and hf['sliding_window'] == 16
    assert gpt_config(hf, 'export') == dict(gpt_config(hf, 'export'), **args)
    with pytest.raises(UserError, match="sliding_window=16 with mlp='gelu'"):
        hf_model({}, dict(args, mlp='gelu'))
    with pytest.raises(UserError, match='sliding_window=16 with pos_emb'):
        hf_model({}, dict(args, pos_emb='learned', norm='layernorm', mlp='gelu', qk_norm=False, qkv_bias=False))


def llama_with_peft_fixture_adapter():
    """The llama fixture with nanotrain adapters holding the PEFT fixture adapter's tensors."""
    model = load_gpt(hf_fixture('llama'))
    apply_lora(model, r=4, lora_alpha=8, target_modules='q_proj,v_proj')
    peft = load_file(hf_fixture('peft_llama/adapter_model.safetensors'))
    hf = read_json_file(hf_fixture('llama/config.json'))
    names = {k: peft_name(k, hf) for k in lora_state_dict(model)}
    assert sorted(names.values()) == sorted(peft)  # the same tensors under PEFT's names
    model.load_state_dict({k: peft[p] for k, p in names.items()}, strict=False)
    return model.eval(), hf


@pytest.mark.comparison
def test_peft_adapter_gives_the_logits_peft_gives_and_exports_to_the_same_files(tmp_path):
    model, hf = llama_with_peft_fixture_adapter()
    want = load_file(os.path.join(HF_FIXTURES, 'expected', 'peft_llama.safetensors'))
    with torch.no_grad():
        torch.testing.assert_close(model(want['input_ids'])[0], want['logits_adapted'], atol=1e-5, rtol=0)
        merged = GPT.from_state_dict(model.config, merged_state_dict(model)).eval()
        torch.testing.assert_close(merged(want['input_ids'])[0], want['logits_merged'], atol=1e-5, rtol=0)
    settings = dict(lora_r=4, lora_alpha=8.0, use_rslora=False, lora_dropout=0.0)
    save_peft_adapter(lora_state_dict(model), settings, hf, hf_fixture('llama'), str(tmp_path))
    ours, theirs = load_file(str(tmp_path / 'adapter_model.safetensors')), load_file(
        hf_fixture('peft_llama/adapter_model.safetensors'))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = read_json_file(str(tmp_path / 'adapter_config.json'))
    reference = read_json_file(hf_fixture('peft_llama/adapter_config.json'))
    for key in ('peft_type', 'task_type', 'r', 'lora_alpha', 'use_rslora', 'target_modules', 'bias', 'fan_in_fan_out'):
        assert config[key] == reference[key], key


def test_flops_count_attention_over_the_runs_context_not_the_models_longest():
    model = load_gpt(hf_fixture('llama'))
    c = model.config
    assert model.flops_per_token(context=64) == model.flops_per_token() - 12 * c.n_layer * c.n_head * c.head_size * (
        c.block_size - 64)
    mistral = load_gpt(hf_fixture('mistral'))  # sliding_window=64: no token attends to more
    assert mistral.flops_per_token() == mistral.flops_per_token(context=100) == mistral.flops_per_token(context=64)
    assert mistral.flops_per_token(context=32) < mistral.flops_per_token(context=64)


def test_config_json_that_cannot_be_loaded_is_a_clear_error(tmp_path):
    folder = broken_copy(tmp_path)
    config = read_json_file(str(folder / 'config.json'))
    cases = [({k: v for k, v in config.items() if k != 'max_position_embeddings'}, 'has no max_position_embeddings'),
             (dict(config, rope_scaling={'rope_type': 'llama3', 'factor': 8.0}), 'has no low_freq_factor'),
             (dict(config, rope_scaling={'rope_type': 'yarn', 'factor': 4.0}), "RoPE scaling 'yarn' is not supported"),
             (dict(config, architectures='LlamaForCausalLM'), 'a list of one'),
             ([config], 'holds a JSON list')]
    for bad, message in cases:
        (folder / 'config.json').write_text(json.dumps(bad))
        with pytest.raises(UserError, match=message):
            load_hf_checkpoint(str(folder))
    gpt2 = broken_copy(tmp_path, 'gpt2')
    edit_config(gpt2, scale_attn_by_inverse_layer_idx=True)  # another attention: refused, not silently wrong
    with pytest.raises(UserError, match='scale_attn_by_inverse_layer_idx'):
        load_hf_checkpoint(str(gpt2))


@pytest.mark.parametrize('quantization', [
    dict(quant_method='gptq', bits=4, group_size=128), dict(quant_method='awq', bits=4, version='gemm'),
    dict(quant_method='bitsandbytes', load_in_4bit=True), dict(quant_method='fp8', fmt='e4m3')])
def test_a_quantized_model_is_refused_up_front_naming_its_method(tmp_path, quantization):
    # its weights would fail later as "truncated or corrupt" (fp8) or of "different models" (packed int tensors)
    folder = broken_copy(tmp_path)
    edit_config(folder, quantization_config=quantization)
    with pytest.raises(UserError, match=f"quant_method '{quantization['quant_method']}'.*unquantized"):
        load_hf_checkpoint(str(folder))


def test_head_dim_defaults_as_transformers_config_per_family():
    qwen3 = {k: v for k, v in read_json_file(hf_fixture('qwen3/config.json')).items() if k != 'head_dim'}
    assert gpt_config(qwen3, 'qwen3')['head_dim'] == 128  # Qwen3Config's default, not 64 / 4
    llama = {k: v for k, v in read_json_file(hf_fixture('llama/config.json')).items() if k != 'head_dim'}
    model_args = gpt_config(llama, 'llama')
    assert GPTConfig(**model_args).head_size == llama['hidden_size'] // llama['num_attention_heads']


def test_rope_settings_in_either_layout_and_malformed_ones(tmp_path):
    config = read_json_file(hf_fixture('llama/config.json'))
    published = gpt_config(config, 'llama')
    # transformers 5 writes rope_parameters, rope_theta inside it
    v5 = dict({k: v for k, v in config.items() if k not in ('rope_scaling', 'rope_theta')},
              rope_parameters=dict(config['rope_scaling'], rope_theta=config['rope_theta']))
    assert gpt_config(v5, 'llama') == published
    for key, bad in (('rope_scaling', 'linear'), ('rope_scaling', [8.0]), ('rope_parameters', 'llama3')):
        with pytest.raises(UserError, match=f"{key}=.* must be an object"):
            gpt_config(dict(config, **{key: bad}), 'llama')


def test_sizes_that_cannot_make_a_model_are_named_in_config_json_terms():
    """A corrupt or edited config.json (a size of 0, negative, fractional, a string or a bool, an epsilon or RoPE base
    not positive, heads that do not fit together) is refused naming its key as config.json spells it, before any
    tensor is made (they were tracebacks of torch's, or a model that ran on a negative epsilon); null where
    transformers takes a default is fine."""
    llama = read_json_file(hf_fixture('llama/config.json'))
    gpt2 = read_json_file(hf_fixture('gpt2/config.json'))
    for config, key, bad, says in [
            (llama, 'num_hidden_layers', 0, 'num_hidden_layers=0 must be a whole number >= 1'),
            (llama, 'hidden_size', -64, 'hidden_size=-64 must be a whole number >= 1'),
            (llama, 'intermediate_size', 'abc', 'intermediate_size="abc" must be a whole number >= 1'),
            (llama, 'num_attention_heads', 2.5, 'num_attention_heads=2.5 must be'),
            (llama, 'vocab_size', True, 'vocab_size=true must be'),
            (llama, 'head_dim', -2, 'head_dim=-2 must be a whole number (or null)'),
            (llama, 'rms_norm_eps', -1, 'rms_norm_eps=-1 must be a positive number'),
            (llama, 'rope_theta', 'x', 'rope_theta="x" must be a positive number'),
            (llama, 'rope_theta', 0, 'rope_theta=0 must be a positive number'),  # was taken as 10000, silently
            (llama, 'num_key_value_heads', 3, f'num_attention_heads={llama["num_attention_heads"]} is not a multiple '
                                              f'of num_key_value_heads=3; the file is corrupt'),
            (llama, 'head_dim', 7, 'RoPE needs an even head size but it is 7; the file is corrupt'),
            (gpt2, 'n_embd', 0, 'n_embd=0 must be a whole number >= 1'),
            (gpt2, 'layer_norm_epsilon', 0, 'layer_norm_epsilon=0 must be a positive number')]:
        with pytest.raises(UserError, match=re.escape(f'm/config.json: {says}')):
            gpt_config(dict(config, **{key: bad}), 'm')
    for key in ('head_dim', 'num_key_value_heads'):
        assert gpt_config(dict(llama, **{key: None}), 'm')
    assert gpt_config(dict(gpt2, n_inner=None), 'm')['mlp_hidden'] == 0


def test_a_peft_adapter_refuses_added_chat_token_rows_saying_why(tmp_path):
    # PEFT's trainable_token_indices index the base's own embedding rows; nanotrain's chat tokens come after them
    model, hf = llama_with_peft_fixture_adapter()
    settings = dict(lora_r=4, lora_alpha=8.0, use_rslora=False, lora_dropout=0.0)
    state = dict(lora_state_dict(model), **{'transformer.wte.added_rows': torch.zeros(4, model.config.n_embd)})
    with pytest.raises(UserError, match=r'added_rows.*trainable tokens replace rows the base model already has'
                                        r'.*merged\.pt'):
        save_peft_adapter(state, settings, hf, hf_fixture('llama'), str(tmp_path / 'adapter'))
    assert not (tmp_path / 'adapter').exists()
