"""
The task files eval.py measures a model on, and how each kind of row becomes model input.

A task file is JSONL, one example a line (blank lines skipped), every row of one kind:
- generation: {"prompt": str} or {"messages": [{"role", "content"}, ...]} (a conversation ending with
  a user turn or a tool's result, with "tools" where it has them, as SFT data; chat models only), with
  {"reference": str} or {"references": [str, ...]}, and
  optionally {"stop": [str, ...]}: the prediction is cut before the first of these strings. The SFT
  data's rows are generation rows too: {"prompt", "response"} (the response is the reference; TRL's
  {"prompt", "completion"} likewise, two conversations as one), and {"messages"} (or ShareGPT's
  {"conversations"}) ending with an assistant turn (its content is the reference, the turns before the
  prompt; a turn that calls tools: the calls as the model's chat template writes them).
- multiple choice: {"context": str, "choices": [str, ...] (two or more), "label": int (0-based)}.

read_task checks every row and names the file and line of the first bad one. generation_prompt
encodes a generation row as sample.py does (a chat model answers it as a user turn). Multiple choice
is scored as lm-evaluation-harness v0.4.x scores an output_type multiple_choice task with its HFLM
model (lm_eval/api/task.py, lm_eval/api/model.py, lm_eval/models/huggingface.py):
- ConfigurableTask.construct_requests: one loglikelihood request (context, target_delimiter + choice)
  per choice; target_delimiter ' ' by default.
- TemplateLM._encode_pair (encode_pair here): trailing whitespace of the context moves to the front of
  the continuation; whole = encode(context + continuation), context_enc = encode(context),
  continuation_enc = whole[len(context_enc):]. An empty context (TemplateLM.loglikelihood) is
  [prefix_token_id] (BOS, else EOS) with the continuation encoded alone.
- HFLM.tok_encode: encode as the Hugging Face tokenizer does by default (add_bos_token None, lm-eval
  >= 0.4.9.2): with the tokens its post-processor puts before a text (a Llama's BOS; none for GPT-2-style
  tokenizers such as SmolLM2's, nor for nanotrain's own exported ones), skipped when the text already
  starts with that token's text. Older lm-eval (add_bos_token=False) never adds them: the same scores
  wherever the tokenizer adds none.
- HFLM._loglikelihood_tokens (choice_logliks here): input (context_enc + continuation_enc)[-(max_length
  + 1):][:-1], truncated from the left when too long; the summed log_softmax of the continuation's
  tokens at its last len(continuation_enc) positions.
- ConfigurableTask.process_results: acc = argmax of the summed log-likelihoods == label; acc_norm = argmax
  of log-likelihood / len(choice) (characters of the choice, without the delimiter) == label; acc_bytes =
  argmax of log-likelihood / the choice's UTF-8 bytes == label; ties go to the first (np.argmax).
"""
import json
import math
import random
import re

import numpy as np
import torch
import torch.nn.functional as F

from configurator import UserError
from lm.chat_data import chat_tools, message_list, sharegpt_messages
from lm.tokenizer import base_tokenizer

GENERATION, MULTIPLE_CHOICE, ROLLING = 'generation', 'multiple_choice', 'loglikelihood_rolling'
FORMATS = ('{"prompt": str} or {"messages": [{"role": ..., "content": ...}, ...]} with {"reference": str} or '
           '{"references": [str, ...]} (generation; SFT rows {"prompt", "response"}, {"prompt", "completion"} '
           'and ShareGPT\'s {"conversations"} too), or '
           '{"context": str, "choices": [str, ...], "label": int} (multiple choice), or {"text": str} '
           '(perplexity; a .txt file is one such text)')


def is_text_list(value, least=1):
    return isinstance(value, list) and len(value) >= least and all(isinstance(v, str) for v in value)


def generation_row(row, where):
    """{'prompt' or 'messages', 'references' (None without), 'stop', 'tools', 'call'} of a generation row, checked;
    call: the assistant turn of an SFT example that ends with tool calls (its reference needs the template)."""
    record = row  # as given: its "tools" are read from it as the training scripts read them (chat_tools)
    if 'conversations' in row and 'messages' not in row:  # ShareGPT's, as the training scripts read it
        try:
            row = dict(row, messages=sharegpt_messages(row['conversations']))
        except ValueError as e:
            raise UserError(f"{where}: {e}.") from None
    if isinstance(row.get('prompt'), list) and isinstance(row.get('completion'), list):
        # TRL's conversational prompt-completion row: one conversation, its last assistant turn the reference
        row = dict({k: v for k, v in row.items() if k not in ('prompt', 'completion')},
                   messages=row['prompt'] + row['completion'])
    given = [key for key in ('reference', 'references', 'response', 'completion') if key in row]
    if len(given) > 1:
        raise UserError(f"{where}: give one of \"reference\", \"references\", \"response\" and \"completion\", "
                        f"not {' and '.join(map(repr, given))}.")
    row = dict(row, reference=row[given[0]]) if given in (['response'], ['completion']) else row
    messages, tools, call = row.get('messages'), None, None
    if messages is not None:
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise UserError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}.")
        try:  # text parts joined, tools and tool calls kept, as SFT data's
            messages, tools = message_list(messages, 'messages'), chat_tools(record)
        except ValueError as e:
            raise UserError(f"{where}: {e}.") from None
        if messages[-1]['role'] == 'assistant' and len(messages) > 1 and not given:  # an SFT example
            if messages[-1].get('tool_calls'):  # the reference: the call as the template writes it (call_reference)
                messages, call = messages[:-1], messages[-1]
            else:
                messages, row = messages[:-1], dict(row, reference=messages[-1]['content'])
        if messages[-1]['role'] not in ('user', 'tool'):
            raise UserError(f"{where}: the conversation ends with a {messages[-1]['role']!r} turn; end it with the "
                            f"user turn (or the tool result) the model is to answer.")
    elif not isinstance(row['prompt'], str):
        raise UserError(f"{where}: \"prompt\" must be a string.")
    if 'reference' in row and 'references' in row:
        raise UserError(f"{where}: give \"reference\" or \"references\", not both.")
    references = row.get('references', [row['reference']] if 'reference' in row else None)
    if references is not None and not is_text_list(references):
        raise UserError(f"{where}: \"reference\" must be a string, \"references\" a non-empty list of strings.")
    stop = row.get('stop', [])
    if not is_text_list(stop, least=0) or '' in stop:
        raise UserError(f"{where}: \"stop\" must be a list of non-empty strings.")
    return dict(prompt=row.get('prompt'), messages=messages, references=references, stop=stop, tools=tools, call=call)


def choice_row(row, where):
    """{'context', 'choices', 'label'} of a multiple-choice row, checked."""
    context, choices, label = row.get('context'), row['choices'], row.get('label')
    if not isinstance(context, str):
        raise UserError(f"{where}: a multiple-choice row needs \"context\": str (the text the choices follow).")
    if not is_text_list(choices, least=2):
        raise UserError(f"{where}: \"choices\" must be a list of two or more strings (got "
                        f"{json.dumps(choices)[:80]}).")
    if '' in choices:
        raise UserError(f"{where}: choice {choices.index('')} is empty; a choice needs text to score.")
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(choices):
        raise UserError(f"{where}: \"label\" must be the 0-based index of the right choice, an int from 0 to "
                        f"{len(choices) - 1} (got {json.dumps(label)}).")
    return dict(context=context, choices=choices, label=label)


def read_task(path, max_examples=0):
    """(kind, rows) of a task file: GENERATION, MULTIPLE_CHOICE or ROLLING, and its first max_examples rows
    (0: all), checked, each with 'line', its line number in the file. A .txt file is one ROLLING text."""
    try:
        # a byte-order mark, as the training scripts accept; newline='': a text's \r\n scored as written
        with open(path, encoding='utf-8-sig', newline='') as f:
            content = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"eval_data={path!r} cannot be read ({e}); name a UTF-8 " + (
            "text file (iconv -f latin1 -t utf-8 converts one)" if path.endswith('.txt') else
            "JSONL file of examples") + ".") from None
    if path.endswith('.txt'):
        if not content:
            raise UserError(f"eval_data={path!r} is empty; a text's perplexity needs text.")
        return ROLLING, [dict(text=content, line=1)]
    # lines end at \n (\r\n too) only: U+2028 or U+0085 inside a string is text (str.splitlines would cut there)
    lines, kind, rows = [line.removesuffix('\r') for line in content.split('\n')], None, []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                            f"object: {FORMATS}.") from None
        except RecursionError:
            raise UserError(f"{where} nests its JSON too deeply to read; each line must be one JSON object: "
                            f"{FORMATS}.") from None
        if not isinstance(row, dict):
            raise UserError(f"{where} is a JSON {type(row).__name__}, not an object; each line must be {FORMATS}.")
        try:  # an escaped lone surrogate (\ud800) is no text, as for the training scripts
            json.dumps(row, ensure_ascii=False).encode('utf-8')
        except UnicodeEncodeError:
            raise UserError(f"{where} holds a lone surrogate escape (such as \\ud800), which is no text; fix the "
                            f"line or leave it out.") from None
        row_kind = (MULTIPLE_CHOICE if 'choices' in row else
                    GENERATION if {'prompt', 'messages', 'conversations'} & row.keys() else
                    ROLLING if 'text' in row else None)
        if row_kind is None:
            raise UserError(f"{where} has keys {', '.join(map(repr, row)) or 'none'}, which are neither kind of "
                            f"example; each line must be {FORMATS}.")
        if kind is not None and row_kind != kind:
            raise UserError(f"{where} is a {row_kind.replace('_', ' ')} example but the lines before it are "
                            f"{kind.replace('_', ' ')} ones; one file holds one kind of task.")
        kind = row_kind
        if kind == ROLLING and not (isinstance(row['text'], str) and row['text']):
            raise UserError(f"{where}: \"text\" must be a non-empty string, the text whose perplexity is measured.")
        rows.append(dict(choice_row(row, where) if kind == MULTIPLE_CHOICE else generation_row(row, where)
                         if kind == GENERATION else dict(text=row['text']), line=number))
        if len(rows) == max_examples:
            break
    if not rows:
        raise UserError(f"eval_data={path!r} holds no examples; write one JSON object a line: {FORMATS}.")
    return kind, rows


FEWSHOT_DELIMITER = '\n\n'  # lm-eval's, between the examples and before the question
FEWSHOT_SEED = 1234  # lm-eval's fewshot_random_seed


def with_fewshot(kind, rows, num_fewshot, description, target_delimiter, chat, rows_cut=False):
    """rows with num_fewshot solved examples before each, laid out as lm-eval's ConfigurableTask.fewshot_context:
    description, then each example's text + target_delimiter + its answer (a choice's label, a generation's first
    reference), FEWSHOT_DELIMITER after each, then the row's own text. The examples are other rows of the same
    file, drawn as lm-eval's sampler draws them (fewshot_draws). A chat model gets them as earlier turns instead
    (lm-eval's --apply_chat_template --fewshot_as_multiturn), the description as a system turn. rows_cut: the
    file may have more rows than were read (max_examples), for the message when there are too few."""
    if not num_fewshot and not description:
        return rows
    if kind == ROLLING:
        raise UserError("num_fewshot and description are for generation and multiple-choice tasks, not perplexity.")
    if kind == GENERATION and any(row['tools'] is not None or row['call'] for row in rows):
        raise UserError("num_fewshot and description are not for conversations with tools or tool calls: give the "
                        "solved examples as earlier turns of each conversation instead.")
    if kind == GENERATION and num_fewshot and any(row['references'] is None for row in rows):
        raise UserError("num_fewshot shows solved examples, but some rows have no reference to show as the answer.")
    out = []
    for row, shots in zip(rows, fewshot_draws(rows, num_fewshot, rows_cut)):
        if kind == MULTIPLE_CHOICE:
            solved = ''.join(s['context'] + target_delimiter + s['choices'][s['label']] + FEWSHOT_DELIMITER
                             for s in shots)
            out.append(dict(row, context=description + solved + row['context']))
        elif chat:
            turns = [{'role': 'system', 'content': description}] if description else []
            for s in shots:
                turns += (s['messages'] or [{'role': 'user', 'content': s['prompt']}]) + [
                    {'role': 'assistant', 'content': s['references'][0]}]
            own = row['messages'] or [{'role': 'user', 'content': row['prompt']}]
            out.append(dict(row, prompt=None, messages=turns + own))  # the JSON shows the conversation
        else:
            solved = ''.join(s['prompt'] + target_delimiter + s['references'][0] + FEWSHOT_DELIMITER for s in shots)
            out.append(dict(row, prompt=description + solved + row['prompt']))
    return out


def fewshot_draws(rows, num_fewshot, rows_cut=False):
    """For each row, the num_fewshot other rows shown before it, drawn as lm-eval's ContextSampler draws them
    when the fewshot split is the evaluated one: one random.Random(1234) for the task, for each row in order
    rnd.sample(rows, num_fewshot + 1), the rows equal to it dropped, the first num_fewshot kept; if its copies
    left fewer, rnd.sample(the rows without them, num_fewshot). rows_cut: as in with_fewshot."""
    rnd, draws = random.Random(FEWSHOT_SEED), []
    for row in rows:
        others = [shot for shot in rows if not same_row(shot, row)]
        if len(others) < num_fewshot:
            most = min(sum(not same_row(shot, r) for shot in rows) for r in rows)  # what every row can have
            raise UserError(f"line {row['line']}: num_fewshot={num_fewshot} needs that many other examples, and the "
                            f"task has {len(others)} besides this one and its copies; "
                            + (f"lower num_fewshot to {most} or less" if most else
                               "add other examples (a row's copies are never its examples)")
                            + (f", or raise max_examples, which reads only the file's first {len(rows)} rows" if
                               rows_cut else "") + ".")
        shots = [shot for shot in rnd.sample(rows, num_fewshot + 1) if not same_row(shot, row)][:num_fewshot]
        draws.append(shots if len(shots) == num_fewshot else rnd.sample(others, num_fewshot))
    return draws


def same_row(a, b):
    """Whether two rows hold the same example, wherever they are in the file (lm-eval compares its docs)."""
    return {k: v for k, v in a.items() if k != 'line'} == {k: v for k, v in b.items() if k != 'line'}


def generation_prompt(tokenizer, chat, row, where):
    """The token ids a generation row gives the model: a chat model answers the prompt (as a user turn) or the
    conversation in its chat template, as sample.py does; a base model continues the prompt, opened as its
    tokenizer opens a text (a published model's BOS)."""
    if chat:
        return tokenizer.encode_prompt(row['messages'] or [{'role': 'user', 'content': row['prompt']}], row['tools'])
    if row['messages']:
        raise UserError(f"{where} is a conversation (\"messages\"), but the model is not a chat model (no chat "
                        f"template): give it a \"prompt\" to continue, or evaluate a fine-tuned model.")
    ids = tokenizer.document_prefix + tokenizer.encode(row['prompt'])
    if not ids:
        raise UserError(f"{where}: the prompt is empty; a base model needs text to continue.")
    return ids


def call_reference(tokenizer, chat, row):
    """row with its references: for an SFT example that ends with tool calls, the calls' text as the model's
    chat template writes them (what the model must generate)."""
    if not (chat and row['call']):
        return row
    return dict(row, references=[tokenizer.reply_text(row['messages'] + [row['call']], row['tools'])])


def encode_text(tokenizer, text):
    """text as HFLM.tok_encode encodes it: the tokenizer's own opening tokens (a BOS), unless text already
    starts with their text."""
    tokenizer = base_tokenizer(tokenizer)
    prefix = list(tokenizer.document_prefix)
    if prefix and text.startswith(tokenizer.decode(prefix)):
        prefix = []
    return prefix + tokenizer.encode(text)


def prefix_token_id(tokenizer):
    """lm-eval's prefix_token_id, the context of an empty one: the BOS token, else the EOS token, else None."""
    tokenizer = base_tokenizer(tokenizer)
    if hasattr(tokenizer, 'token_id'):  # a published model's named special tokens
        bos = tokenizer.token_id('bos_token')
        return bos if bos is not None else tokenizer.token_id('eos_token')
    return tokenizer.eos_id


def encode_pair(tokenizer, context, continuation, where):
    """(context ids, continuation ids) of a loglikelihood request, as lm-eval's TemplateLM.loglikelihood and
    _encode_pair split them."""
    if not context:
        prefix = prefix_token_id(tokenizer)
        if prefix is None:
            raise UserError(f"{where}: the context is empty, and the tokenizer has neither a BOS nor an EOS token to "
                            f"condition the choices on (lm-eval's prefix token); give a context.")
        continuation_enc = base_tokenizer(tokenizer).encode(continuation)
        if continuation_enc[:1] == [prefix]:
            return continuation_enc[:1], continuation_enc[1:]
        return [prefix], continuation_enc
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode_text(tokenizer, context + continuation)
    context_enc = encode_text(tokenizer, context)
    if not context_enc:
        raise UserError(f"{where}: the context is only whitespace; give it text, or leave it empty (\"\").")
    return context_enc, whole[len(context_enc):]


def choice_requests(tokenizer, row, target_delimiter, block_size, where):
    """[(token ids, n)] of each of a row's choices: the context's and the continuation's ids, the
    continuation the last n of them; cut from the left to block_size + 1 ids (the last one is predicted,
    never read), as lm-eval truncates to max_length."""
    requests = []
    for k, choice in enumerate(row['choices']):
        context_enc, continuation_enc = encode_pair(tokenizer, row['context'], target_delimiter + choice, where)
        if not continuation_enc or len(continuation_enc) > block_size:
            raise UserError(f"{where}: choice {k} is {len(continuation_enc)} tokens after the context; it must be 1 "
                            f"to block_size={block_size} tokens to be scored.")
        requests.append(((context_enc + continuation_enc)[-(block_size + 1):], len(continuation_enc)))
    return requests


def rolling_windows(tokens, prefix_token, max_seq_len):
    """lm-eval's get_rolling_token_windows(tokens, prefix_token, max_seq_len, context_len=1) with
    make_disjoint_window applied, as HFLM.loglikelihood_rolling scores a text: (context ids, predicted ids)
    pairs predicting every token once; the first window predicts the first max_seq_len tokens after the
    prefix token, each later one the next max_seq_len - 1 or fewer with the tokens before them as context."""
    if not tokens:
        return []
    first = min(max_seq_len, len(tokens))
    windows, predicted = [([prefix_token] + tokens[:first - 1], tokens[:first])], first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, max_seq_len)  # pred_len = max_seq_len - context_len + 1
        end = predicted + n
        windows.append((tokens[max(end - max_seq_len - 1, 0):end - 1], tokens[end - n:end]))
        predicted += n
    # disjoint: the context stops where the predicted tokens begin
    return [(context[:len(context) - (len(pred) - 1)], pred) for context, pred in windows]


def rolling_requests(tokenizer, text, block_size, where):
    """[(token ids, n)] of the windows (rolling_windows) that score text's every token, as lm-eval's
    loglikelihood_rolling: the text encoded as HFLM.tok_encode does, the first token conditioned on the prefix
    token (BOS, else EOS)."""
    prefix = prefix_token_id(tokenizer)
    if prefix is None:
        raise UserError(f"{where}: the tokenizer has neither a BOS nor an EOS token to condition a text's first "
                        f"token on (lm-eval's prefix token), so its perplexity cannot be measured as lm-eval does.")
    return [(context + pred, len(pred)) for context, pred in rolling_windows(encode_text(tokenizer, text), prefix,
                                                                              block_size)]


def rolling_scores(logliks, texts):
    """lm-eval's loglikelihood_rolling metrics of texts and their summed log-likelihoods: word_perplexity and
    byte_perplexity, exp(-sum loglik / sum words or UTF-8 bytes) (weighted_perplexity; words as its
    count_words splits them, at runs of whitespace), and bits_per_byte, -sum loglik / sum bytes / ln 2."""
    total = sum(logliks)
    words = sum(len(re.split(r"\s+", text)) for text in texts)
    n_bytes = sum(len(text.encode('utf-8')) for text in texts)
    return {'word_perplexity': math.exp(-total / words), 'byte_perplexity': math.exp(-total / n_bytes),
            'bits_per_byte': -total / n_bytes / math.log(2)}


@torch.no_grad()
def choice_logliks(model, requests, autocast):
    """Summed log-likelihood of each request's continuation (choice_requests): each of its n tokens' log-prob
    given the ids before it, from one forward pass over all requests right-padded (causal attention: no
    real token sees the padding); logits only where a continuation token is predicted."""
    device = model.lm_head.weight.device
    x = torch.zeros(len(requests), max(len(ids) for ids, _ in requests) - 1, dtype=torch.long)
    rows, cols, targets = [], [], []
    for r, (ids, n) in enumerate(requests):
        x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
        rows += [r] * n
        cols += range(len(ids) - 1 - n, len(ids) - 1)
        targets += ids[-n:]
    at = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    with autocast:
        logits, _ = model(x.to(device), logits_at=at)
    # float32 log-softmax, summed in float32: HFLM's for a float32 model
    logprobs = F.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(targets, device=device)[:, None])[:, 0]
    sums, start = [], 0
    for _, n in requests:
        sums.append(float(logprobs[start:start + n].sum()))
        start += n
    return sums


def choice_predictions(logliks, choices):
    """(pred, pred_norm, pred_bytes): the argmax of logliks, of logliks / len(choice) and of logliks / the
    choice's UTF-8 bytes, as lm-eval's process_results (np.argmax: the first on a tie)."""
    logliks = np.array(logliks)
    chars = np.array([float(len(choice)) for choice in choices])
    utf8 = np.array([float(len(choice.encode('utf-8'))) for choice in choices])
    return int(np.argmax(logliks)), int(np.argmax(logliks / chars)), int(np.argmax(logliks / utf8))
