"""
Naturalness of held-out speech as TTS papers report it without listeners: Microsoft's DNSMOS (P.835: speech
SIG, background BAK, overall OVRL; and the P.808 predictor), whose ONNX models ship inside the `speechmos`
package, never a nanotrain dependency: run it in its own venv on the 16 kHz WAVs `runs/tts_asr.py synthesize`
wrote (every kind: recordings, the reference mel through each vocoder, the model's speech).

    python -m venv ../mosvenv && ../mosvenv/bin/pip install speechmos librosa onnxruntime
    OMP_NUM_THREADS=1 ../mosvenv/bin/python runs/tts_mos.py --wav_dir=/tmp/tts_asr

Prints the mean of each score per kind and writes dnsmos_<kinds>.json (every utterance's scores) beside them.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tts_asr import read_16k  # noqa: E402  (the standard library only: no torch in this venv)

SCORES = ('ovrl_mos', 'sig_mos', 'bak_mos', 'p808_mos')

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--wav_dir', required=True, help="runs/tts_asr.py synthesize's output folder")
    parser.add_argument('--kinds', default='', help="e.g. 'model'; '' = every kind synthesized")
    args = parser.parse_args()
    from speechmos import dnsmos
    with open(os.path.join(args.wav_dir, 'manifest.json')) as f:
        manifest = json.load(f)
    kinds = args.kinds.split(',') if args.kinds else manifest['kinds']
    if set(kinds) - set(manifest['kinds']):
        raise SystemExit(f"--kinds={args.kinds}: {args.wav_dir} holds {','.join(manifest['kinds'])}")
    scores = {kind: {} for kind in kinds}
    for utt_id in manifest['held_out']:
        for kind in kinds:
            result = dnsmos.run(read_16k(os.path.join(args.wav_dir, kind, utt_id + '.wav')), sr=16000)
            scores[kind][utt_id] = {k: float(result[k]) for k in SCORES}
    means = {kind: {k: sum(s[k] for s in per.values()) / len(per) for k in SCORES} for kind, per in scores.items()}
    print(f"checkpoint {manifest['ckpt']}, vocoder {manifest.get('vocoder')}: {len(manifest['held_out'])} held-out "
          f"utterances; DNSMOS means")
    print(f"{'':<12} " + ' '.join(f"{k.split('_')[0].upper():>6}" for k in SCORES))
    for kind, m in means.items():
        print(f"{kind:<12} " + ' '.join(f"{m[k]:>6.2f}" for k in SCORES))
    with open(os.path.join(args.wav_dir, f"dnsmos_{'_'.join(kinds)}.json"), 'w') as f:
        json.dump(dict(ckpt=manifest['ckpt'], vocoder=manifest.get('vocoder'), means=means, utterances=scores), f,
                  indent=1)
