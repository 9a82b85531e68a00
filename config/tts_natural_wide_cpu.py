# issue 56's other lever: config/tts_natural_cpu.py with Matcha-TTS's encoder widths and train_tts.py's
# default decoder (11.9M parameters against 3.0M), the same 5,000 steps (~3 CPU-hours; one seed reached
# 1.06x the recordings' held-out WER through HiFi-GAN LJSpeech on its curve, runs/RESULTS.md), after it:
#   python train_tts.py config/tts_natural_cpu.py config/tts_natural_wide_cpu.py --data_dir=...
out_dir = 'out-tts-natural-wide'
enc_channels = 192
enc_layers = 4
enc_ff_channels = 768
dp_channels = 256
dec_channels = 256
dec_blocks = 2
