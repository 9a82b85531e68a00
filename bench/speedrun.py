"""
Speedrun, side by side on this machine: nanoGPT's CPU quickstart (run unmodified from a nanoGPT
checkout) against nanotrain's config/speedrun_cpu.py, alternating, `pairs` times. Measures the wall
time for nanotrain to reach nanoGPT's final val loss, tokens/s, and draws the loss curves.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    python bench/speedrun.py --data=../shared/data/tinyshakespeare.txt --nanogpt_dir=/tmp/nanoGPT

Both codebases are scored the same way, after the run (not timed): mean cross-entropy over the whole
val split (last 10% of the characters) in non-overlapping windows of `context` characters. While a
run trains, every checkpoint it writes is copied aside with the time it was written; a run's curve
is those checkpoints' losses against seconds since its process was launched (Python start-up, data
loading, its own evals and checkpoint writes all count). nanoGPT's time is when its final checkpoint
was written; nanotrain's, when the first checkpoint scoring <= that pair's nanoGPT loss was written.
"""

import importlib.util
import io
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from contextlib import redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import numpy as np
import torch

from configurator import UserError, check_output_file, configure
from data import prepare
from model import GPT, GPTConfig

# -----------------------------------------------------------------------------
data = '../shared/data/tinyshakespeare.txt'  # the corpus (any text file)
nanogpt_dir = '/tmp/nanoGPT'     # an unmodified nanoGPT checkout; its data/shakespeare_char is (re)made from `data`
config_file = 'config/speedrun_cpu.py'  # nanotrain's side
pairs = 3                        # nanoGPT/nanotrain runs, alternating which goes first
context = 64                     # eval window = the quickstart's block_size
throughput_iters = 300           # steps of each side at nanoGPT's exact shape, for the tokens/s comparison
throughput_only = False          # only the tokens/s comparison (skips the time-to-loss pairs and the plot)
work_dir = 'bench/results/speedrun'  # run logs, checkpoints, results.json
plot = 'bench/speedrun_cpu.png'  # loss against wall time
# -----------------------------------------------------------------------------
configure(globals())
data, nanogpt_dir, work_dir, plot = (os.path.abspath(p) for p in (data, nanogpt_dir, work_dir, plot))
config_file = os.path.relpath(os.path.abspath(config_file), ROOT)  # train.py runs from the repo root

# nanoGPT's README CPU quickstart, verbatim
NANOGPT_CMD = ['train.py', 'config/train_shakespeare_char.py', '--device=cpu', '--compile=False', '--eval_iters=20',
               '--log_interval=1', '--block_size=64', '--batch_size=12', '--n_layer=4', '--n_head=4', '--n_embd=128',
               '--max_iters=2000', '--lr_decay_iters=2000', '--dropout=0.0']
NANOGPT_SHAPE = ['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=64', '--batch_size=12']
NANOGPT_MODEL = ['--pos_emb=learned', '--norm=layernorm', '--mlp=gelu', '--bias=False', '--tie_embeddings=True',
                 '--qk_norm=False', '--logit_softcap=0.0', '--zero_init_proj=False', '--optimizer_type=adamw']


def prepare_data():
    """nanoGPT's data via its own prepare.py (it downloads only when input.txt is missing, so we put the
    corpus there; requests, which it imports, is stubbed), nanotrain's via data.py. Returns both val splits."""
    if not os.path.exists(os.path.join(nanogpt_dir, 'train.py')):
        raise UserError(f"nanogpt_dir={nanogpt_dir!r} is not a nanoGPT checkout; clone it with "
                        f"`git clone https://github.com/karpathy/nanoGPT {nanogpt_dir}` or pass --nanogpt_dir.")
    if not os.path.exists(data):
        raise UserError(f"data={data!r} does not exist; pass --data=path/to/tinyshakespeare.txt.")
    ng_data = os.path.join(nanogpt_dir, 'data', 'shakespeare_char')
    shutil.copyfile(data, os.path.join(ng_data, 'input.txt'))
    stub = "import sys, types, runpy; sys.modules['requests'] = types.ModuleType('requests'); " \
           "runpy.run_path('prepare.py', run_name='__main__')"
    subprocess.run([sys.executable, '-c', stub], cwd=ng_data, check=True, capture_output=True)
    nt_data = prepare(data, os.path.join(work_dir, 'data'), tokenizer='char')
    ng_val = np.fromfile(os.path.join(ng_data, 'val.bin'), dtype=np.uint16)
    nt_val = np.fromfile(os.path.join(nt_data, 'val.bin'), dtype=np.uint16)
    assert np.array_equal(ng_val, nt_val), "the two codebases' val splits differ"
    return nt_data, nt_val


def run_watched(cmd, cwd, ckpt_path, run_dir):
    """Run cmd, copying each new version of ckpt_path aside once it has been stable for 0.3 s and is a
    complete file (nanoGPT writes it in place). Returns (wall seconds, [(seconds after launch it was
    written, copy)])."""
    os.makedirs(run_dir)
    snapshots, seen = [], None
    with open(os.path.join(run_dir, 'stdout.log'), 'w') as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED='1'))
        while True:
            done = proc.poll() is not None
            st = os.stat(ckpt_path) if os.path.exists(ckpt_path) else None
            version = st and (st.st_mtime_ns, st.st_size, st.st_ino)
            if st and version != seen and (done or time.time() - st.st_mtime > 0.3):
                copy = os.path.join(run_dir, f'ckpt{len(snapshots)}.pt')
                shutil.copyfile(ckpt_path, copy)
                if zipfile.is_zipfile(copy):  # complete: torch.save writes the zip directory last
                    seen = version
                    snapshots.append((st.st_mtime - t0, copy))
            if done:
                break
            time.sleep(0.05)
        wall = time.time() - t0
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} exited with {proc.returncode}; see {run_dir}/stdout.log")
    return wall, snapshots


def load_nanogpt_model(path):
    """A nanoGPT checkpoint in nanoGPT's own model.py."""
    spec = importlib.util.spec_from_file_location('nanogpt_model', os.path.join(nanogpt_dir, 'model.py'))
    ng = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ng)
    ckpt = torch.load(path, map_location='cpu', weights_only=True)
    with redirect_stdout(io.StringIO()):  # it prints its parameter count
        model = ng.GPT(ng.GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    return model, ckpt['iter_num']


def load_nanotrain_model(path):
    ckpt = torch.load(path, map_location='cpu', weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']))
    model.load_state_dict(ckpt['model'])
    return model, ckpt['iter_num']


@torch.no_grad()
def val_loss(model, val):
    """Mean cross-entropy over every position of the non-overlapping context-length windows of val."""
    n = (len(val) - 1) // context
    x = torch.from_numpy(val[:n * context].astype(np.int64)).view(n, context)
    y = torch.from_numpy(val[1:n * context + 1].astype(np.int64)).view(n, context)
    model.eval()
    total = 0.0
    for xb, yb in zip(x.split(256), y.split(256)):
        _, loss = model(xb, yb)  # both models return the mean over all B*T positions
        total += loss.item() * yb.numel()
    return total / y.numel()


def score(snapshots, load, val):
    """[(seconds, iter, val loss)] for the distinct checkpoints of a run, in time order."""
    curve, iters = [], set()
    for t, path in snapshots:
        model, it = load(path)
        if it not in iters:  # train.py rewrites the last checkpoint once more at the end
            iters.add(it)
            curve.append((t, it, val_loss(model, val)))
    return curve


def nanogpt_tokens_per_sec(run_dir):
    """12*64 tokens over the median of nanoGPT's own per-iteration times ('iter N: ..., time X ms')."""
    times = [float(line.split('time ')[1].split('ms')[0]) for line in open(os.path.join(run_dir, 'stdout.log'))
             if line.startswith('iter ') and int(line.split()[1][:-1]) % 250]  # eval iterations excluded
    return 12 * 64 / (statistics.median(times) / 1000)


def nanotrain_shape_tokens_per_sec(nt_data, architecture, run_dir):
    """train.py for throughput_iters steps at nanoGPT's exact shape with the given architecture flags."""
    out = os.path.join(run_dir, 'out')
    cmd = [sys.executable, 'train.py', config_file, f'--out_dir={out}', f'--data_dir={nt_data}', '--init_from=scratch',
           *NANOGPT_SHAPE, *architecture, f'--max_iters={throughput_iters}', f'--lr_decay_iters={throughput_iters}',
           '--eval_interval=100000', '--log_interval=1']  # per-step times, as nanoGPT's log_interval=1 gives
    run_watched(cmd, ROOT, os.path.join(out, 'ckpt.pt'), run_dir)
    return nanotrain_tokens_per_sec(out)


def nanotrain_tokens_per_sec(out_dir):
    """Median of train.py's own tokens/s windows (the first, with start-up, excluded): at log_interval=1
    the median per-step rate, the statistic nanogpt_tokens_per_sec takes from nanoGPT's iterations."""
    events = [json.loads(line) for line in open(os.path.join(out_dir, 'log.jsonl'))]
    rates = [e['tokens_per_sec'] for e in events if 'tokens_per_sec' in e]
    return statistics.median(rates[1:])


# ---------------------------------------------------------------------------- plot (dependency-free PNG)

FONT = {  # 3x5 pixel glyphs, rows top to bottom
    '0': '111101101101111', '1': '010110010010111', '2': '111001111100111', '3': '111001111001111',
    '4': '101101111001001', '5': '111100111001111', '6': '111100111101111', '7': '111001001001001',
    '8': '111101111101111', '9': '111101111001111', '.': '000000000000010', '-': '000000111000000',
    '(': '010100100100010', ')': '010001001001010', ' ': '000000000000000', '=': '000111000111000',
    'A': '010101111101101', 'C': '011100100100011', 'E': '111100110100111', 'F': '111100110100100', 'G': '011100101101011',
    'I': '111010010010111', 'L': '100100100100111', 'M': '101111111101101', 'N': '110101101101101',
    'O': '010101101101010', 'P': '110101110100100', 'R': '110101110101101', 'S': '011100010001110',
    'T': '111010010010010', 'U': '101101101101111', 'V': '101101101101010', 'W': '101101111111101', 'X': '101101010101101',
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(b'\xff' * (w * h * 3))

    def dot(self, x, y, color, r=0):
        for yy in range(int(y) - r, int(y) + r + 1):
            for xx in range(int(x) - r, int(x) + r + 1):
                if 0 <= xx < self.w and 0 <= yy < self.h:
                    self.px[(yy * self.w + xx) * 3:(yy * self.w + xx) * 3 + 3] = bytes(color)

    def line(self, x0, y0, x1, y1, color, r=0, dash=0):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n + 1):
            if not dash or (i // dash) % 2 == 0:
                self.dot(x0 + (x1 - x0) * i / n, y0 + (y1 - y0) * i / n, color, r)

    def text(self, x, y, s, color=(0, 0, 0), scale=2):
        for k, ch in enumerate(s.upper()):
            for i, bit in enumerate(FONT.get(ch, FONT[' '])):
                if bit == '1':
                    for dy in range(scale):
                        for dx in range(scale):
                            self.dot(x + (k * 4 + i % 3) * scale + dx, y + (i // 3) * scale + dy, color)

    def save(self, path):
        raw = b''.join(b'\x00' + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))
        chunk = lambda tag, body: struct.pack('>I', len(body)) + tag + body + struct.pack('>I', zlib.crc32(tag + body))
        with open(path, 'wb') as f:
            f.write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', self.w, self.h, 8, 2, 0, 0, 0))
                    + chunk(b'IDAT', zlib.compress(raw, 9)) + chunk(b'IEND', b''))


def draw_plot(path, curves, target):
    """curves: [(label, color, [(seconds, loss), ...]), ...]; a dashed line at the target loss."""
    W, H, left, right, top, bottom = 800, 500, 70, 20, 40, 60
    c = Canvas(W, H)
    t_max = 20 * (int(max(t for _, _, pts in curves for t, _ in pts) // 20) + 1)
    lo, hi = 1.8, 2.6
    sx = lambda t: left + (W - left - right) * t / t_max
    sy = lambda v: top + (H - top - bottom) * (hi - min(max(v, lo), hi)) / (hi - lo)
    for t in range(0, t_max + 1, 20):
        c.line(sx(t), top, sx(t), H - bottom, (230, 230, 230))
        c.text(sx(t) - 8, H - bottom + 8, str(t))
    for k in range(9):
        v = lo + k * 0.1
        c.line(left, sy(v), W - right, sy(v), (230, 230, 230))
        c.text(8, sy(v) - 5, f'{v:.1f}')
    c.line(left, top, left, H - bottom, (0, 0, 0))
    c.line(left, H - bottom, W - right, H - bottom, (0, 0, 0))
    c.line(left, sy(target), W - right, sy(target), (120, 120, 120), dash=6)
    c.text(W - right - 150, sy(target) + 6, f'TARGET {target:.4f}', (120, 120, 120))
    c.text(left + 250, H - 22, 'WALL TIME (S)')
    c.text(left, 12, 'VAL LOSS (FULL SPLIT)')
    for i, (label, color, pts) in enumerate(curves):
        for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
            c.line(sx(t0), sy(v0), sx(t1), sy(v1), color, r=1)
        for t, v in pts:
            c.dot(sx(t), sy(v), color, r=2)
    for i, (label, color) in enumerate(dict((lbl, col) for lbl, col, _ in curves).items()):
        c.line(W - right - 190, top + 30 + 18 * i, W - right - 160, top + 30 + 18 * i, color, r=1)
        c.text(W - right - 150, top + 25 + 18 * i, label)
    c.save(path)


# ---------------------------------------------------------------------------- main

# what main() writes in work_dir: a folder holding nothing else is an earlier speedrun's, which a new one replaces
WORK_ENTRIES = re.compile(r'data|results\.json|\d+-(nanogpt|nanotrain)|shape-.+')


def main():
    check_output_file(plot, 'plot', 'a PNG', lambda path: open(path, 'rb').read(8) == b'\x89PNG\r\n\x1a\n',
                      others="a file of another kind")
    if os.path.lexists(work_dir):
        if not os.path.isdir(work_dir) or not all(WORK_ENTRIES.fullmatch(e) for e in os.listdir(work_dir)):
            raise UserError(f"work_dir={work_dir!r} holds other things than a speedrun's runs, and a speedrun starts "
                            f"by deleting its work_dir: pass a new folder (--work_dir=...), or delete that one "
                            f"yourself if it can go.")
        shutil.rmtree(work_dir)
    os.makedirs(work_dir)
    nt_data, val = prepare_data()
    ng_out = os.path.join(nanogpt_dir, 'out-shakespeare-char')
    runs = []
    for pair in range(0 if throughput_only else pairs):
        order = ['nanogpt', 'nanotrain'] if pair % 2 == 0 else ['nanotrain', 'nanogpt']
        result = {}
        for side in order:
            run_dir = os.path.join(work_dir, f'{pair}-{side}')
            load_avg = os.getloadavg()[0]
            if side == 'nanogpt':
                shutil.rmtree(ng_out, ignore_errors=True)
                wall, snaps = run_watched([sys.executable, *NANOGPT_CMD], nanogpt_dir,
                                          os.path.join(ng_out, 'ckpt.pt'), run_dir)
                curve = score(snaps, load_nanogpt_model, val)
                tps = nanogpt_tokens_per_sec(run_dir)
            else:
                out = os.path.join(run_dir, 'out')
                cmd = [sys.executable, 'train.py', config_file, f'--out_dir={out}', f'--data_dir={nt_data}',
                       '--init_from=scratch']
                wall, snaps = run_watched(cmd, ROOT, os.path.join(out, 'ckpt.pt'), run_dir)
                curve = score(snaps, load_nanotrain_model, val)
                tps = nanotrain_tokens_per_sec(out)
            result[side] = dict(wall=wall, curve=curve, tokens_per_sec=tps, load_before=load_avg)
            print(f"pair {pair} {side}: wall {wall:.1f}s, final val loss {curve[-1][2]:.4f} at iter {curve[-1][1]} "
                  f"({curve[-1][0]:.1f}s), {tps:,.0f} tok/s, load {load_avg:.2f}", flush=True)
        target = result['nanogpt']['curve'][-1][2]
        result['nanogpt']['time'] = result['nanogpt']['curve'][-1][0]
        hit = next((t for t, _, v in result['nanotrain']['curve'] if v <= target), None)
        result['nanotrain']['time'] = hit
        result['ratio'] = hit / result['nanogpt']['time'] if hit is not None else None
        print(f"pair {pair}: target {target:.4f}; nanoGPT {result['nanogpt']['time']:.1f}s, nanotrain "
              + (f"{hit:.1f}s, ratio {result['ratio']:.3f}" if hit is not None else "never reached it"), flush=True)
        runs.append(result)

    # tokens/s at nanoGPT's exact model and batch shape, `pairs` rounds alternating which goes first:
    # nanoGPT's quickstart cut to throughput_iters, and nanotrain with nanoGPT's architecture (so the same
    # model: only the training code differs); then once the speedrun config's architecture and optimizer
    shape_runs = []
    for pair in range(pairs):
        order = ['nanogpt', 'nanogpt_model'] if pair % 2 == 0 else ['nanogpt_model', 'nanogpt']
        rates = {}
        for side in order:
            run_dir = os.path.join(work_dir, f'shape-{pair}-{side}')
            if side == 'nanogpt':
                shutil.rmtree(ng_out, ignore_errors=True)
                cmd = [sys.executable, *NANOGPT_CMD, f'--max_iters={throughput_iters}',
                       f'--lr_decay_iters={throughput_iters}']
                run_watched(cmd, nanogpt_dir, os.path.join(ng_out, 'ckpt.pt'), run_dir)
                rates[side] = nanogpt_tokens_per_sec(run_dir)
            else:
                rates[side] = nanotrain_shape_tokens_per_sec(nt_data, NANOGPT_MODEL, run_dir)
        shape_runs.append(rates)
        print(f"round {pair} at nanoGPT's shape: nanoGPT {rates['nanogpt']:,.0f} tok/s, nanotrain "
              f"{rates['nanogpt_model']:,.0f} tok/s, ratio {rates['nanogpt_model'] / rates['nanogpt']:.3f}", flush=True)
    levers = nanotrain_shape_tokens_per_sec(nt_data, [], os.path.join(work_dir, 'shape-speedrun_levers'))
    print(f"nanotrain at nanoGPT's shape with the speedrun's architecture and optimizer: {levers:,.0f} tok/s",
          flush=True)

    med = lambda xs: statistics.median(xs) if xs and None not in xs else None
    shape = {k: med([r[k] for r in shape_runs]) for k in ('nanogpt', 'nanogpt_model')}
    summary = dict(
        shape_nanogpt_tokens_per_sec=shape['nanogpt'], shape_nanotrain_tokens_per_sec=shape['nanogpt_model'],
        shape_ratio=med([r['nanogpt_model'] / r['nanogpt'] for r in shape_runs]),
        shape_speedrun_levers_tokens_per_sec=levers, shape_speedrun_levers_ratio=levers / shape['nanogpt'],
        torch_threads=torch.get_num_threads(), load_average=os.getloadavg(),
    )
    if runs:
        summary.update(
            nanogpt_final_val_loss=med([r['nanogpt']['curve'][-1][2] for r in runs]),
            nanogpt_time=med([r['nanogpt']['time'] for r in runs]), nanogpt_wall=med([r['nanogpt']['wall'] for r in runs]),
            nanotrain_time_to_target=med([r['nanotrain']['time'] for r in runs]),
            nanotrain_wall=med([r['nanotrain']['wall'] for r in runs]),
            nanotrain_final_val_loss=med([r['nanotrain']['curve'][-1][2] for r in runs]),
            ratio=med([r['ratio'] for r in runs]),
            nanogpt_tokens_per_sec=med([r['nanogpt']['tokens_per_sec'] for r in runs]),
            nanotrain_tokens_per_sec=med([r['nanotrain']['tokens_per_sec'] for r in runs]))
    with open(os.path.join(work_dir, 'results.json'), 'w') as f:
        json.dump(dict(summary=summary, runs=runs, shape_runs=shape_runs), f, indent=1)
    if runs:
        curves = [(name, color, [(t, v) for t, _, v in r[side]['curve']])
                  for r in runs for side, name, color in (('nanogpt', 'nanoGPT', (70, 110, 200)),
                                                          ('nanotrain', 'nanotrain', (230, 110, 30)))]
        draw_plot(plot, curves, summary['nanogpt_final_val_loss'])
        print(f"plot: {plot}")
    print(json.dumps(summary, indent=1))


if __name__ == '__main__':
    main()
