"""
Real-time factor of the vocoders on the CPU (seconds of compute per second of audio; < 1 is faster than
real time): Griffin-Lim against a HiFi-GAN generator, eager and under torch.compile, on the log-mels of real
recordings (an LJSpeech-layout corpus), rounds alternating so that machine noise hits every variant alike.
With --tts_ckpt, also each train_tts.py model's own share: its text to mel of the same utterances' texts,
alone and through the generator (the RTF sample_tts.py's speech costs), each over the audio it speaks.

    python bench/bench_vocoder.py --vocoder=models/hifigan/generator_universal.pth.tar \
        --data_dir=../shared/data/espeak-ljspeech --threads=2
    python bench/bench_vocoder.py --vocoder=... --data_dir=... --threads=1 --tts_ckpt=out-tts/ckpt.pt,out-wide/ckpt.pt

Prints the median RTF of each variant over the rounds and writes bench/results/vocoder_rtf.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configurator import UserError, check_output_file, install_excepthook  # noqa: E402
from run.checkpoint import load_checkpoint  # noqa: E402
from run.device import cpu_name  # noqa: E402
from tts.data import MEL_SETTINGS, MelExtractor, read_metadata, read_wav  # noqa: E402
from tts.model import load_tts, synthesize  # noqa: E402
from tts.vocoder import load_hifigan  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
parser.add_argument('--vocoder', required=True, help='a HiFi-GAN generator file (config.json beside it)')
parser.add_argument('--data_dir', required=True, help='an LJSpeech-layout corpus: its first utterances are vocoded')
parser.add_argument('--utterances', type=int, default=4)
parser.add_argument('--rounds', type=int, default=5)
parser.add_argument('--threads', type=int, default=2)
parser.add_argument('--compile', type=int, default=1, help='also time the generator under torch.compile')
parser.add_argument('--tts_ckpt', default='', help="train_tts.py checkpoints, comma-separated: also time their "
                    "text to mel, alone and through the eager generator (a multi-speaker model: its first voice)")
parser.add_argument('--out', default=os.path.join(ROOT, 'bench', 'results', 'vocoder_rtf.json'))
args = parser.parse_args()
install_excepthook()


def earlier_result(path):
    """Whether path holds this script's results: the one file --out replaces."""
    try:
        with open(path) as f:
            return {'vocoder', 'rtf'} <= set(json.load(f))
    except (OSError, ValueError, TypeError):
        return False


os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
tts_ckpts = [path for path in args.tts_ckpt.split(',') if path]
check_output_file(args.out, 'out', 'the results JSON', earlier_result, reads=[args.vocoder, *tts_ckpts])
torch.set_num_threads(args.threads)

extractor = MelExtractor(**MEL_SETTINGS)
rate = MEL_SETTINGS['sample_rate']
rows = read_metadata(args.data_dir)[:args.utterances]
mels = [extractor(read_wav(os.path.join(args.data_dir, 'wavs', utt_id + '.wav'), rate)[0]) for utt_id, _ in rows]
texts = [text for _, text in rows]


def audio_seconds(mels):
    return sum(m.shape[1] for m in mels) * MEL_SETTINGS['hop_length'] / rate


generator = load_hifigan(args.vocoder)
# name: (what is timed, its inputs, the seconds of audio they make)
variants = {'Griffin-Lim (32 iterations)': (extractor.to_waveform, mels, audio_seconds(mels)),
            'HiFi-GAN, eager': (generator.vocode, mels, audio_seconds(mels))}
if args.compile:
    compiled = torch.compile(generator, dynamic=True)

    @torch.inference_mode()
    def vocode_compiled(log_mel):
        return compiled(log_mel[None])[0]
    t0 = time.perf_counter()
    for mel in mels:  # compiles (dynamic length), then warm
        vocode_compiled(mel)
    print(f"torch.compile: first pass {time.perf_counter() - t0:.1f} s")
    variants['HiFi-GAN, torch.compile'] = (vocode_compiled, mels, audio_seconds(mels))
for path in tts_ckpts:
    ckpt = load_checkpoint(path, fix="give train_tts.py checkpoints in --tts_ckpt, comma-separated")
    if ckpt['kind'] != 'tts':
        raise UserError(f"--tts_ckpt: {path} is a {ckpt['kind']!r} checkpoint, not a text-to-speech one "
                        f"(train_tts.py's); give those, comma-separated.")
    model = load_tts(ckpt)
    voice = model.config.speakers[0] if model.config.speakers else ''

    def text_to_mel(text, model=model, voice=voice):  # the checkpoint's own synthesis settings aside: defaults
        return synthesize(model, text, vocode=lambda log_mel: log_mel, speaker=voice)[1]
    spoken = audio_seconds([text_to_mel(text) for text in texts])  # the same noise seed every time
    variants[f'{path}: text to mel'] = (text_to_mel, texts, spoken)
    variants[f'{path}: + HiFi-GAN'] = (lambda text, f=text_to_mel: generator.vocode(f(text)), texts, spoken)
for vocode, inputs, _ in variants.values():  # warm-up
    vocode(inputs[0])

rtf = {name: [] for name in variants}
for _ in range(args.rounds):
    for name, (vocode, inputs, seconds) in variants.items():
        t0 = time.perf_counter()
        for item in inputs:
            vocode(item)
        rtf[name].append((time.perf_counter() - t0) / seconds)
print(f"{len(mels)} utterances, {audio_seconds(mels):.1f} s of recorded audio, {args.threads} threads, {args.rounds} "
      f"rounds; RTF:")
width = max(map(len, variants))
for name, values in rtf.items():
    print(f"  {name:<{width}} median {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f})")
os.makedirs(os.path.dirname(args.out), exist_ok=True)
with open(args.out, 'w') as f:
    json.dump(dict(vocoder=os.path.basename(args.vocoder), audio_seconds=audio_seconds(mels), threads=args.threads,
                   cpu=cpu_name(), torch=torch.__version__, date=time.strftime('%Y-%m-%d'),
                   rtf={name: dict(median=statistics.median(v), rounds=v, audio_seconds=variants[name][2])
                        for name, v in rtf.items()}), f, indent=1)
print(f"wrote {args.out}")
