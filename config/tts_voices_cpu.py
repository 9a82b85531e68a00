# several voices on 2 CPU cores: Piper's "joe" (600 utterances) and 28 espeak-ng voice variants (100 each),
# rows id|speaker|text made by bench/make_voices_corpus.py (docs/tts.md, "Several voices"):
#   OMP_NUM_THREADS=1 python train_tts.py config/tts_voices_cpu.py --data_dir=../data/voices
# config/tts_natural_cpu.py's model and schedule, with a learned vector per voice and a clip encoder
# (sample_tts.py --speaker=NAME, --voice_clip=some.wav).
multi_speaker = True
voice_clips = True
text_frontend = 'phonemes'   # the transcripts' espeak-ng phonemes, made inside (tts/phonemes.py)

out_dir = 'out-tts-voices'
max_minutes = 0.0            # the run ends at max_iters (results do not depend on the machine's speed)
eval_interval = 500
log_interval = 25
val_fraction = 0.05          # 50 held-out utterances of the corpus for the losses and the final MCD-DTW
eval_utterances = 0
audio_samples = 3
dtype = 'float32'            # CPU bf16 autocast without native bf16 units was 9x slower here

frame_budget = 3000          # ~12 utterances per batch, 76 batches per epoch

enc_channels = 128
enc_layers = 3
enc_heads = 2
enc_ff_channels = 512
dp_channels = 128
dropout = 0.1
dec_channels = 128
dec_blocks = 1
dec_heads = 2

learning_rate = 1e-3         # as the espeak recipe (its alignment checks over 8 seeds)
align_prior_iters = 1000
max_iters = 5000             # at 2000 steps the held-out losses were still falling
lr_schedule = 'cosine'
warmup_iters = 100
lr_decay_iters = 5000
min_lr = 1e-4
