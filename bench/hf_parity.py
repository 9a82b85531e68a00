"""
nanotrain against transformers on published Hugging Face checkpoints (hf/checkpoint.py, hf/tokenizer.py).

1. Parity on a real model (SmolLM2-135M-Instruct, float32): for fixed chat prompts, nanotrain's chat
   template ids == apply_chat_template(add_generation_prompt=True) ids; max |logits difference| over every
   position (fp32) between GPT.from_state_dict and AutoModelForCausalLM; 40 greedy tokens from
   GPT.generate (KV cache) vs generate(do_sample=False), and the decoded answers.
2. Load time and host memory of that model, each in a fresh process (median of 3): nanotrain's
   load_hf_checkpoint + GPT.from_state_dict vs transformers' from_pretrained(dtype=float32). Memory is in
   MiB above the process's resident set size after its imports: load peak (VmHWM, reset after the imports
   through /proc/self/clear_refs, and a thread sampling /proc/self/status every 5 ms), then every weight is
   read once (weights left memory-mapped count only once read, as in a first forward pass): peak over both,
   and the resident set afterwards split into anonymous memory and mapped file pages.
3. The same for a checkpoint over 1 GB: a Llama-3.2-1B-shaped folder (hidden 2048, 16 layers, 32 heads,
   8 kv heads, MLP 8192, vocab 128256, tied, llama3 RoPE scaling) of random bf16 weights, written straight
   to safetensors in 3 shards with an index, plus SmolLM2's tokenizer files, in a temporary folder under
   /tmp that is deleted afterwards. Loaded to float32 by both, and by transformers in its stored bf16.
   The claim checked: nanotrain's peak stays near one float32 copy plus at most one shard.

Run (the bench venv has transformers; nanotrain itself never imports it):
    cd /work/main && /work/hfvenv/bin/python bench/hf_parity.py
        -> bench/results/hf_parity.json (all numbers, versions, CPU) and a table on stdout
One measurement alone (what the script runs in each fresh process; prints one JSON line):
    /work/hfvenv/bin/python bench/hf_parity.py --measure nanotrain|transformers|transformers_bf16 --folder DIR
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch

from run.device import cpu_name

SMOLLM2 = '/work/models/smollm2-135m-instruct'
OUT = os.path.join(ROOT, 'bench', 'results', 'hf_parity.json')
NEW_TOKENS = 40
REPEATS = 3
SHARD_BYTES = 2**30
LLAMA_1B = dict(  # Llama-3.2-1B's config.json, with the ids of the tokenizer copied next to it (SmolLM2's)
    architectures=['LlamaForCausalLM'], model_type='llama', hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, hidden_act='silu',
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(rope_type='llama3', factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    attention_bias=False, mlp_bias=False, tie_word_embeddings=True, vocab_size=128256, bos_token_id=1,
    eos_token_id=2, torch_dtype='bfloat16', use_cache=True)
PARAGRAPH = (
    "The Industrial Revolution, which began in Britain in the late eighteenth century, transformed the way "
    "goods were produced. Before it, most people worked on farms or in small workshops, making things by hand. "
    "The invention of the steam engine, the spinning jenny and the power loom allowed factories to produce "
    "textiles and other goods far faster and more cheaply than before. Cities grew rapidly as people moved "
    "from the countryside to find work, and new railways carried raw materials and finished products across "
    "the country. Working conditions in early factories were often harsh, with long hours, low pay and child "
    "labour, which eventually led to reforms and the rise of trade unions.")
PROMPTS = {
    'capital': [{'role': 'user', 'content': 'What is the capital of France?'}],
    'arithmetic': [{'role': 'user', 'content': 'What is 48+26?'}],
    'two_turns': [{'role': 'user', 'content': 'Hi! Can you recommend a good book?'},
                  {'role': 'assistant', 'content': "Sure! 'To Kill a Mockingbird' by Harper Lee is a classic."},
                  {'role': 'user', 'content': 'What is it about?'}],
    'system': [{'role': 'system', 'content': 'You are a concise assistant. Answer in one sentence.'},
               {'role': 'user', 'content': 'Why is the sky blue?'}],
    'paragraph': [{'role': 'user', 'content': 'Summarize this paragraph in two sentences.\n\n' + PARAGRAPH}],
}


def proc_status():
    """{field: kB} of the numeric memory fields of /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile)."""
    fields = {}
    with open('/proc/self/status') as f:
        for line in f:
            name, _, value = line.partition(':')
            if name in ('VmRSS', 'VmHWM', 'RssAnon', 'RssFile'):
                fields[name] = int(value.split()[0])
    return fields


class PeakSampler:
    """Samples /proc/self/status in a thread; keeps the sample with the largest resident set size."""

    def __init__(self):
        self.peak, self.running = proc_status(), True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while self.running:
            now = proc_status()
            if now['VmRSS'] > self.peak['VmRSS']:
                self.peak = now
            time.sleep(0.005)

    def stop(self):
        self.running = False
        self.thread.join()
        return self.peak


def measure(mode, folder):
    """Load the folder the way mode names in this (fresh) process; time, memory and parameter bytes."""
    if mode == 'nanotrain':
        from hf.checkpoint import load_hf_checkpoint
        from model import GPT, GPTConfig
    else:
        from transformers import AutoModelForCausalLM
        import transformers.models.llama.modeling_llama  # noqa: F401 (imported here, not inside the timing)
    try:  # reset VmHWM to the current size (Linux >= 4.0), so the import peak does not count
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
    except OSError:
        pass
    before = proc_status()
    sampler = PeakSampler()
    t0 = time.perf_counter()
    if mode == 'nanotrain':
        ckpt = load_hf_checkpoint(folder)
        model = GPT.from_state_dict(GPTConfig(**ckpt['model_args']), ckpt['model'])
        del ckpt
    else:
        dtype = torch.bfloat16 if mode == 'transformers_bf16' else torch.float32
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    seconds = time.perf_counter() - t0
    load_peak = max(proc_status()['VmHWM'], sampler.stop()['VmRSS'])
    # weights a loader leaves memory-mapped are read from the file only when first used: read every one
    # once (in chunks, no copy of a whole tensor), as the first forward pass does, to count them
    sampler = PeakSampler()
    with torch.no_grad():
        for p in model.parameters():
            for chunk in p.view(-1).split(2**22):
                chunk.sum()
    sampled = sampler.stop()
    after = proc_status()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() skips tied copies
    mib = 1 / 1024
    return dict(mode=mode, load_s=seconds, param_mib=param_bytes / 2**20,
                rss_after_imports_mib=before['VmRSS'] * mib,
                load_peak_mib=(load_peak - before['VmRSS']) * mib,
                peak_mib=(max(after['VmHWM'], sampled['VmRSS']) - before['VmRSS']) * mib,
                resident_mib=(after['VmRSS'] - before['VmRSS']) * mib,
                resident_anon_mib=(after['RssAnon'] - before['RssAnon']) * mib,
                resident_file_mib=(after['RssFile'] - before['RssFile']) * mib)


def measure_in_fresh_processes(folder, modes):
    """{mode: median of REPEATS fresh-process measurements}; the modes take turns, so drift hits all alike."""
    runs = {mode: [] for mode in modes}
    for _ in range(REPEATS):
        for mode in modes:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), '--measure', mode, '--folder', folder],
                                 capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                raise RuntimeError(f"{mode} on {folder} failed:\n{out.stderr[-3000:]}")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {}
    for mode, results in runs.items():
        medians[mode] = {key: statistics.median(r[key] for r in results) for key in results[0] if key != 'mode'}
        medians[mode]['runs'] = results
    return medians


def warm_page_cache(folder):
    """Read every file once, so no measured load waits on the disk."""
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), 'rb') as f:
            while f.read(64 * 2**20):
                pass


def write_random_llama(folder, hf_config, shard_bytes, tokenizer_folder=SMOLLM2, device='cpu'):
    """A Hugging Face Llama folder of random bf16 weights: config.json, model-0000k-of-0000n.safetensors
    shards of at most shard_bytes with their index, and the tokenizer files of tokenizer_folder (SmolLM2's).
    device: where the weights are drawn (a GPU draws an 8B model's in seconds; the CPU takes minutes)."""
    from safetensors.torch import save_file
    c = hf_config
    hidden, kv = c['hidden_size'], c['num_key_value_heads'] * c['head_dim']
    shapes = {'model.embed_tokens.weight': (c['vocab_size'], hidden)}
    for i in range(c['num_hidden_layers']):
        p = f'model.layers.{i}.'
        shapes.update({p + 'input_layernorm.weight': (hidden,),
                       p + 'self_attn.q_proj.weight': (c['num_attention_heads'] * c['head_dim'], hidden),
                       p + 'self_attn.k_proj.weight': (kv, hidden), p + 'self_attn.v_proj.weight': (kv, hidden),
                       p + 'self_attn.o_proj.weight': (hidden, c['num_attention_heads'] * c['head_dim']),
                       p + 'post_attention_layernorm.weight': (hidden,),
                       p + 'mlp.gate_proj.weight': (c['intermediate_size'], hidden),
                       p + 'mlp.up_proj.weight': (c['intermediate_size'], hidden),
                       p + 'mlp.down_proj.weight': (hidden, c['intermediate_size'])})
    shapes['model.norm.weight'] = (hidden,)
    if not c.get('tie_word_embeddings', True):
        shapes['lm_head.weight'] = (c['vocab_size'], hidden)
    groups, size = [[]], 0  # names per shard
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    generator = torch.Generator(device).manual_seed(0)
    weight_map = {}
    for k, names in enumerate(groups, 1):  # one shard's tensors in memory at a time
        file = f'model-{k:05d}-of-{len(groups):05d}.safetensors'
        tensors = {n: torch.ones(shapes[n], dtype=torch.bfloat16) if len(shapes[n]) == 1 else
                   (torch.randn(shapes[n], generator=generator, dtype=torch.bfloat16, device=device) * 0.02).cpu()
                   for n in names}
        save_file(tensors, os.path.join(folder, file), metadata={'format': 'pt'})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    with open(os.path.join(folder, 'model.safetensors.index.json'), 'w') as f:
        json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
    with open(os.path.join(folder, 'config.json'), 'w') as f:
        json.dump(hf_config, f, indent=2)
    for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
        shutil.copyfile(os.path.join(tokenizer_folder, name), os.path.join(folder, name))
    return {'shards': len(groups), 'bytes': total,
            'largest_shard_mib': max(os.path.getsize(os.path.join(folder, f)) for f in set(weight_map.values()))
            / 2**20}


def random_llama_folder(out, hidden_size, layers, vocab_size, tokenizer_folder):
    """(folder, config): out/model, a Llama-3.2-1B-shaped folder of random weights (LLAMA_1B at this width,
    depth and vocabulary, MLP 4x), written once and reused while its config.json is the same."""
    folder = os.path.join(out, 'model')
    hf_config = dict(LLAMA_1B, hidden_size=hidden_size, num_hidden_layers=layers, vocab_size=vocab_size,
                     intermediate_size=4 * hidden_size, head_dim=hidden_size // LLAMA_1B['num_attention_heads'])
    config_path = os.path.join(folder, 'config.json')
    if not os.path.exists(config_path) or json.load(open(config_path)) != hf_config:
        os.makedirs(folder, exist_ok=True)
        write_random_llama(folder, hf_config, SHARD_BYTES, tokenizer_folder)
    return folder, hf_config


def hf_chat_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids['input_ids'] if hasattr(ids, 'keys') else ids)


@torch.no_grad()
def parity(folder):
    """Token ids, logits and greedy answers of nanotrain vs transformers on each of PROMPTS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from hf.checkpoint import load_hf_checkpoint
    from hf.tokenizer import load_hf_tokenizer
    from model import GPT, GPTConfig
    ckpt = load_hf_checkpoint(folder)
    nano = GPT.from_state_dict(GPTConfig(**ckpt['model_args']), ckpt['model']).eval()
    tokenizer = load_hf_tokenizer(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    results = {}
    for name, messages in PROMPTS.items():
        ids = tokenizer.encode_prompt(messages)
        hf_ids = hf_chat_ids(hf_tokenizer, messages)
        idx = torch.tensor([hf_ids])
        logits, _ = nano(idx)
        hf_logits = hf(idx).logits.float()
        answer = nano.generate(idx, NEW_TOKENS, temperature=0, eos_id=tokenizer.eos_id)[0, idx.size(1):].tolist()
        hf_answer = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=NEW_TOKENS,
                                do_sample=False, eos_token_id=tokenizer.eos_id,
                                pad_token_id=tokenizer.pad_id)[0, idx.size(1):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(answer, hf_answer)) if a != b), min(len(answer), len(hf_answer)))
        results[name] = dict(
            prompt_tokens=len(ids), ids_identical=ids == hf_ids,
            max_abs_logits_diff=(logits - hf_logits).abs().max().item(),
            max_abs_logit=hf_logits.abs().max().item(),
            argmax_agree=(logits.argmax(-1) == hf_logits.argmax(-1)).float().mean().item(),
            new_tokens=len(answer), hf_new_tokens=len(hf_answer), identical_prefix_tokens=same,
            greedy_identical=answer == hf_answer, answer=tokenizer.decode(answer),
            hf_answer=hf_tokenizer.decode(hf_answer))
    return results


def environment():
    import safetensors
    import tokenizers
    import transformers
    def git(*args):
        return subprocess.run(['git', *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    commit, dirty = git('rev-parse', '--short', 'HEAD'), git('status', '--porcelain')
    return dict(date=time.strftime('%Y-%m-%d %H:%M'), commit=commit + (' (with uncommitted changes)' if dirty else ''),
                cpu=cpu_name(), threads=torch.get_num_threads(), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__,
                safetensors=safetensors.__version__, tokenizers=tokenizers.__version__)


def print_tables(report):
    print(f"\nparity on {SMOLLM2} (fp32, {NEW_TOKENS} greedy tokens)")
    print(f"{'prompt':<11}{'tokens':>7}{'ids same':>9}{'max|dlogit|':>13}{'greedy same':>13}  nanotrain's answer")
    for name, r in report['parity'].items():
        print(f"{name:<11}{r['prompt_tokens']:>7}{str(r['ids_identical']):>9}{r['max_abs_logits_diff']:>13.2e}"
              f"{r['identical_prefix_tokens']:>6}/{max(r['new_tokens'], r['hf_new_tokens']):<6}  {r['answer'][:60]!r}")
    for label in ('smollm2_135m', 'llama_1b_random'):
        loads = report['load'][label]
        print(f"\nload {label} (median of {REPEATS} fresh processes; MiB above the process after imports)")
        print(f"{'mode':<19}{'load s':>8}{'params':>8}{'load peak':>11}{'peak':>7}{'resident':>10}{'(anon':>7}"
              f"{'file)':>7}{'peak/params':>13}")
        for mode, m in loads.items():
            print(f"{mode:<19}{m['load_s']:>8.2f}{m['param_mib']:>8.0f}{m['load_peak_mib']:>11.0f}{m['peak_mib']:>7.0f}"
                  f"{m['resident_mib']:>10.0f}{m['resident_anon_mib']:>7.0f}{m['resident_file_mib']:>7.0f}"
                  f"{m['peak_mib'] / m['param_mib']:>13.2f}")


def main():
    t0 = time.perf_counter()
    report = dict(environment=environment(), commands=dict(
        all=f'cd {ROOT} && /work/hfvenv/bin/python bench/hf_parity.py',
        one_measurement='/work/hfvenv/bin/python bench/hf_parity.py --measure MODE --folder DIR'))
    report['parity'] = parity(SMOLLM2)
    warm_page_cache(SMOLLM2)
    report['load'] = {'smollm2_135m': measure_in_fresh_processes(SMOLLM2, ['nanotrain', 'transformers'])}
    folder = tempfile.mkdtemp(prefix='hf_parity_llama1b_', dir='/tmp')
    try:
        report['llama_1b_random'] = dict(config=LLAMA_1B, **write_random_llama(folder, LLAMA_1B, SHARD_BYTES))
        warm_page_cache(folder)
        report['load']['llama_1b_random'] = measure_in_fresh_processes(
            folder, ['nanotrain', 'transformers', 'transformers_bf16'])
    finally:
        shutil.rmtree(folder)
    big, shard = report['load']['llama_1b_random'], report['llama_1b_random']['largest_shard_mib']
    report['claim'] = dict(  # nanotrain's peak against one float32 copy of the model, plus one shard at most
        nanotrain_peak_mib=big['nanotrain']['peak_mib'], fp32_copy_mib=big['nanotrain']['param_mib'],
        largest_shard_mib=shard,
        nanotrain_peak_over_fp32_copy=big['nanotrain']['peak_mib'] / big['nanotrain']['param_mib'],
        nanotrain_peak_over_fp32_copy_plus_shard=big['nanotrain']['peak_mib'] / (big['nanotrain']['param_mib'] + shard),
        transformers_fp32_peak_over_nanotrain_peak=big['transformers']['peak_mib'] / big['nanotrain']['peak_mib'])
    report['total_s'] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, 'w') as f:
        json.dump(report, f, indent=1)
    print_tables(report)
    print(f"\nclaim: {json.dumps(report['claim'])}\nwrote {OUT} in {report['total_s']:.0f} s")


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--measure', choices=['nanotrain', 'transformers', 'transformers_bf16'])
    parser.add_argument('--folder')
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.folder)))
    else:
        main()
