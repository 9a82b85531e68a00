"""runs/tts_voices.py's similarity table against cosines worked out by hand on made-up speaker embeddings (the
scorer itself, Resemblyzer, lives in its own venv; tests/test_tts.py runs the synthesis step)."""
import numpy as np
import pytest

from runs.tts_voices import similarities, table


def unit(*v):
    v = np.array(v, dtype=float)
    return v / np.linalg.norm(v)


def test_similarities_compare_each_voice_with_its_own_and_the_nearest_other():
    a, b, c = unit(1, 0, 0), unit(0, 1, 0), unit(0, 0, 1)
    embed = {('reference', 'A'): np.stack([a, unit(1, 0.2, 0)]), ('reference', 'B'): np.stack([b, b]),
             ('reference', 'U'): np.stack([c, unit(0.1, 0, 1)]),
             ('speaker', 'A'): np.stack([unit(1, 0.5, 0)]),   # nearer A
             ('speaker', 'B'): np.stack([unit(1, 0.1, 0)]),   # B's speech that sounds like A
             ('clip', 'U'): np.stack([unit(0.3, 0, 1)])}      # an unseen voice, scored against A and B only
    rows = {(r['kind'], r['speaker']): r for r in similarities(embed, ['A', 'B', 'U'], {'A', 'B'})}
    centroid_a = unit(*(a + unit(1, 0.2, 0)))
    # the recordings: each utterance against the centroid of its voice's other utterances (leave one out)
    assert rows['reference', 'A']['own'] == pytest.approx((a @ unit(1, 0.2, 0) + unit(1, 0.2, 0) @ a) / 2)
    assert rows['reference', 'B']['own'] == pytest.approx(1.0)
    r = rows['speaker', 'A']
    assert r['own'] == pytest.approx(unit(1, 0.5, 0) @ centroid_a) and r['nearest_other'] == 'B'
    assert r['other'] == pytest.approx(unit(1, 0.5, 0) @ b) and r['closer'] and r['seen']
    r = rows['speaker', 'B']
    assert r['nearest_other'] == 'A' and not r['closer']
    r = rows['clip', 'U']
    centroid_u = unit(*(c + unit(0.1, 0, 1)))
    assert not r['seen'] and r['nearest_other'] == 'A' and r['closer']
    assert r['own'] == pytest.approx(unit(0.3, 0, 1) @ centroid_u)
    assert r['other'] == pytest.approx(unit(0.3, 0, 1) @ centroid_a)
    assert ('speaker', 'U') not in rows  # an unseen voice speaks only from its clip
    lines = table(list(rows.values())).split('\n')
    assert lines[2].startswith('| recordings | training (2) |') and lines[2].endswith('| 2/2 |')
    assert '| model, --speaker | training (2) |' in lines[4] and lines[4].endswith('| 1/2 |')
    assert lines[5].startswith('| model, --voice_clip | unseen (1) |') and lines[5].endswith('| 1/1 |')


def test_the_voices_corpus_keeps_held_out_sentences_apart(tmp_path):
    """runs/make_voices_corpus.py: joe's rows and each espeak-ng voice's own sentences in the training corpus,
    the held-out sentences read by every voice (unseen ones too) and never trained on, each voice at one speed.
    espeak-ng is faked: a script on PATH that writes a silent WAV and logs its arguments."""
    import json
    import os
    import subprocess
    import sys
    import wave
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fake = tmp_path / 'bin' / 'espeak-ng'
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys, wave\na = sys.argv[1:]\n"
                    f"open({str(tmp_path / 'calls.jsonl')!r}, 'a').write(json.dumps(a) + '\\n')\n"
                    "w = wave.open(a[a.index('-w') + 1], 'wb'); w.setnchannels(1); w.setsampwidth(2)\n"
                    "w.setframerate(22050); w.writeframes(bytes(4410)); w.close()\n")
    fake.chmod(0o755)
    for name, n in (('joe', 3), ('joe-held', 2)):
        (tmp_path / name / 'wavs').mkdir(parents=True)
        rows = [f'{name[:3].upper()}{i}|Joe says line {name} number {i}, clearly.' for i in range(n)]
        (tmp_path / name / 'metadata.csv').write_text('\n'.join(rows) + '\n')
        for r in rows:
            with wave.open(str(tmp_path / name / 'wavs' / f"{r.split('|')[0]}.wav"), 'wb') as w:
                w.setnchannels(1), w.setsampwidth(2), w.setframerate(22050), w.writeframes(bytes(100))
    source = tmp_path / 'source.txt'
    source.write_text('\n'.join(f'This is a usable sentence for the voices, number {"x" * k}.' for k in range(1, 12)))
    out = tmp_path / 'voices'
    subprocess.run([sys.executable, 'runs/make_voices_corpus.py', f'--joe_dir={tmp_path / "joe"}',
                    f'--joe_held_out_dir={tmp_path / "joe-held"}', f'--source={source}', f'--out={out}',
                    '--voices=a,b', '--unseen_voices=c', '--utterances=3', '--joe_utterances=2', '--held_out=2'],
                   cwd=root, check=True, capture_output=True, env=dict(os.environ, PATH=f"{fake.parent}:"
                                                                       f"{os.environ['PATH']}"))
    train = [r.split('|') for r in (out / 'metadata.csv').read_text().splitlines()]
    held = [r.split('|') for r in (tmp_path / 'voices-heldout' / 'metadata.csv').read_text().splitlines()]
    assert [s for _, s, _ in train] == ['joe'] * 2 + ['a'] * 3 + ['b'] * 3
    assert [s for _, s, _ in held] == ['joe'] * 2 + ['a'] * 2 + ['b'] * 2 + ['c'] * 2
    assert not {t for _, _, t in train} & {t for _, _, t in held}  # no held-out sentence is trained on
    assert len({t for _, s, t in train if s != 'joe'}) == 6  # each voice its own sentences
    for folder, rows in ((out, train), (tmp_path / 'voices-heldout', held)):
        assert sorted(os.listdir(folder / 'wavs')) == sorted(f'{i}.wav' for i, _, _ in rows)
    calls = [json.loads(line) for line in (tmp_path / 'calls.jsonl').read_text().splitlines()]
    speeds = {}
    for a in calls:  # espeak-ng -v en-us+VOICE -s SPEED -w PATH TEXT
        speeds.setdefault(a[1], set()).add(a[3])
    assert set(speeds) == {'en-us+a', 'en-us+b', 'en-us+c'} and all(len(s) == 1 for s in speeds.values())
