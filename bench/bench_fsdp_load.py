"""
Host memory of each rank while it loads a checkpoint the way train.py does, under DDP (every rank builds the
whole model and copies the checkpoint in) and under FSDP (run/fsdp.py: built around the memory-mapped checkpoint,
each rank copying out its shard). `python bench/bench_fsdp_load.py` writes a checkpoint of the given shape
(fp32) once, then runs one torchrun job per mode (CPU, gloo, `ranks` processes) and prints, per rank: the
peak resident set size above what it was just before loading (mapped checkpoint pages included), and after
loading the private (anonymous) and file-backed resident memory. `--checkpoint=<Hugging Face folder>`
measures that instead (e.g. a bf16 one). Writes results/fsdp_load.json (or fsdp_load_hf.json).
"""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.distributed as dist

from configurator import at_least, check_values, configure
from hf.checkpoint import weight_files
from memory import _max_rss_bytes
from model import GPT, GPTConfig
from run.checkpoint import save_checkpoint
from run.fsdp import shard_model
from run.run_folder import is_hf_folder
from run.runtime import compute_cleanup, compute_init
from starting_model import build_model, load_model

# -----------------------------------------------------------------------------
checkpoint = '/tmp/nanotrain_fsdp_load.pt'  # written when missing
n_layer = 24
n_head = 16
n_embd = 1024
vocab_size = 32768
ranks = 2
parallel = ''                # '' runs both modes, each in its own torchrun job; 'ddp' | 'fsdp': one rank's side
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('n_layer', 'n_head', 'n_embd', 'vocab_size', 'ranks'))])
MB = 2**20


def resident():
    """(private, file-backed) resident bytes of this process now."""
    with open('/proc/self/status') as f:
        fields = dict(line.split(':', 1) for line in f)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ('RssAnon', 'RssFile'))


if not parallel:
    if not os.path.exists(checkpoint):
        shape = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=1024)
        save_checkpoint(checkpoint, dict(kind='gpt', model=GPT(GPTConfig(**shape)).state_dict(), model_args=shape))
    hf = is_hf_folder(checkpoint)
    size = sum(map(os.path.getsize, weight_files(checkpoint))) if hf else os.path.getsize(checkpoint)
    results = dict(checkpoint_mb=size / MB, ranks=ranks, modes={})
    for mode in ('ddp', 'fsdp'):
        out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}',
                              __file__, f'--checkpoint={checkpoint}', f'--parallel={mode}'],
                             capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        results['modes'][mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"checkpoint {size / MB:,.0f} MB ({'Hugging Face folder' if hf else 'fp32'}), {ranks} ranks; per rank, the "
          f"largest over ranks:")
    print("| mode | peak RSS while loading | x checkpoint | private after | file-backed after |")
    print("| --- | --- | --- | --- | --- |")
    for mode, row in results['modes'].items():
        print(f"| {mode} | {row['peak_mb']:,.0f} MB | {row['peak_mb'] * MB / size:.2f} | {row['private_mb']:,.0f} MB "
              f"| {row['file_mb']:,.0f} MB |")
    os.makedirs(os.path.join(os.path.dirname(__file__), 'results'), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), 'results', f"fsdp_load{'_hf' if hf else ''}.json"), 'w') as f:
        json.dump(results, f, indent=1)
    sys.exit(0)

ddp, rank, local_rank, world_size, device = compute_init('cpu', 0)
before = _max_rss_bytes()
dist.barrier()
ckpt = load_model(checkpoint)
model = build_model(GPTConfig(**ckpt['model_args']), ckpt, assign=parallel == 'fsdp')
if parallel == 'fsdp':
    shard_model(model, device, torch.float32, cpu_offload=False)
else:
    model = torch.nn.parallel.DistributedDataParallel(model)
ckpt = None
private, file_backed = resident()
row = torch.tensor([(_max_rss_bytes() - before) / MB, private / MB, file_backed / MB], dtype=torch.float64)
rows = [torch.zeros_like(row) for _ in range(world_size)]
dist.all_gather(rows, row)
worst = torch.stack(rows).max(0).values.tolist()
if rank == 0:
    print(json.dumps(dict(peak_mb=worst[0], private_mb=worst[1], file_mb=worst[2])))
compute_cleanup(ddp)
