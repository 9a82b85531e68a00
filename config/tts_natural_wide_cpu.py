# issue 56's recipe: config/tts_natural_cpu.py with Matcha-TTS's encoder widths and train_tts.py's default
# decoder (11.9M parameters against 3.0M), the same 5,000 steps (~2.5 hours on one idle thread). Three seeds:
# held-out WER 1.08x the recordings' through HiFi-GAN LJSpeech, DNSMOS OVRL 3.01 (README, docs/tts.md):
#   python train_tts.py config/tts_natural_cpu.py config/tts_natural_wide_cpu.py --data_dir=...
out_dir = 'out-tts-natural-wide'
enc_channels = 192
enc_layers = 4
enc_ff_channels = 768
dp_channels = 256
dec_channels = 256
dec_blocks = 2
