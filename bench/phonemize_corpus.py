"""
A phoneme front end for train_tts.py, made offline: copies an LJSpeech-layout corpus with its text column
spelled in espeak-ng phonemes (IPA, as Piper and Matcha-TTS feed their models), so the model learns sounds
rather than English spelling. train_tts.py needs no change: its vocabulary is the corpus's characters.
espeak-ng comes from Piper's package (its phonemizer, data included), never a nanotrain dependency:

    python -m venv piper-venv && piper-venv/bin/pip install piper-tts   # 1.8.0 here
    piper-venv/bin/python bench/phonemize_corpus.py --data_dir=data/piper-ljspeech --out_dir=data/piper-ipa

The copy's metadata.csv rows are 'id|original text|phonemes': train_tts.py reads the last column,
bench/tts_asr.py scores against the original words (the middle one; phonemes.json marks the copy). wavs/
links to the source's. Text for such a model is phonemized the same way: --text_only prints it.
"""

import argparse
import json
import os
import sys
import unicodedata


def phonemizer(voice='en-us'):
    """text -> espeak-ng IPA, sentences joined by a space, punctuation kept (Piper's phonemize_espeak)."""
    try:
        from piper.phonemize_espeak import EspeakPhonemizer
    except ImportError:
        sys.exit("bench/phonemize_corpus.py needs piper-tts (espeak-ng inside) in its own environment; "
                 "see this file's docstring for the install line")
    espeak = EspeakPhonemizer()

    def phonemize(text):
        sentences = espeak.phonemize(voice, text)
        return unicodedata.normalize('NFC', ' '.join(''.join(s).strip() for s in sentences)).replace('|', ' ')
    return phonemize


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--data_dir', help="an LJSpeech-layout corpus: metadata.csv (id|raw|normalized) and wavs/")
    p.add_argument('--out_dir', help="where the phonemized copy goes (metadata.csv, wavs -> the source's wavs)")
    p.add_argument('--voice', default='en-us', help="espeak-ng voice")
    p.add_argument('--text_only', help="print this text's phonemes and exit")
    args = p.parse_args()
    phonemize = phonemizer(args.voice)
    if args.text_only:
        print(phonemize(args.text_only))
        return
    if not (args.data_dir and args.out_dir):
        sys.exit("give --data_dir and --out_dir (or --text_only=TEXT)")
    rows = []
    with open(os.path.join(args.data_dir, 'metadata.csv'), encoding='utf-8-sig') as f:
        for line in f:
            fields = line.rstrip('\r\n').split('|')
            if len(fields) >= 2:
                rows.append((fields[0], fields[-1]))  # the normalized column: what a character model reads
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, 'metadata.csv'), 'w', encoding='utf-8') as f:
        for utt_id, text in rows:
            f.write(f"{utt_id}|{text}|{phonemize(text)}\n")
    with open(os.path.join(args.out_dir, 'phonemes.json'), 'w') as f:  # tells bench/tts_asr.py where the words are
        json.dump(dict(source=os.path.abspath(args.data_dir), voice=args.voice, phonemizer='espeak-ng (piper-tts)'), f)
    wavs = os.path.join(args.out_dir, 'wavs')
    if not os.path.exists(wavs):
        os.symlink(os.path.abspath(os.path.join(args.data_dir, 'wavs')), wavs)
    print(f"{len(rows)} utterances phonemized into {args.out_dir}; e.g. {rows[0][1]!r} -> {phonemize(rows[0][1])!r}")


if __name__ == '__main__':
    main()
