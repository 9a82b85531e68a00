"""
Speaker similarity of a multi-speaker TTS model as papers report it: the cosine between Resemblyzer's speaker
embeddings (GE2E, its weights shipped inside the package) of the model's speech and each voice's held-out
recordings. Two steps in two environments, because resemblyzer is never a nanotrain dependency:

    OMP_NUM_THREADS=1 python runs/tts_voices.py synthesize --ckpt=out-tts-voices/ckpt.pt \
        --held_out_dir=data/voices-heldout --wav_dir=/tmp/tts_voices
    python -m venv resvenv && resvenv/bin/pip install torch resemblyzer 'setuptools<70'
    resvenv/bin/python runs/tts_voices.py score --wav_dir=/tmp/tts_voices

The held-out corpus (rows id|speaker|text, runs/make_voices_corpus.py) has sentences no voice trained on, read
by the training voices and by voices the model never heard. For each voice its first utterance is the clip
(sample_tts.py --voice_clip) and the rest are scored. `synthesize` writes 16 kHz WAVs: the recordings, the
model's speech by name (--speaker, training voices) and from the clip (--voice_clip, every voice).
`score` embeds them, averages each voice's recordings into its centroid and writes similarity.json: for every
voice and kind, the mean cosine of the utterances to the voice's own centroid and to the nearest other voice's
(the training voices', for an unseen voice), and whether the own voice is the nearer. The recordings'
row (each scored utterance against centroids without it) is the floor a model is judged against.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tts_asr import check_wav_dir, write_16k  # noqa: E402  (Resemblyzer's input rate is Whisper's, 16 kHz)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthesize(args):
    check_wav_dir(args.wav_dir)
    import torch
    sys.path.insert(0, ROOT)
    from tts.data import MEL_SETTINGS, read_metadata, read_speakers, read_wav
    from tts.model import clip_voice, load_tts, synthesize as speak
    from tts.vocoder import load_vocoder

    ckpt = torch.load(args.ckpt, map_location='cpu', weights_only=False)
    model = load_tts(ckpt)
    trained = set(model.config.speakers)
    c = ckpt['config']
    vocode = load_vocoder(args.vocoder)
    settings = (c['n_timesteps'], c['temperature'], c['length_scale'], c['guidance'], c['seed'], vocode)
    rate = MEL_SETTINGS['sample_rate']
    texts = dict(read_metadata(args.held_out_dir, multi_speaker=True))
    speaker_of = read_speakers(args.held_out_dir)
    voices = {}
    for utt_id, speaker in speaker_of.items():
        voices.setdefault(speaker, []).append(utt_id)
    manifest = dict(ckpt=os.path.abspath(args.ckpt), step=ckpt['iter_num'], trained=sorted(trained),
                    clips={}, scored={}, vocoder=os.path.abspath(args.vocoder) if args.vocoder else None)

    def write(kind, speaker, utt_id, wav):
        path = os.path.join(args.wav_dir, kind, speaker, utt_id + '.wav')
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_16k(path, wav, rate)

    for speaker, utt_ids in voices.items():
        utt_ids = utt_ids[:args.utterances + 1] if args.utterances else utt_ids
        clip_id, scored = utt_ids[0], utt_ids[1:]
        with torch.no_grad():
            voice = clip_voice(model, read_wav(os.path.join(args.held_out_dir, 'wavs', clip_id + '.wav'), rate)[0])
        manifest['clips'][speaker], manifest['scored'][speaker] = clip_id, scored
        for utt_id in scored:
            write('reference', speaker, utt_id, read_wav(os.path.join(args.held_out_dir, 'wavs', utt_id + '.wav'),
                                                         rate)[0])
            if speaker in trained:
                write('speaker', speaker, utt_id, speak(model, texts[utt_id], *settings, speaker=speaker)[0])
            write('clip', speaker, utt_id, speak(model, texts[utt_id], *settings, voice=voice)[0])
        print(f"{speaker}: {len(scored)} sentences{'' if speaker in trained else ' (unseen voice)'}", flush=True)
    with open(os.path.join(args.wav_dir, 'manifest.json'), 'w') as f:
        json.dump(manifest, f, indent=1)


def similarities(embed, scored, trained):
    """Rows of the similarity table from embed {(kind, voice): (n, d) unit vectors of its scored utterances}
    (kinds 'reference', 'speaker', 'clip'); scored: the voices; trained: those the model trained on. Each voice's
    centroid is the normalised mean of its recordings. A row: the mean cosine of a kind's utterances to their own
    voice's centroid (for the recordings, each against the centroid of the others: leave one out) and to the
    nearest training voice's other than their own."""
    import numpy as np

    def unit(v):
        return v / np.linalg.norm(v)
    centroid = {s: unit(embed['reference', s].mean(0)) for s in scored}
    rows = []
    for kind in ('reference', 'speaker', 'clip'):
        for voice in scored:
            if (kind, voice) not in embed:
                continue
            e = embed[kind, voice]
            own = (np.mean([e[i] @ unit(np.delete(e, i, 0).mean(0)) for i in range(len(e))]) if kind == 'reference'
                   else (e @ centroid[voice]).mean())
            other = {s: float((e @ centroid[s]).mean()) for s in scored if s != voice and s in trained}
            nearest = max(other, key=other.get)
            rows.append(dict(kind=kind, speaker=voice, seen=voice in trained, own=float(own), nearest_other=nearest,
                             other=other[nearest], closer=bool(own > other[nearest])))
    return rows


def table(rows):
    """The markdown summary of similarities' rows: per kind and seen/unseen voices, the mean cosines and how many
    voices are nearer their own."""
    lines = ['| speech | voices | own voice, mean cosine | nearest other voice | nearer its own |',
             '| --- | --- | --- | --- | --- |']
    for kind, label in (('reference', 'recordings'), ('speaker', 'model, --speaker'), ('clip', 'model, --voice_clip')):
        for seen in (True, False):
            r = [x for x in rows if x['kind'] == kind and x['seen'] == seen]
            if r:
                lines.append(f"| {label} | {'training' if seen else 'unseen'} ({len(r)}) | "
                             f"{sum(x['own'] for x in r) / len(r):.3f} | {sum(x['other'] for x in r) / len(r):.3f} | "
                             f"{sum(x['closer'] for x in r)}/{len(r)} |")
    return '\n'.join(lines)


def score(args):
    import numpy as np
    from resemblyzer import VoiceEncoder, preprocess_wav

    with open(os.path.join(args.wav_dir, 'manifest.json')) as f:
        manifest = json.load(f)
    encoder = VoiceEncoder('cpu')
    embed = {}
    for kind in ('reference', 'speaker', 'clip'):
        for voice, utt_ids in manifest['scored'].items():
            paths = [os.path.join(args.wav_dir, kind, voice, u + '.wav') for u in utt_ids]
            if all(os.path.exists(p) for p in paths):
                e = np.stack([encoder.embed_utterance(preprocess_wav(p)) for p in paths])
                embed[kind, voice] = e / np.linalg.norm(e, axis=1, keepdims=True)
    rows = similarities(embed, list(manifest['scored']), set(manifest['trained']))
    with open(os.path.join(args.wav_dir, 'similarity.json'), 'w') as f:
        json.dump(dict(manifest=manifest, rows=rows), f, indent=1)
    print(table(rows))
    for x in rows:
        if not x['closer']:
            print(f"  {x['kind']} {x['speaker']}: own {x['own']:.3f} <= {x['nearest_other']} {x['other']:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().split('\n\n')[0])
    steps = ap.add_subparsers(dest='step', required=True)
    step = steps.add_parser('synthesize', help="the recordings and the model's speech, 16 kHz WAVs (nanotrain's venv)")
    step.add_argument('--ckpt', required=True, help='a train_tts.py checkpoint of a multi_speaker=True run')
    step.add_argument('--held_out_dir', required=True, help="rows id|speaker|text (runs/make_voices_corpus.py's)")
    step.add_argument('--wav_dir', required=True)
    step.add_argument('--utterances', type=int, default=0, help='scored sentences per voice; 0 = all but the clip')
    step.add_argument('--vocoder', default='', help="a HiFi-GAN generator file; '' = Griffin-Lim")
    step = steps.add_parser('score', help='speaker similarity by Resemblyzer (its own venv)')
    step.add_argument('--wav_dir', required=True)
    args = ap.parse_args()
    synthesize(args) if args.step == 'synthesize' else score(args)


if __name__ == '__main__':
    main()
