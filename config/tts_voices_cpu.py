# several voices on 2 CPU cores: Piper's "joe" (600 utterances) and 28 espeak-ng voice variants (100 each),
# rows id|speaker|text made by runs/make_voices_corpus.py (docs/tts.md, "Several voices"). Given after
# config/tts_natural_cpu.py, whose model and schedule it keeps:
#   OMP_NUM_THREADS=1 python train_tts.py config/tts_natural_cpu.py config/tts_voices_cpu.py --data_dir=data/voices
# then sample_tts.py --out_dir=out-tts-voices --speaker=NAME (or --voice_clip=some.wav)
out_dir = 'out-tts-voices'
multi_speaker = True         # a learned vector per voice
voice_clips = True           # and a clip encoder that maps a few seconds of speech to one
