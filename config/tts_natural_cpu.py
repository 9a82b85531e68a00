# flow-matching TTS on a natural voice: 1,000 Piper "joe" utterances (42.5 min, 22050 Hz) read in
# espeak-ng phonemes, sized to finish within an hour on 2 CPU cores (docs/tts.md, "A natural voice"):
#   OMP_NUM_THREADS=1 python train_tts.py config/tts_natural_cpu.py --data_dir=../data/piper-ljspeech
# config/tts_espeak_cpu.py with two changes, each measured on held-out sentences (runs/RESULTS.md):
# phonemes instead of letters, and 2.5x the steps.
text_frontend = 'phonemes'   # the transcripts' espeak-ng phonemes, made inside (tts/phonemes.py)

out_dir = 'out-tts-natural'
max_minutes = 0.0            # the run ends at max_iters (results do not depend on the machine's speed)
eval_interval = 500
log_interval = 25
val_fraction = 0.05          # 50 held-out utterances of the corpus for the losses and the final MCD-DTW
eval_utterances = 0
audio_samples = 3
dtype = 'float32'            # CPU bf16 autocast without native bf16 units was 9x slower here

frame_budget = 3000          # ~12 utterances per batch, 76 batches per epoch

# the espeak recipe's model: 3.0M parameters (encoder 1.6M, duration predictor 0.1M, U-Net 1.3M)
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
