"""bench/tts_asr.py's text normalisation and error rates against values worked out by hand (the script's
`score` step needs faster-whisper and a Whisper model; these helpers need neither)."""

from bench.tts_asr import edit_distance, error_rates, normalize


def test_normalize_lowercases_strips_punctuation_and_collapses_spaces():
    assert normalize("Where should be graven, if that right were right,") == \
        "where should be graven if that right were right"
    assert normalize("I'll  find out\u2014your man;") == "ill find out your man"  # an em dash splits words
    assert normalize(" O'er-leap 'tis  GOOD-night!\n") == "oer leap tis good night"
    assert normalize("Twas 3 o'clock_") == "twas 3 oclock"  # digits stay: the corpora spell numbers out


def test_edit_distance_counts_substitutions_deletions_insertions():
    assert edit_distance("kitten", "sitting") == 3  # k->s, e->i, +g
    assert edit_distance("", "abc") == edit_distance("abc", "") == 3
    assert edit_distance("flaw", "lawn") == 2  # -f, +n
    assert edit_distance("the cat sat".split(), "the bat sat down".split()) == 2  # cat->bat, +down


def test_error_rates_sum_edits_over_the_corpus():
    pairs = [("The cat sat.", "the bat sat down"), ("Go, go!", "Go go")]
    # words: (2 + 0) / (3 + 2); characters: 'the cat sat' -> 'the bat sat down' is c->b and +' down' (6)
    # over 11 + 5 reference characters, spaces included
    assert error_rates(pairs) == (2 / 5, 6 / 16)
    assert error_rates([("Good night.", "good-night")]) == (0.0, 0.0)
