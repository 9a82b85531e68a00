# HiFi-GAN fine-tuned on a natural-voice TTS model's own mels (config/tts_natural_cpu.py's, or its long
# recipe's), a lever of issue 56's curve (runs/RESULTS.md): ~1.2 hours on one thread, ~40 minutes on 2 cores
#   OMP_NUM_THREADS=1 python train_vocoder.py config/vocoder_natural_cpu.py --tts_ckpt=out-tts-natural-long/ckpt.pt \
#       --init_from=models/hifigan/generator_LJSpeech.pth.tar
out_dir = 'out-vocoder-natural'
batch_size = 4               # 2,000 segments of 8,192 samples in all
max_iters = 500
discriminator_divisor = 4    # quarter-width fresh discriminators: the release's widths cost 3.3x a segment
