"""
nanotrain's and sentencepiece tokenizers as a Hugging Face tokenizer.json (a tokenizers.Tokenizer).

from_sentencepiece(model_bytes, tokenizer_config, special_tokens): a published folder's sentencepiece
tokenizer.model (Llama 2, Mistral 7B v0.1, TinyLlama kept without tokenizer.json) converted the way
transformers 5 converts it for LlamaTokenizer, so that it encodes token for token as transformers does.

write_tokenizer_files(tokenizer, out_folder): tokenizer.json and tokenizer_config.json of nanotrain's own
CharTokenizer, BPETokenizer or ChatTokenizer, so that transformers' AutoTokenizer (and hf/tokenizer.py)
encode as nanotrain does; export.py writes them into the Hugging Face folders it exports.
"""

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from configurator import UserError
from lm.tokenizer import CHAT_TEMPLATE_JINJA, BPETokenizer, CharTokenizer, ChatTokenizer

SPACE = '\u2581'  # '▁': sentencepiece's spelling of a space inside a piece
# sentencepiece's piece types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2  # sentencepiece's model types


# -----------------------------------------------------------------------------
# reading a sentencepiece model file (a protobuf message; protobuf itself is not a dependency)

def varint(data, i):
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


def proto_fields(data):
    """(field number, value) of one protobuf message's fields: an int or the raw bytes."""
    i = 0
    while i < len(data):
        key, i = varint(data, i)
        wire = key & 7
        if wire == 0:
            value, i = varint(data, i)
        elif wire == 2:
            size, i = varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire in (1, 5):  # fixed64, fixed32 (a piece's float score)
            size = 8 if wire == 1 else 4
            value, i = data[i:i + size], i + size
        else:
            raise ValueError(f"unknown protobuf wire type {wire}")
        yield key >> 3, value


def read_sentencepiece(model_bytes):
    """([(piece, type)] in id order, model type) of a sentencepiece ModelProto: pieces are field 1
    (piece 1, type 3, NORMAL when absent), trainer_spec field 2 (model_type 3, UNIGRAM when absent)."""
    pieces, model_type = [], UNIGRAM
    for field, value in proto_fields(model_bytes):
        if field == 1:
            piece = dict(proto_fields(value))
            pieces.append((piece[1].decode('utf-8'), piece.get(3, NORMAL)))
        elif field == 2:
            model_type = dict(proto_fields(value)).get(3, UNIGRAM)
    return pieces, model_type


def bpe_merges(pieces):
    """sentencepiece BPE joins two adjacent pieces into the highest-scoring normal piece they spell;
    a BPE model's normal pieces are in score order, so merges are ranked by the joined piece's id
    (then by the left part's length: the order transformers' generate_merges gives them)."""
    normal = {piece for piece, kind in pieces if kind == NORMAL}
    return [(piece[:k], piece[k:]) for piece, kind in pieces if kind == NORMAL
            for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal]


def sentencepiece_vocab(model_bytes, source):
    pieces, model_type = read_sentencepiece(model_bytes)
    if model_type != BPE:
        kind = {UNIGRAM: 'Unigram', 3: 'word', 4: 'char'}.get(model_type, str(model_type))
        raise UserError(f"{source} is a sentencepiece {kind} model; nanotrain reads sentencepiece BPE models only "
                        f"(Llama 2, Mistral v0.1). Give the folder its tokenizer.json: "
                        f"AutoTokenizer.from_pretrained(folder).save_pretrained(folder) in transformers writes one.")
    return pieces, {piece: i for i, (piece, _) in enumerate(pieces)}, bpe_merges(pieces)


# -----------------------------------------------------------------------------
# a published folder's tokenizer.model

# LlamaTokenizer's defaults
LLAMA_SPECIAL_TOKENS = {'unk_token': '<unk>', 'bos_token': '<s>', 'eos_token': '</s>'}


def from_sentencepiece(model_bytes, tokenizer_config=None, special_tokens=None, source='tokenizer.model'):
    """The tokenizers.Tokenizer transformers 5 builds from a sentencepiece BPE tokenizer.model for a
    LlamaTokenizer folder without tokenizer.json. tokenizer_config: the folder's tokenizer_config.json;
    of it count legacy (false: the dummy-prefix space only opens the text; true: it opens every piece of
    text between special tokens), add_prefix_space (default true; false: no dummy prefix), add_bos_token,
    add_eos_token and added_tokens_decoder. special_tokens: {'bos_token': '<s>', ...} as named in the
    folder's configs (LlamaTokenizer's <unk> <s> </s> fill in the missing ones). Byte fallback is always on
    and the model's normalizer spec is not read: LlamaTokenizer does the same."""
    config = tokenizer_config or {}
    special_tokens = {**LLAMA_SPECIAL_TOKENS, **(special_tokens or {})}
    pieces, vocab, merges = sentencepiece_vocab(model_bytes, source)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    set_llama_spaces(tokenizer, config)
    # control pieces (<s>, </s>) and named special tokens are matched in text; user-defined pieces
    # too, but as ordinary tokens; then the folder's added_tokens_decoder, its own flags and ids
    tokenizer.add_special_tokens([AddedToken(piece, normalized=False, special=True)
                                  for piece, kind in pieces if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=False) for piece, kind in pieces if kind == USER_DEFINED])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in special_tokens.values()])
    for i, token in sorted((int(i), token) for i, token in (config.get('added_tokens_decoder') or {}).items()):
        added = AddedToken(token['content'], single_word=token.get('single_word', False), lstrip=token.get('lstrip', False),
                           rstrip=token.get('rstrip', False), normalized=token.get('normalized', False),
                           special=token.get('special', False))
        (tokenizer.add_special_tokens if added.special else tokenizer.add_tokens)([added])
        if tokenizer.token_to_id(added.content) != i:
            raise UserError(f"tokenizer_config.json's added_tokens_decoder gives {added.content!r} id {i}, but after the "
                            f"{len(pieces)} pieces of {source} it is {tokenizer.token_to_id(added.content)}; the folder's "
                            f"tokenizer files do not belong together.")
    set_bos_eos(tokenizer, config, special_tokens)
    return tokenizer


def set_llama_spaces(tokenizer, config):
    """Give tokenizer the normalizer, pre-tokenizer and decoder transformers 5's LlamaTokenizer builds
    whatever its files hold: the dummy-prefix space by tokenizer_config's legacy and add_prefix_space."""
    add_prefix_space = config.get('add_prefix_space') is not False
    prepend = 'never' if not add_prefix_space else 'always' if config.get('legacy') else 'first'
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=prepend, split=False)
    strip = [decoders.Strip(content=' ', left=1)] if add_prefix_space else []  # the dummy prefix
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, ' '), decoders.ByteFallback(), decoders.Fuse()] + strip)


def set_bos_eos(tokenizer, config, special_tokens):
    """BOS / EOS around a text by tokenizer_config's add_bos_token and add_eos_token, as transformers'
    update_post_processor puts them. special_tokens: {'bos_token': '<s>', 'eos_token': '</s>', ...}."""
    bos = [special_tokens['bos_token']] if config.get('add_bos_token') else []
    eos = [special_tokens['eos_token']] if config.get('add_eos_token') else []
    tokenizer.post_processor = processors.TemplateProcessing(
        single=[f'{t}:0' for t in bos] + ['$A:0'] + [f'{t}:0' for t in eos],
        pair=[f'{t}:{k}' for k, seq in ((0, '$A'), (1, '$B')) for t in bos + [seq] + eos],
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(bos + eos)])


def as_transformers_llama(tokenizer, config, special_tokens):
    """A LlamaTokenizer folder's tokenizer.json (tokenizer) as transformers 5 rebuilds it: its vocabulary,
    merges and added tokens with set_llama_spaces' pipeline (an older file's Prepend('▁') normalizer is
    dropped), and its post-processor unless tokenizer_config names add_bos_token or add_eos_token."""
    set_llama_spaces(tokenizer, config)
    if 'add_bos_token' in config or 'add_eos_token' in config:
        set_bos_eos(tokenizer, config, {**LLAMA_SPECIAL_TOKENS, **special_tokens})


# -----------------------------------------------------------------------------
# nanotrain's own tokenizers

def char_tokenizer_json(base):
    """One token per character. A character outside the vocabulary is an error, as in nanotrain: the model
    names '<unk>' as its unknown token but has no such token, so tokenizers raises
    "Unk token `<unk>` not found in the vocabulary" instead of dropping or replacing the character."""
    tokenizer = Tokenizer(models.BPE(vocab=base.stoi, merges=[], unk_token='<unk>'))
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def bpe_tokenizer_json(base):
    """The sentencepiece BPE model train_bpe makes: no normalization but spaces written as '▁', no dummy
    prefix, no splitting into words (sentencepiece merges across the whole text), byte fallback."""
    pieces, vocab, merges = sentencepiece_vocab(base.model_bytes, 'the BPE tokenizer')
    unk = base.sp.id_to_piece(base.sp.unk_id())
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(' ', SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, ' '), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(piece, normalized=False, special=True) for piece, kind in pieces
                                  if kind in (UNKNOWN, CONTROL)])
    return tokenizer


def save_tokenizer(tokenizer, path):
    """tokenizer.save(path); a failed write (a full disk, ulimit -f) raised as the OSError it is (the tokenizers
    library raises a bare Exception), which export.py reports as any other failed write."""
    try:
        tokenizer.save(path)
    except Exception as e:
        raise OSError(f"writing {os.path.basename(path)}: {e}") from None


def write_tokenizer_files(tokenizer, out_folder):
    """Write tokenizer.json and tokenizer_config.json of a CharTokenizer, a BPETokenizer or a ChatTokenizer
    over either into out_folder; returns the generation_config.json entries they imply ({'eos_token_id': id},
    or {} for a character tokenizer, which has no end-of-sequence token).

    A BPE tokenizer names its <unk> and </s> as unk_token and eos_token, and sets split_special_tokens so that
    transformers, like nanotrain, reads "</s>" in a text as plain text. A ChatTokenizer adds its four tokens
    <|system|> <|user|> <|assistant|> <|end|> as special tokens with its ids, eos_token <|end|> and the chat
    template CHAT_TEMPLATE_JINJA; there, as in every chat template, the special tokens' text is read as those
    tokens (nanotrain's encode reads message content as plain text)."""
    chat = isinstance(tokenizer, ChatTokenizer)
    base = tokenizer.base if chat else tokenizer
    if isinstance(base, CharTokenizer):
        hf, named = char_tokenizer_json(base), {}
    elif isinstance(base, BPETokenizer):
        hf = bpe_tokenizer_json(base)
        named = {'unk_token': base.sp.id_to_piece(base.sp.unk_id()), 'eos_token': base.sp.id_to_piece(base.eos_id)}
    else:
        raise TypeError(f"write_tokenizer_files takes nanotrain's CharTokenizer, BPETokenizer or ChatTokenizer, "
                        f"not {type(tokenizer).__name__}")
    config = dict(tokenizer_class='PreTrainedTokenizerFast', clean_up_tokenization_spaces=False)
    if chat:
        hf.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in tokenizer.special])
        assert all(hf.token_to_id(token) == i for token, i in tokenizer.special.items())
        named = dict(named, eos_token='<|end|>')
        config['chat_template'] = CHAT_TEMPLATE_JINJA
    else:
        config['split_special_tokens'] = True
    config.update(named)
    config['added_tokens_decoder'] = {str(i): dict(content=t.content, lstrip=t.lstrip, normalized=t.normalized,
                                                   rstrip=t.rstrip, single_word=t.single_word, special=t.special)
                                      for i, t in sorted(hf.get_added_tokens_decoder().items())}
    os.makedirs(out_folder, exist_ok=True)
    save_tokenizer(hf, os.path.join(out_folder, 'tokenizer.json'))
    with open(os.path.join(out_folder, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write('\n')
    return {} if tokenizer.eos_id is None else {'eos_token_id': tokenizer.eos_id}
