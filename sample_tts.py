"""
Speak with a trained text-to-speech checkpoint (train_tts.py):
`python sample_tts.py --out_dir=out-tts-espeak --text="I am as well acquainted here." --wav=out.wav`;
`--vocoder=models/hifigan/generator_universal.pth.tar` speaks through HiFi-GAN instead of Griffin-Lim (docs/tts.md).
A model trained on phonemes (--text_frontend=phonemes, or a corpus spelled in them) is given plain text too: its
phonemes are made inside (tts/phonemes.py); IPA given is read as it is.
GPT checkpoints and published models generate text with sample.py instead.
--wav replaces an existing file only if it is a WAV sample_tts.py wrote (it names itself in each WAV's LIST/INFO
chunk, ISFT 'nanotrain sample_tts.py'): a recording, a corpus's WAV or any other file there is refused, untouched.
"""

import errno
import os
import shlex
import time

from configurator import (FOLDER, SEED, UserError, at_least, check_output_file, check_values, configure,
                          interval)
from run.checkpoint import load_checkpoint
from run.device import pick_device
from tts.data import MEL_SETTINGS, read_voice_clip, wav_software, write_wav
from tts.model import clip_voice, load_tts, synthesize
from tts.vocoder import load_vocoder, vocoder_name

SOFTWARE = 'nanotrain sample_tts.py'  # the mark of this script's WAVs (tts/data.py, write_wav)
# audio formats --wav is not: a WAV written under one of these names would not play as what it says
OTHER_AUDIO = {'.mp3': 'an MP3', '.flac': 'a FLAC', '.ogg': 'an Ogg', '.opus': 'an Opus', '.m4a': 'an M4A',
               '.aac': 'an AAC', '.aif': 'an AIFF', '.aiff': 'an AIFF', '.wma': 'a WMA', '.webm': 'a WebM'}

# -----------------------------------------------------------------------------
out_dir = 'out-tts'          # folder of the train_tts.py run to speak with
ckpt_name = 'ckpt.pt'        # 'ckpt.pt' (latest) or 'best.pt'
text = 'I will unfold some causes of your deaths.'  # what to say
wav = 'out.wav'              # where to write the 16-bit PCM WAV (an existing file only if sample_tts.py wrote it)
n_timesteps = 10             # Euler steps of the flow-matching ODE
tts_temperature = 0.667      # scale of the starting noise
length_scale = 1.0           # > 1 speaks slower
guidance = 0.0               # classifier-free guidance weight (models trained with cfg_drop > 0)
seed = 1337                  # random seed of the starting noise
speaker = ''                 # a multi-speaker model's voice, by name (a wrong one lists them)
voice_clip = ''              # or a WAV of a voice to speak in (a model trained with voice_clips=True)
vocoder = ''                 # a HiFi-GAN generator file, config.json beside it (docs/tts.md); '' = Griffin-Lim
device = 'auto'              # 'auto' (cuda, else mps, else cpu) | 'cpu' | 'cuda' | 'cuda:1' | 'mps'
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [
    (SEED, ('seed',)),
    (at_least(1), ('n_timesteps',)),
    # bounds far past any use (the defaults 0.667, 1.0, 0): beyond them the audio overflows or fills the memory
    (interval('[0, 10]'), ('tts_temperature',)),
    (interval('(0, 10]'), ('length_scale',)),
    (interval('[0, 100]'), ('guidance',)),
    (FOLDER, ('out_dir',)),
])

if not text.strip():
    raise UserError(f"text={text!r} is empty: give the words to speak, e.g. --text=\"I am as well acquainted "
                    f"here.\"")
ckpt_path = os.path.join(out_dir, ckpt_name)
if not os.path.isfile(ckpt_path):
    found = sorted(f for f in os.listdir(out_dir) if f.endswith('.pt')) if os.path.isdir(out_dir) else []
    problem = 'is a folder, not a checkpoint file' if os.path.isdir(ckpt_path) else 'does not exist'
    raise UserError(f"no model to speak with: {ckpt_path} {problem}. " + (
        f"{out_dir} holds {', '.join(found)}: pick one with --ckpt_name." if found else
        f"Train one there first (`python train_tts.py --out_dir={out_dir} --data_dir=<an LJSpeech-layout corpus>`), "
        f"or point --out_dir at a run's folder."))
stem, extension = os.path.splitext(wav)
if extension.lower() in OTHER_AUDIO:  # a WAV under that name would not play as what the name says
    raise UserError(f"wav={wav!r} names {OTHER_AUDIO[extension.lower()]} file, but sample_tts.py writes 16-bit PCM "
                    f"WAV: name it .wav (--wav={shlex.quote(stem + '.wav')}), and convert that if you need another "
                    f"format: `ffmpeg -i {shlex.quote(stem + '.wav')} {shlex.quote(wav)}` (nothing was written).")
# the one file --wav replaces: this script's own earlier output, by its mark
check_output_file(wav, 'wav', 'a WAV', lambda path: wav_software(path) == SOFTWARE,
                  reads=[ckpt_path, vocoder, voice_clip], others="a recording, a corpus's WAV or another program's")
if speaker and voice_clip:
    raise UserError(f"speaker={speaker!r} and voice_clip={voice_clip!r}: give one voice, a name or a clip.")
ckpt = load_checkpoint(ckpt_path, fix="speak with another checkpoint (--ckpt_name=best.pt, say)")
if ckpt.get('kind') == 'vocoder':  # the generator file beside it is what speaks through (loading.py says the same)
    raise UserError(f"{ckpt_path} is a train_vocoder.py run's checkpoint (a HiFi-GAN generator), not a "
                    f"text-to-speech model; speak through it: `python sample_tts.py "
                    f"--vocoder={os.path.join(out_dir, 'generator.pth.tar')} --out_dir=<a train_tts.py run>`.")
if ckpt.get('kind') in ('gpt', 'lora'):
    raise UserError(f"{ckpt_path} is a {ckpt['kind']!r} checkpoint, not a text-to-speech one (train_tts.py); "
                    f"generate text from it with `python sample.py --out_dir={out_dir}"
                    + (f" --ckpt_name={ckpt_name}" if ckpt_name != 'ckpt.pt' else '') + "`.")
if ckpt.get('kind') != 'tts' or not isinstance(ckpt.get('model_args'), dict) or 'model' not in ckpt:
    holds = f"its kind is {ckpt['kind']!r}" if 'kind' in ckpt else "it holds no 'kind'"
    raise UserError(f"{ckpt_path} is not a text-to-speech checkpoint ({holds}; train_tts.py writes kind 'tts', "
                    f"its model_args and weights). Point --out_dir at a train_tts.py run's folder, or --ckpt_name "
                    f"at its checkpoint.")
run_device = pick_device(device)
try:
    model = load_tts(ckpt, run_device)
except (TypeError, RuntimeError) as e:  # model_args that are no TTSConfig's, or weights of another shape
    detail = str(e).strip().split('\n')[-1].strip()[:200]
    raise UserError(f"{ckpt_path}: its model_args and its weights do not fit together ({detail}); the "
                    f"checkpoint was edited or is corrupt. Restore it from a backup, or speak with another "
                    f"(--ckpt_name=best.pt, say).") from None
broken = [name for name, t in model.state_dict().items() if t.is_floating_point() and not t.isfinite().all()]
if broken:  # they would speak NaN (Griffin-Lim's lstsq fails inside torch on it)
    raise UserError(f"the weights of {ckpt_path} are not finite ({broken[0]}"
                    f"{' and others' if len(broken) > 1 else ''}): it is the checkpoint of a run that diverged; "
                    f"speak with another (--ckpt_name=best.pt, say).")
if guidance and not model.config.cfg_drop:  # its unconditional flow, which guidance steers away from, is untrained
    raise UserError(f"guidance={guidance}: {ckpt_path} was trained with cfg_drop=0, never without its condition, "
                    f"so guidance has nothing to steer from; leave guidance at 0 (or train with --cfg_drop=0.2).")
vocode = load_vocoder(vocoder, run_device)


def finite_audio(log_mel):
    """vocode's audio of log_mel, refused unless finite: it would be written as a silent WAV."""
    audio = vocode(log_mel) if log_mel.isfinite().all() else None  # a NaN mel fails inside Griffin-Lim's lstsq
    if audio is None or not audio.isfinite().all():
        raise UserError(f"the synthesized audio is not finite (NaN or inf), so no WAV was written: the mel "
                        f"overflowed at tts_temperature={tts_temperature}, guidance={guidance}; lower "
                        f"tts_temperature (0.667 by default)" + (" and guidance (0 by default)" if guidance else "")
                        + ".")
    return audio


voice = clip_voice(model, read_voice_clip(voice_clip, MEL_SETTINGS['sample_rate'])) if voice_clip else None
t0 = time.time()
audio, _ = synthesize(model, text, n_timesteps=n_timesteps, temperature=tts_temperature,
                      length_scale=length_scale, guidance=guidance, seed=seed, vocode=finite_audio,
                      speaker=speaker, voice=voice)
try:  # through a temporary beside wav, renamed over it once whole (write_wav): a failure leaves wav as it was
    write_wav(wav, audio, MEL_SETTINGS['sample_rate'], software=SOFTWARE)
except OSError as e:
    cause = {errno.ENOSPC: 'the disk is full', errno.EDQUOT: 'your disk quota is used up',
             errno.EFBIG: 'it would be over the file size limit, `ulimit -f`'}.get(e.errno)
    raise UserError(f"wav={wav!r} could not be written ({e.strerror or e}{': ' + cause if cause else ''}); "
                    + (f"{wav} is as it was" if os.path.lexists(wav) else "nothing was written") + ". "
                    + ("Free some space or raise the limit, or point --wav at another disk, and run this again."
                       if cause else "Point --wav at a file in a folder you can write.")) from None
seconds = len(audio) / MEL_SETTINGS['sample_rate']
print(f"wrote {wav}: {seconds:.2f} s of audio through {vocoder_name(vocoder)}, real-time factor "
      f"{(time.time() - t0) / seconds:.3f}")
