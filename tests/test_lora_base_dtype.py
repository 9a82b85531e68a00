"""LoRA with the frozen base kept in the run's 16-bit dtype (lora_base_dtype, lora.cast_frozen_base): what is
stored in which dtype, training that is the float32 base's bit for bit (autocast rounds a float32 weight to bf16
at every use, exactly as storing it in bf16 does), merged.pt, train.py on a published model (resume, export)
and the settings that are refused."""

import copy
import os

import pytest
import torch

from configurator import UserError
from conftest import assert_user_error, dpo, evals, fine_tune, hf_fixture, load, load_gpt, run, train_losses, val_losses
from hf.checkpoint import load_hf_checkpoint
from lm.lora import (apply_lora, cast_frozen_base, check_lora_base_dtype, disable_adapters, low_rank_delta,
                     lora_optimizer, lora_state_dict, merged_state_dict)
from model import GPT, GPTConfig


BF16_AUTOCAST = torch.autocast('cpu', dtype=torch.bfloat16)


def is_linear_weight(name):
    """The weight of one of the blocks' Linear layers (attn.q/k/v/proj, mlp.fc/gate/proj)."""
    return name.endswith('.weight') and ('.attn.' in name or '.mlp.' in name)


def grown_gpt(tie):
    """A tiny pretrained-like GPT (biases, SwiGLU) with 4 chat tokens added to its 16."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=16, bias=True, mlp='swiglu',
                          tie_embeddings=tie))
    model.resize_vocab(20)
    return model


def lora_pair(tie, bias='none'):
    """The same LoRA model twice: with its base in float32, and with it cast to bf16 (before apply_lora, as
    build_model does)."""
    base = grown_gpt(tie)
    models = copy.deepcopy(base), copy.deepcopy(base)
    cast_frozen_base(models[1], torch.bfloat16)
    for model in models:
        torch.manual_seed(1)
        apply_lora(model, r=4, lora_alpha=8, target_modules='attn.q,mlp.fc', added_tokens=4, bias=bias)
    return models


@pytest.mark.parametrize('tie', [True, False])
def test_only_the_blocks_linear_weights_are_16_bit(tie):
    _, model = lora_pair(tie, bias='lora_only')
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    linear_weights = {n for n in dtypes if is_linear_weight(n)}
    assert len(linear_weights) == 2 * 7  # q, k, v, proj, fc, gate, proj in each of the 2 blocks
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == linear_weights
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(dtypes[n] == torch.float32 for n in trained)  # adapters, added rows, trained biases
    assert (model.lm_head.weight is model.transformer.wte.weight) == tie and dtypes['transformer.wte.weight'] == torch.float32


@pytest.mark.comparison
@pytest.mark.parametrize('tie', [True, False])
def test_training_on_a_bf16_base_is_the_float32_bases_under_the_same_autocast_bit_for_bit(tie):
    """Under bf16 autocast every Linear rounds its float32 weight to bf16 (round to nearest even, as .to() does)
    before it computes, so a weight stored in bf16 feeds the same operations: loss, gradients and Adam steps are
    equal, not merely close. Only the storage changes."""
    models = lora_pair(tie, bias='lora_only')
    optimizers = [lora_optimizer(m, 0.1, 1e-2, (0.9, 0.95), 'cpu') for m in models]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randint(20, (4, 8), generator=g), torch.randint(20, (4, 8), generator=g)
        losses = []
        for model, optimizer in zip(models, optimizers):
            with BF16_AUTOCAST:
                losses.append(model(x, y)[1])
            losses[-1].backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(*losses)
    adapters = [lora_state_dict(m) for m in models]
    assert all(torch.equal(v, adapters[1][k]) for k, v in adapters[0].items())
    with BF16_AUTOCAST:
        assert torch.equal(models[0](x)[0], models[1](x)[0])
        with disable_adapters(models[0]), disable_adapters(models[1]):  # DPO's reference: the 16-bit base too
            assert torch.equal(models[0](x)[0], models[1](x)[0])


@pytest.mark.comparison
@pytest.mark.parametrize('tie', [True, False])
def test_merged_is_the_16_bit_base_upcast_plus_the_adapters(tie):
    _, model = lora_pair(tie)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('lora_B', 'added_rows')):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    merged = merged_state_dict(model)
    assert all(v.dtype == torch.float32 for v in merged.values())
    assert (merged['lm_head.weight'] is merged['transformer.wte.weight']) == tie
    for name, module in model.transformer.h.named_modules(prefix='transformer.h'):
        if isinstance(module, torch.nn.Linear):
            upcast = module.weight.float()  # exact: every bf16 value is a float32 value
            expected = upcast + low_rank_delta(module.lora_A, module.lora_B, module.scaling) \
                if hasattr(module, 'lora_A') else upcast
            assert torch.equal(merged[name + '.weight'], expected), name
    assert torch.equal(merged['transformer.wte.weight'][-4:], model.transformer.wte.added_rows)
    GPT(model.config).load_state_dict(merged)  # strict: a plain GPT


def test_settings_that_cannot_work_are_refused():
    # a run that is not a LoRA run is refused by its script (test_scripts_refuse_them_with_exit_status_2)
    check_lora_base_dtype('float32', torch.float32, 'fsdp')
    check_lora_base_dtype('bfloat16', torch.bfloat16, 'ddp')
    with pytest.raises(UserError, match=r"dtype resolves to float32 here\. Set --dtype=bfloat16"):
        check_lora_base_dtype('bfloat16', torch.float32, 'ddp')
    with pytest.raises(UserError, match=r"needs a run that computes in float16.*resolves to bfloat16"):
        check_lora_base_dtype('float16', torch.bfloat16, 'ddp')
    with pytest.raises(UserError, match=r"parallel='fsdp'.*lora_base_dtype='float32', or parallel='ddp'"):
        check_lora_base_dtype('bfloat16', torch.bfloat16, 'fsdp')


@pytest.mark.parametrize('script, args, message', [
    ('train.py', ['--training_type=sft', '--dtype=bfloat16'], "set training_type='lora'"),
    ('train.py', ['--training_type=lora'], 'Set --dtype=bfloat16'),  # dtype='auto' is float32 on a CPU
    ('train.py', ['--training_type=lora', '--lora_base_dtype=int8'], "lora_base_dtype='int8' must be one of"),
    ('train_dpo.py', ['--dtype=bfloat16'], 'set use_lora=True'),
    ('train.py', ['--training_type=sft', '--lora_base_dtype=nf4'], "but this run is not one: it trains every weight"),
    ('train_rl.py', ['--lora_base_dtype=nf4'], 'set use_lora=True')])
def test_scripts_refuse_them_with_exit_status_2(tmp_path, script, args, message):
    p = run([script, '--device=cpu', '--lora_base_dtype=bfloat16', f'--out_dir={tmp_path / "out"}', *args],
            check=False)
    assert_user_error(p, message)
    assert not os.path.exists(tmp_path / 'out')  # refused before the run touches out_dir


@pytest.mark.slow
def test_train_py_on_a_bf16_base_resumes_bit_exactly_matches_float32_and_exports(tmp_path, task):
    """A published model (the SmolLM2 fixture, tied) with lora_base_dtype='bfloat16', stopped at step 2 and
    continued to 4, against a float32 base trained straight to 4 under the same bf16 autocast: equal losses and
    adapters (see above: only the storage differs)."""
    common = ['--dtype=bfloat16', '--learning_rate=3e-2', '--max_iters=4', '--eval_interval=2', '--lr_decay_iters=4',
              '--exact_match_examples=0', '--lora_target_modules=all-linear', '--lora_r=4', '--lora_alpha=8']
    bf16, f32 = tmp_path / 'bf16', tmp_path / 'f32'
    fine_tune(bf16, task, 'smollm2', *common, '--lora_base_dtype=bfloat16', '--max_iters=2', training_type='lora')
    fine_tune(bf16, task, 'smollm2', *common, '--lora_base_dtype=bfloat16', training_type='lora')
    fine_tune(f32, task, 'smollm2', *common, training_type='lora')
    assert sorted(train_losses(bf16)) == [1, 2, 3, 4] and train_losses(bf16) == train_losses(f32)
    losses = val_losses(bf16)
    assert losses[-1] < losses[0], losses
    adapters, f32_adapters = load(bf16 / 'ckpt.pt')['model'], load(f32 / 'ckpt.pt')['model']
    assert all(v.dtype == torch.float32 and torch.equal(v, f32_adapters[k]) for k, v in adapters.items())

    merged = load(bf16 / 'merged.pt')['model']
    base = load_hf_checkpoint(hf_fixture('smollm2'))['model']
    for name, weight in merged.items():
        upcast = base[name].to(torch.bfloat16).float() if is_linear_weight(name) else base[name]
        layer = name.removesuffix('.weight')
        if layer + '.lora_A' in adapters:
            upcast = upcast + low_rank_delta(adapters[layer + '.lora_A'], adapters[layer + '.lora_B'], 8 / 4)
        assert weight.dtype == torch.float32 and torch.equal(weight, upcast), name
    run(['export.py', str(bf16 / 'merged.pt'), str(tmp_path / 'exported')])
    exported = load_gpt(str(tmp_path / 'exported'))
    assert all(torch.equal(v, merged[k]) for k, v in exported.state_dict().items())


@pytest.mark.slow
def test_dpo_with_a_bf16_base_and_its_reference_starts_as_the_float32_bases_run(tmp_path, dpo_env):
    """train_dpo.py use_lora: the reference is the policy with its adapters disabled, so its 16-bit base too;
    under the same bf16 autocast the step-0 metrics equal the float32 base's bit for bit. (Later ones differ: for a
    nanotrain checkpoint the float32 path draws a random initialisation before loading, which the 16-bit path,
    built around the checkpoint's tensors, skips, so the adapters' A matrices start from other random draws.)"""
    common = ['--use_lora=True', '--lora_r=2', '--max_iters=2', '--eval_interval=1', '--dtype=bfloat16',
              '--exact_match_examples=0']
    dpo(dpo_env, tmp_path / 'bf16', *common, '--lora_base_dtype=bfloat16')
    dpo(dpo_env, tmp_path / 'f32', *common)
    bf16, f32 = evals(tmp_path / 'bf16'), evals(tmp_path / 'f32')
    assert len(bf16) == 3 and bf16[0]['eval/loss'] == pytest.approx(0.6931, abs=1e-4)
    assert {k: v for k, v in bf16[0].items() if k.startswith('eval/')} == \
        {k: v for k, v in f32[0].items() if k.startswith('eval/')}
    assert bf16[2]['eval/rewards/margins'] != 0  # the adapters trained
    merged = load(tmp_path / 'bf16' / 'merged.pt')['model']
    assert all(v.dtype == torch.float32 for v in merged.values())
