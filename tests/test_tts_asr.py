"""runs/tts_asr.py's text normalisation and error rates against values worked out by hand (the script's
`score` step needs faster-whisper and a Whisper model; these helpers need neither)."""

import json
import os
import subprocess
import sys
import wave

import pytest

from runs.tts_asr import check_wav_dir, edit_distance, error_rates, normalize


def test_normalize_lowercases_strips_punctuation_and_collapses_spaces():
    assert normalize("Where should be graven, if that right were right,") == \
        "where should be graven if that right were right"
    assert normalize("I'll  find out\u2014your man;") == "ill find out your man"  # an em dash splits words
    assert normalize(" O'er-leap 'tis  GOOD-night!\n") == "oer leap tis good night"
    assert normalize("Twas 3 o'clock_") == "twas 3 oclock"  # digits stay: the corpora spell numbers out


def test_edit_distance_counts_substitutions_deletions_insertions():
    assert edit_distance("kitten", "sitting") == 3  # k->s, e->i, +g
    assert edit_distance("", "abc") == edit_distance("abc", "") == 3
    assert edit_distance("flaw", "lawn") == 2  # -f, +n
    assert edit_distance("the cat sat".split(), "the bat sat down".split()) == 2  # cat->bat, +down


def test_error_rates_sum_edits_over_the_corpus():
    pairs = [("The cat sat.", "the bat sat down"), ("Go, go!", "Go go")]
    # words: (2 + 0) / (3 + 2); characters: 'the cat sat' -> 'the bat sat down' is c->b and +' down' (6)
    # over 11 + 5 reference characters, spaces included
    assert error_rates(pairs) == (2 / 5, 6 / 16)
    assert error_rates([("Good night.", "good-night")]) == (0.0, 0.0)


def test_dnsmos_means_every_kind_over_the_held_out(tmp_path):
    """runs/tts_mos.py on a synthesize folder, with a stand-in speechmos whose scores are the clip's length
    in seconds (the real one runs in its own venv): each kind's means over its utterances, all in the JSON."""
    fake = tmp_path / 'fake' / 'speechmos'
    fake.mkdir(parents=True)
    (fake / '__init__.py').write_text('')
    (fake / 'dnsmos.py').write_text("def run(sample, sr):\n    s = len(sample) / sr\n"
                                    "    return dict(ovrl_mos=s, sig_mos=2 * s, bak_mos=3 * s, p808_mos=4 * s)\n")
    wav_dir = tmp_path / 'wavs'
    seconds = {'reference': [1.0, 2.0], 'model': [0.5, 1.5]}
    for kind, lengths in seconds.items():
        (wav_dir / kind).mkdir(parents=True)
        for utt_id, s in zip(('a', 'b'), lengths):
            with wave.open(str(wav_dir / kind / f'{utt_id}.wav'), 'wb') as w:
                w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
                w.writeframes(b'\0\0' * int(16000 * s))
    manifest = dict(ckpt=None, kinds=list(seconds), held_out={'a': 'x', 'b': 'y'})
    (wav_dir / 'manifest.json').write_text(json.dumps(manifest))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / 'fake'))
    p = subprocess.run([sys.executable, 'runs/tts_mos.py', f'--wav_dir={wav_dir}'], env=env, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    result = json.loads((wav_dir / 'dnsmos_reference_model.json').read_text())
    assert result['means']['reference'] == dict(ovrl_mos=1.5, sig_mos=3.0, bak_mos=4.5, p808_mos=6.0)
    assert result['means']['model']['ovrl_mos'] == 1.0 and result['utterances']['model']['b']['p808_mos'] == 6.0
    assert 'reference' in p.stdout and '1.50' in p.stdout


def test_synthesize_writes_only_into_a_folder_of_its_own(tmp_path):
    """--wav_dir: new, or holding only what the synthesize and score steps write (a later step adds its kinds, a
    killed one is run again); a corpus (its wavs/ and metadata.csv) or any other folder is refused."""
    check_wav_dir(str(tmp_path / 'new'))
    (tmp_path / 'ours' / 'model').mkdir(parents=True)
    (tmp_path / 'ours' / 'whisper_model.json').write_text('{}')
    check_wav_dir(str(tmp_path / 'ours'))
    (tmp_path / 'corpus' / 'wavs').mkdir(parents=True)
    (tmp_path / 'corpus' / 'metadata.csv').write_text('a|b|c\n')
    with pytest.raises(SystemExit, match='holds other files than these scripts write there'):
        check_wav_dir(str(tmp_path / 'corpus'))


def test_transcribe_decodes_a_looped_transcript_again_from_a_fixed_seed(monkeypatch):
    """A decoding loop (a hallucinated repeat that added 82 words to one floor's 807) is decoded again with
    Whisper's sampled fallback from seed 0; any other transcript is beam search's at temperature 0, decoded once.
    faster-whisper lives in its own venv: its compression ratio and ctranslate2's seed are stood in for here."""
    import types
    import zlib

    from runs.tts_asr import transcribe
    seeds = []
    monkeypatch.setitem(sys.modules, 'ctranslate2', types.SimpleNamespace(set_random_seed=seeds.append))
    ratio = types.SimpleNamespace(get_compression_ratio=lambda t: len(t.encode()) / len(zlib.compress(t.encode())))
    monkeypatch.setitem(sys.modules, 'faster_whisper', types.ModuleType('faster_whisper'))
    monkeypatch.setitem(sys.modules, 'faster_whisper.transcribe', ratio)

    class Whisper:
        def __init__(self, first):
            self.first, self.calls = first, []

        def transcribe(self, audio, **options):
            self.calls.append(options)
            text = self.first if options['temperature'] == 0.0 else 'So sweet is zealous contemplation.'
            return [types.SimpleNamespace(text=' ' + text)], None

    fine = Whisper('We are undone, lady, we are undone!')  # a real repeat compresses far less than 2.4x
    assert transcribe(fine, None, 5) == 'We are undone, lady, we are undone!'
    assert [c['temperature'] for c in fine.calls] == [0.0] and fine.calls[0]['beam_size'] == 5 and not seeds
    looped = Whisper("It's so sweet, " + "it's so sweet " * 30)
    assert transcribe(looped, None, 5) == 'So sweet is zealous contemplation.'
    assert [c['temperature'] for c in looped.calls] == [0.0, [0.2, 0.4, 0.6, 0.8, 1.0]] and seeds == [0]
    assert all(c['condition_on_previous_text'] is False and c['language'] == 'en' for c in looped.calls)
