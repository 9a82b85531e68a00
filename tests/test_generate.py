import pytest
import torch

from lm.generate import generate_batch, length_groups
from model import GPT, GPTConfig

PROMPTS = [[5, 9, 1], [7], [3, 3, 8, 2, 11, 30, 4], [12, 6]]  # different lengths: padding in play
PREFILLS = len(length_groups(list(map(len, PROMPTS))))  # the prefill's passes: 1 token; 2 and 3; 7


def sharp_model(**kw):
    """A tiny float64 GPT with 20x its init weights: predictions depend on the context (at
    init it repeats one token), and float64 keeps padding's kernels from flipping a greedy choice."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(**{**dict(block_size=32, vocab_size=32, n_layer=2, n_head=2, n_embd=16), **kw}))
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(20 if p.dim() == 2 else 1)
    return m.double().eval()


def one_at_a_time(m, prompts, n, **sampling):
    """Each prompt through GPT.generate alone: the reference the batch must match."""
    return [m.generate(torch.tensor([p]), n, **sampling)[0, len(p):].tolist() for p in prompts]


def count_fed(m):
    """The (rows, tokens) of every forward pass m makes from now on."""
    seen = []
    m.transformer.wte.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    return seen


@pytest.mark.comparison
@pytest.mark.parametrize("opts", [dict(), dict(n_head=4, n_kv_head=2), dict(sliding_window=3),
                                  dict(pos_emb='learned'),
                                  dict(n_head=4, n_kv_head=1, sliding_window=4, qk_norm=True, mlp='swiglu')])
def test_greedy_batch_equals_one_prompt_at_a_time(opts):
    m = sharp_model(**opts)
    got = generate_batch(m, PROMPTS, 12)
    assert got == one_at_a_time(m, PROMPTS, 12, temperature=0)
    assert all(len(c) == 12 for c in got)
    assert len({tuple(c) for c in got}) == len(PROMPTS)  # the prompts lead to different tokens


@pytest.mark.comparison
def test_each_row_stops_after_its_first_stop_id_and_leaves_the_batch():
    m = sharp_model()
    free = generate_batch(m, PROMPTS, 12)
    stops = (free[0][2], free[2][5])

    def cut(c):
        first = min((i for i, t in enumerate(c) if t in stops), default=len(c) - 1)
        return c[:first + 1]
    want = [cut(c) for c in free]
    assert len(want[0]) <= 3 and len(want[2]) <= 6 and max(map(len, want)) == 12  # some run on
    seen = count_fed(m)
    assert generate_batch(m, PROMPTS, 12, stop_ids=stops) == want
    # a row is fed every token but its last; each stop here is early enough for its row to leave at once
    assert [rows for rows, _ in seen[PREFILLS:]] == [sum(len(c) > step for c in want) for step in range(1, 12)]


@pytest.mark.comparison
def test_a_row_stopping_near_the_end_runs_on_in_the_batch():
    """Leaving the batch copies the caches: a finished row leaves once computing it in the steps left would cost
    more than a decode step of the batch. One that stops two steps before the end (2 row-steps < 4 rows) runs
    on, its tokens thrown away."""
    m = sharp_model()
    free = generate_batch(m, PROMPTS, 12)
    assert [i for i, c in enumerate(free) if 28 in c] == [1] and free[1].index(28) == 9
    seen = count_fed(m)
    assert generate_batch(m, PROMPTS, 12, stop_ids=[28]) == [free[0], free[1][:10], free[2], free[3]]
    assert [rows for rows, _ in seen[PREFILLS:]] == [4] * 11


def test_all_rows_stopping_ends_generation():
    m = sharp_model()
    free = generate_batch(m, PROMPTS, 8)
    seen = count_fed(m)
    assert generate_batch(m, PROMPTS, 8, stop_ids=[c[0] for c in free]) == [c[:1] for c in free]
    assert len(seen) == PREFILLS  # the prefill only


def test_samples_share_one_prefill_per_prompt():
    m = sharp_model()
    seen = count_fed(m)
    generate_batch(m, PROMPTS, 4, temperature=1.0, num_samples=5, generator=torch.Generator().manual_seed(0))
    # each prompt once, in groups of similar length padded to their longest, then 4 x 5 rows a token a step
    assert seen == [(1, 1), (2, 3), (1, 7)] + [(20, 1)] * 3


@pytest.mark.comparison
@pytest.mark.parametrize("opts", [dict(), dict(n_head=4, n_kv_head=2, sliding_window=3), dict(pos_emb='learned')])
def test_rows_sharing_their_prompts_cache_sample_what_rows_with_copies_do(opts):
    """A prompt's G rows reading its keys from one copy (lm/shared_prompts.SharedPromptCache, the CPU default)
    draw what G rows reading a copy each do: the same attention, summed in another order (float64: no draw
    flips), also as rows leave, some before their first decode step."""
    m = sharp_model(**opts)
    caches = []
    m.transformer.h[0].attn.register_forward_pre_hook(lambda mod, args: caches.append(type(args[2]).__name__))
    first = generate_batch(m, PROMPTS[:1], 1)[0][0]  # prompt 0's greedy first token: its 3 rows stop at once

    def draw(share):
        caches.clear()
        return generate_batch(m, PROMPTS, 10, temperature=1.5, num_samples=3, stop_ids=[first, 28], share_prompts=share,
                              generator=torch.Generator().manual_seed(5)), list(caches)
    (shared, shared_caches), (copied, copied_caches) = draw(None), draw(False)
    assert shared == copied
    assert shared_caches == ['KVCache'] * PREFILLS + ['SharedPromptCache'] * 9
    assert copied_caches == ['KVCache'] * PREFILLS + ['DecodeCache'] * 9
    assert len(set(map(tuple, shared))) > 6 and min(map(len, shared)) < 10  # diverse, and some rows stopped early
    greedy = lambda share: generate_batch(m, PROMPTS, 10, num_samples=3, stop_ids=[first], share_prompts=share)
    assert greedy(True) == greedy(False) and greedy(True)[:3] == [[first]] * 3


@pytest.mark.comparison
def test_greedy_samples_are_copies_of_the_greedy_completion():
    m = sharp_model()
    got = generate_batch(m, PROMPTS, 10, num_samples=3)
    assert got == [c for c in generate_batch(m, PROMPTS, 10) for _ in range(3)]


@pytest.mark.comparison
def test_top_k_one_is_greedy_for_every_sample():
    m = sharp_model()
    got = generate_batch(m, PROMPTS, 10, temperature=1.0, top_k=1, num_samples=3,
                         generator=torch.Generator().manual_seed(3))
    assert got == [c for c in generate_batch(m, PROMPTS, 10) for _ in range(3)]


@pytest.mark.comparison
@pytest.mark.parametrize("sampling", [dict(temperature=1.5), dict(temperature=0.9, top_k=10, top_p=0.9)])
def test_sampling_equal_prompts_draws_what_generate_draws(sampling):
    # no padding, one sample each: the same logits and the same sample_next calls on one generator
    m = sharp_model()
    prompts = [[5, 9, 1], [3, 8, 2]]
    got = generate_batch(m, prompts, 12, generator=torch.Generator().manual_seed(7), **sampling)
    want = m.generate(torch.tensor(prompts), 12, generator=torch.Generator().manual_seed(7), **sampling)
    assert got == want[:, 3:].tolist()
    assert len(set(got[0] + got[1])) > 3  # non-trivial output


@pytest.mark.comparison
def test_samples_follow_each_prompts_next_token_distribution():
    m = sharp_model()
    prompts, n = [[5, 9, 1], [7]], 4000
    got = generate_batch(m, prompts, 1, temperature=1.0, num_samples=n, generator=torch.Generator().manual_seed(0))
    for i, p in enumerate(prompts):
        probs = torch.softmax(m(torch.tensor([p]))[0][0, -1], dim=-1)
        drawn = torch.tensor([c[0] for c in got[i * n:(i + 1) * n]])
        freq = torch.bincount(drawn, minlength=len(probs)).double() / n
        torch.testing.assert_close(freq, probs, rtol=0, atol=0.03)  # 4.5 standard errors at p = 0.5


@pytest.mark.comparison
def test_rows_split_across_calls_sample_as_one_batch():
    """train_rl.py's ranks: each generates its share of the step's completions (rows_of=(first, total)) from
    the same seed and gets the completions one process draws for the whole batch, although its padding and
    batch differ (a token could flip only where a number lands within rounding of a CDF step: ~1e-7)."""
    m = sharp_model()
    sampling = dict(temperature=1.5, num_samples=3, stop_ids=[28])
    whole = generate_batch(m, PROMPTS, 10, generator=torch.Generator().manual_seed(5), **sampling)
    parts = [generate_batch(m, PROMPTS[i:i + 2], 10, generator=torch.Generator().manual_seed(5), rows_of=(3 * i, 12),
                            **sampling) for i in (0, 2)]
    assert parts[0] + parts[1] == whole
    assert len(set(map(tuple, whole))) > 6 and min(map(len, whole)) < 10  # diverse, and some rows stopped early


def test_a_different_seed_draws_different_samples():
    m = sharp_model()
    draw = lambda seed: generate_batch(m, PROMPTS, 10, temperature=1.5, num_samples=2,
                                       generator=torch.Generator().manual_seed(seed))
    assert draw(1) == draw(1) != draw(2)
    assert draw(1)[0] != draw(1)[1]  # a prompt's samples differ


def test_nothing_to_generate():
    m = sharp_model()
    seen = count_fed(m)
    assert generate_batch(m, PROMPTS, 0, num_samples=2) == [[]] * 8
    assert generate_batch(m, [], 5) == []
    assert seen == []


@pytest.mark.comparison
def test_prompts_may_fill_block_size_but_not_pass_it():
    m = sharp_model(block_size=10)
    # 6 prompt tokens and 5 new: the last new token is never fed back, so 10 positions are used
    assert generate_batch(m, [[1, 2, 3, 4, 5, 6], [7]], 5) == one_at_a_time(m, [[1, 2, 3, 4, 5, 6], [7]], 5,
                                                                            temperature=0)
    with pytest.raises(ValueError, match=r"prompt 1 has 10 tokens.*11 positions but block_size is 10"):
        generate_batch(m, [[1], list(range(10))], 2)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate_batch(m, [[]], 2)


class NoFloat64(torch.overrides.TorchFunctionMode):
    """A stand-in for Apple's MPS, which has no float64: any float64 tensor made inside fails."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64:
            raise TypeError(f"{func.__name__} made a float64 tensor, which MPS cannot hold")
        return out


def test_a_device_without_float64_samples_in_float32(monkeypatch):
    """On MPS (no float64) sampling's uniform numbers and CDF are float32: generate_batch and sample_next make
    no float64 tensor there, and float32 sampling keeps the distribution (frequencies of 40,000 draws within
    0.01 of the probabilities: ~4 standard errors)."""
    import lm.generate
    import model
    assert model.sampling_dtype('mps') == torch.float32 and model.sampling_dtype('cpu') == torch.float64
    for module in (model, lm.generate):
        monkeypatch.setattr(module, 'sampling_dtype', lambda device: torch.float32)
    torch.manual_seed(0)
    net = GPT(GPTConfig(block_size=32, vocab_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    with NoFloat64():
        out = generate_batch(net, [[1, 2, 3], [4]], 6, temperature=1.0, top_p=0.9, num_samples=3,
                             generator=torch.Generator().manual_seed(1))
        probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
        picks = model.sample_next(probs.log().expand(40000, 4), 1.0, generator=torch.Generator().manual_seed(0))
    assert len(out) == 6 and all(len(c) == 6 for c in out)
    freq = torch.bincount(picks[:, 0], minlength=4).float() / len(picks)
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)


def decode_compiled(m, device, backend='inductor', **kw):
    """generate_batch's compiled decoding (lm.generate.CompiledDecoding) and its eager path on the same calls."""
    from lm.generate import CompiledDecoding
    decoding = CompiledDecoding(backend)
    # one shape (4 prompts x 2 samples), so one compilation
    runs = [dict(), dict(stop_ids=[9]), dict(temperature=1.5, stop_ids=[8, 9])]

    def run(d, opts):
        g = torch.Generator(device=device).manual_seed(5)
        return generate_batch(m, PROMPTS, 10, num_samples=2, generator=g, decoding=d, **kw, **opts)
    return decoding, [(run(decoding, opts), run(None, opts)) for opts in runs]


@pytest.mark.comparison
def test_compiled_static_cache_decoding_draws_what_eager_decoding_draws():
    """torch.compile'd decode steps over the static caches (traced whole and functionalized, the in-place cache
    writes included; aot_eager: inductor's C++ kernels take ~100 s to build on a loaded 2-core machine, and the cuda
    test below runs inductor's) give the tokens the eager path gives, which are GPT.generate's one prompt at a time:
    greedy, G samples of each prompt stopping at a stop id (every row stays in the compiled batch, its tokens after
    the stop thrown away), and sampled with a fixed seed (each row's number is the same in both; float64, so no
    draw flips: ~1e-15 apart). A second call of the same shape reuses the caches (a CUDA graph reads fixed
    addresses)."""
    m = sharp_model(n_layer=1, n_head=4, n_kv_head=2, sliding_window=5)
    decoding, runs = decode_compiled(m, 'cpu', 'aot_eager')
    for compiled, eager in runs:
        assert compiled == eager
    (greedy, _), (stopped, _), (sampled, _) = runs
    assert greedy == [c for c in one_at_a_time(m, PROMPTS, 10, temperature=0) for _ in range(2)]
    assert stopped == [c[:c.index(9) + 1] if 9 in c else c for c in greedy] != greedy
    assert len(set(map(tuple, sampled))) > 4 and min(map(len, sampled)) < 10  # diverse, some stopped
    assert len(decoding.caches) == 1  # the caches of the first call, reused by the others


@pytest.mark.cuda
def test_compiled_decoding_replays_cuda_graphs():
    """On a GPU the compiled step is a CUDA graph (mode='reduce-overhead'; none skipped) and draws what eager
    decoding draws; float32 with TF32 off, where a near tie could flip a greedy choice (none in this model)."""
    from torch._dynamo.utils import counters
    torch.backends.cuda.matmul.allow_tf32 = False
    counters.clear()
    m = sharp_model(n_layer=2, n_head=4, n_kv_head=2).float().cuda()
    _, runs = decode_compiled(m, 'cuda')
    for compiled, eager in runs:
        assert compiled == eager
    assert not counters['inductor']['cudagraph_skips']


@pytest.mark.comparison
def test_a_streamed_answer_draws_what_generate_draws():
    """stream_tokens (sample.py's answers): one prompt's tokens as GPT.generate draws them, greedy and
    sampled with a seed, through compiled decoding (aot_eager, as above) where the answer fits the static cache and
    GPT.generate_tokens where it would pass block_size (the context slides); a reader may stop it at any token."""
    from lm.generate import CompiledDecoding, stream_tokens
    m = sharp_model(n_layer=1, n_head=4, n_kv_head=2)
    decoding, prompt = CompiledDecoding('aot_eager'), PROMPTS[1]

    def generated(n, opts):
        out = m.generate(torch.tensor([prompt]), n, generator=torch.Generator().manual_seed(3), **opts)
        return out[0, len(prompt):].tolist()

    def streamed(n, d, opts):
        return list(stream_tokens(m, prompt, n, generator=torch.Generator().manual_seed(3), decoding=d, **opts))

    long = m.config.block_size - len(prompt) + 4  # past block_size
    for opts in (dict(temperature=0), dict(temperature=1.5, top_k=20)):
        assert streamed(10, decoding, opts) == streamed(10, None, opts) == generated(10, opts)
        assert streamed(long, decoding, opts) == generated(long, opts)
    assert decoding.step is not None  # compiled, not the eager path
    stream = stream_tokens(m, prompt, 10, decoding=decoding)
    assert [next(stream), next(stream)] == generated(10, dict(temperature=0))[:2]
    stream.close()


@pytest.mark.cuda
def test_a_streamed_answer_replays_cuda_graphs():
    """On a GPU, stream_tokens through CompiledDecoding (sample.py's compile_decode) replays CUDA
    graphs (none skipped) and draws the eager path's greedy tokens; float32 with TF32 off, as above."""
    from torch._dynamo.utils import counters
    from lm.generate import CompiledDecoding, stream_tokens
    torch.backends.cuda.matmul.allow_tf32 = False
    counters.clear()
    m = sharp_model(n_layer=2, n_head=4, n_kv_head=2).float().cuda()
    decoding = CompiledDecoding()
    for prompt in PROMPTS[:2]:
        assert list(stream_tokens(m, prompt, 10, decoding=decoding)) == list(stream_tokens(m, prompt, 10))
    assert not counters['inductor']['cudagraph_skips']
