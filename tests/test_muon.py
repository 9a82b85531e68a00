"""Muon: Newton-Schulz orthogonalization against the SVD, the optimizer's update rules, its param
grouping, and train.py with optimizer_type='muon' (checkpoint round trip, bit-exact resume)."""

import copy

import pytest
import torch

from conftest import load, train, train_losses
from lm.muon import Muon, muon_param_groups, orthogonalize
from model import GPT, GPTConfig



def svd_factors(G):
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U, S, Vh.mT


@pytest.mark.comparison
@pytest.mark.parametrize('shape', [(32, 96), (96, 32), (64, 64), (256, 64)])
def test_orthogonalize_keeps_singular_vectors_and_maps_singular_values_near_one(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape)
    if shape[0] == shape[1]:  # a random square matrix has near-zero singular values; keep it well conditioned
        G = G + 8 * torch.eye(shape[0])
    X = orthogonalize(G).double()
    U, S, V = svd_factors(G)
    # X = U f(S) V^T: in G's singular bases it is diagonal...
    D = U.mT @ X @ V
    off_diagonal = D - torch.diag_embed(D.diagonal())
    assert off_diagonal.norm() < 1e-4 * D.norm()
    # ...with every singular value mapped into Newton-Schulz's band around 1 (Jordan's coefficients: ~[0.68, 1.2])
    s = torch.linalg.svdvals(X)
    assert s.min() > 0.6 and s.max() < 1.25
    # so X points the same way as the exact orthogonalization U V^T
    O = U @ V.mT
    assert (X * O).sum() / (X.norm() * O.norm()) > 0.97


@pytest.mark.comparison
def test_orthogonalize_ignores_scale_and_batches():
    torch.manual_seed(1)
    G = torch.randn(3, 16, 48)
    batched = orthogonalize(G)
    for i in range(3):
        torch.testing.assert_close(batched[i], orthogonalize(G[i]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(orthogonalize(1e3 * G[i]), orthogonalize(G[i]), atol=1e-4, rtol=1e-4)


def make_gpt(**kw):
    torch.manual_seed(0)
    config = dict(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)
    return GPT(GPTConfig(**{**config, **kw}))


def test_param_groups_put_block_matrices_on_muon_and_the_rest_on_adamw():
    m = make_gpt(tie_embeddings=False, bias=True, pos_emb='learned', qk_norm=True)
    groups = muon_param_groups(m, learning_rate=1e-3, weight_decay=0.1, betas=(0.9, 0.95), muon_lr=0.02)
    names = {id(p): n for n, p in m.named_parameters()}
    muon, decay, no_decay = ({names[id(p)] for p in g['params']} for g in groups)
    assert muon == {n for n, p in m.transformer.h.named_parameters(prefix='transformer.h') if p.dim() == 2}
    assert len(muon) == 2 * 6  # q, k, v, attn proj, fc, mlp proj per layer
    assert decay == {'lm_head.weight'}
    assert {'transformer.wte.weight', 'transformer.wpe.weight', 'transformer.ln_f.weight'} <= no_decay
    assert all(m.get_parameter(n).dim() == 1 for n in no_decay - {'transformer.wte.weight', 'transformer.wpe.weight'})
    assert len(muon) + len(decay) + len(no_decay) == len(list(m.parameters()))  # each parameter exactly once
    assert [g['use_muon'] for g in groups] == [True, False, False]
    assert groups[0]['lr'] == 0.02 and groups[0]['lr_scale'] == pytest.approx(20.0)
    assert [g['weight_decay'] for g in groups] == [0.0, 0.1, 0.0]
    # tied: lm_head is the embedding, so nothing is decayed
    tied = muon_param_groups(make_gpt(), 1e-3, 0.1, (0.9, 0.95), 0.02)
    assert tied[1]['params'] == []


def test_vectors_in_a_muon_group_are_refused():
    with pytest.raises(ValueError, match='2-D'):
        Muon([dict(params=[torch.nn.Parameter(torch.ones(4))], use_muon=True, lr=0.1, momentum=0.9,
                   nesterov=True, ns_steps=5, weight_decay=0.0)])


@pytest.mark.comparison
def test_muon_step_is_nesterov_momentum_then_orthogonalized():
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(24, 8))
    w0 = w.detach().clone()
    lr, mom, wd = 0.05, 0.9, 0.1
    opt = Muon([dict(params=[w], use_muon=True, lr=lr, momentum=mom, nesterov=True, ns_steps=5, weight_decay=wd)])
    grads = [torch.randn(24, 8) for _ in range(3)]
    expected, buf = w0.clone(), torch.zeros(24, 8)
    for g in grads:
        w.grad = g.clone()
        opt.step()
        buf = mom * buf + (1 - mom) * g  # independent restatement of the rule
        update = (1 - mom) * g + mom * buf
        expected = expected * (1 - lr * wd) - lr * (24 / 8) ** 0.5 * orthogonalize(update)
    torch.testing.assert_close(w.detach(), expected, atol=1e-5, rtol=1e-5)
    # a single step moves every singular direction by about lr * scale, whatever the gradient's spectrum
    v = torch.nn.Parameter(torch.zeros(8, 24))
    opt = Muon([dict(params=[v], use_muon=True, lr=0.1, momentum=0.0, nesterov=False, ns_steps=5, weight_decay=0.0)])
    v.grad = torch.randn(8, 1) @ torch.randn(1, 24) * 10 + torch.randn(8, 24) * 0.5  # top singular value ~50x the rest
    opt.step()
    s = torch.linalg.svdvals(v.detach())
    assert s.min() > 0.06 and s.max() < 0.125


@pytest.mark.comparison
def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(3)
    a = torch.nn.Parameter(torch.randn(5, 7))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Muon([dict(params=[a], use_muon=False, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)])
    ref = torch.optim.AdamW([b], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(5, 7)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-6)


def test_state_dict_round_trip_continues_bit_exactly():
    x = torch.randint(0, 32, (4, 8))

    def steps(model, opt, n):
        for _ in range(n):
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def make_opt(model):
        return Muon(muon_param_groups(model, 1e-2, 0.1, (0.9, 0.95), 0.05))

    m = make_gpt(tie_embeddings=False)
    opt = make_opt(m)
    steps(m, opt, 3)
    saved_model, saved_opt = copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict())
    steps(m, opt, 2)
    m2 = make_gpt(tie_embeddings=False)
    m2.load_state_dict(saved_model)
    opt2 = make_opt(m2)
    opt2.load_state_dict(saved_opt)
    steps(m2, opt2, 2)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


@pytest.mark.slow
def test_train_with_muon_learns_and_resumes_bit_exactly(tmp_path, data_dir):
    common = ['--optimizer_type=muon', '--muon_lr=0.05', '--lr_decay_iters=8', '--eval_interval=100']
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    train(straight, data_dir, '--max_iters=8', *common)
    train(split, data_dir, '--max_iters=4', *common)
    p = train(split, data_dir, '--max_iters=8', *common)
    assert 'resuming' in p.stdout + p.stderr
    a, b = train_losses(straight), train_losses(split)
    assert a == b and a[8] < a[1]
    ckpt = load(straight / 'ckpt.pt')
    assert ckpt['optimizer']['param_groups'][0]['use_muon']
    assert all(torch.equal(ckpt['model'][k], load(split / 'ckpt.pt')['model'][k]) for k in ckpt['model'])
    # the checkpoint's optimizer state does not fit AdamW: resuming with another optimizer is refused clearly
    p = train(split, data_dir, '--max_iters=9', '--lr_decay_iters=8', check=False)
    assert p.returncode != 0 and 'optimizer_type' in p.stderr and 'Traceback' not in p.stderr


@pytest.mark.slow
@pytest.mark.comparison
def test_muon_under_ddp_matches_single_process_with_double_accumulation(tmp_path, data_dir):
    # DDP averages the gradients before step(), so every rank orthogonalizes the same momentum
    single, ddp = tmp_path / 'single', tmp_path / 'ddp'
    common = ['--max_iters=5', '--eval_interval=5', '--lr_decay_iters=5', '--optimizer_type=muon', '--muon_lr=0.05']
    train(single, data_dir, *common, '--gradient_accumulation_steps=2')
    train(ddp, data_dir, *common, '--gradient_accumulation_steps=1', ranks=2)
    a, b = train_losses(single), train_losses(ddp)
    assert sorted(a) == sorted(b) == list(range(1, 6))
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a), (a, b)
    wa, wb = load(single / 'ckpt.pt')['model'], load(ddp / 'ckpt.pt')['model']
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
