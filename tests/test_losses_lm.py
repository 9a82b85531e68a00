"""Token-weighted cross-entropy, z-loss and multi-objective weighting (losses.py), checked against
independent computations, and global-batch normalization under gradient accumulation."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

import losses
from configurator import UserError
from conftest import ROOT
from losses import (LOSS_TERMS, check_loss_weights, combine_losses, target_weights, token_weight_table,
                    weighted_cross_entropy, z_loss)
from model import GPT, GPTConfig


def batch(seed=0, B=3, T=5, V=7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(V, (B, T), generator=g)
    targets[0, :2] = -100
    targets[2, 4] = -100
    return logits, targets


def labelled_positions(logits, targets):
    """(float64 logits row, target) of every non-ignored position, one at a time."""
    for b in range(targets.size(0)):
        for t in range(targets.size(1)):
            if targets[b, t].item() != -100:
                yield logits[b, t].double(), targets[b, t].item()


def reference_weighted_ce(logits, targets, table):
    """sum(w * -log p(target)) / sum(w) over non-ignored positions, one position at a time."""
    num = den = 0.0
    for row, target in labelled_positions(logits, targets):
        num += table[target].item() * (math.log(row.exp().sum().item()) - row[target].item())
        den += table[target].item()
    return num / den


@pytest.mark.comparison
def test_unweighted_is_standard_cross_entropy():
    logits, targets = batch()
    expected = F.cross_entropy(logits.view(-1, 7), targets.view(-1), ignore_index=-100)
    torch.testing.assert_close(weighted_cross_entropy(logits, targets), expected, rtol=2e-7, atol=0)  # ~ the last bit
    torch.testing.assert_close(weighted_cross_entropy(logits, targets, torch.ones(7)), expected, rtol=2e-7, atol=0)


@pytest.mark.comparison
def test_weighted_matches_reference():
    logits, targets = batch(1)
    table = torch.tensor([1.0, 1.5, 1.3, 1.2, 1.2, 0.5, 2.0])
    got = weighted_cross_entropy(logits, targets, table).item()
    assert got == pytest.approx(reference_weighted_ce(logits, targets, table), rel=1e-6)
    assert got != pytest.approx(weighted_cross_entropy(logits, targets).item(), rel=1e-3)  # the weights matter


def test_target_weights_zero_on_ignored_positions():
    _, targets = batch()
    table = torch.arange(7.0) + 1
    w = target_weights(targets, table)
    assert (w[targets == -100] == 0).all()
    assert torch.equal(w[targets != -100], table[targets[targets != -100]])


def reference_z_loss(logits, targets, table=None):
    """sum(w * log(sum(exp(logits)))^2) / sum(w) over non-ignored positions, one position at a time;
    w = 1 without a table."""
    num = den = 0.0
    for row, target in labelled_positions(logits, targets):
        w = 1.0 if table is None else table[target].item()
        num += w * math.log(row.exp().sum().item()) ** 2
        den += w
    return num / den


@pytest.mark.comparison
def test_z_loss_matches_reference():
    logits, targets = batch(2)
    logits = 3 * logits  # log Z well away from 0
    # float32 logsumexp of 7 values: ~1e-7 relative error per position, twice that squared
    assert z_loss(logits, targets).item() == pytest.approx(reference_z_loss(logits, targets), rel=1e-6)


@pytest.mark.comparison
def test_z_loss_weighs_every_label_alike_and_adds_up_over_micro_batches():
    # as train.py's train_step: token weights scale the cross-entropy only; the z-loss of each micro-batch is
    # divided by the labelled positions of the whole global batch, so the parts add up to its plain mean
    logits, targets = batch(4, B=4)
    logits = 3 * logits
    targets[1, :4] = -100  # micro-batches with different label counts
    table = torch.tensor([1.0, 1.5, 1.3, 1.2, 1.2, 0.5, 2.0])
    label_count = (targets != -100).sum()
    parts = sum(z_loss(logits[i:i + 1], targets[i:i + 1], label_count) for i in range(4))
    expected = reference_z_loss(logits, targets)
    assert parts.item() == pytest.approx(expected, rel=1e-6)
    assert expected != pytest.approx(reference_z_loss(logits, targets, table), rel=1e-3)  # the weights would matter


@pytest.mark.comparison
def test_micro_batch_losses_add_up_to_the_global_batch_loss():
    logits, targets = batch(3, B=4)
    table = torch.tensor([1.0, 1.5, 1.3, 1.2, 1.2, 0.5, 2.0])
    targets[1, :4] = -100  # micro-batches with different token counts: per-micro-batch means would be wrong
    total_weight = target_weights(targets, table).sum()
    parts = sum(weighted_cross_entropy(logits[i:i + 1], targets[i:i + 1], table, total_weight) for i in range(4))
    whole = weighted_cross_entropy(logits, targets, table)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    naive = sum(weighted_cross_entropy(logits[i:i + 1], targets[i:i + 1], table) for i in range(4)) / 4
    assert naive.item() != pytest.approx(whole.item(), rel=1e-3)


@pytest.mark.comparison
def test_accumulation_1x4_gives_the_gradient_of_4x1():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=16))
    x = torch.randint(11, (4, 8))
    y = torch.randint(11, (4, 8))
    y[0, :6] = -100
    y[3, :3] = -100
    table = torch.linspace(0.5, 2.0, 11)

    def grads(micro_batch):
        model.zero_grad()
        total_weight = target_weights(y, table).sum()  # known up front, for the whole global batch
        label_count = (y != -100).sum()
        for i in range(0, 4, micro_batch):
            logits, _ = model(x[i:i + micro_batch])
            targets = y[i:i + micro_batch]
            (weighted_cross_entropy(logits, targets, table, total_weight)
             + 0.1 * z_loss(logits, targets, label_count)).backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(4), grads(1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class Tokens:
    """A toy tokenizer: every word one token, except 'therefore' (two)."""

    def encode(self, text):
        return {'because': [3], ' because': [4], '<tool>': [5], 'therefore': [6, 7]}[text]


def test_token_weight_table_from_groups():
    table = token_weight_table(10, {'reasoning': (1.5, ['because', ' because']), 'tool': (1.3, ['<tool>', 9])},
                               Tokens())
    expected = torch.ones(10)
    expected[[3, 4]] = 1.5
    expected[[5, 9]] = 1.3
    assert torch.equal(table, expected)


@pytest.mark.parametrize('groups, message', [
    ({'reasoning': (1.5, ['therefore'])}, 'not one token'),
    ({'a': (1.5, ['because']), 'b': (1.2, [3])}, "in both 'a' and 'b'"),
    ({'a': 1.5}, 'must be \\(weight'),
    ({'a': (1.5, [12])}, 'is no token id of this model \\(its ids are 0 to 9\\)'),
])
def test_token_weight_table_errors(groups, message):
    with pytest.raises(UserError, match=message):
        token_weight_table(10, groups, Tokens())


def test_combine_losses():
    terms = {'ce': torch.tensor(2.0), 'z_loss': torch.tensor(30.0)}
    assert combine_losses(terms, {'ce': 1.0, 'z_loss': 1e-2}).item() == pytest.approx(2.3)
    with pytest.raises(UserError, match='z_loss'):
        combine_losses(terms, {'ce': 1.0})


# -- the output layer and its loss in one, chunk by chunk (losses.linear_cross_entropy: model.py's forward) ----

EPS32 = torch.finfo(torch.float32).eps


def reference_terms(h, weight, targets, ce_weights, z_weights, softcap=0.0):
    """The two sums from every (N, V) logit at once, through F.cross_entropy and torch.logsumexp."""
    logits = h @ weight.T
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    keep = targets != -100
    ce = (torch.where(keep, ce_weights, 0.0) * F.cross_entropy(logits, targets, reduction='none')).sum()
    return ce, (torch.where(keep, z_weights, 0.0) * torch.logsumexp(logits, dim=-1).square()).sum()


def terms_and_grads(fn, h, weight, *args):
    h, weight = h.detach().requires_grad_(), weight.detach().requires_grad_()
    ce, z = fn(h, weight, *args)
    (2 * ce + 3 * z).backward()
    return ce.detach(), z.detach(), h.grad, weight.grad


@pytest.mark.comparison
@pytest.mark.parametrize('softcap', [0.0, 2.0])
def test_linear_cross_entropy_matches_cross_entropy_in_values_and_gradients(softcap, monkeypatch):
    g = torch.Generator().manual_seed(0)
    N, C, V = 37, 8, 23
    h, weight = torch.randn(N, C, generator=g, dtype=torch.float64), torch.randn(V, C, generator=g, dtype=torch.float64)
    targets = torch.randint(V, (N,), generator=g)
    targets[[0, 5, 6, 30]] = -100
    ce_weights, z_weights = torch.rand(N, generator=g, dtype=torch.float64), torch.rand(N, generator=g, dtype=torch.float64)
    ce_weights[5] = float('nan')  # a weight at an ignored position counts for nothing, whatever it is
    widest = []  # the logits each chunk computes: never more than chunk_logits
    linear = F.linear
    monkeypatch.setattr(F, 'linear', lambda *a: widest.append(a[0].size(0) * a[1].size(0)) or linear(*a))
    chunked = terms_and_grads(lambda *a: losses.linear_cross_entropy(*a, softcap=softcap, chunk_logits=100),
                              h, weight, targets, ce_weights, z_weights)
    assert len(widest) == 10 and max(widest) <= 100  # 4 rows (92 logits) a chunk
    monkeypatch.undo()
    expected = terms_and_grads(lambda *a: reference_terms(*a, softcap), h, weight, targets, ce_weights, z_weights)
    # float64, the same arithmetic in another order: equal to ~1e-15 relative
    for got, want in zip(chunked, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())
    # float32 (the model's), against float64: each logit a sum of 8 products and each log-softmax of 23 terms, a few
    # dozen roundings of eps32 apart at most, so 64 eps32 of each result's scale
    single = terms_and_grads(lambda *a: losses.linear_cross_entropy(*a, softcap=softcap, chunk_logits=100),
                             h.float(), weight.float(), targets, ce_weights.float(), z_weights.float())
    for got, want in zip(single, expected):
        torch.testing.assert_close(got.double(), want, rtol=64 * EPS32, atol=64 * EPS32 * want.abs().max().item())
    assert losses.linear_cross_entropy(h, weight, targets, ce_weights)[1] is None  # no z weights, no z term


@pytest.mark.comparison
@pytest.mark.parametrize('softcap', [0.0, 2.0])
def test_compiled_linear_cross_entropy_writes_its_gradient_without_a_scatter_and_equals_eager(softcap):
    """Compiled, P - onehot(target) is one torch.where (fused into the pass that writes the 16-bit gradient, where
    the eager in-place scatter_add_ made the compiler keep a float32 P: bench/README.md); it adds the same -1 (or
    -slope) at the same places, so values and gradients are eager's bit for bit, z-loss and chunks included."""
    g = torch.Generator().manual_seed(1)
    N, C, V = 37, 8, 23
    h, weight = torch.randn(N, C, generator=g), torch.randn(V, C, generator=g)
    targets = torch.randint(V, (N,), generator=g)
    targets[[0, 5]] = -100
    ce_weights, z_weights = torch.rand(N, generator=g), torch.rand(N, generator=g)
    ops = []

    def recording(gm, inputs):  # the autograd.Function's forward is a subgraph of its own
        ops.extend(str(node.target) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                   for node in m.graph.nodes)
        return gm.forward

    def terms(*a):
        return losses.linear_cross_entropy(*a, softcap=softcap, chunk_logits=100)
    eager = terms_and_grads(terms, h, weight, targets, ce_weights, z_weights)
    torch._dynamo.reset()
    compiled = terms_and_grads(torch.compile(terms, backend=recording), h, weight, targets, ce_weights, z_weights)
    assert any('where' in op for op in ops) and not any('scatter' in op for op in ops)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)


@pytest.mark.comparison
@pytest.mark.parametrize('tie', [True, False])
def test_model_loss_is_train_pys_weighted_cross_entropy_and_z_loss_of_its_logits(tie, monkeypatch):
    """forward(targets, logits_at, weights) against weighted_cross_entropy and z_loss of forward's logits (train.py's
    terms before they were computed chunk by chunk), float64, several chunks, a soft cap, chat-token rows that LoRA
    trains (lm_head's computed_weight)."""
    from lm.lora import apply_lora
    monkeypatch.setattr(losses, 'CHUNK_LOGITS', 64)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=9, n_layer=1, n_head=2, n_embd=16, logit_softcap=3.0,
                          tie_embeddings=tie))
    model.resize_vocab(11)
    apply_lora(model, r=2, lora_alpha=4, target_modules='all-linear', added_tokens=2)
    model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('lora_B', 'added_rows')):
                p.add_(torch.randn_like(p) * 0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(11, (3, 8), generator=g), torch.randint(11, (3, 8), generator=g)
    y[0, :5] = -100
    table = torch.linspace(0.5, 2.0, 11, dtype=torch.float64)
    weight_sum, label_count = target_weights(y, table).sum(), (y != -100).sum()
    labels_at = y != -100

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad()
        return out
    _, terms = model(x, y, logits_at=labels_at, weights={'ce': target_weights(y, table) / weight_sum,
                                                         'z_loss': labels_at / label_count})
    (ce, _), (z, _) = terms['ce'], terms['z_loss']
    (ce + 0.1 * z).backward()
    chunked = grads()
    logits, _ = model(x, logits_at=labels_at)
    ce_ref = weighted_cross_entropy(logits, y[labels_at], table, weight_sum)
    z_ref = z_loss(logits, y[labels_at], label_count)
    (ce_ref + 0.1 * z_ref).backward()
    # weighted_cross_entropy and z_loss compute in float32 (logits.float()): their rounding, not ours
    torch.testing.assert_close(ce, ce_ref.double(), rtol=16 * EPS32, atol=0)
    torch.testing.assert_close(z, z_ref.double(), rtol=16 * EPS32, atol=0)
    for name, grad in grads().items():
        torch.testing.assert_close(chunked[name], grad, rtol=64 * EPS32, atol=64 * EPS32 * grad.abs().max().item())
    assert any(n.endswith('added_rows') for n in chunked)


@pytest.mark.cuda
def test_linear_cross_entropy_under_bf16_autocast_on_cuda_holds_no_logits():
    """On a GPU under bf16 autocast: the plain path's values and gradients within bf16's rounding, and a peak memory
    below the plain path's by at least its (N, V) bf16 logits."""
    torch.manual_seed(0)
    N, C, V = 8192, 256, 32768
    h = torch.randn(N, C, device='cuda')
    weight = torch.randn(V, C, device='cuda') * 0.05
    targets = torch.randint(V, (N,), device='cuda')
    keep = torch.ones(N, device='cuda')

    def run(fn):
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = fn(hh, ww)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach().float(), hh.grad, ww.grad, torch.cuda.max_memory_allocated() - base

    chunked = run(lambda hh, ww: losses.linear_cross_entropy(hh, ww, targets, keep / N, chunk_logits=2**24)[0])
    plain = run(lambda hh, ww: F.cross_entropy(F.linear(hh, ww).float(), targets))
    # both round the same operands to bf16 (8 bits): the loss to ~2^-8 relative, each gradient to a few 2^-8
    torch.testing.assert_close(chunked[0], plain[0], rtol=2**-8, atol=0)
    for got, want in zip(chunked[1:3], plain[1:3]):
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * want.abs().max().item())
    assert chunked[3] < plain[3] - N * V * 2, (chunked[3], plain[3])


# -- loss terms (losses.LOSS_TERMS): per-position values, each position weighted by its token and its source

def positions(seed=5, N=40, C=6, V=7, S=2):
    """Labelled positions: float64 hidden states (N, C), an output matrix (V, C), targets, token weights,
    sources and the sources' weights."""
    g = torch.Generator().manual_seed(seed)
    h, head = torch.randn(N, C, generator=g, dtype=torch.float64), torch.randn(V, C, generator=g, dtype=torch.float64)
    targets = torch.randint(V, (N,), generator=g)
    token_weight = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    sources = torch.randint(S, (N,), generator=g)
    return h, head, targets, token_weight, sources, torch.tensor([1.0, 0.25], dtype=torch.float64)[:S]


def step_totals(weights, sources, S=2):
    """What train.py's step sums before its first micro-batch: (loss weight, labelled positions) per source."""
    return torch.zeros(2, S, dtype=weights.dtype).index_add_(1, sources, weights)


def step_terms(h, head, targets, weights, sources, totals, loss_weights, head_weight=True):
    """train.py's loss_terms on positions: {name: (share, per-source shares)} through head_loss_terms."""
    terms = losses.head_loss_terms(h, targets, losses.term_weights(weights, totals, loss_weights),
                                   lambda hc: hc @ head.T, head.size(0), head if head_weight else None)
    shares = losses.source_shares(terms, weights, sources, totals)
    return {name: (term, shares[name]) for name, (term, _) in terms.items()}


@pytest.mark.comparison
@pytest.mark.parametrize('head_weight', [True, False])
def test_loss_terms_weigh_positions_by_token_times_source_and_add_up_over_micro_batches(head_weight):
    """ce = sum(w_token * w_source * CE) / sum(w_token * w_source) over the whole global batch, one position at a
    time (float64); the z-loss counts every position alike; each source's mean is its own token-weighted mean (its
    weight cancels). Micro-batches divided by the whole batch's totals add up to it. Through linear_cross_entropy
    (a plain output matrix) and through the logits chunk by chunk (none): float64 throughout, the same sums in
    another order, 1e-12 relative."""
    h, head, targets, token_weight, sources, source_weight = positions()
    weights = torch.stack([token_weight * source_weight[sources], torch.ones_like(token_weight)])
    totals = step_totals(weights, sources)
    loss_weights = {'ce': 1.0, 'z_loss': 0.1}
    whole = step_terms(h, head, targets, weights, sources, totals, loss_weights, head_weight)
    logits = h @ head.T
    ce = [math.log(row.exp().sum().item()) - row[t].item() for row, t in zip(logits, targets.tolist())]
    lse2 = [math.log(row.exp().sum().item()) ** 2 for row in logits]
    w = (token_weight * source_weight[sources]).tolist()
    assert whole['ce'][0].item() == pytest.approx(sum(a * b for a, b in zip(w, ce)) / sum(w), rel=1e-12)
    assert whole['z_loss'][0].item() == pytest.approx(sum(lse2) / len(lse2), rel=1e-12)
    for s in range(2):
        mine = (sources == s).nonzero().flatten().tolist()
        own = sum(token_weight[i].item() * ce[i] for i in mine) / sum(token_weight[i].item() for i in mine)
        assert whole['ce'][1][s].item() == pytest.approx(own, rel=1e-12)
        assert whole['z_loss'][1][s].item() == pytest.approx(sum(lse2[i] for i in mine) / len(mine), rel=1e-12)
    plain = torch.stack([token_weight, weights[1]])
    unweighted = step_terms(h, head, targets, plain, sources, step_totals(plain, sources), loss_weights, head_weight)
    assert unweighted['ce'][0].item() != pytest.approx(whole['ce'][0].item(), rel=1e-3)  # the source weights matter
    parts = [step_terms(h[i:i + 10], head, targets[i:i + 10], weights[:, i:i + 10], sources[i:i + 10], totals,
                        loss_weights, head_weight) for i in range(0, 40, 10)]
    for name in whole:
        assert sum(p[name][0] for p in parts).item() == pytest.approx(whole[name][0].item(), rel=1e-12)
        torch.testing.assert_close(sum(p[name][1] for p in parts), whole[name][1], rtol=1e-12, atol=0)
    assert set(step_terms(h, head, targets, weights, sources, totals, {'ce': 1.0, 'z_loss': 0.0})) == {'ce'}


def test_a_batch_whose_labels_all_weigh_zero_is_a_loss_of_zero_not_nan():
    """token_weights that give every labelled token of a batch weight 0: the ce term is 0 with a zero gradient (it
    was 0 / 0: NaN, every step skipped, then a "diverging" abort whose advice could not help); the z-loss, which
    counts positions, is unchanged."""
    h, head, targets, _, sources, _ = positions()
    h.requires_grad_(True)
    weights = torch.stack([torch.zeros(len(targets), dtype=torch.float64), torch.ones(len(targets), dtype=torch.float64)])
    terms = step_terms(h, head, targets, weights, sources, step_totals(weights, sources), {'ce': 1.0, 'z_loss': 0.1})
    assert terms['ce'][0].item() == 0 and torch.isfinite(terms['z_loss'][0]) and terms['z_loss'][0] > 0
    terms['ce'][0].backward()
    assert torch.equal(h.grad, torch.zeros_like(h))


def entropy(logits, targets):
    """A term a user adds (docs/configuration.md): each position's predictive entropy."""
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.comparison
def test_a_new_loss_term_is_one_function_and_one_entry(monkeypatch):
    """Adding ('entropy': (entropy, True)) to losses.LOSS_TERMS is all it takes: check_loss_weights knows it,
    head_loss_terms computes it (and its gradient) chunk by chunk of logits, never more than CHUNK_LOGITS at once,
    beside the fused ce; train.py's step and logs go by LOSS_TERMS (no term named there: its loss_weights default
    is its only mention of one; the end-to-end run: test_sft's tests/entropy_term.py)."""
    with pytest.raises(UserError, match="unknown terms \\['entropy'\\]"):
        check_loss_weights({'ce': 1.0, 'entropy': 0.1})
    monkeypatch.setitem(LOSS_TERMS, 'entropy', (entropy, True))
    check_loss_weights({'ce': 1.0, 'entropy': 0.1})
    with pytest.raises(UserError, match="'ce', 'z_loss', 'entropy'"):
        check_loss_weights({'ce': 1.0, 'entropyy': 0.1})
    monkeypatch.setattr(losses, 'CHUNK_LOGITS', 7 * 8)  # 8 positions a chunk
    h, head, targets, token_weight, sources, _ = positions()
    targets[3] = -100  # no label: no term there, whatever the term's function says
    token_weight[3] = 0.0
    weights = torch.stack([token_weight, (targets != -100).double()])
    totals = step_totals(weights, sources)
    widest = []

    def logits(hc):
        widest.append(hc.size(0) * head.size(0))
        return hc @ head.T

    def loss_and_grad(fn):
        hh = h.clone().requires_grad_()
        terms = fn(hh)
        (terms['ce'][0] + 0.1 * terms['entropy'][0]).backward()
        return terms, hh.grad
    chunked, grad = loss_and_grad(lambda hh: losses.head_loss_terms(
        hh, targets, losses.term_weights(weights, totals, {'ce': 1.0, 'entropy': 0.1}), logits, 7, head))
    assert len(widest) == 10 and max(widest) <= 7 * 8  # 5 chunks, each computed again for the backward
    keep = targets != -100
    full = h @ head.T
    expected = (entropy(full, targets) * token_weight)[keep].sum() / token_weight.sum()
    assert set(chunked) == {'ce', 'entropy'}
    assert chunked['entropy'][0].item() == pytest.approx(expected.item(), rel=1e-12)
    assert chunked['entropy'][1][3] == 0 and chunked['entropy'][1][0] == pytest.approx(entropy(full[:1], None).item())

    def reference(hh):
        full = hh @ head.T
        ce = (F.cross_entropy(full, targets, reduction='none') * token_weight).sum() / token_weight.sum()
        return {'ce': (ce, None), 'entropy': ((entropy(full, targets) * token_weight)[keep].sum() / token_weight.sum(),
                                              None)}
    torch.testing.assert_close(grad, loss_and_grad(reference)[1], rtol=1e-12, atol=1e-12)
    with open(os.path.join(ROOT, 'train.py')) as f:
        script = f.read()
    # the step names no term: its terms are loss_weights' (the val loss is the plain CE, by definition)
    step = script[script.index('\ndef loss_terms('):script.index('\ndef source_means(')]
    step += script[script.index('\ndef train_step('):script.index('\n\n\n', script.index('\ndef train_step('))]
    assert "'ce'" not in step and "'z_loss'" not in step and 'LOSS_TERMS' in step, step
    assert [line for line in script.splitlines() if "'z_loss'" in line][0].startswith('loss_weights = ')


def test_loss_weights_must_name_ce():
    with pytest.raises(UserError, match="has no 'ce'"):
        check_loss_weights({'z_loss': 1e-4})
    check_loss_weights({'ce': 0.0, 'z_loss': 1e-4})  # said: the other terms alone
