"""QLoRA's 4-bit base (lm/nf4.py, lora_base_dtype='nf4'): the bits against bitsandbytes' (a committed fixture),
the quantization against a brute-force nearest level, the matmul and its gradient against the dequantized
weight's, LoRA on it (what is stored how, merged.pt, the reference with adapters off), the settings refused,
and train.py / train_dpo.py / train_rl.py on a 4-bit base: resume, a SIGKILL relaunch, export."""

import copy
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from configurator import UserError
from conftest import (HF_FIXTURES, HF_TINY, INDUCTOR_ON_THIS_CPU, dpo, evals, fine_tune, hf_fixture,
                      kill_and_relaunch, load, load_gpt, read_json_file, run, train_losses, val_losses)
from hf.checkpoint import hf_names, load_hf_checkpoint
from lm.lora import LoRALinear, apply_lora, cast_frozen_base, check_lora_base_dtype, disable_adapters, \
    low_rank_delta, lora_state_dict, merged_state_dict
from lm import nf4
from lm.nf4 import BLOCK, DYNAMIC_LEVELS, NF4_LEVELS, NF4Linear, NF4Weight, nf4_linear
from loading import load_for_generation
from model import GPT, GPTConfig
from starting_model import build_model, load_model

# made by tests/fixtures/make_nf4_fixture.py
BNB = os.path.join(os.path.dirname(HF_FIXTURES), 'nf4_bitsandbytes.safetensors')


@pytest.mark.comparison  # bit for bit on every CPU kernel (dynamic_levels must not follow torch.linspace's)
@pytest.mark.parametrize('case', ['bf16', 'float32'])
def test_the_bits_are_bitsandbytes(case):
    """Our NF4 codes, absmax scales and offset are bitsandbytes' bit for bit; each block's 8-bit absmax code is
    the nearest of the 256 levels to what it stands for, which bitsandbytes' search misses for 1 block in 512
    and 1 in 75 here (the level it picks is farther). Its own tensors, dequantized by us, are its dequantized
    weight bit for bit: a bitsandbytes 4-bit weight reads as it was written."""
    ref = {k.split('.', 1)[1]: v for k, v in load_file(BNB).items() if k.startswith(case + '.')}
    assert torch.equal(ref['code'], DYNAMIC_LEVELS)
    ours = NF4Weight(ref['weight'])
    for name in ('packed', 'absmax_scales', 'absmax_offset'):
        assert torch.equal(getattr(ours, name), ref[name]), name
    differ = ours.absmax_codes != ref['absmax_codes']
    assert differ.sum() == 1
    scales = ours.absmax_scales.repeat_interleave(256)[:len(differ)]
    absmax = ref['weight'].float().reshape(-1, BLOCK).abs().amax(1)
    target = ((absmax - absmax.mean()) / scales)[differ]
    assert (target - DYNAMIC_LEVELS[ours.absmax_codes[differ].long()]).abs() < \
        (target - DYNAMIC_LEVELS[ref['absmax_codes'][differ].long()]).abs()
    for name in ('packed', 'absmax_codes', 'absmax_scales', 'absmax_offset'):
        getattr(ours, name).copy_(ref[name])
    assert ours.dequantize().dtype == ref['weight'].dtype and torch.equal(ours.dequantize(), ref['dequantized'])
    # compiled (one fused kernel), the same bits; straight to bf16, its values rounded once, as a cast rounds them
    assert torch.equal(torch.compile(ours.dequantize)(), ref['dequantized'])
    assert torch.equal(ours.dequantize(torch.bfloat16), ref['dequantized'].bfloat16())


def test_each_value_takes_the_nearest_level_of_its_block():
    """Against a brute-force search over the 16 levels, on a weight of 3 x 2^20 + 64 values (several of
    NF4Weight's chunks, a short last block of absmaxes) with a block of zeros: each value's code is its
    nearest level at its block's absmax, and the dequantized value is that level times the stored absmax,
    within the absmax's own 8-bit error."""
    torch.manual_seed(0)
    weight = torch.randn(3 * 2 ** 14 + 1, 64) * 0.02
    weight[5] = 0
    q = NF4Weight(weight)
    absmax = weight.abs().amax(1, keepdim=True)
    scaled = weight / torch.where(absmax == 0, 1.0, absmax)
    nearest = (scaled.unsqueeze(-1) - NF4_LEVELS).abs().argmin(-1).reshape(-1)
    codes = torch.stack([q.packed >> 4, q.packed & 15], 1).reshape(-1)
    assert torch.equal(codes.long(), nearest)
    stored = q.absmax().unsqueeze(1)
    assert torch.equal(q.dequantize(), NF4_LEVELS[nearest].view_as(weight) * stored)
    assert (stored - absmax).abs().max() <= 0.01 * absmax.max()  # 8 bits over a 256-block's spread
    assert torch.equal(q.dequantize()[5], torch.zeros(64))


@pytest.mark.comparison
def test_dequantizing_a_chunk_at_a_time_changes_nothing(monkeypatch):
    """Eagerly, dequantize() works through CPU_DEQUANTIZE_CHUNK values at a time on a CPU (a scratch of 1.5 MB a
    chunk, within cache, beside the blocks' absmaxes), DEQUANTIZE_CHUNK elsewhere;
    compiled, through the whole weight at once. Chunks that split the weight anywhere, a short last block, and
    the compiled pass give the values of one eager pass bit for bit."""
    torch.manual_seed(0)
    for weight in (torch.randn(40, 96, dtype=torch.bfloat16), torch.randn(7, 50)):  # 3840 = 60 blocks; 350 = 5.5
        q = NF4Weight(weight)
        whole = q.dequantize()
        expected = NF4_LEVELS[torch.stack([q.packed >> 4, q.packed & 15], 1).reshape(-1).long()] * \
            q.absmax().repeat_interleave(BLOCK)[:weight.numel()]
        assert torch.equal(whole, expected.to(weight.dtype).view_as(weight))
        for chunk in (BLOCK, 3 * BLOCK, 1024):
            monkeypatch.setattr(nf4, 'CPU_DEQUANTIZE_CHUNK', chunk)
            assert torch.equal(q.dequantize(), whole)
        assert torch.equal(torch.compile(q.dequantize)(), whole)


def test_the_matmul_is_the_dequantized_weights_and_keeps_no_copy_for_backward():
    """NF4Matmul computes F.linear with the dequantized weight, in float32 and under bf16 autocast, the same
    input gradient, no gradient for the weight, and saves no tensor of the weight's size for the backward
    (it dequantizes again there)."""
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 128)
    layer = NF4Linear(base)
    dequantized = layer.nf4.dequantize()
    x = torch.randn(4, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        y = layer(x)
    expected = F.linear(x_ref, dequantized) + base.bias  # the bias added after, as nf4_linear does
    assert torch.equal(y, expected)
    y.square().sum().backward()
    expected.square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and layer.weight is None and base.bias.grad is not None
    assert all(n < dequantized.numel() for n in saved), saved
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert torch.equal(nf4_linear(x, layer.nf4), F.linear(x, dequantized))


def assert_within_rounding(a, b, magnitude, n):
    """a and b, two float32 computations of the same sums of at most n products each, in any order, differ by at
    most twice γ_n = n u / (1 - n u) times magnitude, the sums of the products' absolute values (Higham, Accuracy
    and Stability of Numerical Algorithms, 3.1)."""
    u = 2.0 ** -24
    assert ((a - b).abs() <= 2 * n * u / (1 - n * u) * magnitude).all(), (a - b).abs().max()


@pytest.mark.comparison
@INDUCTOR_ON_THIS_CPU
def test_compiled_a_layer_on_a_4_bit_base_computes_what_it_does_eagerly_and_keeps_no_weight():
    """torch.compile'd, a LoRA layer on a 4-bit base gives eager's output and gradients up to float32's rounding of
    the same sums, and its forward saves no tensor of the weight's size for the backward: the dequantization, one
    fused kernel, runs again there (without nf4_linear's checkpointed region the compiled graph kept the weight)."""
    torch.manual_seed(0)
    layer = LoRALinear(NF4Linear(torch.nn.Linear(128, 64)), r=4, lora_alpha=8)
    with torch.no_grad():
        layer.lora_B.normal_()
    w, A, B, s = layer.nf4.dequantize(), layer.lora_A, layer.lora_B, layer.scaling
    x, g = torch.randn(6, 128), torch.randn(6, 64)

    def forward_backward(f):
        xg = x.clone().requires_grad_()
        layer.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            y = f(xg)
        (y * g).sum().backward()
        assert all(n < w.numel() for n in saved), saved
        return y, xg.grad, A.grad, B.grad

    eager, compiled = forward_backward(layer), forward_backward(torch.compile(layer))
    with torch.no_grad():
        xA, gB = x.abs() @ A.abs().T, g.abs() @ B.abs()
        magnitudes = (x.abs() @ w.abs().T + layer.bias.abs() + s * xA @ B.abs().T, g.abs() @ w.abs() + s * gB @ A.abs(),
                      s * gB.T @ x.abs(), s * g.abs().T @ xA)
    for e, c, magnitude in zip(eager, compiled, magnitudes):
        assert_within_rounding(c, e, magnitude, 128 + 6 + 4)


@pytest.mark.cuda
def test_on_a_gpu_one_compiled_kernel_dequantizes_and_no_weight_waits_for_the_backward():
    """On CUDA, compiled: one generated kernel dequantizes a whole weight (the absmaxes come from their own op, so
    their multiply and add stay two roundings, not one fused multiply-add) to bitsandbytes' bits for its fixture
    and to the CPU's eager bits for 65,536 blocks; eagerly too. An 8B model's MLP weight under bf16 autocast:
    the compiled forward saves nothing of the weight's size for the backward, and the input's gradient is
    F.linear's with the dequantized weight up to bf16's rounding of the same products' sums."""
    from torch._inductor.utils import run_and_get_code
    ref = {k.split('.', 1)[1]: v for k, v in load_file(BNB).items() if k.startswith('bf16.')}
    fixture = NF4Weight.stored(ref['weight'].shape, torch.bfloat16, *(
        ref[k] for k in ('packed', 'absmax_codes', 'absmax_scales', 'absmax_offset')))
    torch.manual_seed(0)
    blocks = NF4Weight(torch.randn(4096, 1024, dtype=torch.bfloat16))
    for q, expected in ((fixture, ref['dequantized']), (blocks, blocks.dequantize())):
        q = q.cuda()
        assert torch.equal(q.dequantize().cpu(), expected)
        out, (code, *_) = run_and_get_code(torch.compile(q.dequantize))
        assert torch.equal(out.cpu(), expected) and code.count('@triton.jit') == 1, code

    layer = NF4Linear(torch.nn.Linear(4096, 14336, bias=False, device='cuda', dtype=torch.bfloat16))
    w = layer.nf4.dequantize()
    x, g = torch.randn(512, 4096, device='cuda'), torch.randn(512, 14336, device='cuda', dtype=torch.bfloat16)
    compiled = torch.compile(layer)
    grads, saved = [], []
    for f in (compiled, compiled, lambda x: F.linear(x, w)):  # the first compiles
        xg = x.clone().requires_grad_()
        saved.append([])
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved[-1].append(t.numel()) or t, lambda t: t), \
                torch.autocast('cuda', dtype=torch.bfloat16):
            y = f(xg)
        y.backward(g)
        grads.append(xg.grad)
    assert all(n < w.numel() for n in saved[1]), saved[1]
    magnitude = g.float().abs() @ w.float().abs()
    assert ((grads[1] - grads[2]).abs() <= 2 * 2 ** -8 * magnitude).all()  # each rounded to bf16 once


def tiny_gpt():
    """A tiny pretrained-like GPT (biases, SwiGLU, an untied lm_head) with 4 chat tokens added to its 16."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=32, bias=True, mlp='swiglu',
                          tie_embeddings=False))
    model.resize_vocab(20)
    return model


def lora_on(model, base_dtype):
    """model with its base in base_dtype (before apply_lora, as build_model does), adapted."""
    cast_frozen_base(model, base_dtype)
    torch.manual_seed(1)
    apply_lora(model, r=4, lora_alpha=8, target_modules='attn.q,attn.v,mlp.fc', added_tokens=4, bias='lora_only')
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('lora_B'):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


def dequantized_twin(model):
    """A float32 LoRA model whose blocks' Linear weights are model's 4-bit ones dequantized, its adapters model's."""
    twin = tiny_gpt()
    with torch.no_grad():
        for name, module in model.transformer.h.named_modules(prefix='transformer.h'):
            if getattr(module, 'nf4', None) is not None:
                twin.get_submodule(name).weight.copy_(module.nf4.dequantize())
    lora_on(twin, torch.float32)
    twin.load_state_dict(lora_state_dict(model), strict=False)
    return twin


@pytest.mark.comparison
def test_lora_on_a_4_bit_base():
    """Every Linear of the blocks is 4-bit (adapted or not), everything else float32, only the adapters (and
    added rows, trained biases) train; the model computes what a float32 model holding the dequantized weights
    does (up to the order of float32 sums: q, k, v as three matmuls instead of one), adapters off too; merged.pt's
    weights are the dequantized base plus the update exactly; a 4-bit layer refuses to merge in place."""
    model = lora_on(tiny_gpt(), 'nf4')
    linears = [m for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 14 and all(m.weight is None and m.nf4 is not None for m in linears)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert {n.rsplit('.', 1)[1] for n, p in model.named_parameters() if p.requires_grad} == \
        {'lora_A', 'lora_B', 'added_rows', 'bias'}
    assert all(n.split('.')[-1] in ('lora_A', 'lora_B', 'added_rows', 'bias') for n in lora_state_dict(model))
    assert model.get_num_params() == tiny_gpt().get_num_params() + sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(('lora_A', 'lora_B', 'added_rows')))
    twin = dequantized_twin(model)
    x = torch.randint(20, (3, 8), generator=torch.Generator().manual_seed(2))
    tolerance = dict(rtol=0, atol=1e-5)  # float32 sums of 32 products in another order
    torch.testing.assert_close(model(x)[0], twin(x)[0], **tolerance)
    with disable_adapters(model), disable_adapters(twin):
        torch.testing.assert_close(model(x)[0], twin(x)[0], **tolerance)
    merged = merged_state_dict(model)
    for name, module in model.transformer.h.named_modules(prefix='transformer.h'):
        if isinstance(module, torch.nn.Linear):
            expected = module.nf4.dequantize() + (low_rank_delta(module.lora_A, module.lora_B, module.scaling)
                                                  if hasattr(module, 'lora_A') else 0)
            assert torch.equal(merged[name + '.weight'], expected), name
    GPT(model.config).load_state_dict(merged)  # strict: a plain GPT
    with pytest.raises(RuntimeError, match='4-bit base cannot hold the update'):
        model.transformer.h[0].attn.q.merge()


@pytest.mark.slow  # ~10 s of CPU: dynamo traces a block and the loss
@pytest.mark.comparison
def test_the_scripts_compiled_4_bit_model_computes_what_it_does_eagerly():
    """train.py, train_dpo.py and train_rl.py with --compile=True compile the 4-bit LoRA GPT block by block
    (run/runtime.wrap_model: GPT.compile_blocks), train.py with activation checkpointing too: the compiled
    branch of nf4_linear (its checkpointed region and absmax op) nested in a block's checkpoint gives eager's loss and
    adapter gradients, called as DPO and RL call it (positions, mask, logits_at) and with targets as train.py.
    aot_eager runs what dynamo and AOTAutograd trace (the part that sees those regions) as aten ops, in seconds;
    inductor's code for the dequantization is the layer test's above."""
    model = lora_on(tiny_gpt(), 'nf4')
    model.activation_checkpointing = True
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(20, (2, 8), generator=g), torch.randint(20, (2, 8), generator=g)
    positions, mask = torch.arange(8).expand(2, 8), torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    at = (torch.tensor([0, 1, 1]), torch.tensor([5, 6, 7]))

    def loss_and_grads(m):
        trained = [p for p in m.parameters() if p.requires_grad]
        for p in trained:
            p.grad = None
        loss = m(x, y, positions=positions, mask=mask, logits_at=at)[1]
        loss.backward()
        return [loss.detach()] + [p.grad for p in trained]

    eager = copy.deepcopy(model)
    model.compile_blocks(backend='aot_eager')
    # the same float32 ops, at most reassociated within a sum of 32 products (tolerance as test_lora_on_a_4_bit_base)
    for e, c in zip(loss_and_grads(eager), loss_and_grads(model)):
        torch.testing.assert_close(c, e, rtol=0, atol=1e-5)


def test_a_4_bit_base_trains_its_adapters():
    model = lora_on(tiny_gpt(), 'nf4')
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(20, (8, 8), generator=g), torch.randint(20, (8, 8), generator=g)
    packed = [m.nf4.packed.clone() for m in model.modules() if getattr(m, 'nf4', None) is not None]
    losses = []
    for _ in range(20):
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(torch.equal(p, m.nf4.packed) for p, m in
               zip(packed, [m for m in model.modules() if getattr(m, 'nf4', None) is not None]))


def test_settings_that_cannot_work_are_refused():
    # a run that is not a LoRA run is refused by its script (test_lora_base_dtype.py)
    check_lora_base_dtype('nf4', torch.float32, 'ddp')
    check_lora_base_dtype('nf4', torch.bfloat16, 'ddp')
    with pytest.raises(UserError, match=r"parallel='fsdp' yet.*parallel='ddp'"):
        check_lora_base_dtype('nf4', torch.bfloat16, 'fsdp')


LORA = ['--learning_rate=3e-2', '--max_iters=4', '--eval_interval=2', '--lr_decay_iters=4', '--exact_match_examples=0',
        '--lora_target_modules=all-linear', '--lora_r=4', '--lora_alpha=8', '--lora_base_dtype=nf4']


@pytest.mark.slow
def test_train_py_on_a_4_bit_published_model(tmp_path, task):
    """The SmolLM2 fixture (bf16 weights) with lora_base_dtype='nf4': stopped at step 2 and continued to 4 equals a
    run straight to 4; the loss falls; the checkpoint holds the adapters only; merged.pt is the dequantized base
    plus the update; the adapter checkpoint loads for generation as that same model; the export reads back."""
    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    fine_tune(resumed, task, 'smollm2', *LORA, '--max_iters=2', training_type='lora')
    fine_tune(resumed, task, 'smollm2', *LORA, training_type='lora')
    fine_tune(straight, task, 'smollm2', *LORA, training_type='lora')
    assert sorted(train_losses(resumed)) == [1, 2, 3, 4] and train_losses(resumed) == train_losses(straight)
    losses = val_losses(resumed)
    assert losses[-1] < losses[0], losses
    ckpt = load(resumed / 'ckpt.pt')
    adapters = ckpt['model']
    assert all(torch.equal(v, load(straight / 'ckpt.pt')['model'][k]) for k, v in adapters.items())
    assert all(k.endswith(('lora_A', 'lora_B', 'added_rows')) for k in adapters)
    assert ckpt['base_checkpoint'] == os.path.abspath(hf_fixture('smollm2'))

    merged = load(resumed / 'merged.pt')['model']
    base = load_file(os.path.join(hf_fixture('smollm2'), 'model.safetensors'))
    q = merged['transformer.h.0.attn.q.weight']
    expected = NF4Weight(base['model.layers.0.self_attn.q_proj.weight']).dequantize().float() + low_rank_delta(
        adapters['transformer.h.0.attn.q.lora_A'], adapters['transformer.h.0.attn.q.lora_B'], 8 / 4)
    assert torch.equal(q, expected)
    from_adapters = load_for_generation(str(resumed / 'ckpt.pt')).model.state_dict()
    assert all(torch.equal(v, merged[k]) for k, v in from_adapters.items() if k in merged)
    run(['export.py', str(resumed / 'merged.pt'), str(tmp_path / 'exported')])
    exported = load_gpt(str(tmp_path / 'exported'))
    assert all(torch.equal(v, merged[k]) for k, v in exported.state_dict().items())


@pytest.mark.slow
def test_a_killed_4_bit_run_continues(tmp_path, task):
    out = tmp_path / 'out'
    args = ['train.py', '--training_type=lora', f'--init_from={hf_fixture("smollm2")}', f'--out_dir={out}',
            f'--sft_data={task}', *HF_TINY, *LORA, '--max_iters=24', '--eval_interval=2', '--log_interval=1',
            '--lr_decay_iters=24']  # enough steps that the kill lands before the end on a fast machine
    killed_at, output, steps = kill_and_relaunch(args, out)
    assert 0 < killed_at < 24 and f'resuming from {out / "ckpt.pt"} at step {killed_at}' in output
    assert steps == list(range(1, 25))


@pytest.mark.slow
def test_dpo_and_rl_on_a_4_bit_base(tmp_path, dpo_env):
    """train_dpo.py and train_rl.py with use_lora: the reference is the policy with its adapters off, the 4-bit
    base, so DPO's first eval has its loss at ln 2; both train, and merge into float32."""
    dpo(dpo_env, tmp_path / 'dpo', '--use_lora=True', '--lora_r=2', '--max_iters=2', '--eval_interval=1',
        '--exact_match_examples=0', '--lora_base_dtype=nf4')
    metrics = evals(tmp_path / 'dpo')
    assert metrics[0]['eval/loss'] == pytest.approx(0.6931, abs=1e-4) and metrics[-1]['eval/rewards/margins'] != 0
    run(['train_rl.py', f"--init_from={dpo_env['sft']}", f"--data_dir={dpo_env['data_dir']}",
         f"--rl_data={dpo_env['task']}", f"--out_dir={tmp_path / 'rl'}", '--use_lora=True', '--lora_r=2',
         '--lora_base_dtype=nf4', '--max_iters=2', '--eval_interval=2', '--prompts_per_step=2', '--num_generations=2', '--max_new_tokens=4', '--eval_prompts=2',
         '--max_prompt_length=36', '--exact_match_examples=0', '--device=cpu'])
    for folder in ('dpo', 'rl'):
        merged = load(tmp_path / folder / 'merged.pt')['model']
        assert all(v.dtype == torch.float32 for v in merged.values())
        trained = load(tmp_path / folder / 'ckpt.pt')['model']
        assert trained and all(k.endswith(('lora_A', 'lora_B', 'added_rows')) for k in trained)


# -- a Hugging Face folder bitsandbytes saved in 4 bits (made by tests/fixtures/make_bnb4_fixture.py) -------

BNB_FOLDER = hf_fixture('llama_bnb4')
BNB_EXPECTED = load_file(os.path.join(HF_FIXTURES, 'expected', 'llama_bnb4.safetensors'))


@pytest.mark.comparison
def test_a_bitsandbytes_4_bit_folder_is_read_as_its_bits():
    """Each 4-bit weight dequantizes to bitsandbytes' own dequantized weight bit for bit, read to float32 (any
    use) or kept in NF4 (a 4-bit base); the model computes transformers' logits for those weights; what
    export writes back has no quantization_config."""
    hf = read_json_file(os.path.join(BNB_FOLDER, 'config.json'))
    as_float = load_hf_checkpoint(BNB_FOLDER)
    kept = load_hf_checkpoint(BNB_FOLDER, as_stored=True, keep_nf4=True)
    assert 'quantization_config' in hf and 'quantization_config' not in as_float['hf_config']
    stored = load_file(os.path.join(BNB_FOLDER, 'model.safetensors'))
    quantized = 0
    for nano, hf_name in hf_names(as_float['model'], hf).items():
        if f'dequantized.{hf_name}' in BNB_EXPECTED:
            quantized += 1
            want = BNB_EXPECTED[f'dequantized.{hf_name}']  # bfloat16, as bitsandbytes gives it
            assert torch.equal(as_float['model'][nano], want.float())
            nf4 = kept['model'][nano]
            assert isinstance(nf4, NF4Weight) and torch.equal(nf4.packed, stored[hf_name].reshape(-1))
            assert nf4.dequantize().dtype == torch.bfloat16 and torch.equal(nf4.dequantize(), want)
        else:  # embeddings, norms, lm_head: stored in bf16, read as they are
            assert torch.equal(as_float['model'][nano], stored[hf_name].float())
    assert quantized == 14  # every Linear of the 2 blocks
    # transformers in float32 with the dequantized weights: the same arithmetic, so float32's rounding only
    model = load_for_generation(BNB_FOLDER).model
    logits = model(BNB_EXPECTED['input_ids'])[0]
    torch.testing.assert_close(logits, BNB_EXPECTED['logits_float32'], atol=1e-5, rtol=0)
    # transformers through bitsandbytes computes in bfloat16: 8 significant bits, a few roundings per layer
    scale = BNB_EXPECTED['logits'].abs().max().item()
    assert (logits - BNB_EXPECTED['logits']).abs().max() < 4 * 2 ** -8 * scale
    # a 4-bit base built from the kept bits: NF4Linear layers holding them, the same logits
    base = build_model(GPTConfig(**kept['model_args']), kept, lora_base_dtype='nf4').eval()
    layers = [m for m in base.modules() if isinstance(m, NF4Linear)]
    assert len(layers) == 14 and torch.equal(base.transformer.h[1].mlp.proj.nf4.packed,
                                             stored['model.layers.1.mlp.down_proj.weight'].reshape(-1))
    torch.testing.assert_close(base(BNB_EXPECTED['input_ids'])[0], logits, atol=1e-5, rtol=0)


def edited_copy(tmp_path, config=None, tensors=None):
    """The 4-bit fixture copied with config.json's quantization_config and the tensors changed."""
    folder = tmp_path / 'bnb'
    shutil.copytree(BNB_FOLDER, folder)
    hf = read_json_file(str(folder / 'config.json'))
    hf['quantization_config'].update(config or {})
    (folder / 'config.json').write_text(json.dumps(hf))
    weights = load_file(str(folder / 'model.safetensors'))
    for name, value in (tensors or {}).items():
        if value is None:
            del weights[name]
        else:
            weights[name] = value
    save_file(weights, str(folder / 'model.safetensors'))
    return str(folder)


def test_other_4_bit_formats_are_refused_with_the_reason(tmp_path):
    q = 'model.layers.0.self_attn.q_proj.weight'
    for i, (config, says) in enumerate([({'bnb_4bit_use_double_quant': False}, 'bnb_4bit_use_double_quant=False'),
                         ({'bnb_4bit_quant_type': 'fp4'}, "bnb_4bit_quant_type='fp4'"),
                         ({'load_in_4bit': False, 'load_in_8bit': True}, 'load_in_8bit=True')]):
        with pytest.raises(UserError, match=f"quant_method 'bitsandbytes'.*{says}.*unquantized release") as e:
            load_hf_checkpoint(edited_copy(tmp_path / f'config{i}', config=config))
        assert '--lora_base_dtype' not in str(e.value)  # sample.py and eval.py read such folders too, without it
    state = json.loads(bytes(load_file(os.path.join(BNB_FOLDER, 'model.safetensors'))[
        f'{q}.quant_state.bitsandbytes__nf4'].tolist()))
    for i, (tensors, says) in enumerate([({f'{q}.absmax': None}, 'lacks absmax'),
                          ({f'{q}.quant_map': torch.linspace(-1, 1, 16)}, 'other code books'),
                          ({f'{q}.quant_state.bitsandbytes__nf4': torch.tensor(list(b'{"quant'), dtype=torch.uint8)},
                           'unreadable quant_state'),
                          ({f'{q}.quant_state.bitsandbytes__nf4': torch.tensor(
                              list(json.dumps(dict(state, blocksize=128)).encode()), dtype=torch.uint8)},
                           r"quantized as \('nf4', 128")]):
        with pytest.raises(UserError, match=f"{q} .*{says}"):
            load_hf_checkpoint(edited_copy(tmp_path / f'tensors{i}', tensors=tensors))


def test_a_4_bit_config_and_weights_that_disagree_say_which_is_missing(tmp_path, capsys):
    """4-bit weights whose config.json lost its quantization_config: the entry is named missing (it is the same
    model, not another); a config that says 4-bit beside unquantized weights: they are read as stored, with a
    note that quantization_config was ignored."""
    folder = edited_copy(tmp_path / 'lost')
    hf = read_json_file(os.path.join(folder, 'config.json'))
    (tmp_path / 'lost' / 'bnb' / 'config.json').write_text(json.dumps({k: v for k, v in hf.items()
                                                                       if k != 'quantization_config'}))
    with pytest.raises(UserError, match=r"is part of a weight bitsandbytes saved in 4 bits, but .*config.json has no "
                                        r"quantization_config.*the entry is missing") as e:
        load_hf_checkpoint(folder)
    assert 'different models' not in str(e.value)
    stored = load_file(os.path.join(BNB_FOLDER, 'model.safetensors'))
    plain = {name: BNB_EXPECTED.get(f'dequantized.{name}', tensor) for name, tensor in stored.items()
             if '.weight.' not in name}  # the packed weights dequantized, their quantization's tensors left out
    unquantized = edited_copy(tmp_path / 'plain')
    save_file(plain, os.path.join(unquantized, 'model.safetensors'))
    capsys.readouterr()
    read = load_hf_checkpoint(unquantized)
    assert 'none of them is quantized: they are read as stored, and quantization_config is ignored' in \
        capsys.readouterr().out
    expected = load_hf_checkpoint(BNB_FOLDER)['model']
    assert all(torch.equal(read['model'][k], expected[k]) for k in expected)


def test_a_4_bit_lm_head_is_dequantized_for_a_4_bit_base(tmp_path):
    """A folder whose lm_head bitsandbytes also quantized (llm_int8_skip_modules without it): a 4-bit base keeps
    the blocks' bits and dequantizes the head, which stays float32 as every weight outside the blocks does."""
    head = load_file(os.path.join(BNB_FOLDER, 'model.safetensors'))['lm_head.weight']
    q = NF4Weight(head)  # bitsandbytes' layout, written as it saves a 4-bit weight
    state = {'shape': list(head.shape), 'dtype': 'bfloat16', 'quant_type': 'nf4', 'blocksize': BLOCK,
             'nested_blocksize': 256, 'nested_dtype': 'float32', 'nested_offset': q.absmax_offset.item()}
    folder = edited_copy(tmp_path, tensors={
        'lm_head.weight': q.packed.view(-1, 1), 'lm_head.weight.absmax': q.absmax_codes,
        'lm_head.weight.nested_absmax': q.absmax_scales, 'lm_head.weight.quant_map': NF4_LEVELS,
        'lm_head.weight.nested_quant_map': DYNAMIC_LEVELS,
        'lm_head.weight.quant_state.bitsandbytes__nf4': torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)})
    kept = load_hf_checkpoint(folder, as_stored=True, keep_nf4=True)
    assert isinstance(kept['model']['transformer.h.0.attn.q.weight'], NF4Weight)
    assert torch.equal(kept['model']['lm_head.weight'], q.dequantize())
    model = build_model(GPTConfig(**kept['model_args']), kept, lora_base_dtype='nf4')
    assert model.lm_head.weight.dtype == torch.float32 and torch.equal(model.lm_head.weight, q.dequantize().float())


def test_a_4_bit_folder_read_as_stored_becomes_float32_in_a_run_that_trains_every_weight(monkeypatch):
    """load_model reads a published folder as stored (its blocks' 4-bit weights as NF4Weights, the rest in its
    bf16); build_model makes a run that trains every weight float32 from it, each weight what reading the
    folder to float32 gives, and a 4-bit base keeps the bits."""
    stored = load_model(BNB_FOLDER)
    assert isinstance(stored['model']['transformer.h.0.attn.q.weight'], NF4Weight)
    assert stored['model']['transformer.wte.weight'].dtype == torch.bfloat16
    as_float = load_hf_checkpoint(BNB_FOLDER)['model']
    state = build_model(GPTConfig(**stored['model_args']), stored).state_dict()
    assert all(v.dtype == torch.float32 for v in state.values())
    assert state.keys() == as_float.keys() and all(torch.equal(state[k], as_float[k]) for k in state)
    # a 4-bit base is built from the bits as read, never a dequantized copy of them (an 8B: 16 GB of bf16)
    with monkeypatch.context() as patch:
        patch.setattr(NF4Weight, 'dequantize', lambda self, dtype=None: pytest.fail('dequantized a kept weight'))
        base = build_model(GPTConfig(**stored['model_args']), stored, lora_base_dtype='nf4')
    assert torch.equal(base.transformer.h[0].attn.q.nf4.packed, stored['model']['transformer.h.0.attn.q.weight'].packed)
    # a float32 folder: the model is built around the tensors as read, no second copy in memory
    stored = load_model(hf_fixture('llama'))
    model = build_model(GPTConfig(**stored['model_args']), stored)
    assert all(p.data_ptr() == stored['model'][k].data_ptr() for k, p in model.state_dict().items())


@pytest.mark.slow
def test_train_py_qlora_on_a_bitsandbytes_folder(tmp_path, task):
    """train.py's LoRA on the 4-bit folder with lora_base_dtype='nf4': trains on its bits as stored; merged.pt is
    bitsandbytes' dequantized weight plus the update; the export is an unquantized model that reads back, in the
    published model's bf16 by default (the line says so), in float32 with --dtype=float32."""
    out = tmp_path / 'out'
    fine_tune(out, task, 'llama_bnb4', *LORA, training_type='lora')
    losses = val_losses(out)
    assert losses[-1] < losses[0], losses
    adapters = load(out / 'ckpt.pt')['model']
    merged = load(out / 'merged.pt')['model']
    expected = BNB_EXPECTED['dequantized.model.layers.1.mlp.down_proj.weight'].float() + low_rank_delta(
        adapters['transformer.h.1.mlp.proj.lora_A'], adapters['transformer.h.1.mlp.proj.lora_B'], 8 / 4)
    assert torch.equal(merged['transformer.h.1.mlp.proj.weight'], expected)
    p = run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'exported')])
    assert 'quantization_config' not in read_json_file(str(tmp_path / 'exported' / 'config.json'))
    exported = load_gpt(str(tmp_path / 'exported'))  # in the model's published dtype, bfloat16, which is named
    assert all(torch.equal(v, merged[k].bfloat16().float()) for k, v in exported.state_dict().items())
    assert '(LlamaForCausalLM, bfloat16, the published model\'s; the checkpoint holds float32, which ' \
           '--dtype=float32 writes)' in p.stdout
    p = run(['export.py', str(out / 'merged.pt'), str(tmp_path / 'float32'), '--dtype=float32'])
    assert '(LlamaForCausalLM, float32) to' in p.stdout
    assert read_json_file(str(tmp_path / 'float32' / 'config.json'))['dtype'] == 'float32'
    exported = load_gpt(str(tmp_path / 'float32'))  # the merged weights as the run holds them
    assert all(torch.equal(v, merged[k]) for k, v in exported.state_dict().items())


@pytest.mark.slow
@pytest.mark.cuda
def test_train_py_qlora_compiled_on_a_gpu(tmp_path, task):
    """train.py's QLoRA compiled on a GPU in bf16 (--compile=True: one fused kernel dequantizes each weight, again
    in the backward), on the 4-bit folder's bits as stored: the loss falls; merged.pt is bitsandbytes' dequantized
    weight plus the update, up to TF32's rounding of the update's product (train.py allows TF32 on CUDA).
    On a CPU the compiled path is the unit tests' (a compiled launch there takes minutes)."""
    out = tmp_path / 'out'
    fine_tune(out, task, 'llama_bnb4', *LORA, '--compile=True', '--device=cuda', '--dtype=bfloat16',
              training_type='lora', timeout=900)
    losses = val_losses(out)
    assert losses[-1] < losses[0], losses
    adapters = load(out / 'ckpt.pt')['model']
    A, B = adapters['transformer.h.1.mlp.proj.lora_A'], adapters['transformer.h.1.mlp.proj.lora_B']
    expected = BNB_EXPECTED['dequantized.model.layers.1.mlp.down_proj.weight'].float() + low_rank_delta(A, B, 8 / 4)
    bound = 8 / 4 * B.abs() @ A.abs() * 2 ** -9 + expected.abs() * 2 ** -23  # TF32's 10-bit inputs, one float32 add
    assert ((load(out / 'merged.pt')['model']['transformer.h.1.mlp.proj.weight'] - expected).abs() <= bound).all()
