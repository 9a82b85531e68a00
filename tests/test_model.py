import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from configurator import UserError
from conftest import INDUCTOR_ON_THIS_CPU
import model as model_py
from model import (GPT, DocumentRows, GPTConfig, KVCache, apply_rope, document_positions, packed_attention, peak_flops,
                   rope_cos_sin, sample_next, window_mask)

TINY = dict(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw}))


def batch(B=3, T=8, V=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def test_forward_shapes_and_loss_is_cross_entropy():
    m = tiny()
    x, y = batch(T=5)  # shorter than block_size
    y[0, :2] = -100
    logits, no_loss = m(x)
    assert logits.shape == (3, 5, 32) and no_loss is None
    # with targets, the loss without the logits (losses.linear_cross_entropy)
    no_logits, loss = m(x, y)
    assert no_logits is None
    # independent CE: mean negative log-likelihood over the non-ignored targets
    logp = torch.log_softmax(logits.double(), dim=-1)
    keep = y != -100
    nll = -logp.gather(-1, y.clamp(min=0)[..., None])[..., 0][keep]
    assert loss.item() == pytest.approx(nll.mean().item(), rel=1e-5)


def test_too_long_input_is_a_clear_error():
    m = tiny()
    with pytest.raises(ValueError, match="block_size is 8"):
        m(torch.zeros(1, 9, dtype=torch.long))


def test_backward_reaches_every_parameter():
    m = tiny(bias=True, qk_norm=True, mlp='swiglu', tie_embeddings=False, pos_emb='learned', norm='layernorm')
    x, y = batch()
    m(x, y)[1].backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("opts", [
    dict(),
    dict(pos_emb='learned', norm='layernorm', mlp='gelu', bias=True),
    dict(mlp='swiglu', qk_norm=True, logit_softcap=5.0),
    dict(mlp='relu2', tie_embeddings=False, zero_init_proj=True, dropout=0.1),
    dict(pos_emb='learned', mlp='swiglu', norm='layernorm', qk_norm=True, bias=True, tie_embeddings=False),
])
def test_option_combinations_train(opts):
    m = tiny(**opts)
    x, y = batch()
    opt = m.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')
    losses = []
    for _ in range(5):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_layer_names():
    names = {n for n, _ in tiny(mlp='swiglu', qk_norm=True).named_modules()}
    for layer in ('q', 'k', 'v', 'proj', 'q_norm', 'k_norm'):
        assert f'transformer.h.0.attn.{layer}' in names
    for layer in ('fc', 'gate', 'proj'):
        assert f'transformer.h.1.mlp.{layer}' in names
    assert 'transformer.h.0.mlp.gate' not in {n for n, _ in tiny().named_modules()}


@pytest.mark.comparison
def test_mlp_variants_compute_their_activation():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16)
    for kind, act in [('gelu', lambda m, x: F.gelu(m.fc(x))),
                      ('relu2', lambda m, x: F.relu(m.fc(x)) ** 2),
                      ('swiglu', lambda m, x: F.silu(m.gate(x)) * m.fc(x))]:
        mlp = tiny(mlp=kind).transformer.h[0].mlp
        torch.testing.assert_close(mlp(x), mlp.proj(act(mlp, x)))


@pytest.mark.comparison
def test_logit_softcap_is_cap_tanh():
    m = tiny(logit_softcap=0.05)
    x, _ = batch()
    capped, _ = m(x)
    m.config.logit_softcap = 0.0
    raw, _ = m(x)
    torch.testing.assert_close(capped, 0.05 * torch.tanh(raw / 0.05))
    assert capped.abs().max() <= 0.05


def test_init_scales_residual_projections():
    m = GPT(GPTConfig(**{**TINY, 'n_embd': 64, 'n_layer': 8}))
    std = m.transformer.h[0].attn.proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert m.transformer.h[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    z = tiny(zero_init_proj=True)
    assert all(not b.attn.proj.weight.any() and not b.mlp.proj.weight.any() for b in z.transformer.h)


@pytest.mark.comparison
def test_rope_matches_complex_rotation():
    T, D, theta = 6, 8, 10000.0
    cos, sin = rope_cos_sin(T, D, theta)
    x = torch.randn(2, 3, T, D, dtype=torch.float64)
    out = apply_rope(x, cos.double(), sin.double())
    # pair i is (x[i], x[i + D/2]) as a complex number, rotated by position * theta**(-2i/D)
    z = torch.complex(x[..., :D // 2], x[..., D // 2:])
    freqs = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rotated = z * torch.polar(torch.ones(T, D // 2, dtype=torch.float64), torch.arange(T)[:, None] * freqs)
    torch.testing.assert_close(out, torch.cat([rotated.real, rotated.imag], dim=-1), rtol=1e-6, atol=1e-6)


def test_attention_takes_views_of_bthd_tensors(monkeypatch):
    """Queries, keys and values reach attention as (B, H, T, D) views of (B, T, H, D) tensors (RoPE applied in that
    layout), so the fused kernels return their gradients in it and the backward needs no transposing copy (on a GPU:
    test_sdpa_returns_gradients_in_the_layout_of_its_inputs_on_cuda)."""
    import model as model_module
    seen = []
    attend = model_module.attend
    monkeypatch.setattr(model_module, 'attend', lambda q, k, v, *a, **kw: seen.append((q, k, v)) or attend(q, k, v, *a, **kw))
    m = tiny(n_kv_head=1)
    m(batch()[0])
    assert len(seen) == 2
    for q, k, v in seen:
        assert q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()  # RoPE's own outputs
        assert v.stride(-1) == 1 and v.stride(2) > v.stride(1)  # a view of the projection's (B, T, H * D) output


@pytest.mark.cuda
def test_sdpa_returns_gradients_in_the_layout_of_its_inputs_on_cuda():
    """The premise of the layout above, on a GPU's fused kernels (bf16: flash or cuDNN): the gradient that reaches a
    (B, T, H, D) tensor through its (B, H, T, D) view comes back contiguous, with no copy to make it so."""
    import model as model_module
    q, k, v = (torch.randn(4, 256, 8, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    layouts = []
    qs = [t * 1.0 for t in (q, k, v)]  # non-leaves: a hook sees the gradient as it arrives
    for t in qs:
        t.register_hook(lambda g: layouts.append(g.is_contiguous()))
    out = model_module.attend(*(t.transpose(1, 2) for t in qs))
    assert out.transpose(1, 2).is_contiguous()  # and the output, in the layout the projection takes
    out.float().square().sum().backward()
    assert layouts == [True, True, True]


def step_terms_and_grads(model, x, y, weights):
    model.zero_grad()
    _, terms = model(x, y, weights=dict(zip(('ce', 'z_loss'), weights)))
    (ce, _), (z, _) = terms['ce'], terms['z_loss']
    (ce + z).backward()
    return [ce.detach(), z.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.comparison
@INDUCTOR_ON_THIS_CPU
def test_compiled_training_step_equals_eager():
    """torch.compile'd model (Inductor's generated kernels; on the CPU here, on a GPU in the cuda test below) against
    eager: the chunked loss with token weights, z-loss and a soft cap, and every gradient. Inductor reorders float32
    sums of at most a few dozen terms: each result within 64 eps32 of its scale."""
    eps = torch.finfo(torch.float32).eps
    m = tiny(n_layer=1, logit_softcap=5.0, qk_norm=True)  # one layer: each kernel compiled once either way
    x, y = batch()
    y[0, :3] = -100
    keep = (y != -100).float()
    weights = (keep * torch.linspace(0.5, 2.0, 8) / keep.sum(), 1e-2 * keep / keep.sum())
    eager = step_terms_and_grads(m, x, y, weights)
    compiled = step_terms_and_grads(torch.compile(m), x, y, weights)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=64 * eps, atol=64 * eps * want.abs().max().item())


@pytest.mark.cuda
def test_compiled_training_step_equals_eager_on_cuda():
    """The same with Inductor's Triton kernels, float32 (TF32 off)."""
    eps = torch.finfo(torch.float32).eps
    m = tiny(logit_softcap=5.0, mlp='swiglu', qk_norm=True).cuda()
    x, y = (t.cuda() for t in batch())
    y[0, :3] = -100
    keep = (y != -100).float()
    weights = (keep * torch.linspace(0.5, 2.0, 8, device='cuda') / keep.sum(), 1e-2 * keep / keep.sum())
    eager = step_terms_and_grads(m, x, y, weights)
    compiled = step_terms_and_grads(torch.compile(m), x, y, weights)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=64 * eps, atol=64 * eps * want.abs().max().item())


def test_tied_embeddings_are_shared():
    m = tiny()
    assert m.lm_head.weight is m.transformer.wte.weight
    with torch.no_grad():
        m.lm_head.weight[0, 0] = 123.0
    assert m.transformer.wte.weight[0, 0] == 123.0
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    assert untied.get_num_params(non_embedding=False) - m.get_num_params(non_embedding=False) == 32 * 16


def test_num_params_leaves_out_lookup_tables():
    m = tiny(pos_emb='learned', tie_embeddings=False)
    total = sum(p.numel() for p in m.parameters())
    assert m.get_num_params(non_embedding=False) == total
    assert m.get_num_params() == total - 8 * 16 - 32 * 16


@pytest.mark.parametrize("tie", [True, False])
def test_no_decay_on_norms_biases_embeddings(tie, capsys):
    m = tiny(pos_emb='learned', bias=True, qk_norm=True, tie_embeddings=tie)
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    by_id = {id(p): n for n, p in m.named_parameters()}
    decayed = {by_id[id(p)] for p in opt.param_groups[0]['params']}
    assert opt.param_groups[0]['weight_decay'] == 0.1 and opt.param_groups[1]['weight_decay'] == 0.0
    expected = {n for n, p in m.named_parameters()
                if n.endswith('.weight') and 'wte' not in n and 'wpe' not in n and 'norm' not in n
                and 'ln_' not in n}
    assert decayed == expected
    assert ('lm_head.weight' in decayed) == (not tie)
    n_all = len(list(m.parameters()))
    assert len(opt.param_groups[0]['params']) + len(opt.param_groups[1]['params']) == n_all
    out = capsys.readouterr().out
    assert f"num decayed parameter tensors: {len(decayed)}," in out
    assert f"num non-decayed parameter tensors: {n_all - len(decayed)}," in out


def test_frozen_params_are_left_out_of_the_optimizer():
    m = tiny()
    m.transformer.h[0].attn.q.weight.requires_grad_(False)
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    assert all(p is not m.transformer.h[0].attn.q.weight for g in opt.param_groups for p in g['params'])


@pytest.mark.comparison
@pytest.mark.parametrize("pos_emb", ['rope', 'learned'])
def test_activation_checkpointing_recomputes_and_gives_identical_grads(pos_emb):
    x, y = batch()
    grads, calls = [], []
    for ckpt in (False, True):
        m = tiny(pos_emb=pos_emb, dropout=0.1, qk_norm=True)
        m.activation_checkpointing = ckpt
        count = [0]
        m.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        torch.manual_seed(5)  # same dropout masks; checkpoint replays the RNG state on recompute
        m(x, y)[1].backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
        calls.append(count[0])
    assert calls == [1, 2]  # the checkpointed block really ran again during backward
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=0, msg=n)


def sharp(m):
    """float64 eval copy with 20x the init weights: sharp, input-dependent predictions (at init a tiny
    model repeats one token whatever the context), and float64 so kernel rounding cannot flip a choice."""
    m = m.double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(20 if p.dim() == 2 else 1)
    return m


def reference_greedy(m, idx, n):
    """Greedy decoding written out plainly: crop to the last block_size tokens, take the argmax."""
    for _ in range(n):
        logits, _ = m(idx[:, -m.config.block_size:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("pos_emb", ['rope', 'learned'])
def test_greedy_generation_crops_to_block_size(pos_emb):
    m = sharp(tiny(pos_emb=pos_emb, qk_norm=True, mlp='swiglu', logit_softcap=3.0))
    prompt = batch(B=2, T=3)[0]
    want = reference_greedy(m, prompt, 14)  # runs well past block_size = 8
    assert torch.equal(m.generate(prompt, 14, temperature=0, use_kv_cache=False), want)
    assert torch.equal(m.generate(prompt, 14, temperature=0, use_kv_cache=True), want)
    assert len(set(want[:, 3:].flatten().tolist())) > 3  # non-trivial output


@pytest.mark.comparison
@pytest.mark.parametrize("pos_emb", ['rope', 'learned'])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.5), dict(temperature=0.9, top_k=10, top_p=0.9)])
def test_kv_cache_equals_no_cache(pos_emb, sampling):
    m = sharp(tiny(pos_emb=pos_emb, qk_norm=True, mlp='swiglu', logit_softcap=3.0))
    prompt = batch(B=2, T=3)[0]
    out = [m.generate(prompt, 14, use_kv_cache=c, generator=torch.Generator().manual_seed(7), **sampling)
           for c in (False, True)]
    assert out[0].shape == (2, 17)
    assert torch.equal(out[0], out[1])
    assert len(set(out[0][:, 3:].flatten().tolist())) > 3  # non-trivial output


def test_kv_cache_decodes_one_token_per_step():
    m = tiny().eval()
    seen = []
    m.transformer.wte.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].size(1)))
    m.generate(batch(B=1, T=3)[0], 8, temperature=0)  # 3 + 8 tokens: slides past block_size 8 at the end
    # prefill 3, five single-token steps fill the cache to 8, then each step re-prefills the last 8
    assert seen == [3, 1, 1, 1, 1, 1, 8, 8]


def windowed(window, **kw):
    """tiny() in float64 (kernels differ between the masked and unmasked paths; float64 leaves ~1e-15 of rounding)
    with a sliding_window, 32 positions."""
    return tiny(block_size=32, sliding_window=window, **kw).double().eval()


@pytest.mark.comparison
def test_sliding_window_at_least_the_row_is_full_causal_attention():
    T = 12
    assert torch.equal(window_mask(torch.arange(T), torch.arange(T), T), torch.ones(T, T, dtype=torch.bool).tril())
    x = batch(T=T)[0]
    with torch.no_grad():
        full = windowed(0)(x)[0]
        assert torch.equal(windowed(T)(x)[0], full) and torch.equal(windowed(T + 5)(x)[0], full)
        assert not torch.allclose(windowed(T - 1)(x)[0][:, -1], full[:, -1])  # the first token leaves the window


@pytest.mark.comparison
def test_sliding_window_counts_the_query_itself():
    # one layer: position t's logits are full attention's over tokens t-window+1..t alone, a row of their own to
    # RoPE (relative), up to the float32 rounding of the RoPE tables (~1e-7 relative); a token more or less differs
    window, x = 5, batch(B=2, T=20)[0]
    m, full = windowed(window, n_layer=1), windowed(0, n_layer=1)  # the same weights
    with torch.no_grad():
        logits = m(x)[0]
        scale = logits.abs().max()
        for t in range(window + 1, 20):
            crops = [full(x[:, t - n + 1:t + 1])[0][:, -1] for n in (window - 1, window, window + 1)]
            assert (crops[1] - logits[:, t]).abs().max() < 1e-6 * scale
            assert min((crop - logits[:, t]).abs().max() for crop in (crops[0], crops[2])) > 1e-3 * scale


@pytest.mark.comparison
def test_sliding_window_in_packed_rows_gives_each_document_its_logits_alone():
    m, x = windowed(6), batch(B=2, T=30)[0]
    doc_ids = torch.tensor([[0] * 17 + [1] * 13, [0] * 4 + [1] * 26])  # longer and shorter than the window
    with torch.no_grad():
        packed = m(x, doc_ids=doc_ids)[0]
        for row in range(2):
            for doc in (0, 1):
                alone = m(x[row:row + 1, doc_ids[row] == doc])[0][0]
                torch.testing.assert_close(packed[row, doc_ids[row] == doc], alone, rtol=0, atol=1e-12)


@pytest.mark.comparison
@pytest.mark.parametrize('window', [0, 6])
def test_packed_rows_attended_one_document_at_a_time_match_the_document_mask(monkeypatch, window):
    """DocumentRows (each document a row of its own, causal attention with no mask) gives the document mask's
    logits, loss and gradients: float64, so the same sums in another order differ by ~1e-15; grouped-query heads,
    padding (doc id -1) and a sliding window shorter and longer than documents. packed_attention takes it where
    its rows cost at most the masked square (PACKED_ROWS_SHARE), the mask elsewhere."""
    m = windowed(window, n_layer=2, n_head=4, n_kv_head=2).train()
    doc_ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 3 + [3] * 15, [0] * 12 + [1] * 14 + [-1] * 6])
    x, y = batch(B=2, T=32)
    y[doc_ids < 0] = -100

    def logits_loss_grads(share):
        monkeypatch.setattr(model_py, 'PACKED_ROWS_SHARE', share)
        m.zero_grad()
        logits = m(x, doc_ids=doc_ids)[0][doc_ids >= 0]
        loss = m(x, y, doc_ids=doc_ids)[1]
        loss.backward()
        return [logits, loss] + [p.grad.clone() for p in m.parameters()]
    for rows, mask in zip(logits_loss_grads(math.inf), logits_loss_grads(0.0)):
        torch.testing.assert_close(rows, mask, rtol=0, atol=1e-12)
    monkeypatch.undo()
    # 5 documents of at most 15 tokens: 1,125 <= 2 x 32^2; one 30-token document: 2 x 900 > 1 x 32^2
    assert isinstance(packed_attention(doc_ids, document_positions(doc_ids)), DocumentRows)
    long = torch.tensor([[0] * 30 + [1] * 2])
    assert packed_attention(long, document_positions(long)).shape == (1, 1, 32, 32)
    # 28 one-token documents and a 4-token one: 29 x 16 <= 32^2, but 116 slots for 32 tokens
    spread = torch.tensor([list(range(28)) + [28] * 4])
    assert packed_attention(spread, document_positions(spread)).shape == (1, 1, 32, 32)


@pytest.mark.comparison
def test_positions_continuing_a_cache_under_a_window_need_the_callers_mask():
    """The cached keys' positions are not known to hidden_states: a window over them is the caller's mask,
    never a band over the new tokens alone (which would let a decoded token see every cached key)."""
    m = tiny(sliding_window=3)
    caches = [KVCache(8) for _ in m.transformer.h]
    x, _ = batch()
    m.hidden_states(x[:, :5], caches)
    with pytest.raises(ValueError, match='mask holding the window'):
        m.hidden_states(x[:, 5:6], caches, positions=torch.full((3, 1), 5))


def test_kv_cache_generation_attends_over_the_sliding_window():
    m = sharp(tiny(block_size=24, sliding_window=5, qk_norm=True, mlp='swiglu'))
    prompt = batch(B=2, T=3)[0]
    want = reference_greedy(m, prompt, 30)  # past the window, then past block_size
    assert torch.equal(m.generate(prompt, 30, temperature=0, use_kv_cache=True), want)
    assert torch.equal(m.generate(prompt, 30, temperature=0, use_kv_cache=False), want)
    assert len(set(want[:, 3:].flatten().tolist())) > 3  # non-trivial output
    full = sharp(tiny(block_size=24, qk_norm=True, mlp='swiglu'))
    assert not torch.equal(full.generate(prompt, 30, temperature=0), want)  # the window changes the tokens


def test_grouped_query_attention_with_a_mask_repeats_keys_and_values_for_a_fused_kernel(monkeypatch):
    """On CUDA no fused kernel takes enable_gqa with a mask (the math kernel then builds (B, H, T, T) scores):
    a packed GQA model must hand SDPA as many key/value heads as query heads, and keep enable_gqa (flash)
    where there is no mask."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, enable_gqa=False, **kw):
        calls.append((q.size(1), k.size(1), attn_mask is not None, enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(F, 'scaled_dot_product_attention', recording)
    m = tiny(n_head=4, n_kv_head=2)
    x, y = batch()
    m(x, y)
    assert calls and all(c == (4, 2, False, True) for c in calls)
    calls.clear()
    monkeypatch.setattr(model_py, 'PACKED_ROWS_SHARE', 0.0)  # the mask, not DocumentRows
    m(x, y, doc_ids=torch.tensor([[0] * 3 + [1] * 5] * 3))
    assert calls and all(c == (4, 4, True, False) for c in calls)
    calls.clear()  # one query (decoding) has no T x T scores to spare: the cache is not copied to every head
    caches = [KVCache(8) for _ in m.transformer.h]
    m.hidden_states(x[:, :4], caches)
    calls.clear()
    m.hidden_states(x[:, 4:5], caches, positions=torch.full((3, 1), 4), mask=torch.ones(3, 1, 1, 5, dtype=torch.bool))
    assert calls and all(c == (4, 2, True, True) for c in calls)


def test_q_k_v_run_as_one_matmul_except_in_a_decode_step():
    """The stacked q/k/v matmul (4% of a CPU step) calls no layer; a decode step calls each (stacking the
    weights would copy them per token)."""
    m = tiny()
    x, _ = batch()
    called = []
    for block in m.transformer.h:
        for layer in (block.attn.q, block.attn.k, block.attn.v):
            layer.register_forward_hook(lambda mod, args, out: called.append(mod))
    m(x)
    caches = [KVCache(8) for _ in m.transformer.h]
    m.hidden_states(x[:, :7], caches)
    assert called == []
    m.hidden_states(x[:, 7:], caches)
    assert len(called) == 6


@pytest.mark.comparison
def test_grouped_query_attention_with_a_mask_is_attention_over_each_query_heads_group():
    """attend against attention written out (float64 both sides, so agreement to rounding): query head h
    uses key/value head h // (H / Hkv), and masked keys get no weight."""
    from model import attend
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 2, 6, 2, 7, 4
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    mask = torch.rand(B, 1, T, T, generator=g) < 0.6
    mask |= torch.eye(T, dtype=torch.bool)  # every query sees at least one key
    out = attend(q, k, v, mask=mask)
    group = torch.arange(H) // (H // Hkv)
    scores = (q @ k[:, group].transpose(-1, -2)) / math.sqrt(D)
    expected = torch.softmax(scores.masked_fill(~mask, float('-inf')), dim=-1) @ v[:, group]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_top_k_one_is_greedy():
    m = tiny().eval()
    prompt = batch(B=2, T=3)[0]
    greedy = m.generate(prompt, 10, temperature=0)
    assert torch.equal(m.generate(prompt, 10, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(3)), greedy)
    assert torch.equal(m.generate(prompt, 10, top_p=1e-9, generator=torch.Generator().manual_seed(3)), greedy)


def test_top_k_and_top_p_restrict_support_and_renormalize():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log().expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    for kw, support in [(dict(top_k=2), [1, 3]), (dict(top_p=0.7), [1, 3]), (dict(top_p=0.85), [1, 3, 2]),
                        (dict(top_k=3, top_p=0.7), [1, 3]), (dict(), [0, 1, 2, 3])]:
        picks = sample_next(logits, 1.0, generator=g, **kw)[:, 0]
        freq = torch.bincount(picks, minlength=4).double() / len(picks)
        want = torch.zeros(4, dtype=torch.float64)
        want[support] = probs[support].double() / probs[support].sum()
        torch.testing.assert_close(freq, want, atol=0.015, rtol=0, msg=str(kw))


def test_sampling_never_draws_a_token_of_probability_zero():
    """The CDF's ends: a number of 0 (or just below 1) picks the first (last) token with probability, not a
    token top-k or top-p removed before (after) it."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0]]).expand(2, 5)
    for kw, support in [(dict(top_k=2), {1, 3}), (dict(top_p=0.6), {1, 3}), (dict(), {0, 1, 2, 3, 4})]:
        ends = sample_next(logits, 1.0, uniform=torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64), **kw)
        assert ends[0, 0].item() == min(support) and ends[1, 0].item() == max(support), kw


def test_temperature_sharpens():
    logits = torch.tensor([[0.0, 1.0]]).expand(20000, 2)
    g = torch.Generator().manual_seed(0)
    frac = sample_next(logits, 0.5, generator=g).float().mean().item()
    assert frac == pytest.approx(1 / (1 + math.exp(-2.0)), abs=0.015)


def test_a_tiny_temperature_is_greedy_not_nan():
    """logits / 1e-40 overflows float32 to inf, whose softmax is NaN (a run of one token, or nothing): shifted to
    the largest first, the others go to -inf and the largest is drawn, with top_k and top_p too."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 5
    for temperature in (1e-30, 1e-38, 1e-40, 5e-324):
        for kw in (dict(), dict(top_k=5), dict(top_p=0.9)):
            picks = sample_next(logits, temperature, generator=torch.Generator().manual_seed(1), **kw)
            assert torch.equal(picks, logits.argmax(-1, keepdim=True)), (temperature, kw)


def test_eos_stops_generation():
    m = tiny().eval()
    prompt = batch(B=1, T=3)[0]
    free = m.generate(prompt, 10, temperature=0)
    eos = free[0, 5].item()  # the third generated token
    first = (free[0, 3:] == eos).nonzero()[0].item() + 3
    out = m.generate(prompt, 10, temperature=0, eos_id=eos)
    assert torch.equal(out, free[:, :first + 1])
    # with a batch, finished rows are padded with eos until every row is done
    two = m.generate(torch.cat([prompt, batch(B=1, T=3, seed=9)[0]]), 10, temperature=0, eos_id=eos)
    for row in two:
        hits = (row[3:] == eos).nonzero()
        if len(hits):
            assert (row[3 + hits[0].item():] == eos).all()


def test_estimate_mfu(monkeypatch):
    m = tiny()
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert m.estimate_mfu(1e6) is None
    assert m.estimate_mfu(1e6, 'cpu') is None and m.estimate_mfu(1e6, 'mps') is None
    assert m.estimate_mfu(1e6, 'Some Future GPU') is None
    # flops/token = 6N + 12 * n_layer * n_head * head_dim * block_size
    n = sum(p.numel() for p in m.parameters())  # tied, rope: every parameter does matmul work
    flops = 6 * n + 12 * 2 * 2 * 8 * 8
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda *a: 'NVIDIA H100 80GB HBM3')
    assert m.estimate_mfu(1e9) == pytest.approx(flops * 1e9 / 989e12)
    assert m.estimate_mfu(1e9, 'NVIDIA A100-SXM4-80GB') == pytest.approx(flops * 1e9 / 312e12)


def test_mfu_counts_the_output_layer_only_where_logits_are_computed():
    # a fine-tuning step of 100 tokens, 30 of them labelled: only those 30 go through lm_head (forward's logits_at)
    m = tiny()
    d, V, L, hidden = 16, 32, 2, 64
    blocks = L * (4 * d * d + 2 * d * hidden + 2 * d) + d  # q, k, v, proj, MLP fc and proj, two norms; final norm
    attention = 12 * L * 2 * 8 * 8  # n_layer * n_head * head_dim * block_size
    flops = (6 * blocks + attention) * 100 + 6 * d * V * 30
    assert m.estimate_mfu(100, 'NVIDIA H100 80GB HBM3', output_fraction=0.3) == pytest.approx(flops / 989e12, rel=1e-12)
    # pretraining: every position has logits
    flops = (6 * blocks + attention + 6 * d * V) * 100
    assert m.estimate_mfu(100, 'NVIDIA H100 80GB HBM3') == pytest.approx(flops / 989e12, rel=1e-12)
    # an untied head is the same work (the embedding lookup is none)
    untied = tiny(tie_embeddings=False)
    assert untied.estimate_mfu(100, 'NVIDIA H100 80GB HBM3') == pytest.approx(flops / 989e12, rel=1e-12)


@pytest.mark.parametrize("name, peak", [
    ('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H100 NVL', 835e12),
    ('NVIDIA H200', 989e12), ('NVIDIA GH200 480GB', 989e12), ('NVIDIA A100-SXM4-40GB', 312e12),
    ('NVIDIA A100 80GB PCIe', 312e12), ('NVIDIA A10G', 125e12), ('NVIDIA A10', 125e12),
    ('NVIDIA L40S', 362e12), ('NVIDIA L4', 121e12), ('NVIDIA GeForce RTX 4090', 165.2e12),
    ('Tesla V100-SXM2-16GB', 125e12), ('Tesla V100-PCIE-32GB', 112e12), ('Tesla T4', 65e12),
    ('NVIDIA GeForce GTX 1080', None), ('cpu', None),
])
def test_peak_flops_table_matching(name, peak):
    assert peak_flops(name) == peak


@pytest.mark.parametrize("opts", [dict(), dict(pos_emb='learned', tie_embeddings=False, qk_norm=True)])
def test_state_dict_round_trip(opts):
    m = tiny(**opts)
    sd = m.state_dict()
    assert not any('rope' in k for k in sd)
    assert set(sd) == {n for n, _ in m.named_parameters(remove_duplicate=False)}
    m2 = GPT(GPTConfig(**m.model_args()))
    m2.load_state_dict(sd)
    assert m.model_args() == dataclasses.asdict(m.config)
    x, _ = batch()
    torch.testing.assert_close(m2(x)[0], m(x)[0], rtol=0, atol=0)
    if m.config.tie_embeddings:
        assert m2.lm_head.weight is m2.transformer.wte.weight


@pytest.mark.parametrize("bad, match", [
    (dict(pos_emb='alibi'), "pos_emb='alibi'"), (dict(mlp='geglu'), "mlp='geglu'"),
    (dict(norm='batchnorm'), "norm='batchnorm'"), (dict(n_embd=15, n_head=2), "not divisible"),
    (dict(n_embd=6, n_head=2), "even head size"), (dict(logit_softcap=-1.0), "logit_softcap"),
    (dict(sliding_window=-1), "sliding_window=-1"),
])
def test_bad_config_is_a_clear_error(bad, match):
    with pytest.raises(UserError, match=match):
        GPTConfig(**{**TINY, **bad})


@pytest.mark.comparison
def test_blocks_compiled_one_by_one_are_compiled_once_and_compute_what_eager_does():
    """GPT.compile_blocks (what --compile=True calls): one compile serves every block, so a deeper model compiles
    no more graphs (train.py's 3 steps of a 32-layer model: 49 s against 366 s whole, on a CPU); loss and gradients
    are eager's, with activation checkpointing too, up to float32 reassociation; decoding with a KV cache runs the
    blocks eagerly. aot_eager runs what dynamo and AOTAutograd trace as aten ops, in seconds."""
    x, y = batch()

    def loss_and_grads(m):
        m.zero_grad()
        loss = m(x, y)[1]
        loss.backward()
        return [loss.detach()] + [p.grad for p in m.parameters()]

    counts = []
    for n_layer in (2, 6):
        torch._dynamo.reset()
        graphs = []

        def counting(gm, inputs):
            graphs.append(gm)
            return gm.forward
        eager, model = tiny(n_layer=n_layer, dropout=0.0), tiny(n_layer=n_layer, dropout=0.0)
        model.compile_blocks(backend=counting)
        for checkpointing in (False, True):
            eager.activation_checkpointing = model.activation_checkpointing = checkpointing
            for e, c in zip(loss_and_grads(eager), loss_and_grads(model)):
                torch.testing.assert_close(c, e, rtol=0, atol=1e-6)
        counts.append(len(graphs))
        model.eval()
        before = len(graphs)
        with torch.no_grad():
            prompt = x[:1, :3]
            assert torch.equal(model.generate(prompt, 4, temperature=0.0), eager.generate(prompt, 4, temperature=0.0))
        assert len(graphs) == before  # the cached decode never went through the compiled blocks
    # the blocks' graphs and the loss's, not one per block
    assert counts[0] == counts[1] and 2 <= counts[0] <= 4, counts
