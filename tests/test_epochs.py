"""Runs counted in epochs (num_train_epochs, run/epochs.py): the steps of each epoch worked out from the data and the
global batch against the steps the samplers then draw (SFT padded, packed, bucketed and with a curriculum; DPO pairs;
TTS batches), the plan's epochs, which of max_iters and num_train_epochs counts and the schedule's end. End to end:
an SFT run counted in epochs (test_sft's resume), DPO's (test_dpo's held-out metrics), TTS's (test_tts's decoder
without attention)."""

import math
import random
import re
import sys

import pytest
import torch

from configurator import UserError, configure
from conftest import start_up_refusal
from lm.chat_data import PreferenceBatches, SFTBatches
from run.epochs import EpochPlan, counts_epochs, warmup_fits
from scheduler import LRSchedule
from tts.data import FrameBudgetSampler


def examples_of_lengths(lengths):
    return [(list(range(n)), [-100] * (n // 2) + list(range(n // 2, n))) for n in lengths]


def hf_steps_per_epoch(n, batch_size, accumulation, ranks):
    """Hugging Face Trainer's count (drop_last=False): the dataloader's batches per rank, ceil(n / (batch x ranks)),
    in steps of `accumulation` of them, the last step taking what is left."""
    return math.ceil(math.ceil(n / (batch_size * ranks)) / accumulation)


@pytest.mark.parametrize('pack, bucket_batches, curriculum', [(False, 1, False), (False, 3, False), (True, 1, False),
                                                               (False, 1, True), (True, 1, True)])
def test_sft_epochs_are_planned_exactly_and_never_share_a_batch(pack, bucket_batches, curriculum):
    """The steps epoch_steps() plans are the steps sample() then draws: every epoch's rows in its own global batches,
    each example once (all of them without a curriculum, which skips the longer ones), the epoch's last batch
    filled up with empty rows (-1); unpacked, Trainer's count. Drawn again after a state_dict round trip mid-epoch,
    the batches are the same."""
    lengths = torch.randint(3, 30, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    batches = SFTBatches(examples_of_lengths(lengths), 4, 0, 32, pack, bucket_batches, whole_epochs=True)

    def limit(step):  # a length curriculum's growing limit
        return min(8 + 2 * step, 32) if curriculum else None

    n = 12  # a global batch: e.g. 2 ranks x 3 accumulation x 2 rows
    planned = batches.epoch_steps(n, 3, limit if curriculum else None)
    if not pack and not curriculum:
        assert planned == [hf_steps_per_epoch(150, 2, 3, 2)] * 3 == [13] * 3
    drawn, step = [], 0
    for epoch_steps in planned:
        rows = []
        for _ in range(epoch_steps):
            batch = batches.sample(n, limit(step))
            step += 1
            assert len(batch) == n
            rows.append(batch.view(n, -1).tolist())
        assert batches.epoch_ended() and not batches.pending  # the epoch ends with its planned steps
        examples = [i for batch in rows for row in batch for i in row if i >= 0]
        assert len(examples) == len(set(examples))
        if not curriculum:
            assert sorted(examples) == list(range(150))
        full = [all(max(row) >= 0 for row in batch) for batch in rows]
        assert all(full[:-1])  # only the last batch has empty rows
        drawn.append(rows)
    assert drawn[0] != drawn[1]  # reshuffled
    if pack:  # each epoch packs its own shuffle
        assert sum(len(b) for b in drawn[0]) < 150
    # resumed mid-epoch: the same rows
    again = SFTBatches(examples_of_lengths(lengths), 4, 0, 32, pack, bucket_batches, whole_epochs=True)
    for step in range(planned[0] + 2):
        again.sample(n, limit(step))
    state, step = again.state_dict(), planned[0] + 2
    expected = [again.sample(n, limit(step + k)).tolist() for k in range(planned[1])]
    resumed = SFTBatches(examples_of_lengths(lengths), 99, 0, 32, pack, bucket_batches, whole_epochs=True)
    resumed.load_state_dict(state)
    assert [resumed.sample(n, limit(step + k)).tolist() for k in range(planned[1])] == expected


def test_preference_and_tts_epochs_end_with_their_planned_steps():
    """DPO: an epoch of 40 pairs in global batches of 12 is 4 steps, the last 4 pairs then -1 (no pair), each pair
    once. TTS: an epoch of B batches a rank in steps of A batches is ceil(B / A) steps, the last taking those left."""
    pairs = PreferenceBatches([([1, 2], [3], [4 + i % 5]) for i in range(40)], 0, 0, 8, whole_epochs=True)
    assert pairs.epoch_steps(12, 2) == [hf_steps_per_epoch(40, 3, 2, 2)] * 2 == [4, 4]
    for _ in range(2):
        epoch = [pairs.sample(12) for _ in range(4)]
        assert pairs.sampler.ended() and all(len(b) == 12 for b in epoch)
        assert sorted(i for b in epoch for i in b.tolist() if i >= 0) == list(range(40))
        assert epoch[-1][4:].tolist() == [-1] * 8 and pairs.count_tokens(epoch[-1]) == pairs.count_tokens(epoch[-1][:4])

    rng = random.Random(0)
    lengths = [rng.randint(20, 200) for _ in range(101)]
    sampler = FrameBudgetSampler(lengths, 600, seed=5, rank=1, world_size=2)
    planned = sampler.epoch_steps(3, 3)
    assert planned == [math.ceil(len(sampler.epoch_batches(e)) / 3) for e in range(3)]
    for epoch, steps in enumerate(planned):
        taken = [sampler.next_batches(3, within_epoch=True) for _ in range(steps)]
        assert [b for step in taken for b in step] == sampler.epoch_batches(epoch)
        assert all(len(step) == 3 for step in taken[:-1]) and 1 <= len(taken[-1]) <= 3


def test_epoch_plan_counts_as_trainer_does():
    """Steps, fractional epochs and epoch ends; a fractional num_train_epochs ends within its last epoch, after
    ceil(fraction x that epoch's steps) of them (Trainer's max_steps = ceil(epochs x steps per epoch))."""
    plan = EpochPlan([4, 5, 4], 3)
    assert plan.steps == 13 and plan.ends == [4, 9, 13]
    assert [plan.epoch(s) for s in (0, 2, 4, 9, 11, 13)] == [0, 0.5, 1, 2, 2.5, 3]
    assert [plan.ending(s) for s in range(14)] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 2, 0, 0, 0, 3]
    assert [plan.under_way(s) for s in (0, 3, 4, 12, 13)] == [1, 1, 2, 3, 3]
    assert 'epoch(s) of 4, 5, 4 steps' in plan.describe('8 rows', 'cosine') and 'to min_lr' in plan.describe('', 'wsd')
    assert "lr_schedule='noam' keeping its own shape" in plan.describe('8 rows', 'noam')
    assert EpochPlan([10, 10], 1.25).steps == 13 == math.ceil(1.25 * 10)
    assert EpochPlan([10], 0.5).steps == 5
    with pytest.raises(UserError, match='warmup_iters=13 is as long as the whole run'):
        warmup_fits(13, plan)
    plan.check_resumed([4, 5], 'ckpt.pt')  # a run extended by an epoch
    with pytest.raises(UserError, match=r'planned its epochs as \[4, 6\] steps'):
        plan.check_resumed([4, 6], 'ckpt.pt')
    with pytest.raises(UserError, match='counted in max_iters'):
        plan.check_resumed(None, 'ckpt.pt')


def test_the_length_set_last_counts_and_both_in_one_place_are_refused(tmp_path, monkeypatch):
    """max_iters and num_train_epochs: the one set later wins (the command line over a config file, a later file
    over an earlier one); both in one place, or lr_decay_iters beside or after num_train_epochs, is an error."""
    for name in ('excepthook', 'stdout', 'stderr'):  # configure() installs its own
        monkeypatch.setattr(sys, name, getattr(sys, name))
    steps = tmp_path / 'steps.py'
    steps.write_text('max_iters = 2000\nlr_decay_iters = 2000\n')
    epochs = tmp_path / 'epochs.py'
    epochs.write_text('num_train_epochs = 3\n')
    both = tmp_path / 'both.py'
    both.write_text('num_train_epochs = 3\nmax_iters = 2000\n')

    def counted(*argv):
        return counts_epochs(configure({'max_iters': 600, 'lr_decay_iters': 600, 'num_train_epochs': 0.0}, list(argv)))

    assert not counted() and not counted(str(steps))
    assert counted('--num_train_epochs=2') and counted(str(steps), '--num_train_epochs=2')
    assert counted(str(steps), str(epochs)) and counted(str(epochs))
    assert not counted(str(epochs), '--max_iters=10') and not counted(str(epochs), str(steps))
    for argv, message in [((str(both),), 'both.py sets both num_train_epochs=3 and max_iters=2000'),
                          (('--max_iters=10', '--num_train_epochs=2'), 'the command line sets both'),
                          ((str(epochs), '--lr_decay_iters=50'), 'lr_decay_iters=50 (the command line) with'),
                          (('--lr_decay_iters=50', '--num_train_epochs=2'), 'decays its learning rate to min_lr')]:
        with pytest.raises(UserError, match=re.escape(message)):
            counted(*argv)


def test_an_epoch_counted_schedule_ends_at_the_last_step():
    """decay_end replaces lr_decay_iters: the cosine reaches min_lr exactly at the run's end, whatever lr_decay_iters
    says (nanoGPT's max_iters == lr_decay_iters: the last step trains just above min_lr)."""
    config = dict(lr_schedule='cosine', learning_rate=1.0, min_lr=0.1, warmup_iters=2, lr_decay_iters=600,
                  restart_iters=10, restart_mult=1, decay_frac=0.2)
    get_lr = LRSchedule.from_config(config, 13)
    assert get_lr(13) == 0.1 and get_lr(12) > 0.1 and get_lr(12) == LRSchedule.from_config(
        dict(config, lr_decay_iters=13))(12)
    assert LRSchedule.from_config(config)(13) > 0.9  # lr_decay_iters=600 would hardly have begun


def test_epochs_where_a_script_has_none_are_refused_at_start_up(monkeypatch, tmp_path):
    """Pretraining draws random windows (no epochs): num_train_epochs is refused, max_iters named; eval_every_epochs
    without num_train_epochs is refused in each script that has it."""
    out = f'--out_dir={tmp_path / "out"}'
    message = start_up_refusal(monkeypatch, 'train.py', out, '--num_train_epochs=2')
    assert "pretraining (training_type='from_scratch') draws random windows" in message and 'max_iters' in message
    for script, *args in [('train.py', '--training_type=sft'), ('train_dpo.py',), ('train_tts.py',)]:
        message = start_up_refusal(monkeypatch, script, out, *args, '--eval_every_epochs=1')
        assert 'eval_every_epochs=1 evaluates at the end of epochs' in message, script
    assert not (tmp_path / 'out').exists()
