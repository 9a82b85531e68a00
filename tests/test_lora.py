"""LoRA (lm/lora.py) against independent computations, and train.py with training_type='lora' through
subprocesses: adapter checkpoints, bit-exact resume, merged checkpoints for sample.py, DDP."""

import copy
import math
import shutil

import pytest
import torch
import torch.nn as nn

from configurator import UserError
from conftest import assert_user_error, load, logged, read_log, run, sft, sft_args, torchrun, train_losses
from loading import load_for_generation
from lm.lora import (LoRALinear, apply_lora, disable_adapters, lora_optimizer, lora_param_groups, lora_state_dict,
                     merge_lora, merged_copy, merged_state_dict, refresh_merged_copy, unmerge_lora)
from model import GPT, GPTConfig


def tiny_gpt(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**dict(dict(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=16), **kw)))


def nudge(model, suffix, seed):
    """Random changes to the parameters whose name ends with suffix: what training would leave behind."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def nudge_adapters(model, seed=1):
    """Random nonzero B matrices (they start at zero)."""
    nudge(model, 'lora_B', seed)


def test_wrapped_model_starts_identical_with_b_zero():
    model = tiny_gpt()
    x = torch.randint(16, (2, 8))
    before, _ = model(x)
    wrapped = apply_lora(model, r=4, lora_alpha=8)
    assert len(wrapped) == 2 * 4 and all(isinstance(model.get_submodule(n), LoRALinear) for n in wrapped)
    assert all((m.lora_B == 0).all() for m in model.modules() if isinstance(m, LoRALinear))
    after, _ = model(x)
    assert torch.equal(before, after)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {f'{n}.lora_{ab}' for n in wrapped for ab in 'AB'}


@pytest.mark.parametrize('use_rslora, scale', [(False, 8 / 4), (True, 8 / math.sqrt(4))])
def test_scaling_and_update(use_rslora, scale):
    base = nn.Linear(6, 5)
    layer = LoRALinear(base, r=4, lora_alpha=8, use_rslora=use_rslora)
    assert layer.weight is base.weight and layer.scaling == scale
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(3, 6)
    expected = x @ base.weight.T + base.bias + scale * (x @ layer.lora_A.T @ layer.lora_B.T)
    torch.testing.assert_close(layer(x), expected)
    bound = 1 / math.sqrt(6)  # Kaiming uniform with a=sqrt(5), as nn.Linear
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.std() > bound / 4


@pytest.mark.comparison
def test_merged_equals_unmerged_and_merged_state_dict_is_a_plain_gpt():
    model = tiny_gpt()
    apply_lora(model, r=4, lora_alpha=8, target_modules='all-linear')
    nudge_adapters(model)
    x = torch.randint(16, (2, 8))
    unmerged, _ = model(x)
    plain = tiny_gpt()
    plain.load_state_dict(merged_state_dict(model))  # strict: no lora_ keys left
    torch.testing.assert_close(plain(x)[0], unmerged, rtol=1e-5, atol=1e-5)
    merge_lora(model)
    torch.testing.assert_close(model(x)[0], unmerged, rtol=1e-5, atol=1e-5)
    unmerge_lora(model)
    torch.testing.assert_close(model(x)[0], unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.comparison
@pytest.mark.parametrize('base', ['float32', 'nf4'])
def test_merged_rollout_copy_computes_what_the_adapters_do_and_follows_their_training(base):
    """train_rl.py's rollouts sample from merged_copy: a plain GPT whose block weights are base + update (a 4-bit
    base dequantized), refreshed in place after each step, the rest shared (a trained bias as it trains). In
    float32 it gives the adapter model's logits up to float32 rounding; in bf16 under autocast it is as close to
    the exact (float32) logits as the adapter model under the same autocast is: each weight rounded to bf16 once
    (2^-9 relative) where autocast rounds the base and the update separately."""
    from lm.nf4 import quantize_blocks
    model = tiny_gpt(n_embd=64, bias=True)
    if base == 'nf4':
        quantize_blocks(model)
    apply_lora(model, r=4, lora_alpha=8, target_modules='attn.q,attn.v,mlp.fc', bias='all')  # attn.k, proj: frozen
    nudge_adapters(model)
    x = torch.randint(16, (2, 8))
    bf16 = torch.autocast('cpu', dtype=torch.bfloat16)
    copies = {dtype: merged_copy(model, dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert type(copies[torch.float32]) is GPT and copies[torch.bfloat16].transformer.h[0].attn.k.weight.dtype == torch.bfloat16
    for step in range(2):
        exact = model(x)[0]
        torch.testing.assert_close(copies[torch.float32](x)[0], exact, rtol=1e-5, atol=1e-5)
        with bf16:
            adapters_error = (model(x)[0].float() - exact).abs().max()
            copy_error = (copies[torch.bfloat16](x)[0].float() - exact).abs().max()
        assert 0 < copy_error <= 2 * adapters_error
        # a training step: the adapters and biases move; the copy's weights follow after a refresh
        nudge(model, 'lora_B', 2 + step)
        nudge(model, 'bias', 4 + step)
        for merged in copies.values():
            refresh_merged_copy(merged, model)
    assert all(not p.requires_grad for c in copies.values() for p in c.parameters())
    assert model.transformer.h[0].attn.q.bias.requires_grad  # the model's own still train


@pytest.mark.comparison
def test_disabled_adapters_are_the_base_model_bit_for_bit():
    base = tiny_gpt()
    model = copy.deepcopy(base)
    apply_lora(model, r=4, lora_alpha=8, lora_dropout=0.1, target_modules='all-linear')
    nudge_adapters(model)
    x = torch.randint(16, (2, 8))
    with disable_adapters(model):
        assert torch.equal(model(x)[0], base(x)[0])
    assert not torch.equal(model(x)[0], base(x)[0])
    merge_lora(model)
    with pytest.raises(RuntimeError, match='unmerge'):
        with disable_adapters(model):
            pass


@pytest.mark.parametrize('bias, trained_biases', [
    ('none', set()),
    ('lora_only', {'attn.q.bias', 'attn.v.bias'}),
    ('all', {'attn.q.bias', 'attn.k.bias', 'attn.v.bias', 'attn.proj.bias', 'mlp.fc.bias', 'mlp.proj.bias',
             'ln_1.bias', 'ln_2.bias'}),
])
def test_training_changes_only_adapters_and_chosen_biases(bias, trained_biases):
    model = tiny_gpt(bias=True, norm='layernorm', dropout=0.1)
    apply_lora(model, r=2, lora_alpha=4, lora_dropout=0.1, target_modules='attn.q,attn.v', bias=bias)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(lora_param_groups(model, 0.1), lr=1e-2)
    for _ in range(3):
        _, loss = model(torch.randint(16, (4, 8)), torch.randint(16, (4, 8)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    expected = {f'transformer.h.{i}.{name}' for i in range(2) for name in
                {'attn.q.lora_A', 'attn.q.lora_B', 'attn.v.lora_A', 'attn.v.lora_B'} | trained_biases}
    if bias == 'all':
        expected.add('transformer.ln_f.bias')
    assert changed == expected
    assert set(lora_state_dict(model)) == expected  # the adapter checkpoint holds exactly what trains


def test_adapter_state_dict_round_trip():
    model = tiny_gpt()
    apply_lora(model, r=4, lora_alpha=8)
    nudge_adapters(model)
    adapters = lora_state_dict(model)
    assert all('lora_' in k for k in adapters)
    fresh = tiny_gpt()
    apply_lora(fresh, r=4, lora_alpha=8)
    fresh.load_state_dict({**fresh.state_dict(), **adapters})
    x = torch.randint(16, (2, 8))
    assert torch.equal(fresh(x)[0], model(x)[0])


# -- chat-token rows added by resize_vocab (a pretrained model fine-tuned with LoRA) -------------------

def grown_gpt(tie, lora=True, **kw):
    """tiny_gpt with 4 tokens added to its 16 (rows 16-19), with LoRA adapters that train those rows too."""
    model = tiny_gpt(tie_embeddings=tie, **kw)
    model.resize_vocab(20)
    if lora:
        apply_lora(model, r=4, lora_alpha=8, target_modules='all-linear', added_tokens=4)
    return model


def nudge_added_rows(model, seed=2):
    nudge(model, 'added_rows', seed)


def full_weights(model):
    """The embedding and lm_head the model computes with (merged_state_dict folds in the trained rows)."""
    state = merged_state_dict(model)
    return state['transformer.wte.weight'].clone(), state['lm_head.weight'].clone()


@pytest.mark.parametrize('tie', [True, False])
def test_added_token_rows_train_and_nothing_else_in_the_vocab(tie):
    model = grown_gpt(tie)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wte_before, head_before = full_weights(model)
    optimizer = lora_optimizer(model, weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95), device_type='cpu')
    rows = [p for n, p in model.named_parameters() if n.endswith('added_rows')]
    assert len(rows) == (1 if tie else 2) and all(p.shape == (4, 16) for p in rows)
    rows_groups = [g for g in optimizer.param_groups if any(p is q for p in g['params'] for q in rows)]
    assert len(rows_groups) == 1 and rows_groups[0]['weight_decay'] == 0.0  # embeddings are not decayed
    g = torch.Generator().manual_seed(3)
    for _ in range(3):  # every batch holds the new tokens, as inputs and as targets
        x, y = torch.randint(20, (4, 8), generator=g), torch.randint(20, (4, 8), generator=g)
        x[:, :4], y[:, 4:] = torch.arange(16, 20), torch.arange(16, 20)
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    wte_after, head_after = full_weights(model)
    assert torch.equal(wte_after[:16], wte_before[:16]) and torch.equal(head_after[:16], head_before[:16])
    assert (wte_after[16:] != wte_before[16:]).any(1).all() and (head_after[16:] != head_before[16:]).any(1).all()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert 'transformer.wte.weight' not in changed and 'lm_head.weight' not in changed  # the frozen base
    assert {k for k in changed if 'lora_' not in k} == {'transformer.wte.added_rows', 'lm_head.added_rows'}


@pytest.mark.parametrize('tie', [True, False])
def test_added_rows_merge_into_a_plain_gpt_and_disable_with_the_adapters(tie):
    base = grown_gpt(tie, lora=False)
    model = grown_gpt(tie)
    nudge_adapters(model)
    nudge_added_rows(model)
    x = torch.arange(16).view(2, 8) + 4  # tokens 4-19: the 4 added ones among them
    unmerged, _ = model(x)
    merged = merged_state_dict(model)
    assert not any('lora_' in k or 'added_rows' in k for k in merged)
    assert (merged['lm_head.weight'] is merged['transformer.wte.weight']) == tie  # a tied weight is saved once
    plain = grown_gpt(tie, lora=False)
    plain.load_state_dict(merged)  # strict
    # the added rows are copied exactly; only the adapters' W x + s B (A x) vs (W + s B A) x order of float32
    # sums differs (~1e-7 relative per operation over 16-wide dot products, logits of order 1)
    torch.testing.assert_close(plain(x)[0], unmerged, rtol=1e-5, atol=1e-5)
    assert (unmerged[..., 16:] - base(x)[0][..., 16:]).abs().max() > 1e-3  # the new tokens' logits did move
    with disable_adapters(model):
        assert torch.equal(model(x)[0], base(x)[0])


@pytest.mark.parametrize('tie', [True, False])
def test_adapter_state_dict_round_trip_includes_added_rows(tie):
    model = grown_gpt(tie)
    nudge_adapters(model)
    nudge_added_rows(model)
    adapters = lora_state_dict(model)
    assert {k for k in adapters if 'lora_' not in k} == {'transformer.wte.added_rows'} | (
        set() if tie else {'lm_head.added_rows'})  # a tied lm_head shares the embedding's rows
    fresh = grown_gpt(tie)
    fresh.load_state_dict({**fresh.state_dict(), **adapters})
    x = torch.arange(16).view(2, 8) + 4
    assert torch.equal(fresh(x)[0], model(x)[0])


def test_target_modules():
    assert len(apply_lora(tiny_gpt(mlp='swiglu'), target_modules='all-linear')) == 2 * 7
    assert len(apply_lora(tiny_gpt(), target_modules='all-linear')) == 2 * 6  # no mlp.gate with gelu
    assert apply_lora(tiny_gpt(), target_modules='mlp.fc, attn.proj') == [
        'transformer.h.0.attn.proj', 'transformer.h.0.mlp.fc', 'transformer.h.1.attn.proj', 'transformer.h.1.mlp.fc']
    with pytest.raises(UserError, match="'attn.out' is not a LoRA target"):
        apply_lora(tiny_gpt(), target_modules='attn.q,attn.out')
    with pytest.raises(UserError, match='mlp.gate'):
        apply_lora(tiny_gpt(), target_modules='mlp.gate')
    with pytest.raises(UserError, match='lora_bias'):
        apply_lora(tiny_gpt(), bias='some')


def test_loraplus_groups_hold_only_trainable_parameters():
    model = tiny_gpt(bias=True)
    apply_lora(model, r=2, lora_alpha=4, bias='lora_only')
    groups = lora_param_groups(model, weight_decay=0.1, loraplus_lr_ratio=16)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in groups for p in g['params']} == trainable
    a, b, biases = groups
    assert all(p.shape[0] == 2 for p in a['params']) and all(p.shape[1] == 2 for p in b['params'])
    assert b['lr_scale'] == 16 and a.get('lr_scale', 1.0) == 1.0 and biases['weight_decay'] == 0.0


@pytest.mark.comparison
def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for recompute in (False, True):
        model = tiny_gpt()
        apply_lora(model, r=2, lora_alpha=4)
        nudge_adapters(model)
        model.activation_checkpointing = recompute
        model(torch.arange(16).view(2, 8) % 16, torch.arange(16).view(2, 8).flip(1) % 16)[1].backward()
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    assert all(g is not None for g in grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# -- train.py ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_lora_resumes_bit_exactly_and_merges_for_sample(tmp_path, sft_env):
    base = tmp_path / 'base.pt'
    shutil.copy(sft_env['base'], base)  # this test changes it at the end
    env = dict(sft_env, base=str(base))
    common = ['--lr_decay_iters=8', '--eval_interval=4', '--gradient_accumulation_steps=2', '--lora_dropout=0.1',
              '--lora_r=4', '--lora_target_modules=all-linear', '--loraplus_lr_ratio=4']
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    p = sft(env, straight, '--max_iters=8', *common, training_type='lora')
    assert 'trainable parameters' in p.stdout and 'merged.pt' in p.stdout
    sft(env, split, '--max_iters=4', *common, training_type='lora')
    sft(env, split, '--max_iters=8', *common, training_type='lora')
    a, b = train_losses(straight), train_losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 9)) and all(a[s] == b[s] for s in a), (a, b)
    ckpt = load(straight / 'ckpt.pt')
    assert ckpt['kind'] == 'lora' and ckpt['base_checkpoint'] == str(base) and len(ckpt['base_hash']) == 64
    adapters = {k for k in ckpt['model'] if 'lora_' in k}
    assert len(adapters) == 2 * 2 * 6 and set(ckpt['model']) - adapters == {'transformer.wte.added_rows'}
    assert all(torch.equal(v, load(split / 'ckpt.pt')['model'][k]) for k, v in ckpt['model'].items())
    assert [e['step'] for e in read_log(straight) if 'eval/exact_match' in e] == [0, 4, 8]

    merged = load(straight / 'merged.pt')
    assert merged['kind'] == 'gpt' and not any('lora_' in k for k in merged['model'])
    GPT(GPTConfig(**merged['model_args'])).load_state_dict(merged['model'])
    # the chat tokens' rows (added to the pretrained vocabulary, tied lm_head) trained, and merged.pt holds them
    pretrained = load(base)
    start = GPT(GPTConfig(**pretrained['model_args']))
    start.load_state_dict(pretrained['model'])
    start.resize_vocab(merged['model_args']['vocab_size'])  # the rows the run started from
    rows = ckpt['model']['transformer.wte.added_rows']
    assert rows.shape == (4, 32) and (rows != start.transformer.wte.weight[-4:]).any(1).all()
    assert torch.equal(merged['model']['transformer.wte.weight'],
                       torch.cat([pretrained['model']['transformer.wte.weight'], rows]))
    s = run(['sample.py', f'--out_dir={straight}', '--ckpt_name=merged.pt', '--device=cpu', '--start=What is 1+2?',
             '--max_new_tokens=5'])
    assert '<|user|>What is 1+2?<|end|><|assistant|>' in s.stdout
    # the adapters checkpoint loads as the merged model: the base it names, adapters applied and folded in
    # (the same float32 W + s B A as merged.pt's, perhaps on another thread count: float32 tolerance)
    loaded = load_for_generation(str(straight / 'ckpt.pt'))
    assert loaded.chat and loaded.tokenizer.identity() == merged['tokenizer']
    state = loaded.model.state_dict()
    assert set(state) == set(merged['model'])
    for k, v in merged['model'].items():
        torch.testing.assert_close(state[k], v)
    s = run(['sample.py', f'--init_from={straight / "ckpt.pt"}', '--device=cpu', '--start=What is 1+2?',
             '--max_new_tokens=5'])
    assert '<|user|>What is 1+2?<|end|><|assistant|>' in s.stdout

    p = sft(env, split, '--max_iters=10', *common, '--lora_r=8', training_type='lora', check=False)
    assert_user_error(p, 'LoRA setup', 'lora_r: checkpoint has 4')
    older = load(split / 'ckpt.pt')  # as written before the added chat-token rows trained
    older['model'] = {k: v for k, v in older['model'].items() if 'added_rows' not in k}
    torch.save(older, split / 'ckpt.pt')
    p = sft(env, split, '--max_iters=10', *common, training_type='lora', check=False)
    assert_user_error(p, 'older nanotrain')
    torch.save(dict(load(base), iter_num=99), base)  # a different base model: the adapters no longer fit
    p = sft(env, split, '--max_iters=10', *common, training_type='lora', check=False)
    assert_user_error(p, 'has changed')
    with pytest.raises(UserError, match='is not the base model the adapters'):
        load_for_generation(str(straight / 'ckpt.pt'))


@pytest.mark.slow
def test_lora_ddp_with_activation_checkpointing_matches_single_process(tmp_path, sft_env):
    common = ['--max_iters=3', '--eval_interval=3', '--lr_decay_iters=3', '--exact_match_examples=0',
              '--lora_dropout=0', '--activation_checkpointing=True', '--batch_size=2']
    single, ddp = tmp_path / 'single', tmp_path / 'ddp'
    sft(sft_env, single, '--gradient_accumulation_steps=2', *common, training_type='lora')
    run([*torchrun(2), *sft_args(sft_env, ddp, *common, '--gradient_accumulation_steps=1', training_type='lora')])
    # the same micro-batches of 2 on both sides, whose 2 gradients the all-reduce adds instead of the accumulation
    # (DDP's x2 and /2 are exact): the same float32 operations on any CPU, so equal to a few ulps (measured:
    # bit-equal, also on SSE kernels). The gradient norm catches a gradient scale error, which Adam's steps would hide.
    assert sorted(train_losses(single)) == [1, 2, 3]
    for key in ('train_loss', 'grad_norm', 'val_loss'):
        a, b = (logged(out, key) for out in (single, ddp))
        assert b == pytest.approx(a, rel=1e-6), (key, a, b)


def test_mfu_counts_a_frozen_weight_as_forward_and_input_gradient_only():
    """Per token, a trained weight costs 6 FLOPs per element (forward, input gradient, weight gradient) and a
    frozen one 4 (no weight gradient): a LoRA run's MFU counts its frozen base at 4, not at full training's 6."""
    model = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16))
    attention = 12 * 2 * 2 * 8 * 8  # n_layer * n_head * head_dim * block_size
    base = sum(p.numel() for p in model.parameters())  # tied, rope: every weight does matmul work
    assert model.flops_per_token() == 6 * base + attention
    apply_lora(model, r=4, lora_alpha=8, target_modules='attn.q,attn.v')
    adapters = 2 * 2 * (4 * 16 + 16 * 4)  # two layers, q and v, A and B
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapters
    assert model.flops_per_token() == 4 * base + 6 * adapters + attention
    head = 4 * 16 * 32
    assert model.flops_per_token(output_fraction=0.25) == 4 * base - head + head / 4 + 6 * adapters + attention
