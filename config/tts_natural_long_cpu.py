# config/tts_natural_cpu.py trained twice as long, issue 56's steps lever (runs/RESULTS.md; 10,000 steps: ~2.5
# CPU-hours; ~1.9 hours on 2 cores, which train 1.3x one's frames a second; config/tts_natural_wide_cpu.py's
# width moved held-out WER further), given after it:
#   python train_tts.py config/tts_natural_cpu.py config/tts_natural_long_cpu.py --data_dir=../data/piper-ljspeech
# then its generator, config/vocoder_natural_cpu.py (--tts_ckpt=out-tts-natural-long/ckpt.pt)
out_dir = 'out-tts-natural-long'
max_iters = 10000
lr_decay_iters = 10000
