"""
Intelligibility of a TTS model as papers report it: word and character error rates by Whisper base (OpenAI's,
MIT, in CTranslate2 layout for faster-whisper) on held-out utterances of (a) the reference recordings, (b) the
reference mel through Griffin-Lim and (c) through a HiFi-GAN generator (--vocoder; each vocoder alone: the floor a
model is judged against) and (d) the model's speech synthesized from text, through --vocoder if given, else
Griffin-Lim. Two steps in two environments, because faster-whisper is never a nanotrain
dependency (the score step needs no torch):

    OMP_NUM_THREADS=1 python runs/tts_asr.py synthesize --ckpt=out-tts-espeak/ckpt.pt --wav_dir=/tmp/tts_asr
    python -m venv asrvenv && asrvenv/bin/pip install faster-whisper   # model: ../shared/tools/make_whisper_base.py
    OMP_NUM_THREADS=1 asrvenv/bin/python runs/tts_asr.py score --wav_dir=/tmp/tts_asr --whisper=models/whisper-base-ct2

The held-out utterances of any LJSpeech-layout corpus: the checkpoint's held-out split of its corpus
(train_tts.py's val_fraction), or with --held_out_dir every utterance of a corpus of sentences the model never
saw (e.g. one made with make_piper_ljspeech.py --skip). Without --ckpt (d) is not written, without --vocoder (c).
`synthesize` writes 16 kHz WAVs of each kind and manifest.json (with the real-time factors of the model's
speech and of the vocoder alone, by the clock and in CPU time, and the synthesis settings: --n_timesteps,
--temperature, --length_scale, --guidance and the noise's --seed override the checkpoint's); `score` decodes
them (beam 5, English, temperature 0; a transcript caught in a decoding loop is decoded again, sampled from a
fixed seed, so a rerun gives the same words) and writes whisper_<kinds>.json with every transcript. Both sides
are compared after `normalize` (its docstring states the rules).
"""
import argparse
import json
import os
import re
import sys
import time
import wave

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASR_RATE = 16000  # Whisper's input rate
LOOP_RATIO = 2.4  # a transcript gzip compresses more than this is a decoding loop (Whisper's threshold)
KINDS = ('reference', 'griffin_lim', 'vocoder', 'model')


def normalize(text):
    """The text compared: lower case, hyphens and dashes as spaces, every other character that is neither a
    letter, a digit nor a space removed (apostrophes too: "I'll" and "Ill" match), whitespace collapsed.
    Numbers stay as written: the corpora spell them out, so a digit Whisper writes counts as an error."""
    text = re.sub(r'[-\u2010-\u2015]', ' ', text.lower())
    return ' '.join(re.sub(r'[^\w\s]|_', '', text).split())


def edit_distance(reference, hypothesis):
    """Levenshtein distance between two sequences (words of a list, or characters of a string):
    the fewest substitutions, deletions and insertions that turn reference into hypothesis."""
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        current = [i]
        for j, h in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


def error_rates(pairs):
    """(WER, CER) of (reference, hypothesis) text pairs, each normalized: the summed word (character)
    edits over the summed reference words (characters, spaces included), as jiwer computes a corpus."""
    pairs = [(normalize(r), normalize(h)) for r, h in pairs]
    words = sum(len(r.split()) for r, _ in pairs)
    chars = sum(len(r) for r, _ in pairs)
    return (sum(edit_distance(r.split(), h.split()) for r, h in pairs) / words,
            sum(edit_distance(r, h) for r, h in pairs) / chars)


def write_16k(path, wav, rate):
    """A waveform at rate Hz written to path as a 16 kHz WAV (the scorers' rate), scaled down if it clips.
    nanotrain's venv only (runs/tts_voices.py writes with it too)."""
    import torchaudio
    from tts.data import write_wav
    wav = torchaudio.functional.resample(wav.float(), rate, ASR_RATE)
    write_wav(path, wav / max(1.0, wav.abs().max().item()), ASR_RATE)


# what the synthesize and score steps of this script, runs/tts_voices.py and runs/tts_mos.py write in wav_dir
WAV_DIR_ENTRIES = re.compile(r'(reference|griffin_lim|vocoder|model|clip|speaker)|'
                             r'(manifest|similarity|(whisper|dnsmos)_[a-z_]+)\.json')


def check_wav_dir(wav_dir):
    """Exit with a message unless wav_dir may take a synthesize step's WAVs and manifest.json: new, or holding
    only what these scripts write there (an earlier step's, whose kinds a later one adds to, or one killed
    midway); another folder (a corpus, its recordings) is never written into."""
    if os.path.lexists(wav_dir) and not (os.path.isdir(wav_dir) and all(
            WAV_DIR_ENTRIES.fullmatch(entry) for entry in os.listdir(wav_dir))):
        raise SystemExit(f"--wav_dir={wav_dir} holds other files than these scripts write there (kind folders, "
                         f"manifest.json): give a new folder, or delete that one yourself if it can go.")


def synthesize(args):
    # torch and nanotrain only here: `score` runs in the ASR venv, which has neither
    check_wav_dir(args.wav_dir)
    import torch
    sys.path.insert(0, ROOT)
    from tts.data import MEL_SETTINGS, MelExtractor, read_metadata, read_speakers, read_wav, split_ids
    from tts.model import load_tts, synthesize as speak
    from tts.vocoder import load_vocoder

    ckpt = torch.load(args.ckpt, map_location='cpu', weights_only=False) if args.ckpt else None
    if args.held_out_dir:
        data_dir = args.held_out_dir
        rows = read_metadata(data_dir)
        val_ids = [utt_id for utt_id, _ in rows]
    else:
        data_dir = args.data_dir or ckpt['data_dir']
        rows = read_metadata(data_dir)
        val_fraction = args.val_fraction or (ckpt['config']['val_fraction'] if ckpt else 0.05)
        _, val_ids = split_ids([utt_id for utt_id, _ in rows], val_fraction)
    texts = dict(rows)
    words = spoken_words(data_dir, texts)
    val_ids = val_ids[:args.utterances or len(val_ids)]
    kinds = (args.kinds.split(',') if args.kinds else
             [k for k in KINDS if (k != 'model' or ckpt) and (k != 'vocoder' or args.vocoder)])
    if set(kinds) - set(KINDS) or ('model' in kinds and not ckpt) or ('vocoder' in kinds and not args.vocoder):
        raise SystemExit(f"--kinds={args.kinds}: choose from {','.join(KINDS)}; 'model' needs --ckpt, 'vocoder' "
                         f"--vocoder")
    model = load_tts(ckpt) if 'model' in kinds else None
    speakers = read_speakers(data_dir) if model is not None and model.config.speakers else {}
    vocode = load_vocoder(args.vocoder)
    rate = MEL_SETTINGS['sample_rate']
    extractor = MelExtractor(**MEL_SETTINGS)
    knob = {k: ckpt['config'][k] if getattr(args, k) is None else getattr(args, k)
            for k in ('n_timesteps', 'temperature', 'length_scale', 'guidance', 'seed')} if ckpt else {}
    torch.manual_seed(0)  # Griffin-Lim starts from random phases
    # synthesis time (wall and this process's CPU), audio's: on one thread the CPU time is what an idle core
    # takes, whatever else the machine runs
    clock, cpu = {'vocoder': 0.0, 'model': 0.0}, {'vocoder': 0.0, 'model': 0.0}
    spoken = {'vocoder': 0.0, 'model': 0.0}
    for kind in kinds:
        os.makedirs(os.path.join(args.wav_dir, kind), exist_ok=True)
    for utt_id in val_ids:
        recording, _ = read_wav(os.path.join(data_dir, 'wavs', utt_id + '.wav'), rate)
        wavs = {'reference': recording}
        if 'griffin_lim' in kinds:  # the slow one: only where asked for
            wavs['griffin_lim'] = extractor.to_waveform(extractor(recording))
        if 'vocoder' in kinds:
            mel = extractor(recording)
            t0, c0 = time.perf_counter(), time.process_time()
            wavs['vocoder'] = vocode(mel)
            clock['vocoder'] += time.perf_counter() - t0
            cpu['vocoder'] += time.process_time() - c0
            spoken['vocoder'] += len(recording) / rate
        if model is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            wavs['model'] = speak(model, texts[utt_id], knob['n_timesteps'], knob['temperature'],
                                  knob['length_scale'], knob['guidance'], knob['seed'], vocode,
                                  speakers.get(utt_id, ''))[0]
            clock['model'] += time.perf_counter() - t0
            cpu['model'] += time.process_time() - c0
            spoken['model'] += len(wavs['model']) / rate
        for kind in kinds:
            write_16k(os.path.join(args.wav_dir, kind, utt_id + '.wav'), wavs[kind], rate)
        print(f"{utt_id}: {words[utt_id]}", flush=True)
    with open(os.path.join(args.wav_dir, 'manifest.json'), 'w') as f:
        json.dump(dict(ckpt=os.path.abspath(args.ckpt) if ckpt else None, step=ckpt['iter_num'] if ckpt else None,
                       data_dir=os.path.abspath(data_dir), kinds=kinds,
                       vocoder=os.path.abspath(args.vocoder) if args.vocoder else None, synthesis=knob,
                       rtf={k: clock[k] / spoken[k] for k in clock if k in kinds},  # real-time factors
                       cpu_rtf={k: cpu[k] / spoken[k] for k in cpu if k in kinds},  # CPU s an audio s
                       held_out={i: words[i] for i in val_ids}), f, indent=1)


def spoken_words(data_dir, texts):
    """{id: the words Whisper should hear}: the corpus's text, except in a corpus spelled in phonemes (an
    `id|words|phonemes` copy marked by phonemes.json beside metadata.csv), whose words are the middle column."""
    if not os.path.exists(os.path.join(data_dir, 'phonemes.json')):
        return texts
    with open(os.path.join(data_dir, 'metadata.csv'), encoding='utf-8-sig') as f:
        rows = [line.rstrip('\r\n').split('|') for line in f if line.strip()]
    return {fields[0]: fields[1] for fields in rows}


def read_16k(path):
    """A 16 kHz 16-bit mono WAV (as `synthesize` writes them) -> float32 numpy array in [-1, 1]."""
    import numpy as np
    with wave.open(path, 'rb') as w:
        assert w.getframerate() == ASR_RATE and w.getsampwidth() == 2 and w.getnchannels() == 1, path
        return np.frombuffer(w.readframes(w.getnframes()), dtype='<i2').astype(np.float32) / 32768.0


def transcribe(whisper, audio, beam_size):
    """What Whisper hears in audio: beam search at temperature 0; a transcript caught in a decoding loop ("it's
    so sweet" 30 times over: gzip compresses it more than 2.4x, Whisper's own test) is decoded again as Whisper
    does, sampling at rising temperatures, from a fixed seed so that a rerun gives the same words."""
    import ctranslate2
    from faster_whisper.transcribe import get_compression_ratio

    def decode(temperature):
        segments, _ = whisper.transcribe(audio, language='en', beam_size=beam_size, temperature=temperature,
                                         condition_on_previous_text=False)
        return ' '.join(s.text.strip() for s in segments)
    text = decode(0.0)
    if text and get_compression_ratio(text) > LOOP_RATIO:
        ctranslate2.set_random_seed(0)
        text = decode([0.2, 0.4, 0.6, 0.8, 1.0])
    return text


def score(args):
    from faster_whisper import WhisperModel
    with open(os.path.join(args.wav_dir, 'manifest.json')) as f:
        manifest = json.load(f)
    whisper = WhisperModel(args.whisper, device='cpu', compute_type='int8', cpu_threads=args.threads)
    held_out = manifest['held_out']
    kinds = args.kinds.split(',') if args.kinds else manifest['kinds']
    if set(kinds) - set(manifest['kinds']):
        raise SystemExit(f"--kinds={args.kinds}: {args.wav_dir} holds {','.join(manifest['kinds'])}")
    heard = {kind: {} for kind in kinds}
    for utt_id in held_out:
        for kind in kinds:
            heard[kind][utt_id] = transcribe(whisper, read_16k(os.path.join(args.wav_dir, kind, utt_id + '.wav')),
                                             args.beam_size)
        print(f"{utt_id}: {held_out[utt_id]} | " + ' | '.join(heard[k][utt_id] for k in kinds), flush=True)
    rates = {kind: error_rates([(held_out[i], heard[kind][i]) for i in held_out]) for kind in kinds}
    words = sum(len(normalize(t).split()) for t in held_out.values())
    print(f"checkpoint {manifest['ckpt']} (step {manifest['step']}), vocoder {manifest.get('vocoder')}, corpus "
          f"{manifest['data_dir']}: "
          f"{len(held_out)} held-out utterances, {words} words; Whisper base, beam {args.beam_size}")
    print(f"{'':<12} {'WER':>7} {'CER':>7}")
    for kind, (wer, cer) in rates.items():
        print(f"{kind:<12} {wer:>7.1%} {cer:>7.1%}")
    with open(os.path.join(args.wav_dir, f"whisper_{'_'.join(kinds)}.json"), 'w') as f:
        json.dump(dict(ckpt=manifest['ckpt'], step=manifest['step'], vocoder=manifest.get('vocoder'),
                       data_dir=manifest['data_dir'], words=words,
                       beam_size=args.beam_size, wer={k: r[0] for k, r in rates.items()},
                       cer={k: r[1] for k, r in rates.items()},
                       transcripts={i: dict(reference_text=t, **{k: heard[k][i] for k in heard})
                                    for i, t in held_out.items()}), f, indent=1)


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    steps = parser.add_subparsers(dest='step', required=True)
    step = steps.add_parser('synthesize', help="write the WAVs of each kind (nanotrain's python)")
    step.add_argument('--ckpt', default='', help="a train_tts.py checkpoint; '' = the recordings and Griffin-Lim only")
    step.add_argument('--data_dir', default='', help="the corpus whose held-out split is scored; default: the "
                      "checkpoint's")
    step.add_argument('--val_fraction', type=float, default=0.0, help="its held-out share; default: the checkpoint's, "
                      "else train_tts.py's 0.05")
    step.add_argument('--held_out_dir', default='', help='score every utterance of this corpus instead (sentences '
                      'disjoint from the training corpus)')
    step.add_argument('--utterances', type=int, default=0, help='the first N held-out utterances; 0 = all')
    step.add_argument('--wav_dir', required=True)
    step.add_argument('--vocoder', default='', help="a HiFi-GAN generator file (config.json beside it): the 'vocoder' "
                      "kind and the model's speech; '' = the model speaks through Griffin-Lim")
    step.add_argument('--kinds', default='', help="e.g. 'model' (the recordings and the vocoders do not depend on "
                      "the checkpoint); '' = every kind the arguments allow")
    step.add_argument('--guidance', type=float, default=None, help="classifier-free guidance weight; default: the "
                      "checkpoint's")
    step.add_argument('--n_timesteps', type=int, default=None, help="Euler steps of the ODE; default: the checkpoint's")
    step.add_argument('--temperature', type=float, default=None, help="scale of the starting noise; default: the "
                      "checkpoint's")
    step.add_argument('--length_scale', type=float, default=None, help="> 1 speaks slower; default: the checkpoint's")
    step.add_argument('--seed', type=int, default=None, help="the starting noise's seed (another draws other speech "
                      "from the same model: how much a score owes to it); default: the checkpoint's")
    step = steps.add_parser('score', help='word and character error rates by Whisper (the ASR venv)')
    step.add_argument('--wav_dir', required=True)
    step.add_argument('--whisper', required=True, help='Whisper base in CTranslate2 layout (make_whisper_base.py)')
    step.add_argument('--beam_size', type=int, default=5)
    step.add_argument('--threads', type=int, default=1, help="CTranslate2's CPU threads")
    step.add_argument('--kinds', default='', help="e.g. 'model' (the others do not depend on the checkpoint); "
                      "'' = every kind synthesized")
    args = parser.parse_args()
    if args.step == 'synthesize' and not (args.ckpt or args.data_dir or args.held_out_dir):
        parser.error('synthesize needs --ckpt, --data_dir or --held_out_dir')
    if args.step == 'synthesize':
        synthesize(args)
    else:
        score(args)
