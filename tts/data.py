"""
TTS data: LJSpeech-layout corpora, WAV I/O with the standard library, log-mel features,
character front end, held-out split and a length-bucketed frame-budget batch sampler.
"""
import hashlib
import io
import math
import os
import random
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import wave

import numpy as np
import torch
import torchaudio
from tqdm import tqdm

if __name__ == '__main__' and not __package__:  # run by path: the modules are a folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configurator import UserError, require_writable_folder  # noqa: E402

# -----------------------------------------------------------------------------
# WAV I/O (torchaudio.load/save need FFmpeg, the `wave` module needs nothing)

def to_pcm16(path):
    """A shell command that converts the audio file path to a 16-bit PCM WAV under the same name."""
    path = os.fspath(path)
    converted = shlex.quote(os.path.splitext(path)[0] + '.pcm16.wav')
    return f"`ffmpeg -i {shlex.quote(path)} -acodec pcm_s16le {converted} && mv {converted} {shlex.quote(path)}`"


def read_wav(path, sample_rate=None):
    """16-bit PCM WAV -> (float32 mono tensor in [-1, 1], sample_rate). Stereo is averaged;
    with sample_rate given, other rates are resampled to it."""
    try:
        with wave.open(os.fspath(path), 'rb') as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except FileNotFoundError:
        raise UserError(f"{path}: file not found")
    except OSError as e:  # a folder, a file without read permission
        raise UserError(f"{path}: cannot be read ({e.strerror or e}); point at a readable WAV file")
    except (EOFError, wave.Error) as e:
        if isinstance(e, EOFError) or 'chunk missing' in str(e):  # not all there: no converter fixes that
            raise UserError(f"{path}: the WAV is empty or cut short ({os.path.getsize(path)} bytes, its header "
                            f"incomplete); re-export or remove it")
        raise UserError(f"{path}: unreadable WAV ({e}); convert it to 16-bit PCM in place, e.g. {to_pcm16(path)}")
    if width != 2:
        raise UserError(f"{path}: {8 * width}-bit samples; only 16-bit PCM is supported, convert it in place, "
                        f"e.g. {to_pcm16(path)}")
    if len(frames) % (2 * channels):
        raise UserError(f"{path}: the WAV is cut short (its last sample is incomplete); re-export or remove it")
    audio = torch.from_numpy(np.frombuffer(frames, dtype='<i2').astype(np.float32) / 32768.0)
    audio = audio.view(-1, channels).mean(dim=1)
    if sample_rate is not None and rate != sample_rate:
        audio = torchaudio.functional.resample(audio, rate, sample_rate)
        rate = sample_rate
    return audio, rate


SILENCE_DBFS = -60  # a clip whose loudest sample is below this holds no speech (16-bit dither is -90)


def read_voice_clip(path, sample_rate):
    """A clip of the voice to speak in (sample_tts.py --voice_clip), as read_wav reads it; a silent one is a UserError
    naming it: the clip encoder would still turn silence into some voice, and the model speak in it."""
    audio, _ = read_wav(path, sample_rate)
    peak = audio.abs().max().item() if len(audio) else 1.0  # an empty clip: clip_voice says it is too short
    if peak < 10 ** (SILENCE_DBFS / 20):
        level = 'every sample is 0' if peak == 0 else f'its loudest sample is {20 * math.log10(peak):.0f} dBFS'
        raise UserError(f"voice_clip={path} is silent ({level}; speech peaks near 0 dBFS, below {SILENCE_DBFS} is "
                        f"silence): there is no voice in it to speak in. Give a few seconds of the voice's speech.")
    return audio


def write_wav(path, audio, sample_rate, software=''):
    """float waveform in [-1, 1] (clipped) -> 16-bit PCM mono WAV; read_wav inverts it to 1/65536. software: what
    wrote it, in a LIST/INFO chunk's ISFT entry after the samples (as ffmpeg names itself; players skip it):
    sample_tts.py marks its WAVs so, and replaces no other (wav_software). Written to a temporary beside path and
    renamed over it once whole: a write that fails (a full disk, ulimit -f) raises its OSError and leaves path as
    it was, with no partial file."""
    pcm = (audio.detach().float().cpu() * 32768).round().clamp(-32768, 32767).to(torch.int16).numpy()
    data = io.BytesIO()  # the whole file made in memory first: a failed write is one write's, cleaned up below
    with wave.open(data, 'wb') as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.astype('<i2').tobytes())
    if software:
        text = software.encode() + b'\0'  # a RIFF string ends with a NUL; a chunk is padded to even length
        info = b'INFO' + b'ISFT' + struct.pack('<I', len(text)) + text + b'\0' * (len(text) % 2)
        data.seek(0, os.SEEK_END)  # 16-bit samples: the data chunk ends at an even offset
        data.write(b'LIST' + struct.pack('<I', len(info)) + info)
        size = data.tell() - 8
        data.seek(4)
        data.write(struct.pack('<I', size))
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f'.{name}.{os.urandom(4).hex()}.tmp')
    try:
        # os.open's mode, as open()'s, is masked by the umask: the WAV gets a new file's usual permissions
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), 'wb') as f:
            f.write(data.getbuffer())
        os.replace(temporary, path)
    except BaseException:  # a Ctrl-C too: no temporary left behind
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise


def wav_software(path):
    """The ISFT entry (the software that wrote it) of a WAV file's LIST/INFO chunk: '' if it has none or is not a
    WAV. Reads the chunk headers only, whatever the length of the audio."""
    try:
        with open(path, 'rb') as f:
            header = f.read(12)
            if header[:4] != b'RIFF' or header[8:] != b'WAVE':
                return ''
            while len(chunk := f.read(8)) == 8:
                name, size = chunk[:4], struct.unpack('<I', chunk[4:])[0]
                if name != b'LIST':
                    f.seek(size + size % 2, os.SEEK_CUR)
                    continue
                body = f.read(size + size % 2)
                at = 4
                while body[:4] == b'INFO' and at + 8 <= len(body):
                    entry, length = body[at:at + 4], struct.unpack('<I', body[at + 4:at + 8])[0]
                    if entry == b'ISFT':
                        return body[at + 8:at + 8 + length].split(b'\0')[0].decode('utf-8', 'replace')
                    at += 8 + length + length % 2
    except OSError:
        pass
    return ''

# -----------------------------------------------------------------------------
# log-mel features

MEL_SETTINGS = dict(sample_rate=22050, n_fft=1024, win_length=1024, hop_length=256, n_mels=80,
                    f_min=0.0, f_max=8000.0)


class MelExtractor:
    """waveform <-> log-mel (80, T) with the HiFi-GAN/Matcha settings; power=1 magnitudes,
    slaney mel scale and norm, natural log of clamp(1e-5). The inverse uses least squares
    (InverseMelScale) and Griffin-Lim phase reconstruction: intelligible, not vocoder quality."""

    def __init__(self, sample_rate=22050, n_fft=1024, win_length=1024, hop_length=256, n_mels=80,
                 f_min=0.0, f_max=8000.0, griffin_lim_iters=32):
        self.sample_rate, self.hop_length = sample_rate, hop_length
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate, n_fft=n_fft, win_length=win_length, hop_length=hop_length,
            f_min=f_min, f_max=f_max, n_mels=n_mels, power=1.0, norm='slaney', mel_scale='slaney')
        self.inverse_mel = torchaudio.transforms.InverseMelScale(
            n_stft=n_fft // 2 + 1, n_mels=n_mels, sample_rate=sample_rate, f_min=f_min,
            f_max=f_max, norm='slaney', mel_scale='slaney')
        self.griffin_lim = torchaudio.transforms.GriffinLim(
            n_fft=n_fft, win_length=win_length, hop_length=hop_length, power=1.0,
            # zero initial phase: deterministic, no RNG used
            n_iter=griffin_lim_iters, rand_init=False)

    def __call__(self, audio):
        return torch.log(self.mel(audio).clamp(min=1e-5))

    def to_waveform(self, log_mel):
        magnitude = self.inverse_mel(log_mel.float().cpu().exp()).clamp(min=0)
        return self.griffin_lim(magnitude)

# -----------------------------------------------------------------------------
# text front end: characters of the normalised text; ids 0 = padding, 1 = blank

PAD_ID, BLANK_ID = 0, 1


def normalize_text(text):
    # lowercase and collapse whitespace; numbers and abbreviations are left as they are
    return re.sub(r'\s+', ' ', text.lower()).strip()


def build_symbols(texts):
    return ''.join(sorted(set(''.join(normalize_text(t) for t in texts))))


IPA_MARKS = set('ˈˌːəɪʊæɑɔɛɜʌŋθðʃʒɹɡɐᵻ')  # in every English line espeak-ng phonemizes, in no spelled one


def reads_phonemes(symbols):
    """Whether a model's vocabulary is espeak-ng phonemes (text_frontend='phonemes', or a corpus spelled in them)."""
    return len(IPA_MARKS & set(symbols)) >= 3


def encode_text(text, symbols, add_blank=True):
    """text -> list of ids. Characters not in `symbols` are dropped (returned second) so that
    inference on new text works; with add_blank a blank id is put between and around characters
    (Glow-TTS), which gives the aligner a place for pauses and transitions."""
    index = {c: i + 2 for i, c in enumerate(symbols)}
    chars = normalize_text(text)
    ids = [index[c] for c in chars if c in index]
    unknown = sorted(set(c for c in chars if c not in index))
    if add_blank:
        with_blanks = [BLANK_ID] * (2 * len(ids) + 1)
        with_blanks[1::2] = ids
        ids = with_blanks
    return ids, unknown

# -----------------------------------------------------------------------------
# LJSpeech layout: metadata.csv (id|raw text|normalized text) and wavs/<id>.wav

def read_metadata(data_dir, multi_speaker=False):
    """-> list of (id, text) using the normalized column (the raw one if there are two). UTF-8, a BOM
    allowed; each id once, a plain file name. multi_speaker: the rows are id|speaker|text (read_speakers)."""
    path = os.path.join(data_dir, 'metadata.csv')
    if not os.path.isfile(path):
        raise UserError(f"{path}: not found; data_dir must be an LJSpeech-layout folder with "
                        f"metadata.csv (id|raw text|normalized text) and wavs/<id>.wav")
    rows, first_line = [], {}
    with open(path, 'rb') as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode('utf-8-sig' if line_no == 1 else 'utf-8').rstrip('\r\n')
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start}); save the file as "
                                f"UTF-8") from None
            if not line.strip():
                continue
            fields = line.split('|')
            if multi_speaker and len(fields) != 3:
                raise UserError(f"{path}:{line_no}: multi_speaker=True reads rows 'id|speaker|text', got {len(fields)} "
                                f"fields in {line[:60]!r}; " + (
                                    "a speaker's name and a transcript may not contain '|': rename the speaker or "
                                    "take the '|' out of the text" if len(fields) > 3 else
                                    "give every row its speaker, or train one voice (multi_speaker=False)"))
            if not 2 <= len(fields) <= 3:
                raise UserError(f"{path}:{line_no}: expected 'id|raw text|normalized text' (or 'id|text'), got "
                                f"{len(fields)} fields in {line[:60]!r}; a transcript may not contain '|'")
            utt_id, text = fields[0].strip(), fields[-1]
            if utt_id in first_line:
                raise UserError(f"{path}:{line_no}: utterance {utt_id!r} is listed again (first on line "
                                f"{first_line[utt_id]}); remove one of the rows")
            first_line[utt_id] = line_no
            if not utt_id or utt_id != os.path.basename(utt_id) or utt_id.startswith('.'):
                raise UserError(f"{path}:{line_no}: utterance id {utt_id!r} must name a file in wavs/ "
                                f"(no folders); fix the row")
            if not normalize_text(text):
                raise UserError(f"{path}:{line_no}: utterance {utt_id!r} has an empty transcript; "
                                f"add its text or remove the row")
            wav_path = os.path.join(data_dir, 'wavs', utt_id + '.wav')
            if not os.path.isfile(wav_path):
                raise UserError(f"{path}:{line_no}: utterance {utt_id!r} has no audio file "
                                f"{wav_path}; add it or remove the row")
            rows.append((utt_id, text))
    if len(rows) < 2:
        raise UserError(f"{path}: {len(rows)} usable rows; need at least 2 (train and held-out)")
    return rows


def read_speakers(data_dir):
    """{utterance id: speaker name} of a multi-speaker corpus, whose metadata.csv rows are id|speaker|text
    (Matcha-TTS's VCTK filelists; read_metadata has checked the rows and reads the text)."""
    path = os.path.join(data_dir, 'metadata.csv')
    speakers = {}
    with open(path, encoding='utf-8-sig') as f:
        for line_no, line in enumerate(f, 1):
            fields = line.rstrip('\r\n').split('|')
            if not line.strip():
                continue
            if len(fields) != 3 or not fields[1].strip():
                raise UserError(f"{path}:{line_no}: multi_speaker=True reads rows 'id|speaker|text', got "
                                f"{line.strip()[:60]!r}; give every row its speaker (a multi-speaker model reads the "
                                f"corpus it was trained on), or train one voice (train_tts.py --multi_speaker=False).")
            speakers[fields[0].strip()] = fields[1].strip()
    if len(speakers) > 1 and len(set(speakers.values())) == len(speakers):
        names = sorted(set(speakers.values()))[:2]
        raise UserError(f"{path}: every row names a speaker of its own ({names[0]!r}, {names[1]!r}, ...): "
                        f"multi_speaker=True reads rows 'id|speaker|text', and these read like LJSpeech's "
                        f"'id|text|normalized text'. Train one voice (leave multi_speaker out), or put each row's "
                        f"speaker in its second field.")
    return speakers


def split_ids(ids, val_fraction):
    """Deterministic held-out split by id: utterances ordered by a hash of their id, the first
    max(1, round(n * val_fraction)) are held out. Adding utterances moves few others."""
    ranked = sorted(ids, key=lambda i: hashlib.md5(i.encode()).hexdigest())
    n_val = max(1, round(len(ids) * val_fraction))
    if n_val >= len(ids):
        raise UserError(f"val_fraction={val_fraction} holds out {n_val} of the corpus's {len(ids)} utterances, "
                        f"which leaves none to train on; lower val_fraction (or add utterances).")
    held = set(ranked[:n_val])
    return [i for i in ids if i not in held], [i for i in ids if i in held]


def corpus_hash(data_dir, ids):
    """sha256 of a corpus as a run reads it: metadata.csv's bytes and each recording's size (a copy or a move of
    the folder is the same corpus; other transcripts, other or resampled recordings make another)."""
    digest = hashlib.sha256()
    with open(os.path.join(data_dir, 'metadata.csv'), 'rb') as f:
        digest.update(f.read())
    for utt_id in ids:
        digest.update(f"{utt_id}:{os.path.getsize(os.path.join(data_dir, 'wavs', utt_id + '.wav'))}\n".encode())
    return digest.hexdigest()


def check_same_corpus(ckpt, digest, data_dir, out_dir):
    """A continued run (ckpt, or None for a new one) reads the corpus it began with (digest: corpus_hash's); one
    whose checkpoint predates the hash is continued, as before."""
    if ckpt is not None and ckpt.get('corpus_hash', digest) != digest:
        raise UserError(f"{data_dir} is not the corpus the run in {out_dir} began with (data_dir="
                        f"{ckpt['config'].get('data_dir')!r} then): its metadata.csv or recordings differ, and "
                        f"resuming would go on with other utterances. Restore data_dir, or start a new run (another "
                        f"out_dir, or --resume=False to replace it).")


class LJSpeechDataset:
    """Text ids and log-mels of one split. Features are computed once per utterance and cached
    as .pt files in cache_dir (keyed by the corpus folder, the feature settings and each WAV's size
    and modification time, so an edited file is read again), then kept in memory. An utterance
    needs at least one mel frame per text token (the alignment gives each token a frame)."""

    def __init__(self, data_dir, ids, texts, symbols, cache_dir, add_blank=True, progress=False, speakers=None):
        self.ids = ids
        # each utterance's speaker index (speakers: {id: index} of a multi-speaker corpus; else all 0)
        self.speakers = torch.tensor([speakers[i] if speakers else 0 for i in ids], dtype=torch.long)
        extractor = MelExtractor(**MEL_SETTINGS)
        key = repr((os.path.abspath(data_dir), sorted(MEL_SETTINGS.items())))
        cache_dir = os.path.join(cache_dir, hashlib.md5(key.encode()).hexdigest()[:8])
        os.makedirs(cache_dir, exist_ok=True)
        self.text_ids, self.mels = [], []
        for utt_id in tqdm(ids, desc='mel features', dynamic_ncols=True, disable=not progress):
            wav_path = os.path.join(data_dir, 'wavs', utt_id + '.wav')
            stat = os.stat(wav_path)
            cached = os.path.join(cache_dir, f'{utt_id}-{stat.st_size}-{stat.st_mtime_ns}.pt')
            try:  # cached; a cache file damaged since (cut short, edited) is computed again, as a missing one
                mel = torch.load(cached, weights_only=True) if os.path.exists(cached) else None
                mel = mel if isinstance(mel, torch.Tensor) and mel.dim() == 2 else None
            except Exception:
                mel = None
            if mel is None:
                audio, _ = read_wav(wav_path, MEL_SETTINGS['sample_rate'])
                # the STFT's reflect padding needs more
                if len(audio) <= MEL_SETTINGS['n_fft'] // 2:
                    raise UserError(f"{wav_path}: only {len(audio)} samples of audio; too short for an "
                                    f"utterance, remove its row from metadata.csv")
                if not audio.any():  # a recording lost (zeroed): its transcript would align to silence
                    raise UserError(f"{wav_path}: every sample is 0, a recording with nothing in it; restore it, or "
                                    f"remove its row from metadata.csv")
                mel = extractor(audio)
                torch.save(mel, cached + '.tmp')
                os.replace(cached + '.tmp', cached)  # a killed run never leaves half a file
            text_ids = encode_text(texts[utt_id], symbols, add_blank)[0]
            if len(text_ids) > mel.shape[1]:
                raise UserError(f"utterance {utt_id!r}: {len(text_ids)} text tokens but only {mel.shape[1]} mel "
                                f"frames ({wav_path}); check that the transcript belongs to this audio, or "
                                f"remove the row from metadata.csv")
            self.mels.append(mel)
            self.text_ids.append(torch.tensor(text_ids))
        self.lengths = [m.shape[1] for m in self.mels]

    def __len__(self):
        return len(self.ids)

    def mel_stats(self):
        """mean and std of all log-mel values (scalars, as Matcha-TTS)."""
        frames = torch.cat(self.mels, dim=1)
        mean, std = frames.mean().item(), frames.std().item()
        if std == 0:
            raise UserError("every training utterance is silent (all log-mel values equal); check the WAV files")
        return mean, std

    def mean_mel(self):
        """(80,) average log-mel frame: the trivial baseline's 'spectrum'."""
        return torch.cat(self.mels, dim=1).mean(dim=1)

    def collate(self, indices, mel_mean, mel_std):
        """-> text ids (B, Tx), text lengths, normalised mels (B, 80, Ty), mel lengths, speaker indices."""
        texts = [self.text_ids[i] for i in indices]
        mels = [(self.mels[i] - mel_mean) / mel_std for i in indices]
        x_lengths = torch.tensor([len(t) for t in texts])
        y_lengths = torch.tensor([m.shape[1] for m in mels])
        x = torch.full((len(indices), int(x_lengths.max())), PAD_ID, dtype=torch.long)
        y = torch.zeros(len(indices), mels[0].shape[0], int(y_lengths.max()))
        for b, (t, m) in enumerate(zip(texts, mels)):
            x[b, :len(t)] = t
            y[b, :, :m.shape[1]] = m
        return x, x_lengths, y, y_lengths, self.speakers[list(indices)]


class FrameBudgetSampler:
    """Length-bucketed batches whose padded size (batch size x longest mel) stays within
    frame_budget frames. Every epoch: lengths jittered by a few percent (so batches differ),
    sorted, cut greedily into batches, batches shuffled; then trimmed to a multiple of
    world_size and dealt round-robin, so every rank gets the same number of batches (an
    uneven count would hang DDP at the last all-reduce). Deterministic in (seed, epoch);
    state_dict() is the position, for bit-exact resume."""

    def __init__(self, lengths, frame_budget, seed=0, rank=0, world_size=1):
        too_long = max(lengths)
        if too_long > frame_budget:
            raise UserError(f"an utterance has {too_long} mel frames, more than frame_budget="
                            f"{frame_budget}; raise --frame_budget (or drop long utterances)")
        self.lengths, self.frame_budget, self.seed = lengths, frame_budget, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self.batches = self.epoch_batches(0)

    def epoch_batches(self, epoch):
        rng = random.Random(self.seed * 100003 + epoch)
        jittered = [n * rng.uniform(0.95, 1.05) for n in self.lengths]
        order = sorted(range(len(self.lengths)), key=lambda i: jittered[i])
        batches, batch, longest = [], [], 0
        for i in order:
            longest_if_added = max(longest, self.lengths[i])
            if batch and longest_if_added * (len(batch) + 1) > self.frame_budget:
                batches.append(batch)
                batch, longest_if_added = [], self.lengths[i]
            batch.append(i)
            longest = longest_if_added
        batches.append(batch)
        rng.shuffle(batches)
        usable = len(batches) // self.world_size * self.world_size
        if usable == 0:
            raise UserError(f"only {len(batches)} batches per epoch for {self.world_size} ranks; "
                            f"lower --frame_budget or use fewer processes")
        return batches[:usable][self.rank::self.world_size]

    def __len__(self):
        return len(self.batches)

    def next_batch(self):
        if self.position == len(self.batches):
            self.epoch, self.position = self.epoch + 1, 0
            self.batches = self.epoch_batches(self.epoch)
        batch = self.batches[self.position]
        self.position += 1
        return batch

    def next_batches(self, n, within_epoch=False):
        """The next n batches; within_epoch: fewer where the epoch has fewer left (a run counted in epochs)."""
        batches = [self.next_batch()]
        while len(batches) < n and not (within_epoch and self.position == len(self.batches)):
            batches.append(self.next_batch())
        return batches

    def epoch_steps(self, n, epochs):
        """The steps of n batches (an epoch's last: those left) in each of the first `epochs` epochs."""
        return [-(-len(self.epoch_batches(epoch)) // n) for epoch in range(epochs)]

    def state_dict(self):
        return {'epoch': self.epoch, 'position': self.position, 'frame_budget': self.frame_budget,
                'lengths': self.lengths}

    def load_state_dict(self, state):
        # older: unknown
        began_with = state.get('frame_budget', self.frame_budget), state.get('lengths', self.lengths)
        if began_with != (self.frame_budget, self.lengths):
            raise UserError(f"the run being resumed batched other utterances or frame_budget={began_with[0]}; "
                            f"resume with its frame_budget and data, or start a new run: another --out_dir (with "
                            f"--init_from=<its ckpt.pt> to start from its weights), or --resume=False to replace it")
        self.epoch, self.position = state['epoch'], state['position']
        self.batches = self.epoch_batches(self.epoch)


def eval_batches(lengths, frame_budget):
    """Fixed held-out batches: sorted by length, cut greedily under the frame budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, batch = [], []
    for i in order:
        if batch and lengths[i] * (len(batch) + 1) > frame_budget:
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + [batch]

# -----------------------------------------------------------------------------
# optional: make an LJSpeech-layout corpus with espeak-ng (no 2.6 GB download)

def make_espeak_corpus(text_file, out_dir, voice='en-us', speed=175, max_utterances=None):
    """Speak each non-empty line of text_file with espeak-ng into out_dir/wavs/ESnnnn.wav
    (resampled to 22050 Hz) and write out_dir/metadata.csv. out_dir must be new or empty (a corpus there, its
    recordings and metadata.csv, is never written over); the corpus is made in a folder beside it and renamed
    into place at the end, so a failed or killed run leaves nothing."""
    if not out_dir.strip():  # renamed into place at the end, '' failed there, after all the work
        raise UserError("--out_dir='' names no folder: give the new folder to make the corpus in, e.g. "
                        "--out_dir=data/espeak.")
    if os.path.isdir(out_dir) and os.listdir(out_dir) or os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out_dir={out_dir} exists and is not an empty folder (a corpus's recordings and "
                        f"metadata.csv are never written over); give a new folder, or delete that one yourself if it "
                        f"can go.")
    if max_utterances is not None and max_utterances < 1:  # -1 took all lines but the last, 0 none
        raise UserError(f"--max_utterances={max_utterances} must be at least 1; leave it out to speak every line.")
    require_writable_folder(out_dir, '--out_dir', keep=False, fix="Point --out_dir at a new folder you can write, "
                                                                  "e.g. --out_dir=data/espeak (nothing was written).")
    if shutil.which('espeak-ng') is None:
        raise UserError("espeak-ng is not installed (e.g. `apt-get install espeak-ng`)")
    try:  # utf-8-sig: a byte order mark (Windows editors write one) is not part of the first line's text
        with open(text_file, encoding='utf-8-sig') as f:
            numbered = [(n, re.sub(r'\s+', ' ', line).strip()) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--text_file={text_file} cannot be read ({e}); give a UTF-8 text file, one sentence a "
                        f"line.") from None
    numbered = numbered[:max_utterances]
    if not numbered:
        raise UserError(f"--text_file={text_file} holds no text; give a UTF-8 text file, one sentence a line.")
    for n, line in numbered:
        if '|' in line:  # metadata.csv's field separator: the row would not read as id|text|text
            raise UserError(f"{text_file}:{n}: the line holds '|', which separates the fields of the corpus's "
                            f"metadata.csv (id|text|text), so train_tts.py would refuse it; write it without one "
                            f"(a comma, say) or remove the line (nothing was written).")
    parent = os.path.dirname(os.path.abspath(out_dir))
    staging = None
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(os.path.abspath(out_dir)) + '.',
                                   suffix='.tmp')
        os.makedirs(os.path.join(staging, 'wavs'))
        rows = []
        for k, (n, line) in enumerate(numbered):
            utt_id = f'ES{k:04d}'
            wav_path = os.path.join(staging, 'wavs', utt_id + '.wav')
            spoken = subprocess.run(['espeak-ng', '-v', voice, '-s', str(speed), '-w', wav_path, line],
                                    capture_output=True, text=True)
            if spoken.returncode:
                raise UserError(f"espeak-ng could not speak line {n} of {text_file} with voice {voice!r} "
                                f"({spoken.stderr.strip()[:200] or f'exit {spoken.returncode}'}); nothing was written.")
            audio, _ = read_wav(wav_path, MEL_SETTINGS['sample_rate'])
            write_wav(wav_path, audio, MEL_SETTINGS['sample_rate'])
            rows.append(f'{utt_id}|{line}|{line}')
        with open(os.path.join(staging, 'metadata.csv'), 'w', encoding='utf-8') as f:
            f.write('\n'.join(rows) + '\n')
        os.chmod(staging, 0o755)  # mkdtemp makes it 0700
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(staging, out_dir)
    except OSError as e:  # a full disk, a folder beside out_dir that cannot be written
        raise UserError(f"--out_dir={out_dir}: the corpus could not be written ({e.strerror or e}: "
                        f"{e.filename or parent}); nothing was written. Free some space, or point --out_dir at a "
                        f"new folder on a disk you can write.") from None
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir


if __name__ == '__main__':
    import argparse
    from configurator import install_excepthook
    install_excepthook()  # a UserError prints one line and exits 2
    parser = argparse.ArgumentParser(prog='python -m tts.data', description='speak each line of a text file into '
                                     'an LJSpeech-layout corpus with espeak-ng')
    parser.add_argument('--text_file', required=True)
    parser.add_argument('--out_dir', required=True)
    parser.add_argument('--voice', default='en-us')
    parser.add_argument('--speed', type=int, default=175, help='words per minute (espeak-ng default 175)')
    parser.add_argument('--max_utterances', type=int, default=None, help='speak the first N lines (default: all)')
    args = parser.parse_args()
    print(make_espeak_corpus(args.text_file, args.out_dir, args.voice, args.speed, args.max_utterances))
