#!/usr/bin/env python3
"""A multi-speaker corpus for train_tts.py --multi_speaker=True, made offline: Piper's "joe" (a natural voice,
from a corpus made with make_piper_ljspeech.py) beside espeak-ng's voice variants as distinct speakers.

    apt-get install espeak-ng          # the espeak-ng program (Debian/Ubuntu)
    python runs/make_voices_corpus.py --joe_dir=data/piper-ljspeech --joe_held_out_dir=data/piper-ljspeech-heldout \
        --source=data/tinyshakespeare.txt --out=data/voices

Writes two LJSpeech-layout folders with rows id|speaker|text (Matcha-TTS's VCTK filelists):
  OUT/            the training corpus: --joe_utterances of joe, --utterances of each of --voices;
  OUT-heldout/    --held_out sentences the training corpus never has, read by every training voice and by each
                  of --unseen_voices (voices the model never hears: the test of sample_tts.py --voice_clip).
Each espeak voice reads its own sentences of SOURCE (lines picked as make_espeak_ljspeech.py picks them) at
its own speed, so voices differ in timbre, pitch and pace, not in what they say. WAVs are 22050 Hz mono.
"""
import argparse
import os
import random
import re
import shutil
import subprocess

VOICES = ('m1,m2,m3,m4,m5,m6,m7,f1,f2,f3,f4,klatt,klatt2,klatt3,croak,Alex,Andy,Annie,Gene,Jacky,Lee,Mike,'
          'linda,steph,max,paul,robert,shelby')
UNSEEN = 'f5,m8,edward,grandma'


def read_rows(data_dir):
    with open(os.path.join(data_dir, 'metadata.csv'), encoding='utf-8') as f:
        return [line.rstrip('\n').split('|')[:2] for line in f if line.strip()]


def espeak(voice, speed, text, path):
    subprocess.run(['espeak-ng', '-v', f'en-us+{voice}', '-s', str(speed), '-w', path, text], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--joe_dir', required=True, help="a make_piper_ljspeech.py corpus (the training sentences)")
    ap.add_argument('--joe_held_out_dir', required=True, help='its held-out corpus (made with --skip)')
    ap.add_argument('--source', required=True, help='a text file of sentences for the espeak voices')
    ap.add_argument('--out', required=True)
    ap.add_argument('--voices', default=VOICES, help="espeak-ng variants ('en-us+NAME') that train")
    ap.add_argument('--unseen_voices', default=UNSEEN, help='variants only in the held-out folder')
    ap.add_argument('--joe_utterances', type=int, default=600)
    ap.add_argument('--utterances', type=int, default=100, help='per espeak voice')
    ap.add_argument('--held_out', type=int, default=12, help='held-out sentences per voice')
    ap.add_argument('--seed', type=int, default=0)
    a = ap.parse_args()

    joe = read_rows(a.joe_dir)[:a.joe_utterances]
    joe_held = read_rows(a.joe_held_out_dir)[:a.held_out]
    taken = {text for _, text in joe} | {text for _, text in joe_held}
    ok = re.compile(r"^[A-Za-z][A-Za-z ,.;:'!?-]+$")
    lines = sorted({l.strip() for l in open(a.source, encoding='utf-8') if 30 <= len(l.strip()) <= 110
                    and ok.match(l.strip())} - taken)
    rng = random.Random(a.seed)
    rng.shuffle(lines)
    voices, unseen = a.voices.split(','), a.unseen_voices.split(',')
    if len(lines) < len(voices) * a.utterances:
        raise SystemExit(f"{a.source}: {len(lines)} usable sentences, {len(voices) * a.utterances} needed")
    speeds = {voice: rng.randint(140, 185) for voice in voices + unseen}  # words a minute: each its own pace

    held_dir = a.out.rstrip('/') + '-heldout'
    for d in (a.out, held_dir):  # a corpus there (its recordings, metadata.csv) is never written over
        if os.path.isdir(d) and os.listdir(d) or os.path.lexists(d) and not os.path.isdir(d):
            raise SystemExit(f"{d} exists and is not an empty folder: give --out a new folder (it and {held_dir} "
                             f"are written), or delete that one yourself if it can go.")
    for d in (a.out, held_dir):
        os.makedirs(os.path.join(d, 'wavs'), exist_ok=True)
    with open(os.path.join(a.out, 'metadata.csv'), 'w', encoding='utf-8') as meta:
        for utt_id, text in joe:
            shutil.copy(os.path.join(a.joe_dir, 'wavs', utt_id + '.wav'), os.path.join(a.out, 'wavs'))
            meta.write(f'{utt_id}|joe|{text}\n')
        for v, voice in enumerate(voices):
            speed = speeds[voice]
            for i, text in enumerate(lines[v * a.utterances:(v + 1) * a.utterances]):
                utt_id = f'V{voice}{i:04d}'
                espeak(voice, speed, text, os.path.join(a.out, 'wavs', utt_id + '.wav'))
                meta.write(f'{utt_id}|{voice}|{text}\n')
            print(f'{voice}: {a.utterances} utterances at {speed} wpm', flush=True)
    with open(os.path.join(held_dir, 'metadata.csv'), 'w', encoding='utf-8') as meta:
        for utt_id, text in joe_held:
            shutil.copy(os.path.join(a.joe_held_out_dir, 'wavs', utt_id + '.wav'), os.path.join(held_dir, 'wavs'))
            meta.write(f'{utt_id}|joe|{text}\n')
        for voice in voices + unseen:
            for i, (_, text) in enumerate(joe_held):
                utt_id = f'H{voice}{i:04d}'
                espeak(voice, speeds[voice], text, os.path.join(held_dir, 'wavs', utt_id + '.wav'))
                meta.write(f'{utt_id}|{voice}|{text}\n')
    print(f'{a.out}: joe + {len(voices)} espeak voices; {held_dir}: {a.held_out} sentences each, '
          f'{len(unseen)} unseen voices ({a.unseen_voices})')


if __name__ == '__main__':
    main()
