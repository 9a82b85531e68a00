"""
Monotonic Alignment Search: the vectorised PyTorch version (tts/model.py's
monotonic_alignment_search) against the plain-loop transcription of Glow-TTS's Cython kernel, on
random batches of typical LJSpeech size. Checks they agree, prints the time of each.

    python bench/bench_mas.py --batch=16 --tokens=150 --frames=600 --device=cpu
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tts.model import maximum_path_reference, monotonic_alignment_search  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument('--batch', type=int, default=16)
parser.add_argument('--tokens', type=int, default=150)   # with blanks: ~2x characters
parser.add_argument('--frames', type=int, default=600)   # ~7 s at hop 256, 22050 Hz
parser.add_argument('--device', default='cpu')
parser.add_argument('--repeats', type=int, default=3)
args = parser.parse_args()

g = torch.Generator().manual_seed(0)
x_lengths = torch.randint(args.tokens // 2, args.tokens + 1, (args.batch,), generator=g)
y_lengths = torch.randint(args.frames // 2, args.frames + 1, (args.batch,), generator=g)
x_lengths[0], y_lengths[0] = args.tokens, args.frames
value = torch.randn(args.batch, args.tokens, args.frames, generator=g)
mask = (torch.arange(args.tokens)[None, :, None] < x_lengths[:, None, None]) & \
       (torch.arange(args.frames)[None, None, :] < y_lengths[:, None, None])


def timed(fn, *a):
    best = float('inf')
    for _ in range(args.repeats):
        if args.device.startswith('cuda'):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a)
        if args.device.startswith('cuda'):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return out, best


path, t_vec = timed(monotonic_alignment_search, value.to(args.device), mask.to(args.device))
args.repeats = 1  # the plain loop is slow
reference, t_ref = timed(maximum_path_reference, value, mask)
assert torch.equal(path.cpu(), reference), "vectorised MAS disagrees with the reference"
print(f"MAS batch {args.batch} x {args.tokens} tokens x {args.frames} frames on {args.device}: "
      f"vectorised {t_vec * 1000:.1f} ms, plain loop {t_ref * 1000:.0f} ms ({t_ref / t_vec:.0f}x); paths identical")
