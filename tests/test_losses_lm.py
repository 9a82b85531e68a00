"""Token-weighted cross-entropy, z-loss and multi-objective weighting (losses.py), checked against
independent computations, and global-batch normalization under gradient accumulation."""

import math

import pytest
import torch
import torch.nn.functional as F

from configurator import UserError
from losses import combine_losses, target_weights, token_weight_table, weighted_cross_entropy, z_loss
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
    ({'a': (1.5, [12])}, 'not one token'),
])
def test_token_weight_table_errors(groups, message):
    with pytest.raises(UserError, match=message):
        token_weight_table(10, groups, Tokens())


def test_combine_losses():
    terms = {'ce': torch.tensor(2.0), 'z_loss': torch.tensor(30.0)}
    assert combine_losses(terms, {'ce': 1.0, 'z_loss': 1e-2}).item() == pytest.approx(2.3)
    with pytest.raises(UserError, match='z_loss'):
        combine_losses(terms, {'ce': 1.0})
