"""
What one held-out evaluation of a fine-tuning run costs (lm/heldout_eval.py): config/sft.py's
exact_match_examples=200 number-task prompts answered by train.py's default model shape (random
weights: no answer stops early, the worst case) batch_size at a time, with exact match alone (each
answer at most the reference's tokens + 1) and with BLEU and ROUGE-L (answers run to max_length),
against the path it replaced: one prompt at a time through GPT.generate, exact-match budget.
`OMP_NUM_THREADS=1 python bench/bench_heldout.py`; the median of `repeats` runs is reported.
"""

import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from configurator import at_least, check_values, configure
from lm.chat_data import load_sft_data
from lm.heldout_eval import HeldOut, heldout_answers, score_answers
from lm.tokenizer import CharTokenizer, ChatTokenizer, prompt_and_answer
from model import GPT, GPTConfig
from tasks.number_tasks import prepare_number_tasks

# -----------------------------------------------------------------------------
num_prompts = 200            # config/sft.py's exact_match_examples
batch_size = 32              # config/sft.py's
max_length = 64              # config/sft.py's
repeats = 3
# -----------------------------------------------------------------------------
config = configure(globals())
check_values(config, [(at_least(1), ('num_prompts', 'batch_size', 'max_length', 'repeats'))])

with tempfile.TemporaryDirectory() as folder:
    task = prepare_number_tasks(folder, n_train=10, n_eval=num_prompts)
    chars = sorted(set(open(os.path.join(task, 'test.jsonl')).read()) | set('\n'))
    tokenizer = ChatTokenizer(CharTokenizer(chars))
    held_out = load_sft_data(task, tokenizer, max_length, 'truncate', False)[2]
prompts = [prompt_and_answer(tokenizer, *chat) for chat in held_out[:num_prompts]]
references = [reference for _, reference in prompts]
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=128, vocab_size=tokenizer.vocab_size, n_layer=4, n_head=4, n_embd=128)).eval()


def one_at_a_time():
    return [model.generate(torch.tensor([p]), len(tokenizer.encode(ref)) + 1, temperature=0,
                           eos_id=tokenizer.eos_id)[0, len(p):].tolist() for p, ref in prompts]


def batched(metrics):
    def answer_and_score():
        answers = heldout_answers(model, HeldOut(tokenizer, prompts, metrics, batch_size, max_length),
                                  contextlib.nullcontext())
        score_answers(metrics, answers, references, tokenizer)
        return answers
    return answer_and_score


runs = {'one at a time (exact match)': one_at_a_time, 'batched, exact_match': batched(['exact_match']),
        'batched, exact_match,bleu,rouge_l': batched(['exact_match', 'bleu', 'rouge_l'])}
print(f"{len(prompts)} prompts, batch {batch_size}, max_length {max_length}, {model.get_num_params() / 1e6:.2f}M "
      f"parameters, CPU, {torch.get_num_threads()} threads")
for name, fn in runs.items():
    fn()  # warm-up
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        answers = fn()
        seconds.append(time.perf_counter() - t0)
    print(f"{name:>34}: {statistics.median(seconds):6.2f} s, {sum(map(len, answers)):,} tokens "
          f"(runs: {', '.join(f'{t:.2f}s' for t in seconds)})")
