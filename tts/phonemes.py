"""
The phoneme front end: English text -> espeak-ng phonemes (IPA, stress marks and clause punctuation kept) exactly
as Piper phonemizes for its voices, through the espeak-ng that the piper-tts package bundles with its data (no
system package). A corpus's transcripts are phonemized once and cached, keyed by the texts and the front end's
version, so a model always reads what it was trained on.
"""
import functools
import hashlib
import importlib.metadata
import json
import os
import unicodedata

from tqdm import tqdm

from configurator import UserError

VOICE = 'en-us'                              # espeak-ng's voice (General American)
TEXT_FRONTENDS = ('characters', 'phonemes')  # what a TTS model reads: the transcript's letters, or its phonemes


@functools.cache
def _espeak():
    try:
        from piper.phonemize_espeak import EspeakPhonemizer
    except ImportError:
        raise UserError("the phoneme front end needs piper-tts (espeak-ng and its data inside): "
                        "`pip install -r requirements.txt` installs it.") from None
    return EspeakPhonemizer()


def frontend_version():
    """What the phonemes depend on: the espeak-ng build and data (piper-tts's version) and the voice."""
    return f"espeak-ng of piper-tts {importlib.metadata.version('piper-tts')}, voice {VOICE}"


def phonemize(text):
    """English text -> its phonemes: each sentence's as Piper makes them (clause punctuation and stress kept),
    sentences joined by a space, NFC-composed."""
    sentences = [''.join(codepoints).strip() for codepoints in _espeak().phonemize(VOICE, text)]
    return unicodedata.normalize('NFC', ' '.join(s for s in sentences if s)).replace('|', ' ')


def phonemize_corpus(texts, cache_dir):
    """{utterance id: text} -> {utterance id: phonemes}, read from cache_dir when the same texts were phonemized
    by the same front end before, else made (a few seconds per 10,000 sentences) and written there."""
    key = hashlib.sha256(json.dumps([frontend_version(), sorted(texts.items())]).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f'phonemes-{key}.json')
    try:  # a cache file damaged since (cut short, edited) is made again, as a missing one
        with open(path, encoding='utf-8') as f:
            cached = json.load(f)
        if isinstance(cached, dict) and cached.keys() == texts.keys():
            return cached
    except (OSError, ValueError, RecursionError):
        pass
    phonemes = {utt_id: phonemize(text) for utt_id, text in tqdm(texts.items(), desc='phonemizing',
                                                                  dynamic_ncols=True, leave=False)}
    silent = [utt_id for utt_id, p in phonemes.items() if not p.strip()]
    if silent:
        raise UserError(f"utterance {silent[0]!r} has no phonemes: its text {texts[silent[0]]!r} has nothing "
                        f"espeak-ng speaks ({len(silent)} such in metadata.csv); fix or remove those rows.")
    os.makedirs(cache_dir, exist_ok=True)
    temporary = f'{path}.{os.getpid()}.tmp'  # whole or not at all: every rank may write it at once
    with open(temporary, 'w', encoding='utf-8') as f:
        json.dump(phonemes, f, ensure_ascii=False)
    os.replace(temporary, path)
    return phonemes
