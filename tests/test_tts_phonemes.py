"""tts/phonemes.py: plain English -> the phonemes Piper's own voice speaks (tests/fixtures/make_piper_phonemes.py
recorded them through PiperVoice.phonemize, in Piper's environment), and a corpus phonemized once, cached by its
texts and the front end's version."""

import json
import os
import unicodedata

import pytest

import tts.phonemes
from configurator import UserError
from tts.phonemes import frontend_version, phonemize, phonemize_corpus

FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'piper_phonemes.json')


def test_phonemes_are_the_ones_pipers_voice_speaks():
    """Numbers, abbreviations, quotes, dashes, stress, clause punctuation: what the voice's own front end makes
    (its NFD codepoints composed, as ours are; sentences joined by one space)."""
    with open(FIXTURE, encoding='utf-8') as f:
        fixture = json.load(f)
    assert fixture['piper_tts'] in frontend_version() and fixture['espeak_voice'] == tts.phonemes.VOICE
    for text, expected in fixture['lines'].items():
        assert phonemize(text) == ' '.join(unicodedata.normalize('NFC', expected).split()), text
    assert phonemize('I am as well acquainted here.') == 'aɪɐm æz wˈɛl ɐkwˈeɪntᵻd hˈɪɹ.'


def test_a_corpus_is_phonemized_once_per_texts_and_front_end(tmp_path, monkeypatch):
    texts = {'a': 'Good morning.', 'b': 'Fair is foul.'}
    first = phonemize_corpus(texts, str(tmp_path))
    assert first == {k: phonemize(v) for k, v in texts.items()} and len(os.listdir(tmp_path)) == 1
    monkeypatch.setattr(tts.phonemes, 'phonemize', lambda text: pytest.fail('read from the cache, not made'))
    assert phonemize_corpus(dict(texts), str(tmp_path)) == first
    monkeypatch.undo()
    phonemize_corpus(dict(texts, b='Foul is fair.'), str(tmp_path))  # another text: made again
    monkeypatch.setattr(tts.phonemes, 'frontend_version', lambda: 'espeak-ng of another build')
    phonemize_corpus(texts, str(tmp_path))  # another front end: made again
    assert len([f for f in os.listdir(tmp_path) if f.endswith('.json')]) == 3
    assert not [f for f in os.listdir(tmp_path) if f.endswith('.tmp')]
    monkeypatch.undo()
    for damage in ('{"a": ', '[1, 2]', '{"a": "x"}'):  # cut short, not the texts': made again (was a traceback)
        for cached in tmp_path.glob('phonemes-*.json'):
            cached.write_text(damage)
        assert phonemize_corpus(texts, str(tmp_path)) == first


def test_a_text_with_nothing_to_say_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"utterance 'x' has no phonemes: its text '\.\.\.'"):
        phonemize_corpus({'a': 'Yes.', 'x': '...'}, str(tmp_path))
    assert not os.listdir(tmp_path)
