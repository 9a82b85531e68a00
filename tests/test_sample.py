"""sample.py's conversation mode (--interactive=True): the turns so far as the prompt of each answer, the answer
printed as its tokens are drawn."""
import os
import select
import signal
import subprocess
import sys

from conftest import ROOT, assert_user_error, greedy_answer, hf_fixture, run, script_env, start_up_refusal
from hf.tokenizer import load_hf_tokenizer
from lm.tokenizer import BPETokenizer, CharTokenizer, ChatTokenizer, decoded_pieces, train_bpe
from loading import load_for_generation

BANNER = "Chatting with {}: type a message; /clear forgets the conversation, /quit or Ctrl-D ends.\n"


def chat(folder, lines, *args):
    return run(['sample.py', f'--init_from={folder}', '--device=cpu', '--interactive=True', '--temperature=0',
                *args], input=''.join(line + '\n' for line in lines))


def test_each_answer_reads_the_turns_before_it():
    """Each answer is the model's greedy answer to the conversation so far (its own earlier answers included, as
    assistant turns of the template); /clear starts over; empty lines are skipped; the input's end ends it."""
    folder = hf_fixture('qwen2')
    loaded = load_for_generation(folder)
    first = greedy_answer(loaded, [{'role': 'user', 'content': 'Hello there'}], 12)
    second = greedy_answer(loaded, [{'role': 'user', 'content': 'Hello there'}, {'role': 'assistant', 'content': first},
                                    {'role': 'user', 'content': 'How are you?'}], 12)
    fresh = greedy_answer(loaded, [{'role': 'user', 'content': 'How are you?'}], 12)
    assert second != fresh  # the first exchange changes the second answer: the test below tells them apart
    p = chat(folder, ['Hello there', '', 'How are you?', '/clear', 'How are you?'], '--max_new_tokens=12')
    assert p.stdout.split('overriding max_new_tokens = 12\n')[-1] == (
        BANNER.format(folder) + f"> {first}\n> > {second}\n> > {fresh}\n> \n")


def test_a_turn_the_tokenizer_refuses_leaves_the_conversation_going(dpo_env):
    """A nanotrain SFT model's char vocabulary lacks a typed character: said, and the next turn answered as if the
    refused one had not been typed."""
    path = dpo_env['sft']
    loaded = load_for_generation(path)
    answer = greedy_answer(loaded, [{'role': 'user', 'content': 'What is 2+3?'}], 10)
    p = chat(path, ['Wh\u00e9t?', 'What is 2+3?'], '--max_new_tokens=10')
    assert p.stdout.endswith("characters '\u00e9' are not in this character vocabulary (39 characters of the "
                             f"training corpus). Remove them from the text.]\n> {answer}\n> \n")
    # a line of bytes that are not UTF-8: said, left out (stdin strict, as a UTF-8 locale other than C.UTF-8 has it)
    p = run(['sample.py', f'--init_from={path}', '--device=cpu', '--interactive=True', '--temperature=0',
             '--max_new_tokens=10'], {'PYTHONIOENCODING': 'utf-8:strict'}, input='Wh\udcff\udcfet?\nWhat is 2+3?\n',
            errors='surrogateescape')
    assert p.stdout.endswith("[the line holds bytes that are not UTF-8 text (the terminal's encoding?): left out]\n"
                             f"> {answer}\n> \n"), p.stdout[-500:]


def test_the_oldest_exchanges_leave_when_the_conversation_passes_block_size():
    """A conversation that with max_new_tokens would pass block_size loses its oldest exchanges, said so, instead
    of being cut at an arbitrary token (the template's start)."""
    folder = hf_fixture('qwen2')  # 256 positions
    loaded = load_for_generation(folder)
    first = greedy_answer(loaded, [{'role': 'user', 'content': 'Hello there'}], 200)
    long = len(loaded.tokenizer.encode_prompt([{'role': 'user', 'content': 'Hello there'},
                                               {'role': 'assistant', 'content': first},
                                               {'role': 'user', 'content': 'Again'}]))
    assert long + 200 - 1 > 256  # the fixture's answer is long enough to push the first exchange out
    fresh = greedy_answer(loaded, [{'role': 'user', 'content': 'Again'}], 200)
    p = chat(folder, ['Hello there', 'Again'], '--max_new_tokens=200')
    assert p.stdout.endswith(f"> {first}\n> [the oldest 1 exchange(s) left out: the conversation and "
                             f"max_new_tokens=200 pass block_size=256]\n{fresh}\n> \n")


def test_an_answer_is_printed_before_the_next_turn_is_typed():
    """The answer reaches a pipe while the conversation is open, not when it ends (no PYTHONUNBUFFERED here)."""
    folder = hf_fixture('qwen2')
    answer = greedy_answer(load_for_generation(folder), [{'role': 'user', 'content': 'Hello there'}], 8)
    env = {k: v for k, v in script_env().items() if k != 'PYTHONUNBUFFERED'}
    p = subprocess.Popen([sys.executable, 'sample.py', f'--init_from={folder}', '--device=cpu', '--interactive=True',
                          '--temperature=0', '--max_new_tokens=8'], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        p.stdin.write(b'Hello there\n')
        p.stdin.flush()
        seen, want = b'', f"> {answer}\n> ".encode()
        while not seen.endswith(want):
            ready, _, _ = select.select([p.stdout], [], [], 120)
            assert ready, f'no answer while the conversation is open: {seen!r}'
            chunk = os.read(p.stdout.fileno(), 4096)
            assert chunk, f'sample.py ended: {seen!r}'
            seen += chunk
        assert p.poll() is None  # waiting for the next turn
        p.stdin.write(b'/quit\n')
        p.stdin.flush()
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()


def test_ctrl_c_stops_an_answer_and_the_conversation_goes_on():
    folder = hf_fixture('qwen2')
    p = subprocess.Popen([sys.executable, 'sample.py', f'--init_from={folder}', '--device=cpu', '--interactive=True',
                          '--temperature=0', '--max_new_tokens=230', '--use_kv_cache=False'], cwd=ROOT,
                         env=script_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.stdin.write(b'Hello there\n')
        p.stdin.flush()
        seen, banner = b'', BANNER.format(folder).encode()
        while len(seen.partition(banner)[2]) <= len(b'> '):
            ready, _, _ = select.select([p.stdout], [], [], 120)  # the answer's first piece (230 take seconds)
            assert ready, f'no answer: {seen!r}'
            seen += os.read(p.stdout.fileno(), 4096)
        p.send_signal(signal.SIGINT)
        while not seen.endswith(b'> '):
            ready, _, _ = select.select([p.stdout], [], [], 120)
            assert ready, f'the conversation did not go on: {seen!r}'
            seen += os.read(p.stdout.fileno(), 4096)
        assert seen.endswith(b' [stopped]\n> ') and p.poll() is None
        out, err = p.communicate(b'/quit\n', timeout=60)
        assert p.returncode == 0 and b'Traceback' not in err
    finally:
        p.kill()


def test_streamed_pieces_never_show_half_a_character():
    """decoded_pieces: byte-level tokens that split a character (an emoji, CJK) are held back until it is whole;
    the pieces join into the decoding of all the tokens (a byte-level BPE and sentencepiece's byte fallback)."""
    text = 'héllo wörld 😀 日本語 ok'
    hf = load_for_generation(hf_fixture('qwen2')).tokenizer
    corpus = ['hello world, the old words', 'a plain text of ascii only'] * 50
    bpe = BPETokenizer(train_bpe(corpus, 300))
    for tokenizer in (hf, bpe):
        ids = tokenizer.encode(text)
        pieces = list(decoded_pieces(tokenizer, iter(ids)))
        assert ''.join(pieces) == tokenizer.decode(ids) == text
        assert not any('\ufffd' in piece for piece in pieces), pieces
        split = [i for i in range(1, len(ids)) if '\ufffd' in tokenizer.decode(ids[:i])]
        assert split, 'no token boundary inside a character: the test shows nothing'
        assert len(pieces) > len(text.split()), pieces  # streamed, not given whole at the end


def test_token_bytes_join_into_the_texts_bytes():
    """token_bytes (serve.py's log-probs' "bytes"): the bytes of a text's tokens, joined, are its UTF-8, where
    tokens split its characters (a byte-level BPE, sentencepiece's byte fallback, a published sentencepiece folder,
    which writes its dummy prefix as a space) and where they do not (a character vocabulary, the chat template)."""
    text = 'héllo wörld 😀 日本語 ok'
    corpus = ['hello world, the old words', 'a plain text of ascii only'] * 50
    bpe = BPETokenizer(train_bpe(corpus, 300))
    sentencepiece = load_hf_tokenizer(hf_fixture('sentencepiece'))
    chars = CharTokenizer(sorted(set(text)))
    for tokenizer, opening in ((load_for_generation(hf_fixture('qwen2')).tokenizer, b''), (bpe, b''),
                               (sentencepiece, b' '), (chars, b''), (ChatTokenizer(bpe), b'')):
        ids = tokenizer.encode(text)
        assert b''.join(tokenizer.token_bytes(i) for i in ids) == opening + text.encode()
        if tokenizer is not chars:
            assert any(len(tokenizer.token_bytes(i)) == 1 and tokenizer.token_bytes(i)[0] > 127 for i in ids)
    chat = ChatTokenizer(bpe)
    assert chat.token_bytes(chat.eos_id) == b'<|end|>'


def test_a_base_model_has_no_conversation(monkeypatch):
    says = start_up_refusal(monkeypatch, 'sample.py', f'--init_from={hf_fixture("gpt2")}', '--device=cpu',
                            '--interactive=True')
    assert 'is a base model, which continues a text' in says and '--start=' in says
    says = start_up_refusal(monkeypatch, 'sample.py', f'--init_from={hf_fixture("qwen2")}', '--device=cpu',
                            '--interactive=True', '--compile_decode=True', '--use_kv_cache=False')
    assert 'compile_decode=True decodes over a static KV cache' in says



def test_template_variables_for_a_model_of_nanotrains_own_are_refused(dpo_env):
    """nanotrain's chat template reads no variables: --chat_template_variables on its model did nothing, silently."""
    p = run(['sample.py', f"--init_from={dpo_env['sft']}", '--device=cpu', '--start=hi', '--max_new_tokens=2',
             "--chat_template_variables={'enable_thinking': False}"], check=False)
    assert_user_error(p, "chat_template_variables ['enable_thinking']: ", "whose chat template reads no variables")
