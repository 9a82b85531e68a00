"""parallel='fsdp' (run/fsdp.py) on CPU with gloo, 2 ranks: the same losses as one process with the same global
batch, bit-exact resume, and one checkpoint format that one process, DDP and FSDP all continue from."""
import dataclasses
import json
import math
import shutil
import weakref
import zipfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from configurator import UserError
from starting_model import build_model, frozen_model
from run.checkpoint import all_rng_states, load_checkpoint, write_checkpoint
from conftest import (HF_TINY, REFERENCE, TINY, TRAIN_METRICS, assert_user_error, dpo, evals, hf_fixture,
                      kill_and_relaunch, load, logged, parameter_bytes, real_torchrun,
                      reference_logps_under_bf16_autocast, run, sft_args, torchrun, train, train_metrics)
from model import GPT, GPTConfig
from run.fsdp import (check_parallel, full_state_dict, is_dtensor, model_state_dict, same_init_on_every_rank,
                      shard_model, shard_optimizer_state, tensors_in)
from safetensors.torch import load_file, save_file
from run.sharded_checkpoint import read_shards, unreadable
from tasks.number_tasks import prepare_number_tasks

TORCHRUN = torchrun(2)


def train_on_2_ranks(out_dir, data_dir, *extra, **kw):
    return train(out_dir, data_dir, *extra, ranks=2, **kw)


def assert_same_run(a, b, keys=('train_loss', 'grad_norm', 'val_loss')):
    """The same float32 sums in another order (each rank's share of the batch, then the reduction). A step's
    loss and gradients sum a term a token, at least 256 here (COMMON's 8 windows of 32): in another order such a
    sum moves by up to 255 * 2^-24 of its terms' absolute sum, which for a loss (positive terms) and a norm (carried
    by its largest gradients) is about their own size: 1.5e-5 relative. Measured: up to 12 ulps of a grad norm
    near 1.4 (1.0e-6) three steps after a checkpoint on an AVX512 EPYC, 2 on AVX2; a micro-batch lost or counted
    twice moves them by percents. b may be a continued run, which logs only its own steps."""
    for key in keys:
        theirs, ours = logged(a, key), logged(b, key)
        assert ours and ours == pytest.approx({step: theirs[step] for step in ours}, rel=255 * 2 ** -24), key


def assert_same_adam_state(a, b, terms, beta2=0.95):
    """AdamW states of two runs whose gradients add the same float32 terms in another order.
    A sum of n terms moves by up to ~n * 2^-24 of its terms' absolute sum, not of its own size:
    an element near 0 is large terms cancelling, so it may move by 0.4% of itself (an AMD EPYC).
    A tensor's terms are taken at its largest gradient G (the largest root mean square over the
    steps, from exp_avg_sq): exp_avg, a weighted mean of the gradients, then moves by at most
    terms * 2^-24 * G, exp_avg_sq by 2 G times that (measured: <= 2 * 2^-24 * G, also on SSE and
    AVX2 kernels); a micro-batch lost or counted twice moves them by a fraction of G."""
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys() == {'step', 'exp_avg', 'exp_avg_sq'}, i
        assert a[i]['step'] == b[i]['step'], i
        largest = (a[i]['exp_avg_sq'].max() / (1 - beta2 ** a[i]['step'])).sqrt().item()
        atol = terms * 2 ** -24 * largest
        assert torch.allclose(a[i]['exp_avg'], b[i]['exp_avg'], rtol=0, atol=atol), i
        assert torch.allclose(a[i]['exp_avg_sq'], b[i]['exp_avg_sq'], rtol=0, atol=2 * largest * atol), i


COMMON = ['--max_iters=6', '--eval_interval=3', '--lr_decay_iters=6', '--batch_size=4']


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, data_dir):
    """(one process's run, FSDP's on 2 ranks), 6 steps of the same 8 windows each."""
    single, fsdp = tmp_path_factory.mktemp('single'), tmp_path_factory.mktemp('fsdp')
    train(single, data_dir, *COMMON, '--gradient_accumulation_steps=2')
    train_on_2_ranks(fsdp, data_dir, *COMMON, '--parallel=fsdp')
    return single, fsdp


@pytest.mark.slow
@pytest.mark.comparison
def test_fsdp_matches_one_process(uninterrupted):
    single, fsdp = uninterrupted
    assert sorted(logged(fsdp, 'train_loss')) == list(range(1, 7))
    assert_same_run(single, fsdp)
    # the checkpoint is an unsharded run's: the same tensors (tied embeddings stored once) and optimizer layout
    a, b = load(single / 'ckpt.pt'), load(fsdp / 'ckpt.pt')
    assert a['model'].keys() == b['model'].keys()
    # weights: 6 Adam steps of lr 1e-2 x m / sqrt(v), m off by its rounding (below), amplified where
    # an element's gradients are ~100x below its tensor's largest: ~1e-6 (measured: <= 1.3e-7)
    assert all(torch.allclose(a['model'][k], b['model'][k], rtol=0, atol=1e-6) for k in a['model'])
    assert b['model']['lm_head.weight'].data_ptr() == b['model']['transformer.wte.weight'].data_ptr()
    assert a['optimizer']['param_groups'] == b['optimizer']['param_groups']
    assert_same_adam_state(a['optimizer']['state'], b['optimizer']['state'], terms=8 * 32)  # 8 windows


# untied, with biases and learned positions; 25 rows: uneven shards on 2 ranks (13 and 12)
NEW_MODEL = GPTConfig(block_size=16, vocab_size=25, n_layer=2, n_head=2, n_embd=32, bias=True, norm='layernorm',
                      pos_emb='learned', tie_embeddings=False)


def on_2_gloo_ranks(worker, folder, *args):
    """worker(rank, world_size, folder, *args), a function of this file, on each rank of a 2-rank gloo group
    (tests/gloo_worker.py under conftest.torchrun), each rank ended as run.runtime.compute_cleanup ends one: the
    ranks leave together and the process exits there, skipping the interpreter's teardown, where a gloo thread still
    releasing a collective can abort it (SIGABRT, 'terminate called without an active exception'; seen once in this
    file's first test on CI's CPU). A rank's exception fails the test with its traceback."""
    run([*torchrun(2), 'tests/gloo_worker.py', f'test_fsdp.{worker.__name__}', str(folder), json.dumps(args)])


def draw_a_new_model_sharded(rank, world_size, folder, seed):
    """One rank of a new FSDP model, built as train.py builds it from scratch; writes what it held, and
    (rank 0) the whole model gathered after sharding."""
    with same_init_on_every_rank(seed, enabled=True):
        model = build_model(NEW_MODEL, None, assign=True)
    # where the whole model used to be drawn on every rank
    allocated_before_sharding = sum(p.numel() for p in model.parameters() if not p.is_meta)
    shard_model(model, 'cpu', torch.float32, cpu_offload=False)
    held = sum(p.to_local().numel() for p in model.parameters())
    torch.save(dict(allocated_before_sharding=allocated_before_sharding, held=held, whole=model_state_dict(model)),
               folder / f'rank{rank}.pt')


@pytest.mark.slow
@pytest.mark.comparison
def test_a_new_fsdp_model_is_never_whole_on_a_rank_and_is_one_processs_model(tmp_path):
    """From scratch under FSDP each rank allocates nothing before sharding (the meta device) and then only its
    shards, drawn in place: gathered, they are bit for bit the model one process draws from the same seed
    (each weight drawn from its own stream, by the same CPU kernels, in both)."""
    on_2_gloo_ranks(draw_a_new_model_sharded, tmp_path, 1234)
    ranks = [torch.load(tmp_path / f'rank{r}.pt', weights_only=True) for r in range(2)]
    torch.manual_seed(1234)  # as compute_init seeds a single process
    expected = GPT(NEW_MODEL).state_dict()
    total = sum(t.numel() for t in expected.values())
    assert [r['allocated_before_sharding'] for r in ranks] == [0, 0]
    assert sum(r['held'] for r in ranks) == total and all(r['held'] < 0.6 * total for r in ranks)
    whole = ranks[0]['whole']
    assert whole.keys() == expected.keys() and all(torch.equal(whole[k], expected[k]) for k in expected)
    torch.manual_seed(99)  # another seed, another model
    assert not torch.equal(GPT(NEW_MODEL).state_dict()['lm_head.weight'], expected['lm_head.weight'])


def save_a_sharded_model_to_one_file(rank, world_size, folder):
    """One rank of a tied FSDP model after an AdamW step, saved to one file (write_checkpoint) while counting
    the bytes of gathered tensors (full_tensor's, or shards received) alive at once; rank 0 also saves
    full_state_dict's copy. Then the optimizer state read back as a resumed run reads it, counting its views
    of the memory-mapped file."""
    with same_init_on_every_rank(0, enabled=True):
        model = build_model(dataclasses.replace(NEW_MODEL, tie_embeddings=True), None, assign=True)
    shard_model(model, 'cpu', torch.float32, cpu_offload=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, NEW_MODEL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(x, x)[1].backward()
    optimizer.step()
    state = dict(model=model.state_dict(keep_vars=True), optimizer=optimizer.state_dict(), iter_num=1,
                 rng=all_rng_states(), bf16=torch.arange(5.0, dtype=torch.bfloat16))
    alive, peak, full_tensor, recv = [0], [0], DTensor.full_tensor, dist.recv

    def hold(gathered):  # counted until it is freed
        alive[0] += gathered.nbytes
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(gathered, lambda n=gathered.nbytes: alive.__setitem__(0, alive[0] - n))
        return gathered
    DTensor.full_tensor = lambda self, *args, **kwargs: hold(full_tensor(self, *args, **kwargs))
    dist.recv = lambda tensor, *args, **kwargs: recv(hold(tensor), *args, **kwargs)
    write_checkpoint(str(folder / 'ckpt.pt'), state, sharded=False, master=rank == 0)
    DTensor.full_tensor, dist.recv = full_tensor, recv
    whole = full_state_dict(state)
    if rank == 0:
        torch.save(whole, folder / 'reference.pt')
    sizes = [t.nbytes for t in tensors_in(whole)]  # (none on rank 1: full_state_dict keeps them on rank 0)
    # resuming: the optimizer state cut to this rank's shards holds no view of the mapped file
    ckpt = load_checkpoint(str(folder / 'ckpt.pt'))
    mapped = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors_in(ckpt)]
    start, end = min(p for p, _ in mapped), max(p + n for p, n in mapped)
    resumed = tensors_in(shard_optimizer_state(optimizer, ckpt['optimizer']))
    views = sum(start <= (t.to_local() if is_dtensor(t) else t).data_ptr() < end for t in resumed)
    torch.save(dict(peak=peak[0], sizes=sizes, views=views), folder / f'rank{rank}.pt')


@pytest.mark.slow
@pytest.mark.comparison
def test_a_one_file_fsdp_save_never_holds_the_whole_state_and_writes_what_torch_save_writes(tmp_path):
    """Saved to one file under FSDP, the gathered state is never whole on any rank: rank 0 receives one shard
    of one tensor at a time (at most half the largest tensor on 2 ranks) and writes it into the file before
    the next, the other rank receives nothing. The file is read by load_checkpoint and holds what torch.save
    of the whole state (full_state_dict, gathered by the same processes) holds, tensor for tensor, the tied
    embedding stored once, every zip checksum right. Read back into the shards, the optimizer state keeps no
    view of the file (which would keep it mapped all run)."""
    on_2_gloo_ranks(save_a_sharded_model_to_one_file, tmp_path)
    ranks = [torch.load(tmp_path / f'rank{r}.pt', weights_only=True) for r in range(2)]
    sizes = ranks[0]['sizes']
    assert max(sizes) < sum(sizes) / 4  # the test tells one tensor from the whole state
    assert 0 < ranks[0]['peak'] <= max(sizes) / 2 and ranks[1]['peak'] == 0, [r['peak'] for r in ranks]
    assert [r['views'] for r in ranks] == [0, 0]
    saved, expected = load_checkpoint(str(tmp_path / 'ckpt.pt')), load(tmp_path / 'reference.pt')

    def assert_same(a, b):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        elif isinstance(b, (dict, list)):
            assert type(a) is type(b) and len(a) == len(b) and (not isinstance(b, dict) or a.keys() == b.keys())
            for x, y in zip(a.values(), b.values()) if isinstance(b, dict) else zip(a, b):
                assert_same(x, y)
        else:
            assert a == b
    assert_same(saved, expected)
    assert saved['model']['lm_head.weight'].data_ptr() == saved['model']['transformer.wte.weight'].data_ptr()
    assert zipfile.ZipFile(tmp_path / 'ckpt.pt').testzip() is None


@pytest.mark.slow
def test_fsdp_resumes_exactly_and_shares_checkpoints_with_ddp(tmp_path, data_dir, uninterrupted):
    common, (single, fsdp), split = COMMON, uninterrupted, tmp_path / 'split'
    # stopped at step 3 and relaunched: bit for bit the uninterrupted FSDP run
    train_on_2_ranks(split, data_dir, *common, '--parallel=fsdp', '--max_iters=3')
    step3 = tmp_path / 'step3.pt'
    shutil.copy(split / 'ckpt.pt', step3)
    train_on_2_ranks(split, data_dir, *common, '--parallel=fsdp')
    assert logged(split, 'train_loss') == logged(fsdp, 'train_loss')
    wa, wb = load(fsdp / 'ckpt.pt')['model'], load(split / 'ckpt.pt')['model']
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # FSDP's step-3 checkpoint continued by one process and by DDP; one process's continued by FSDP
    for name, launch in [('by_one', train), ('by_ddp', train_on_2_ranks)]:
        (tmp_path / name).mkdir()
        shutil.copy(step3, tmp_path / name / 'ckpt.pt')
        launch(tmp_path / name, data_dir, *common, *(['--gradient_accumulation_steps=2'] if launch is train else []))
        assert_same_run(single, tmp_path / name, keys=('train_loss', 'grad_norm'))
    train(tmp_path / 'from_one', data_dir, *common, '--gradient_accumulation_steps=2', '--max_iters=3')
    train_on_2_ranks(tmp_path / 'from_one', data_dir, *common, '--parallel=fsdp')
    assert_same_run(single, tmp_path / 'from_one', keys=('train_loss', 'grad_norm'))


@pytest.mark.slow
def test_lora_under_fsdp_matches_one_process(tmp_path, sft_env):
    """LoRA on a frozen sharded base (with activation checkpointing, the added chat-token rows trained, exact
    match answered by both ranks together, merged.pt gathered, a sharded checkpoint of the adapters written and
    read whole): one process's losses from the same
    weights (both continue one process's step-1 checkpoint: the adapters and chat-token rows a run draws at its
    start come from another stream under FSDP). FSDP accumulates 2 micro-batches without reducing gradients in
    between (set_requires_gradient_sync)."""
    common = ['--max_iters=3', '--eval_interval=3', '--lr_decay_iters=3', '--lora_dropout=0', '--batch_size=2']
    for training_type, extra in [('lora', ['--activation_checkpointing=True'])]:  # full SFT: the HF test below
        single, fsdp = tmp_path / f'{training_type}_single', tmp_path / f'{training_type}_fsdp'
        one_process = sft_args(sft_env, single, *common, *extra, '--gradient_accumulation_steps=4',
                               training_type=training_type)
        run([*one_process, '--max_iters=1'])
        shutil.copytree(single, fsdp)
        run(one_process)
        run([*TORCHRUN, *sft_args(sft_env, fsdp, *common, *extra, '--parallel=fsdp', '--gradient_accumulation_steps=2',
                                  '--checkpoint_format=sharded', training_type=training_type)])
        assert sorted(logged(fsdp, 'train_loss')) == [1, 2, 3]
        assert_same_run(single, fsdp)
        assert logged(fsdp, 'eval/exact_match') == logged(single, 'eval/exact_match')
    a, b = load(tmp_path / 'lora_single' / 'merged.pt')['model'], load(tmp_path / 'lora_fsdp' / 'merged.pt')['model']
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    a, b = load(tmp_path / 'lora_single' / 'ckpt.pt'), load_checkpoint(str(tmp_path / 'lora_fsdp' / 'ckpt.pt'))
    assert 'model' not in load(tmp_path / 'lora_fsdp' / 'ckpt.pt')  # its adapters are in ckpt-000003.dcp/
    assert b['model'].keys() == a['model'].keys() and b['optimizer']['state'].keys() == a['optimizer']['state'].keys()


@pytest.mark.slow
def test_dpo_under_fsdp(tmp_path, dpo_env):
    """DPO with a sharded frozen reference matches one process (tolerances: test_dpo's accumulation test), also
    when stopped after step 2 and continued from a sharded checkpoint; with LoRA and precomputed reference
    log-probs the step-0 loss is ln 2 (policy = reference), and after 3 steps the adapters have moved the policy
    off the reference (whether up or down, 3 steps of lr 1e-3 on a tiny model is chance: one process lands at
    0.69297, FSDP, whose adapters come from another stream, at 0.69320)."""
    common = ['--max_iters=3', '--eval_interval=3', '--learning_rate=1e-3']
    single, fsdp, lora = tmp_path / 'single', tmp_path / 'fsdp', tmp_path / 'lora'
    dpo(dpo_env, single, *common, '--batch_size=4')
    for max_iters in (2, 3):
        p = dpo(dpo_env, fsdp, *common, '--batch_size=1', '--gradient_accumulation_steps=2', '--parallel=fsdp',
                '--checkpoint_format=sharded', f'--max_iters={max_iters}', ranks=2)
    assert 'resuming from' in p.stdout and 'at step 2' in p.stdout
    for step, metrics in train_metrics(single).items():
        for k in TRAIN_METRICS + ('grad_norm',) * (step == 1):
            assert train_metrics(fsdp)[step][k] == pytest.approx(metrics[k], rel=1e-5, abs=1e-5), (step, k)
    steps = [e['step'] for e in evals(single)]
    for e, other in zip(evals(single), [e for e in evals(fsdp) if e['step'] in steps], strict=True):
        assert other == pytest.approx(e, rel=1e-5, abs=1e-5)
    dpo(dpo_env, lora, *common, '--batch_size=2', '--parallel=fsdp', '--use_lora=True', '--precompute_ref_logps=True',
        ranks=2)
    assert evals(lora)[0]['eval/loss'] == pytest.approx(math.log(2), abs=1e-6)
    assert (lora / 'merged.pt').exists() and abs(evals(lora)[1]['eval/loss'] - math.log(2)) > 1e-5


def test_frozen_reference_shards_of_a_bf16_run_are_bf16_and_give_the_same_logps(tmp_path):
    """Under FSDP a bf16 run gathers every weight in bf16 (its mixed-precision policy), embeddings
    and norms too, so the reference's shards are kept in bf16 (fsdp.shard_model frozen): the same
    log-probs as from float32 shards, from half the bytes. One rank, in this process."""
    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "store"}', rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        state = GPT(REFERENCE).state_dict()
        before = GPT.from_state_dict(REFERENCE, state).requires_grad_(False).eval()
        shard_model(before, 'cpu', torch.bfloat16, cpu_offload=False)  # float32 shards, as before
        after = frozen_model(REFERENCE, state, 'fsdp', 'cpu', torch.bfloat16, False)
        assert {p.dtype for p in before.parameters()} == {torch.float32}
        assert {p.dtype for p in after.parameters()} == {torch.bfloat16} and after.rope_cos.dtype == torch.float32
        assert parameter_bytes(after) * 2 == parameter_bytes(before)
        (sums, logits), (sums16, logits16) = map(reference_logps_under_bf16_autocast, (before, after))
        assert torch.equal(sums, sums16) and torch.equal(logits, logits16)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_settings_it_cannot_run_are_refused(tmp_path, data_dir):
    for args, message in [(['cpu', torch.float16, 'adamw', False], 'bfloat16'), (['cpu', torch.float32, 'muon', False],
                          'AdamW'), (['cpu', torch.float32, 'adamw', True], 'already')]:
        with pytest.raises(UserError, match=message):
            check_parallel('fsdp', True, *args)
    check_parallel('ddp', False, 'cpu', torch.float16, 'muon', False)
    for args, message in [(['--parallel=fsdp'], 'torchrun')]:
        p = train(tmp_path / 'out', data_dir, '--max_iters=1', *args, check=False)
        assert_user_error(p, message)
    # under torchrun too (init_process_group wraps the hook that prints it); torchrun (the real one) then reports
    # the failed ranks with a traceback of its own, but none comes from train.py
    p = run([*real_torchrun(2), 'train.py', f'--out_dir={tmp_path / "out"}', f'--data_dir={data_dir}', *TINY,
             '--max_iters=1', '--parallel=fsdp', '--optimizer_type=muon'], check=False)
    assert p.returncode != 0 and 'error: parallel' in p.stderr and 'train.py", line' not in p.stderr, p.stderr


@pytest.mark.slow
def test_hugging_face_model_stored_in_bf16_under_fsdp_matches_one_process(tmp_path):
    """A published chat model's folder, its weights stored in bfloat16 and memory-mapped: one process makes the
    model float32 whole, each FSDP rank its shard block by block; both fine-tune the same weights (a chat model
    draws none), so the losses agree (tolerance: assert_same_run)."""
    folder = tmp_path / 'smollm2-bf16'
    shutil.copytree(hf_fixture('smollm2'), folder)
    save_file({k: v.bfloat16() for k, v in load_file(str(folder / 'model.safetensors')).items()},
              str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    task = prepare_number_tasks(str(tmp_path / 'task'), n_train=32, n_eval=8)
    args = ['train.py', '--training_type=sft', f'--init_from={folder}', f'--sft_data={task}', *HF_TINY,
            '--max_iters=3', '--eval_interval=3', '--lr_decay_iters=3', '--batch_size=2']
    run([*args, f'--out_dir={tmp_path / "single"}', '--gradient_accumulation_steps=2'])
    run([*TORCHRUN, *args, f'--out_dir={tmp_path / "fsdp"}', '--parallel=fsdp'])
    assert_same_run(tmp_path / 'single', tmp_path / 'fsdp')
    assert logged(tmp_path / 'fsdp', 'eval/exact_match') == logged(tmp_path / 'single', 'eval/exact_match')


@pytest.mark.slow
def test_fsdp_skips_a_non_finite_step_and_a_killed_run_continues(tmp_path, data_dir):
    """The loop's rules hold under FSDP as under DDP: a NaN step is skipped on every rank (the gathered
    gradient norm is NaN on all), and a torchrun job killed with SIGKILL continues from its checkpoint."""
    nan = tmp_path / 'nan'
    p = train_on_2_ranks(nan, data_dir, '--max_iters=4', '--eval_interval=100', '--lr_decay_iters=4', '--parallel=fsdp',
                         faults='nan@2')
    assert 'step 2: non-finite loss' in p.stdout + p.stderr
    ckpt = load(nan / 'ckpt.pt')
    assert ckpt['iter_num'] == 4 and all(torch.isfinite(v).all() for v in ckpt['model'].values())
    out = tmp_path / 'killed'
    args = [*TORCHRUN, 'train.py', f'--out_dir={out}', f'--data_dir={data_dir}', *TINY, '--max_iters=60',
            '--eval_interval=10', '--lr_decay_iters=60', '--parallel=fsdp', '--sample_tokens=0']
    killed_at, output, steps = kill_and_relaunch(args, out)
    assert killed_at >= 10 and f'resuming from {out / "ckpt.pt"} at step {killed_at}' in output
    assert steps == list(range(1, 61)) and load(out / 'ckpt.pt')['iter_num'] == 60


@pytest.mark.slow
def test_sharded_checkpoints_resume_exactly_on_any_world_size_and_convert_to_one_file(tmp_path, data_dir,
                                                                                       uninterrupted):
    """checkpoint_format='sharded': each rank writes its shards (ckpt-<step>.dcp/, named by a small ckpt.pt).
    Relaunched after step 3, FSDP continues bit for bit; read whole (load_checkpoint, the converter) it is the
    one-file checkpoint of the same run, tensor for tensor; one FSDP rank continues from two ranks' shards, and
    so does one process without FSDP (which reads them whole: whole_checkpoint)."""
    single, fsdp = uninterrupted
    sharded, by_one_rank, unsharded = tmp_path / 'sharded', tmp_path / 'by_one_rank', tmp_path / 'unsharded'
    train_on_2_ranks(sharded, data_dir, *COMMON, '--parallel=fsdp', '--checkpoint_format=sharded', '--max_iters=3')
    shutil.copytree(sharded, by_one_rank)
    shutil.copytree(sharded, unsharded)
    p = train(unsharded, data_dir, *COMMON, '--gradient_accumulation_steps=2', '--checkpoint_format=sharded')
    assert 'at step 3' in p.stdout
    assert_same_run(single, unsharded, keys=('train_loss', 'grad_norm'))
    p = train_on_2_ranks(sharded, data_dir, *COMMON, '--parallel=fsdp', '--checkpoint_format=sharded')
    assert 'at step 3' in p.stdout and logged(sharded, 'train_loss') == logged(fsdp, 'train_loss')
    assert 'model' not in load(sharded / 'ckpt.pt') and len(list(sharded.glob('ckpt-*.dcp'))) == 1  # older removed
    run(['-m', 'run.sharded_checkpoint', str(sharded / 'ckpt.pt'), str(tmp_path / 'whole.pt')])
    for whole in (load_checkpoint(str(sharded / 'ckpt.pt')), load(tmp_path / 'whole.pt')):
        expected = load(fsdp / 'ckpt.pt')
        assert whole.keys() == expected.keys() and whole['optimizer'].keys() == expected['optimizer'].keys()
        assert whole['model'].keys() == expected['model'].keys()
        assert all(torch.equal(whole['model'][k], expected['model'][k]) for k in expected['model'])
        assert whole['model']['lm_head.weight'].data_ptr() == whole['model']['transformer.wte.weight'].data_ptr()
        assert whole['optimizer']['param_groups'] == expected['optimizer']['param_groups']
        assert all(torch.equal(whole['optimizer']['state'][i][k], expected['optimizer']['state'][i][k])
                   for i in expected['optimizer']['state'] for k in expected['optimizer']['state'][i])
    run([*torchrun(1), 'train.py', f'--out_dir={by_one_rank}', f'--data_dir={data_dir}', *TINY, *COMMON,
         '--gradient_accumulation_steps=2', '--parallel=fsdp', '--checkpoint_format=sharded'])
    assert_same_run(single, by_one_rank, keys=('train_loss', 'grad_norm'))
    shards = next(by_one_rank.glob('ckpt-*.dcp'))
    with open(shards / '__0_0.distcp', 'r+b') as f:
        f.truncate(100)
    with pytest.raises(UserError, match='corrupt or cut short'):
        load_checkpoint(str(by_one_rank / 'ckpt.pt'))
    shutil.rmtree(shards)
    with pytest.raises(UserError, match='missing or incomplete'):
        load_checkpoint(str(by_one_rank / 'ckpt.pt'))
    # the converter's advice is its own (it has no --init_from or --out_dir), in one paragraph
    p = run(['-m', 'run.sharded_checkpoint', str(by_one_rank / 'ckpt.pt'), str(tmp_path / 'w.pt')], check=False)
    assert_user_error(p, 'missing or incomplete (no .metadata). Put it back, or convert another sharded ckpt.pt.')


def test_a_shard_folders_metadata_is_read_once(tmp_path, monkeypatch):
    """Continuing from a sharded checkpoint reads its folder's .metadata once (placeholders, read_shards and
    dcp.load share one reader), and the shards read back are the ones written. One rank, in this process."""
    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "store"}', rank=0, world_size=1)
    try:
        with same_init_on_every_rank(0, enabled=True):
            model = build_model(NEW_MODEL, None, assign=True)
        shard_model(model, 'cpu', torch.float32, cpu_offload=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randint(0, NEW_MODEL.vocab_size, (2, 8))
        model(x, x)[1].backward()
        optimizer.step()
        path = str(tmp_path / 'ckpt.pt')
        write_checkpoint(path, dict(model=model.state_dict(keep_vars=True), optimizer=optimizer.state_dict(),
                                    iter_num=1), sharded=True, master=True)
        reads, read_metadata = [], FileSystemReader.read_metadata
        monkeypatch.setattr(FileSystemReader, 'read_metadata',
                            lambda *a, **kw: reads.append(1) or read_metadata(*a, **kw))
        ckpt = load_checkpoint(path, whole=False)
        resumed = build_model(NEW_MODEL, ckpt, assign=True)
        shard_model(resumed, 'cpu', torch.float32, cpu_offload=False)
        resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        read_shards(ckpt, resumed, resumed_optimizer)
        assert len(reads) == 1
        a, b = model_state_dict(model), model_state_dict(resumed)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        moments = [full_state_dict(o.state_dict())['state'][0]['exp_avg'] for o in (optimizer, resumed_optimizer)]
        assert torch.equal(*moments)
    finally:
        dist.destroy_process_group()


def test_unreadable_shards_are_explained_even_by_an_error_without_a_message():
    """A shard file cut short can raise a bare EOFError (DCP writes the items in another order where CUDA is
    present: seen on a GPU machine); the message must still be the one-paragraph explanation."""
    error = unreadable('out/ckpt-000006.dcp', EOFError(), 'point --init_from at another checkpoint')
    assert isinstance(error, UserError) and 'EOFError' in str(error) and 'corrupt or cut short' in str(error)
    assert str(error).endswith('Restore the folder from a backup, or point --init_from at another checkpoint.')


def test_adam_state_tolerance_scales_with_the_gradients_not_the_element():
    """The case seen on an AMD EPYC: an exp_avg element of 6.3e-7 (its tensor's gradients ~1e-3) off by
    2.7e-9, 0.43% of itself, is rounding; a lost micro-batch's share of the gradients is not."""
    exp_avg = torch.linspace(-1e-4, 1e-4, 1024)
    exp_avg[7] = 6.3e-7
    state = {0: {'step': torch.tensor(6.0), 'exp_avg': exp_avg, 'exp_avg_sq': torch.full((1024,), 2.65e-7)}}
    rounded = {0: {**state[0], 'exp_avg': exp_avg.clone()}}
    rounded[0]['exp_avg'][7] += 2.7e-9
    assert_same_adam_state(state, rounded, terms=256)
    lost = {0: {**state[0], 'exp_avg': exp_avg * 0.95}}
    with pytest.raises(AssertionError):
        assert_same_adam_state(state, lost, terms=256)


@pytest.mark.slow
def test_fsdp_leaves_the_final_sample_to_sample_py(tmp_path, data_dir):
    """Every token of a sample under FSDP gathers every layer's shards (250 s for 200 tokens of an 88M model on
    2 CPU ranks, against 50 s of training): the run prints the sample.py command instead, which works."""
    out = tmp_path / 'out'
    p = train_on_2_ranks(out, data_dir, '--max_iters=1', '--eval_interval=1', '--lr_decay_iters=1', '--parallel=fsdp')
    output = p.stdout + p.stderr
    assert f'to sample: python sample.py --out_dir={out} --max_new_tokens=10' in output and '--- sample' not in output
    p = run(['sample.py', f'--out_dir={out}', '--max_new_tokens=10', '--num_samples=1', '--device=cpu'])
    assert '---------------' in p.stdout
