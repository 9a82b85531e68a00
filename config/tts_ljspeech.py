# flow-matching TTS on LJSpeech-1.1 (13,100 utterances, 24 h; https://keithito.com/LJ-Speech-Dataset/),
# sized like Matcha-TTS for one GPU:
#   python train_tts.py config/tts_ljspeech.py --data_dir=/path/to/LJSpeech-1.1
# then: python sample_tts.py --out_dir=out-tts-ljspeech --text="Printing, in the only sense..." --wav=out.wav
# Any LJSpeech-layout corpus works (metadata.csv + wavs/); see config/tts_espeak_cpu.py for a CPU-sized run.

text_frontend = 'phonemes'   # as Matcha-TTS; on the Piper corpus phonemes halved Whisper's errors (docs/tts.md)
out_dir = 'out-tts-ljspeech'
eval_interval = 2000
log_interval = 50
val_fraction = 0.02          # ~260 held-out utterances
eval_utterances = 50         # final MCD-DTW on the first 50 of them (synthesis is per utterance)

frame_budget = 24000         # ~32 utterances of ~8 s per micro-batch
gradient_accumulation_steps = 1

# model: Matcha-TTS-like text encoder, smaller U-Net
enc_channels = 192
enc_layers = 6
enc_heads = 2
enc_ff_channels = 768
dp_channels = 256
dropout = 0.1
dec_channels = 256
dec_blocks = 2
dec_heads = 4
cfg_drop = 0.2               # train the unconditional flow too, so --guidance works at inference

learning_rate = 5e-4
max_iters = 141000           # the end of the third cosine cycle
lr_schedule = 'cosine_restarts'
warmup_iters = 1000
restart_iters = 20000
restart_mult = 2             # cycles of 20k, 40k, 80k steps after warmup: low lr at 21k, 61k, 141k
min_lr = 2e-5
grad_clip = 1.0
