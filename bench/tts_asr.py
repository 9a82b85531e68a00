"""
Intelligibility of a TTS model by an ASR nobody here wrote (pocketsphinx): word error rate on the
held-out utterances of (a) the reference recordings, (b) the reference mel through Griffin-Lim (the
vocoder alone) and (c) the model's speech synthesized from text. Two steps in two environments,
because pocketsphinx is never a nanotrain dependency:

    OMP_NUM_THREADS=1 python bench/tts_asr.py synthesize --ckpt=out-tts-espeak/ckpt.pt --wav_dir=/tmp/tts_asr
    python -m venv asrvenv && asrvenv/bin/pip install pocketsphinx
    asrvenv/bin/python bench/tts_asr.py score --wav_dir=/tmp/tts_asr

`synthesize` (nanotrain's python) writes 16 kHz WAVs of the three kinds and manifest.json (held-out texts,
training texts); `score` (the pocketsphinx venv, no torch) decodes them twice: with a trigram language
model of the training transcripts over the corpus vocabulary (pocketsphinx.lm.ArpaBoLM, dictionary cut to
that vocabulary; the held-out sentences themselves are not in it) and with pocketsphinx's general en-us
model, after adding the same -60 dB noise floor to every WAV (--noise_floor). Pocketsphinx is weak on espeak's
voice: compare the three columns, not the absolute values.
"""
import argparse
import array
import json
import os
import random
import re
import sys
import wave

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASR_RATE = 16000  # pocketsphinx's en-us acoustic model
KINDS = ('reference', 'griffin_lim', 'model')


def words_of(text):
    """Lower-case words (letters and inner apostrophes), as both the transcripts and the dictionary spell them."""
    return [w.strip("'") for w in re.findall(r"[a-z']+", text.lower()) if w.strip("'")]


def synthesize(args):
    # torch and nanotrain only here: `score` runs in the pocketsphinx venv, which has neither
    import torch
    import torchaudio
    sys.path.insert(0, ROOT)
    from tts.data import MEL_SETTINGS, MelExtractor, read_metadata, read_wav, split_ids, write_wav
    from tts.model import load_tts, synthesize as speak

    ckpt = torch.load(args.ckpt, map_location='cpu', weights_only=False)
    config = ckpt['config']
    data_dir = args.data_dir or ckpt['data_dir']
    model = load_tts(ckpt)
    rows = read_metadata(data_dir)
    texts = dict(rows)
    train_ids, val_ids = split_ids([utt_id for utt_id, _ in rows], config['val_fraction'])
    val_ids = val_ids[:args.utterances or len(val_ids)]
    rate = MEL_SETTINGS['sample_rate']
    extractor = MelExtractor(**MEL_SETTINGS)
    for kind in KINDS:
        os.makedirs(os.path.join(args.wav_dir, kind), exist_ok=True)
    for utt_id in val_ids:
        recording, _ = read_wav(os.path.join(data_dir, 'wavs', utt_id + '.wav'), rate)
        audio, _ = speak(model, texts[utt_id], config['n_timesteps'], config['temperature'], config['length_scale'],
                         config['guidance'] if args.guidance is None else args.guidance, config['seed'])
        for kind, wav in zip(KINDS, (recording, extractor.to_waveform(extractor(recording)), audio)):
            wav = torchaudio.functional.resample(wav.float(), rate, ASR_RATE)
            write_wav(os.path.join(args.wav_dir, kind, utt_id + '.wav'), wav / max(1.0, wav.abs().max().item()),
                      ASR_RATE)
        print(f"{utt_id}: {texts[utt_id]}", flush=True)
    with open(os.path.join(args.wav_dir, 'manifest.json'), 'w') as f:
        json.dump(dict(ckpt=os.path.abspath(args.ckpt), step=ckpt['iter_num'], data_dir=os.path.abspath(data_dir),
                       held_out={i: texts[i] for i in val_ids}, train_texts=[texts[i] for i in train_ids],
                       corpus_words=sorted({w for _, t in rows for w in words_of(t)})), f, indent=1)


def word_errors(reference, hypothesis):
    """Levenshtein distance between two word lists (substitutions, deletions, insertions)."""
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        current = [i]
        for j, h in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


def corpus_language_model(manifest, work_dir):
    """(lm path, dict path, corpus words missing from the CMU dictionary): a trigram ARPA model of the
    training transcripts plus every corpus word (count 1), and the CMU dictionary's entries for them."""
    from pocketsphinx import get_model_path
    from pocketsphinx.lm import ArpaBoLM
    vocabulary = set(manifest['corpus_words'])
    pronunciations, known = [], set()
    with open(get_model_path('en-us/cmudict-en-us.dict')) as f:
        for line in f:
            word = line.split(' ', 1)[0]
            base = re.sub(r'\(\d+\)$', '', word)
            if base in vocabulary:
                pronunciations.append(line)
                known.add(base)
    word_file = os.path.join(work_dir, 'corpus_words.txt')
    with open(word_file, 'w') as f:
        f.write('\n'.join(sorted(known)) + '\n')
    sentences = '\n'.join(' '.join(w for w in words_of(t) if w in known) for t in manifest['train_texts'])
    lm = ArpaBoLM(text=sentences, add_start=True, word_file=word_file)
    lm.compute()
    paths = os.path.join(work_dir, 'corpus.lm'), os.path.join(work_dir, 'corpus.dict')
    lm.write_file(paths[0])
    with open(paths[1], 'w') as f:
        f.writelines(pronunciations)
    return paths[0], paths[1], sorted(vocabulary - known)


def transcribe(decoder, path, noise_floor):
    """Words pocketsphinx hears in a 16 kHz 16-bit WAV, after adding Gaussian noise of noise_floor times full
    scale (the same noise for every kind of audio of an utterance: seeded by the file name)."""
    with wave.open(path, 'rb') as w:
        assert w.getframerate() == ASR_RATE and w.getsampwidth() == 2 and w.getnchannels() == 1, path
        pcm = array.array('h', w.readframes(w.getnframes()))
    rng = random.Random(os.path.basename(path))
    pcm = array.array('h', (max(-32768, min(32767, round(v + rng.gauss(0, noise_floor * 32768)))) for v in pcm))
    decoder.start_utt()
    decoder.process_raw(pcm.tobytes(), full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return words_of(hypothesis.hypstr) if hypothesis else []


def score(args):
    from pocketsphinx import Decoder
    with open(os.path.join(args.wav_dir, 'manifest.json')) as f:
        manifest = json.load(f)
    lm_path, dict_path, missing = corpus_language_model(manifest, args.wav_dir)
    decoders = dict(corpus_lm=Decoder(lm=lm_path, dict=dict_path, loglevel='FATAL'),
                    general_lm=Decoder(loglevel='FATAL'))
    references = {i: words_of(t) for i, t in manifest['held_out'].items()}
    n_words = sum(len(r) for r in references.values())
    results, transcripts = {}, {}
    for lm_name, decoder in decoders.items():
        for kind in KINDS:
            errors = 0
            for utt_id, reference in references.items():
                path = os.path.join(args.wav_dir, kind, utt_id + '.wav')
                hypothesis = transcribe(decoder, path, args.noise_floor)
                errors += word_errors(reference, hypothesis)
                transcripts.setdefault(utt_id, {})[f'{lm_name}/{kind}'] = ' '.join(hypothesis)
            results[f'{lm_name}/{kind}'] = errors / n_words
    print(f"checkpoint {manifest['ckpt']} (step {manifest['step']}), {len(references)} held-out utterances, "
          f"{n_words} words, noise floor {args.noise_floor:g} of full scale; corpus words missing from the CMU "
          f"dictionary (never recognised): {len(missing)}, e.g. {' '.join(missing[:10])}")
    print(f"{'WER':<12} {'reference':>10} {'Griffin-Lim':>12} {'model':>8}")
    for lm_name in decoders:
        print(f"{lm_name:<12} " + ' '.join(f"{results[f'{lm_name}/{k}']:>{w}.1%}"
                                           for k, w in zip(KINDS, (10, 12, 8))))
    with open(os.path.join(args.wav_dir, f'wer_noise{args.noise_floor:g}.json'), 'w') as f:
        json.dump(dict(manifest_ckpt=manifest['ckpt'], step=manifest['step'], words=n_words,
                       noise_floor=args.noise_floor, missing_from_dictionary=missing, wer=results,
                       transcripts={i: dict(reference=manifest['held_out'][i], **t) for i, t in transcripts.items()}),
                  f, indent=1)


parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
steps = parser.add_subparsers(dest='step', required=True)
step = steps.add_parser('synthesize', help="write the three kinds of WAVs (nanotrain's python)")
step.add_argument('--ckpt', required=True, help='a train_tts.py checkpoint')
step.add_argument('--data_dir', default='', help="the corpus; default: the checkpoint's")
step.add_argument('--utterances', type=int, default=0, help='the first N held-out utterances; 0 = all')
step.add_argument('--wav_dir', required=True)
step.add_argument('--guidance', type=float, default=None, help="classifier-free guidance weight; default: the checkpoint's")
step = steps.add_parser('score', help='word error rates by pocketsphinx (its venv)')
step.add_argument('--wav_dir', required=True)
# espeak's recordings hold stretches of exact digital silence, on which pocketsphinx's feature normalisation
# fails (WER 91% on the clean references, 64% with this floor, for 69% on their Griffin-Lim version, which
# is never exactly silent); a floor of -60 dB full scale, added alike to all three kinds, removes that artefact
step.add_argument('--noise_floor', type=float, default=1e-3, help='std of the added noise / full scale; 0 = none')
args = parser.parse_args()
if args.step == 'synthesize':
    synthesize(args)
else:
    score(args)
