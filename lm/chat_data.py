r"""
Fine-tuning data: chat examples for supervised fine-tuning (train.py training_type='sft' | 'lora'),
preference pairs for DPO (train_dpo.py) and prompts for online RL (train_rl.py), read from JSONL,
encoded with the chat template of lm/tokenizer.py, and batched padded or packed.

SFT examples, one per line; the JSONL formats map to turns as:
    {"prompt": P, "response": R}                     -> user P, assistant R
    {"instruction": I, "input": X, "output": O}       -> user I + "\n\n" + X (just I if X is empty), assistant O
    {"messages": [{"role": ..., "content": ...}]}     -> as given (at least one assistant turn)
    {"prompt": [messages], "completion": [messages]}  -> as given (TRL's; two strings: user, assistant)
    {"conversations": [{"from": ..., "value": ...}]}  -> ShareGPT's: human, gpt, system (function_call, observation)
    {"text": T}                                       -> T, every token learned (TRL's language-modeling rows)
Any of them may carry "tools" (function schemas): with a published model's chat template, assistant turns
may hold "tool_calls" and "tool" messages the results, rendered as transformers renders them.

Preference pairs, a prompt with a chosen and a rejected completion; JSONL formats, one pair per line:
    {"prompt": P, "chosen": C, "rejected": R}   P: a string (one user turn) or a list of messages;
                                                 C, R: strings, or [{"role": "assistant", "content": ...}]
                                                 (which may hold "tool_calls"; "tools" as for SFT)
    {"chosen": [messages], "rejected": [messages]}   implicit prompt: whole conversations, the same up
                                                     to their last turn, which is the assistant's reply
    {"chosen": "\n\nHuman: ...\n\nAssistant: ...", "rejected": "..."}   Anthropic HH: whole transcripts
                                                     as strings, read as the implicit prompt's messages
    {"conversations": [turns], "chosen": {"from": "gpt", "value": C}, "rejected": {...}}   ShareGPT's
The prompt is rendered with the chat template up to its final <|assistant|> (as SFT's prompts are);
a completion is the reply's content and the <|end|> that closes it (the EOS token).
"""

import bisect
import copy
import json
import os
import re

import torch

from configurator import UserError
from lm.tokenizer import CHAT_ROLES, base_tokenizer, function_name, reply_reference
from run.checkpoint import NEW_RUN
from run.device import to_device

# the roles a message may have: the chat template's, and a tool's result (published models' templates)
MESSAGE_ROLES = (*CHAT_ROLES, 'tool')


# -----------------------------------------------------------------------------
# supervised fine-tuning (train.py training_type='sft' | 'lora'): chat examples from JSONL

def string_field(value, key):
    if not isinstance(value, str):
        raise ValueError(f'"{key}" must be a string, got {type(value).__name__}')
    return value


def message_list(value, key):
    """value checked to be a list of {"role", "content"} messages (roles of the template, or "tool"); ValueError
    if not. A message keeps its other keys (tool_calls, tool_call_id, name, ...) for a published model's template,
    as transformers passes them."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError(f'"{key}" must be a list of {{"role": ..., "content": ...}} objects, got '
                         f'{json.dumps(value)[:80]}')
    messages = []
    for m in value:
        if m.get('role') not in MESSAGE_ROLES:
            raise ValueError(f"message role {m.get('role')!r} in \"{key}\" is not one of {', '.join(MESSAGE_ROLES)}")
        # keys set to null are left out, as transformers passes messages (data sets give every message each key)
        message = {k: v for k, v in m.items() if v is not None}
        if m.get('tool_calls'):
            if m['role'] != 'assistant':
                raise ValueError(f'a {m["role"]!r} message in "{key}" has "tool_calls"; only assistant turns call tools')
            tool_calls(m['tool_calls'])
        # a call without text may have no content (OpenAI's null): "", which some templates need (Qwen3's)
        content = m.get('content')
        message['content'] = '' if content is None and m.get('tool_calls') else message_content(content)
        messages.append(message)
    return messages


def tool_calls(value):
    """The names of an assistant turn's tool calls; ValueError if "tool_calls" is not a list of calls."""
    if not isinstance(value, list):
        raise ValueError(f'"tool_calls" must be a list of calls, got {json.dumps(value)[:80]}')
    return [function_name(call, 'each of "tool_calls"') for call in value]


def chat_tools(record):
    """A record's "tools" (the function schemas the template shows the model), None without: a list of
    {"type": "function", "function": {"name", "description", "parameters"}}, or that list as a JSON string (as
    data sets with differing schemas store it); a ShareGPT row's bare {"name", ...} schemas (LLaMA-Factory's)
    are put in that form. ValueError if malformed."""
    tools = record.get('tools') if isinstance(record, dict) else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise ValueError(f'"tools" is a string but not JSON: {tools[:80]!r}') from None
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f'"tools" must be a list of {{"type": "function", "function": {{...}}}} schemas, got '
                         f'{type(tools).__name__}')
    for tool in tools:
        function_name(tool, 'each of "tools"')
    if 'conversations' in record and 'messages' not in record:
        tools = [tool if 'function' in tool else {'type': 'function', 'function': tool} for tool in tools]
    return tools


def message_content(value):
    """A message's text: a string, or a list of text parts ({"type": "text", "text": ...}, as OpenAI's and
    transformers' multimodal messages write it), joined as chat templates join them; ValueError otherwise."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f'"content" must be a string or a list of {{"type": "text", "text": ...}} parts, got '
                         f'{type(value).__name__}')
    for part in value:
        kind = part.get('type') if isinstance(part, dict) else None
        if kind == 'text' and not isinstance(part.get('text'), str):
            raise ValueError(f'"content" holds a text part whose "text" is no string: {json.dumps(part)[:80]}; '
                             f'write each as {{"type": "text", "text": "..."}}')
        if kind != 'text':
            what = f'a part of type "{kind}"' if isinstance(kind, str) else json.dumps(part)[:80]
            raise ValueError(f'"content" holds {what}; the models here read text only: each part must be '
                             f'{{"type": "text", "text": "..."}} (drop the others, or the line)')
    return ''.join(part['text'] for part in value)


# the keys that make a record a conversation (chat_messages)
CONVERSATION_KEYS = {'messages', 'conversations', 'prompt', 'instruction'}
# ShareGPT's speakers, by the names FastChat, axolotl and LLaMA-Factory read, as roles
SHAREGPT_ROLES = {'human': 'user', 'user': 'user', 'gpt': 'assistant', 'assistant': 'assistant', 'system': 'system',
                  'function_call': 'assistant', 'observation': 'tool', 'tool': 'tool'}


def sharegpt_messages(value):
    """ShareGPT's "conversations": [{"from": "human" | "gpt" | "system", "value": text}, ...] as messages. A
    "function_call" turn (LLaMA-Factory's) is an assistant turn calling the tool(s) its value names (JSON: one
    {"name", "arguments"} or a list of them), an "observation" the result. ValueError if malformed."""
    if not isinstance(value, list) or not all(isinstance(turn, dict) for turn in value):
        raise ValueError(f'"conversations" must be a list of {{"from": ..., "value": ...}} turns, got '
                         f'{json.dumps(value)[:80]}')
    messages = []
    for turn in value:
        speaker = turn.get('from')
        if speaker not in SHAREGPT_ROLES:
            raise ValueError(f'"from": {json.dumps(speaker)} in "conversations" is not one of '
                             f'{", ".join(SHAREGPT_ROLES)}')
        text = string_field(turn.get('value'), 'value')
        if speaker != 'function_call':
            messages.append({'role': SHAREGPT_ROLES[speaker], 'content': text})
            continue
        try:
            calls = json.loads(text)
        except ValueError:
            calls = None
        calls = calls if isinstance(calls, list) else [calls]
        if not all(isinstance(call, dict) for call in calls):
            raise ValueError(f'a "function_call" turn\'s value must be JSON {{"name": ..., "arguments": ...}} (or a '
                             f'list of them), got {text[:80]!r}')
        messages.append({'role': 'assistant', 'content': '',
                         'tool_calls': [{'type': 'function', 'function': call} for call in calls]})
        tool_calls(messages[-1]['tool_calls'])
    return messages


def conversation(record):
    """The messages of a record's "messages", or of ShareGPT's "conversations"; None if it has neither."""
    if 'messages' in record:
        return message_list(record['messages'], 'messages')
    return sharegpt_messages(record['conversations']) if 'conversations' in record else None


def chat_messages(record):
    """A JSONL record in any of its formats as a list of {'role', 'content'}; ValueError if malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    messages = conversation(record)
    if messages is not None:
        if not any(m['role'] == 'assistant' for m in messages):
            key = 'messages' if 'messages' in record else 'conversations'
            raise ValueError(f'"{key}" has no assistant turn, so there is nothing to learn')
        return messages
    if 'prompt' in record and 'response' in record:
        return [{'role': 'user', 'content': string_field(record['prompt'], 'prompt')},
                {'role': 'assistant', 'content': string_field(record['response'], 'response')}]
    if 'prompt' in record and 'completion' in record:  # TRL's prompt-completion rows: two texts, or two conversations
        prompt, completion = record['prompt'], record['completion']
        if isinstance(prompt, str) and isinstance(completion, str):
            return [{'role': 'user', 'content': prompt}, {'role': 'assistant', 'content': completion}]
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise ValueError(f'"prompt" and "completion" must be two strings or two lists of {{"role", "content"}} '
                             f'messages, got {type(prompt).__name__} and {type(completion).__name__}')
        messages = message_list(prompt, 'prompt') + message_list(completion, 'completion')
        if not any(m['role'] == 'assistant' for m in messages[len(prompt):]):
            raise ValueError('"completion" has no assistant turn, so there is nothing to learn')
        return messages
    if 'instruction' in record and 'output' in record:
        user = string_field(record['instruction'], 'instruction')
        if string_field(record.get('input', ''), 'input'):
            user += '\n\n' + record['input']
        return [{'role': 'user', 'content': user},
                {'role': 'assistant', 'content': string_field(record['output'], 'output')}]
    raise ValueError(f"unknown format (keys {sorted(record)}); use {{\"prompt\", \"response\"}} (or TRL's "
                     f"{{\"prompt\", \"completion\"}}), Alpaca {{\"instruction\", \"input\", \"output\"}}, "
                     f"{{\"messages\": [{{\"role\", \"content\"}}, ...]}}, ShareGPT's {{\"conversations\": "
                     f"[{{\"from\", \"value\"}}, ...]}} or a plain {{\"text\"}}")


def is_text_row(record):
    """Whether a record is TRL's language-modeling row {"text": ...}: a text, no conversation beside it."""
    return isinstance(record, dict) and 'text' in record and not CONVERSATION_KEYS & record.keys()


def text_example(tokenizer, text):
    """(ids, labels) of a plain text: the tokens a text opens with (a published model's BOS), the text, and the
    end-of-turn token (where generation stops); every token learned, as TRL trains these rows. tokenizer: a chat
    tokenizer; special-token text in the text is read as those tokens, as transformers' tokenizer(text) reads it."""
    if not string_field(text, 'text'):
        raise ValueError('"text" is empty: there is nothing to learn')
    prefix = list(base_tokenizer(tokenizer).document_prefix)
    ids = prefix + tokenizer.encode(text) + [tokenizer.eos_id]
    return ids, [-100] * len(prefix) + ids[len(prefix):]


def read_jsonl(path, parse, skip_malformed):
    """(results, skipped): parse(record) of every non-blank line of a JSONL file. A line that is not
    JSON, not UTF-8 (or holds a lone surrogate such as \\ud800), or that parse rejects (ValueError,
    UserError) is an error naming path:line, or with skip_malformed skipped and counted."""
    results, skipped = [], 0
    with open(path, 'rb') as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                # a BOM is allowed
                record = json.loads(line.decode('utf-8-sig' if line_no == 1 else 'utf-8'))
                # lone surrogates are not text
                json.dumps(record, ensure_ascii=False).encode('utf-8')
                results.append(parse(record))
            # bad JSON or UTF-8 is a ValueError; deep nesting recurses
            except (ValueError, RecursionError, UserError) as e:
                if not skip_malformed:
                    raise UserError(f"{path}:{line_no}: {str(e).rstrip('.')}. Fix the line, or set skip_malformed=True to skip "
                                    f"malformed lines (they are counted).") from None
                skipped += 1
    return results, skipped


def load_sft_split(path, tokenizer, max_length, overlong='truncate', skip_malformed=False):
    """Read and tokenize one JSONL split (one example per line, blank lines ignored): returns
    (conversations, examples), conversations as (messages, tools) (a plain text has none), examples as
    (ids, labels). A malformed line is an error naming path:line, or with skip_malformed skipped and
    counted. An example longer than max_length tokens is cut to its first max_length tokens
    (overlong='truncate'; dropped if no response token is left) or dropped (overlong='drop'). The
    counts are printed; no examples left is an error."""
    if overlong not in ('truncate', 'drop'):
        raise UserError(f"overlong={overlong!r} is not supported; use 'truncate' or 'drop'.")
    if not os.path.isfile(path):
        raise UserError(f"SFT data file {path} does not exist. Point sft_data at a folder holding train.jsonl "
                        f"and val.jsonl (test.jsonl optional), or leave it '' for the embedded number tasks.")
    conversations, examples, truncated, dropped = [], [], 0, 0

    def parse(record):
        if is_text_row(record):  # no conversation: nothing held out to answer
            return None, None, *text_example(tokenizer, record['text'])
        messages, tools = chat_messages(record), chat_tools(record)
        # a char tokenizer rejects unknown characters
        return messages, tools, *tokenizer.encode_chat(messages, tools)
    parsed, skipped = read_jsonl(path, parse, skip_malformed)
    texts = sum(messages is None for messages, _, _, _ in parsed)
    for messages, tools, ids, labels in parsed:
        if messages is not None:
            conversations.append((messages, tools))
        if len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
            if overlong == 'drop' or all(label == -100 for label in labels[1:]):
                dropped += 1
                continue
            truncated += 1
        examples.append((ids, labels))
    print(f"{path}: {len(examples):,} examples{f', {texts:,} of the lines plain texts' if texts else ''} "
          f"({truncated} truncated and {dropped} dropped at max_length="
          f"{max_length} by overlong={overlong!r}, {skipped} malformed lines skipped)")
    if not examples:
        raise UserError(f"{path} holds no usable examples ({skipped} malformed lines skipped, {dropped} longer "
                        f"than max_length={max_length} dropped). Each line must be one JSON example, e.g. "
                        f"{{\"prompt\": \"What is 2+2?\", \"response\": \"4\"}}; raise max_length if they are "
                        f"too long.")
    return conversations, examples


def load_sft_data(folder, tokenizer, max_length, overlong='truncate', skip_malformed=False, train=True):
    """An SFT data folder's (train examples, val examples, held-out conversations): the held-out ones,
    for exact match, are test.jsonl's, else val.jsonl's. Each split is read by load_sft_split; with
    train=False train.jsonl is not read (no train examples)."""
    def read_split(name):
        return load_sft_split(os.path.join(folder, f'{name}.jsonl'), tokenizer, max_length, overlong, skip_malformed)
    train_examples = read_split('train')[1] if train else []
    val_conversations, val_examples = read_split('val')
    held_out = read_split('test')[0] if os.path.exists(os.path.join(folder, 'test.jsonl')) else val_conversations
    return train_examples, val_examples, held_out


def load_sources(sources, key, load):
    """[load(folder, weight) for each source (name, folder, weight) of the config key `key`, as
    configurator.data_sources lists them], in order. An error in a named source's data names the key and
    the source as well as the file and line."""
    data = []
    for name, folder, weight in sources:
        try:
            data.append(load(folder, weight))
        except UserError as e:
            raise UserError(f"{key} source {name!r}: {e}" if name else str(e)) from None
    return data


def load_sft_sources(sources, tokenizer, max_length, overlong='truncate', skip_malformed=False):
    """load_sft_data of each source of sft_data (load_sources); a source of weight 0 is evaluated, not
    trained: its train.jsonl is not read."""
    return load_sources(sources, 'sft_data', lambda folder, weight: load_sft_data(
        folder, tokenizer, max_length, overlong, skip_malformed, train=weight > 0))


def describe_sources(sources, batches):
    """A line on the named sources [(name, folder, weight)] of batches (SFTBatches of their train examples): each
    one's examples, its share of the response tokens, and its share of the loss weight (weight x tokens)."""
    tokens = torch.zeros(len(sources)).index_add_(0, batches.sources, batches.label_counts.float())
    weighted = tokens * torch.tensor([weight for _, _, weight in sources])
    described = [f"{name} {int((batches.sources == s).sum()):,} examples, {tokens[s] / tokens.sum():.1%} of the "
                 f"response tokens, loss weight {weight:g}: {weighted[s] / weighted.sum():.1%} of the loss"
                 if weight else
                 f"{name} weight 0: evaluated, not trained" for s, (name, _, weight) in enumerate(sources)]
    return f"sft_data: {'; '.join(described)}"


def every_token(examples):
    """(ids, labels) examples with every token learned, the prompts' and the template's too."""
    return [(ids, list(ids)) for ids, _ in examples]


def concatenated(lists):
    """Lists of items, one per source, as one list and each item's source (its list's index), a tensor."""
    return [item for items in lists for item in items], \
        torch.tensor([i for i, items in enumerate(lists) for _ in items], dtype=torch.long)


def best_fit_decreasing(lengths, capacity):
    """Rows of at most capacity tokens, as lists of indices into lengths: the longest item first, each
    into the row it leaves with the least room (a new row if none has room), as TRL's packing_strategy='bfd'.
    Deterministic: equal lengths keep their order, and of rows with equal room the last opened is used."""
    rows, open_rows, rooms = [], {}, []  # open_rows: room -> rows with that room; rooms: those rooms, sorted
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = bisect.bisect_left(rooms, lengths[i])
        if k == len(rooms):
            row, room = [], capacity
            rows.append(row)
        else:
            room = rooms[k]
            row = open_rows[room].pop()
            if not open_rows[room]:
                del open_rows[room], rooms[k]
        row.append(i)
        room -= lengths[i]
        if room:
            if room not in open_rows:
                open_rows[room] = []
                bisect.insort(rooms, room)
            open_rows[room].append(row)
    return rows


def row_tensor(rows):
    """Rows (lists of example indices) as a (len(rows), k) tensor, -1 after a row's last example."""
    k = max((len(row) for row in rows), default=1)
    return torch.tensor([row + [-1] * (k - len(row)) for row in rows], dtype=torch.long).view(len(rows), k)


def build_rows(rows, inputs, targets, pad_id, device='cpu'):
    """Tensors (B, T) for rows of sequences (each row a list of indices into inputs/targets), right-
    padded to the longest row: x (pad_id on padding), y (-100 on padding), doc_ids (the sequence's
    place in its row, -1 on padding) and seq (the sequence's index, -1 on padding)."""
    # at least one position: an empty row fills an epoch's last, short batch (SFTBatches)
    T = max(1, max(sum(len(inputs[i]) for i in row) for row in rows))
    x, y = torch.full((len(rows), T), pad_id), torch.full((len(rows), T), -100)
    doc_ids, seq = torch.full((len(rows), T), -1), torch.full((len(rows), T), -1)
    for r, row in enumerate(rows):
        t = 0
        for d, i in enumerate(row):
            n = len(inputs[i])
            x[r, t:t + n], y[r, t:t + n], doc_ids[r, t:t + n], seq[r, t:t + n] = inputs[i], targets[i], d, i
            t += n
    return to_device((x, y, doc_ids, seq), device)


def branched_rows(units, rows, pad_id, device='cpu'):
    """Units of a prompt shared by several completions laid out in rows (lists of unit indices, each row
    right-padded with pad_id) as a dict of tensors for GPT.forward: x (R, T) tokens, positions (R, T), mask
    (R, 1, T, T) and rows, cols, targets, owners (N,) of the scored tokens. A unit is (tokens, positions,
    branch, scored): branch 0 for the prompt, k for its k-th completion, which attends to the prompt and to
    itself only; scored: (column within the unit, target, owner) of each scored token."""
    T = max(sum(len(units[u][0]) for u in row) for row in rows)
    x = torch.full((len(rows), T), pad_id)
    positions, branch = (torch.zeros(len(rows), T, dtype=torch.long) for _ in range(2))
    unit = torch.full((len(rows), T), -1)  # which unit a position holds; -1 on padding
    scored = []
    for r, row in enumerate(rows):
        t = 0
        for u in row:
            tokens, pos, br, score = units[u]
            x[r, t:t + len(tokens)] = torch.tensor(tokens)
            positions[r, t:t + len(tokens)], branch[r, t:t + len(tokens)] = torch.tensor(pos), torch.tensor(br)
            unit[r, t:t + len(tokens)] = u
            scored += [(r, t + offset, target, owner) for offset, target, owner in score]
            t += len(tokens)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same_branch = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    mask = ((unit[:, :, None] == unit[:, None, :]) & causal & same_branch)[:, None]
    rows, cols, targets, owners = torch.tensor(scored, dtype=torch.long).view(-1, 4).T
    tensors = dict(x=x, positions=positions, mask=mask, rows=rows, cols=cols, targets=targets, owners=owners)
    return dict(zip(tensors, to_device(tensors.values(), device)))


def first_kept(order, n, keep):
    """The places in order of its first n indices that keep(indices) keeps (fewer where there are not n), looked
    for in a head of the order that grows as needed, not in the whole epoch's order each step."""
    span = 1024
    while len(fits := keep(order[:span]).nonzero().flatten()[:n]) < n and span < len(order):
        span *= 4
    return fits


class EpochSampler:
    """Indices 0..n-1 in a seeded random order, reshuffled every epoch: SFT examples, DPO pairs, RL prompts.
    Every rank draws the same order (same seed, same draws) and takes its own slice of each global batch."""

    def __init__(self, n, seed):
        self.n = n
        self.generator = torch.Generator().manual_seed(seed)
        self.order, self.position = torch.randperm(n, generator=self.generator), 0

    def remaining(self):
        """The rest of this epoch's order, or a new epoch's once it is used up; the caller advances position."""
        if self.position == self.n:
            self.order, self.position = torch.randperm(self.n, generator=self.generator), 0
        return self.order[self.position:]

    def sample(self, n, within_epoch=False, keep=None):
        """The next n indices, continuing into a new epoch's order where this one ends; within_epoch: fewer
        where fewer are left, so that no batch holds two epochs (an epoch-counted run's, run/epochs.py).
        keep(indices): which of them may be drawn, a bool each; the others are passed over (a length
        curriculum's longer examples)."""
        taken = []
        while n and not (within_epoch and taken and self.ended()):
            rest = self.remaining()
            fits = torch.arange(min(n, len(rest))) if keep is None else first_kept(rest, n, keep)
            self.position += int(fits[-1]) + 1 if len(fits) == n else len(rest)
            taken.append(rest[fits])
            n -= len(fits)
        return torch.cat(taken)

    def ended(self):
        """Whether this epoch's order is used up (the next draw starts a new epoch)."""
        return self.position == self.n

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'order': self.order, 'position': self.position}

    def load_state_dict(self, state):
        if len(state['order']) != self.n:
            raise UserError(f"the checkpoint's sampler drew from {len(state['order'])} training examples (usable lines "
                            f"of the training file), the data now has {self.n}: the training data changed. Restore it, "
                            f"{NEW_RUN}.")
        self.generator.set_state(state['generator'])
        self.order, self.position = state['order'], state['position']


class SFTBatches:
    """Batches of tokenized chat examples, (ids, labels) pairs, as rows of example indices.

    Like TokenBatches, every rank draws the rows of the whole global batch (same seed, same draws) and
    takes its own contiguous slice. Examples come in a shuffled order, reshuffled every epoch.
    Unpacked, a row is one example, and a micro-batch is padded to its longest. Length bucketing:
    bucket_batches global batches' worth of examples at a time are sorted by length and cut into global
    batches of similar lengths, served in random order, so a micro-batch carries little padding.
    Packed (pack=True), as TRL's packing_strategy='bfd': the epoch's order is cut into windows of one
    global batch's worth of tokens (n rows x max_length), each window's examples are packed whole into
    rows of up to max_length tokens by best fit decreasing, and its rows are served in random order;
    the emptiest row of a window is packed again with the next window's examples (only an epoch's last
    rows run part-empty). A row holds as many examples as fit, and every example is trained once an
    epoch (a row never spans two epochs). doc_ids keep attention and positions inside each example.
    whole_epochs (a run counted in epochs, run/epochs.py): a global batch never holds two epochs' rows either;
    an epoch's last one holds the rows left, then empty rows (they hold no label, so they add nothing), as
    Hugging Face Trainer's last batch of an epoch is smaller; epoch_steps() counts the steps of each epoch.
    Examples of several data sources (sources: each example's source index) are drawn as one set, and
    rows may mix them; get() says each position's source."""

    def __init__(self, examples, seed, pad_id, max_length, pack=False, bucket_batches=1, whole_epochs=False,
                 sources=None):
        if pack and bucket_batches > 1:
            raise UserError(f"bucket_batches={bucket_batches} with pack=True: packed rows are filled to max_length, so "
                            f"there is no padding for bucketing to cut. Set bucket_batches=1, or pack=False.")
        # position t predicts labels[t + 1]
        self.inputs = [torch.tensor(ids[:-1]) for ids, _ in examples]
        self.targets = [torch.tensor(labels[1:]) for _, labels in examples]
        self.lengths = torch.tensor([len(ids) - 1 for ids, _ in examples])
        self.label_counts = torch.tensor([int((targets != -100).sum()) for targets in self.targets])
        self.sources = torch.zeros(len(examples), dtype=torch.long) if sources is None else torch.as_tensor(sources)
        self.pad_id, self.max_length, self.pack, self.bucket_batches = pad_id, max_length, pack, bucket_batches
        self.seed, self.whole_epochs = seed, whole_epochs
        self.sampler = EpochSampler(len(examples), seed)
        self.pending = []  # rows drawn but not yet served, in serving order (each a list of example indices)
        self.carry = []  # packed: examples of the epoch taken from the order, to be packed with the next window
        self.batches_drawn = 0

    def _window(self, tokens, max_len):
        """The next examples of this epoch's order that are at most max_len long (longer ones are skipped),
        until they hold tokens tokens or the epoch ends."""
        rest, span = self.sampler.remaining(), 1024
        while True:  # in a head of the order that grows until it holds the tokens (as first_kept)
            head = rest[:span]
            fits = self.lengths[head] <= max_len
            held = torch.where(fits, self.lengths[head], 0).cumsum(0)
            if held[-1] >= tokens or span >= len(rest):
                break
            span *= 4
        end = min(int((held < tokens).sum()) + 1, len(head))
        self.sampler.position += end
        return head[:end][fits[:end]]

    def _draw(self, n, max_len):
        """Groups of rows to serve: packed, one window's rows, each a group; else bucket_batches global batches."""
        if self.pack:
            window = self.carry + self._window(n * self.max_length, max_len).tolist()
            lengths = self.lengths[window].tolist()
            rows = best_fit_decreasing(lengths, self.max_length)
            # the emptiest row waits to be packed again with the next window, unless the epoch ends here
            self.carry = []
            if rows and self.sampler.position < self.sampler.n:
                emptiest = rows.pop(min(range(len(rows)), key=lambda r: sum(lengths[i] for i in rows[r])))
                self.carry = [window[i] for i in emptiest]
            return [[[window[i] for i in row]] for row in rows]
        # the next examples of the shuffled order that are at most max_len long (longer ones are skipped)
        pool = self.sampler.sample(n * self.bucket_batches, self.whole_epochs,
                                   keep=lambda indices: self.lengths[indices] <= max_len)
        return [[[i] for i in batch.tolist()] for batch in pool[self.lengths[pool].argsort(stable=True)].split(n)]

    def sample(self, n, max_len=None):
        """The next global batch of n rows; max_len (a length curriculum) skips longer examples. Unpacked: (n,)
        example indices; packed: (n, k) rows of example indices, -1 after a row's last (row_tensor)."""
        while len(self.pending) < n and not (self.whole_epochs and self.pending and self.epoch_ended()):
            groups = self._draw(n, self.max_length if max_len is None else max_len)
            # in random order (last drawn first, as earlier versions served them: their runs resume unchanged)
            for g in torch.randperm(len(groups), generator=self.sampler.generator).flip(0).tolist():
                self.pending += groups[g]
        batch, self.pending = self.pending[:n], self.pending[n:]
        batch += [[]] * (n - len(batch))  # whole_epochs: the epoch's last batch, filled with empty rows
        self.batches_drawn += 1
        return row_tensor(batch) if self.pack else row_tensor(batch).flatten()

    def epoch_ended(self):
        """Whether every row of this epoch has been drawn."""
        return self.sampler.ended() and not self.carry

    def epoch_steps(self, n, epochs, max_len=None):
        """The steps, global batches of n rows in whole epochs, of each of the first `epochs` epochs: drawn as a run
        drawing them from its start does (packed rows, examples a curriculum skips and all), on a copy started from
        the seed; this one is left as it is. max_len(step): a length curriculum's limit at each step."""
        if not self.pack and max_len is None:  # every example once an epoch, one a row
            return [-(-self.sampler.n // n)] * epochs
        replay = copy.copy(self)
        replay.sampler, replay.pending, replay.carry = EpochSampler(self.sampler.n, self.seed), [], []
        replay.whole_epochs = True
        steps = []
        for _ in range(epochs):
            steps.append(0)
            while not steps[-1] or replay.pending or not replay.epoch_ended():
                replay.sample(n, max_len(sum(steps)) if max_len else None)
                steps[-1] += 1
        return steps

    def rows(self, indices):
        """Examples (n,) as rows for get(): packed, into rows of up to max_length tokens by best fit
        decreasing (as row_tensor); unpacked, as they are (one a row)."""
        if not self.pack:
            return indices
        indices = indices.tolist()
        rows = best_fit_decreasing(self.lengths[indices].tolist(), self.max_length)
        return row_tensor([[indices[i] for i in row] for row in rows])

    def count_tokens(self, rows):
        return int(self.lengths[rows[rows >= 0]].sum())

    def count_labels(self, rows):
        """Positions with a label (the ones that go through the output layer)."""
        return int(self.label_counts[rows[rows >= 0]].sum())

    def get(self, rows, device='cpu'):
        """(x, y, doc_ids, sources) for rows of examples (as sample() or rows() gives them), right-padded to the
        longest row (y is -100 on padding and prompts). doc_ids (B, T) numbers the examples of each packed row (-1
        on padding), so that each is attended to and positioned as alone; None without packing, where no mask is
        needed: causal attention never sees the padding after a token. sources (B, T): each position's source
        (0 on padding)."""
        rows = [[i for i in row if i >= 0] for row in rows.reshape(len(rows), -1).tolist()]
        x, y, doc_ids, seq = build_rows(rows, self.inputs, self.targets, self.pad_id, device)
        return x, y, doc_ids if self.pack else None, self.sources.to(seq.device)[seq.clamp(min=0)]

    def state_dict(self):
        return {**self.sampler.state_dict(), 'pending': row_tensor(self.pending),
                'carry': torch.tensor(self.carry, dtype=torch.long), 'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)
        pending, carry = state['pending'], state.get('carry', torch.tensor([])).tolist()
        if isinstance(pending, list):  # earlier versions: global batches of examples, served from the end
            pending = torch.cat(pending[::-1])[:, None] if pending else row_tensor([])
        rows = [[i for i in row if i >= 0] for row in pending.tolist()]
        if not self.pack:  # resumed with pack=False: the examples of packed rows one a row
            rows, carry = [[i] for row in rows + [carry] for i in row], []
        self.pending, self.carry, self.batches_drawn = rows, carry, state['batches_drawn']


# -----------------------------------------------------------------------------
# preference pairs (train_dpo.py): a prompt with a chosen and a rejected completion

# where an Anthropic HH transcript's turns begin
HH_TURN = re.compile(r'(?:^|\n\n)(Human|Assistant):')


def hh_transcript(text, key):
    """An Anthropic HH transcript ("\\n\\nHuman: ...\\n\\nAssistant: ...") as user/assistant messages,
    each content stripped of the blanks around it; ValueError if text is not one."""
    parts = HH_TURN.split(text)  # text before the first turn, then (role, content) pairs
    if parts[0].strip() or len(parts) == 1:
        raise ValueError(f'"{key}" is a string with no "prompt" beside it, so it must be a whole Anthropic HH '
                         f'transcript "\\n\\nHuman: ...\\n\\nAssistant: ..." (or give a "prompt" key and "{key}" as '
                         f'the reply alone); got {json.dumps(text)[:80]}')
    return [{'role': 'user' if role == 'Human' else 'assistant', 'content': content.strip()}
            for role, content in zip(parts[1::2], parts[2::2])]


def preference_pair(record):
    """(prompt messages, chosen reply, rejected reply) of a JSONL record, each reply an assistant message (its
    text, or tool calls as well); ValueError if malformed.
    Without "prompt", chosen and rejected are whole conversations (message lists, or Anthropic HH
    transcripts as strings) that must be the same up to their last turn: the prompt is the turns
    before it, the completions the last turn of each."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if 'chosen' not in record or 'rejected' not in record:
        raise ValueError(f'a preference pair needs "chosen" and "rejected" (and usually "prompt"); got keys '
                         f'{sorted(record)}')
    chosen, rejected = record['chosen'], record['rejected']
    if 'prompt' in record:
        prompt = record['prompt']
        if not isinstance(prompt, (str, list)):
            raise ValueError(f'"prompt" must be a string or a list of {{"role": ..., "content": ...}} messages, '
                             f'got {json.dumps(prompt)[:80]}')
        prompt = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else message_list(prompt, 'prompt')
    elif 'conversations' in record:  # ShareGPT's (LLaMA-Factory's): the prompt's turns, and one reply turn each
        prompt = sharegpt_messages(record['conversations'])
        chosen, rejected = ([value] if isinstance(value, dict) else value for value in (chosen, rejected))
        chosen, rejected = (sharegpt_messages(value) if isinstance(value, list) else value
                            for value in (chosen, rejected))
    else:  # implicit prompt: the turns before the last, which chosen and rejected must share
        conversations = []
        for key, value in (('chosen', chosen), ('rejected', rejected)):
            if not isinstance(value, (str, list)):
                raise ValueError(f'"{key}" with no "prompt" beside it must be a whole conversation: an Anthropic HH '
                                 f'transcript string "\\n\\nHuman: ...\\n\\nAssistant: ..." or a list of '
                                 f'{{"role": ..., "content": ...}} messages; got {json.dumps(value)[:80]}')
            conversations.append(hh_transcript(value, key) if isinstance(value, str) else message_list(value, key))
        chosen, rejected = conversations
        same = ('with no "prompt", "chosen" and "rejected" must be the same conversation up to their last turn, '
                'the assistant\'s reply; but')
        if len(chosen) != len(rejected) or not chosen:
            raise ValueError(f'{same} chosen has {len(chosen)} turns and rejected {len(rejected)}')
        if chosen[-1]['role'] != 'assistant' or rejected[-1]['role'] != 'assistant':
            raise ValueError(f'{same} the last turn is a {chosen[-1]["role"]} turn in chosen, a '
                             f'{rejected[-1]["role"]} turn in rejected')
        shared = 0
        while shared < len(chosen) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if shared < len(chosen) - 1:
            raise ValueError(f'{same} they differ at turn {shared + 1} of {len(chosen)} (chosen: '
                             f'{json.dumps(chosen[shared]["content"])[:40]}, rejected: '
                             f'{json.dumps(rejected[shared]["content"])[:40]})')
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if prompt and prompt[-1]['role'] == 'assistant':
        raise ValueError("the prompt ends with an assistant turn; chosen and rejected are the assistant's reply "
                         "to the prompt's last user turn")

    def reply(value, key):
        if isinstance(value, str):
            return {'role': 'assistant', 'content': value}
        if not isinstance(value, list):
            raise ValueError(f'"{key}" must be the reply as a string (the usual form) or as [{{"role": "assistant", '
                             f'"content": ...}}]; got {json.dumps(value)[:80]}')
        messages = message_list(value, key)
        if len(messages) != 1 or messages[0]['role'] != 'assistant':
            raise ValueError(f'"{key}" must be one assistant reply: a string or [{{"role": "assistant", '
                             f'"content": ...}}], got {len(messages)} message(s) after the prompt')
        return messages[0]
    return prompt, reply(chosen, 'chosen'), reply(rejected, 'rejected')


def encode_pair(tokenizer, prompt, chosen, rejected, tools=None):
    """Token ids (prompt, chosen completion, rejected completion); a reply is its text or an assistant
    message. Each completion is tokenized together with its prompt and split at the prompt's length,
    after checking that the prompt's tokens are unchanged by what follows them."""
    prompt_ids = tokenizer.encode_prompt(prompt, tools)
    completions = []
    for reply in (chosen, rejected):
        turn = reply if isinstance(reply, dict) else {'role': 'assistant', 'content': reply}
        ids = tokenizer.encode_chat(prompt + [turn], tools)[0]
        if ids[:len(prompt_ids)] != prompt_ids:
            raise ValueError("the prompt's tokens change when a completion follows it; the chat template must "
                             "end the prompt on a special token")
        completions.append(ids[len(prompt_ids):])
    return prompt_ids, *completions


def load_preference_split(path, tokenizer, max_length, max_prompt_length, skip_malformed=False):
    """Read and tokenize one JSONL split of preference pairs: returns (references, pairs).
    references: (full prompt ids, chosen text) per pair, for exact-match evaluation (a chosen tool call: its
    text as the template writes it). pairs: (prompt, chosen, rejected) token ids fitted to max_length: the
    prompt keeps its last max_prompt_length tokens, each completion its first max_length - len(prompt); a
    pair with a completion left empty, or with chosen == rejected (as given, or once cut), is dropped. A
    malformed line is an error naming path:line, or with skip_malformed skipped and counted."""
    if not os.path.isfile(path):
        raise UserError(f"preference data file {path} does not exist. Point dpo_data at a folder holding "
                        f"train.jsonl and val.jsonl (test.jsonl optional), or leave it '' for the embedded pairs.")
    references, pairs, prompts_cut, completions_cut, dropped, identical = [], [], 0, 0, 0, 0

    def parse(record):
        (prompt, chosen, rejected), tools = preference_pair(record), chat_tools(record)
        # encoded first: a template that cannot write the replies refuses them
        encoded = encode_pair(tokenizer, prompt, chosen, rejected, tools)
        return reply_reference(tokenizer, prompt + [chosen], tools), *encoded
    parsed, skipped = read_jsonl(path, parse, skip_malformed)
    for reference, prompt_ids, chosen_ids, rejected_ids in parsed:
        references.append((prompt_ids, reference))
        if len(prompt_ids) > max_prompt_length:
            prompt_ids, prompts_cut = prompt_ids[-max_prompt_length:], prompts_cut + 1
        room = max_length - len(prompt_ids)
        if room < 1:
            dropped += 1
            continue
        if max(len(chosen_ids), len(rejected_ids)) > room:
            chosen_ids, rejected_ids, completions_cut = chosen_ids[:room], rejected_ids[:room], completions_cut + 1
        # no preference to learn (identical, or alike up to where they were cut)
        if chosen_ids == rejected_ids:
            identical += 1
            continue
        pairs.append((prompt_ids, chosen_ids, rejected_ids))
    print(f"{path}: {len(pairs):,} pairs ({prompts_cut} prompts cut to max_prompt_length={max_prompt_length}, "
          f"{completions_cut} completions cut and {dropped} pairs dropped at max_length={max_length}, "
          f"{identical} pairs dropped with chosen == rejected, {skipped} malformed lines skipped)")
    if not pairs:
        raise UserError(f"{path} holds no usable preference pairs ({skipped} malformed lines skipped, {dropped} "
                        f"dropped because max_prompt_length={max_prompt_length} leaves no room in max_length="
                        f"{max_length}, {identical} with chosen == rejected). Each line must be one JSON pair, e.g. "
                        f"{{\"prompt\": \"What is 2+2?\", \"chosen\": \"4\", \"rejected\": \"5\"}}; raise "
                        f"max_length or lower max_prompt_length.")
    return references, pairs


class PreferenceBatches:
    """Batches of preference pairs for DPO. Like SFTBatches, every rank draws the pair indices of the
    whole global batch (same seed, same draws, a new shuffle each epoch) and takes its own slice.
    get() serves chosen and rejected completions in one batch, so one forward pass scores both.
    whole_epochs (a run counted in epochs): an epoch's last batch holds the pairs left, then -1 (no pair),
    which train_dpo.py leaves out of every sum."""

    def __init__(self, pairs, seed, pad_id, max_length, pack=False, whole_epochs=False):
        self.pairs = pairs
        # padded layout: chosen sequences of all pairs, then rejected ones
        self.inputs, self.targets = [], []
        for completion in (1, 2):
            for pair in pairs:
                prompt, reply = pair[0], pair[completion]
                # position t predicts token t + 1
                self.inputs.append(torch.tensor((prompt + reply)[:-1]))
                self.targets.append(torch.tensor(([-100] * len(prompt) + reply)[1:]))
        self.n_pairs = len(pairs)
        self.completion_tokens = torch.tensor([[len(c), len(r)] for _, c, r in pairs])  # (pairs, 2)
        # input tokens per pair
        self.lengths = torch.tensor([len(x) for x in self.inputs]).view(2, -1).sum(0)
        self.pad_id, self.max_length, self.pack, self.whole_epochs = pad_id, max_length, pack, whole_epochs
        self.sampler = EpochSampler(self.n_pairs, seed)
        self.batches_drawn = 0

    def sample(self, n):
        """Pair indices of the next global batch of n pairs, in shuffled order; a new shuffle each epoch."""
        self.batches_drawn += 1
        indices = self.sampler.sample(n, self.whole_epochs)
        return torch.cat([indices, indices.new_full((n - len(indices),), -1)])

    def epoch_steps(self, n, epochs):
        """The steps, global batches of n pairs in whole epochs, of each of the first `epochs` epochs."""
        return [-(-self.n_pairs // n)] * epochs

    def count_tokens(self, indices):
        return int(self.lengths[indices[indices >= 0]].sum())

    def get(self, indices, device='cpu'):
        """The n pairs at indices as a dict of tensors: x (B, T) tokens; positions (B, T) and mask
        (B, 1, T, T) (None when padded: plain causal attention); rows, cols (N,) the positions whose
        logits are scored, targets (N,) the completion tokens they predict, and owners (N,) the
        sequence each belongs to: the k-th pair's chosen completion is k, its rejected one n + k.
        Padded: the chosen sequences, then the rejected ones, one per row, right-padded.
        Packed (pack=True, padding-free): each pair is laid out once as prompt, chosen, rejected. Both
        completions attend to the prompt and to themselves only and continue its positions, and the
        prompt's last position scores the first token of both, so the prompt is computed once and
        every completion token sees exactly what it would see in its own row. Pairs fill rows of up
        to 2 * max_length tokens, best fit decreasing."""
        if not self.pack:
            sequences = indices.tolist() + [i + self.n_pairs for i in indices.tolist()]
            x, y, _, seq = build_rows([[s] for s in range(len(sequences))], [self.inputs[s] for s in sequences],
                                      [self.targets[s] for s in sequences], self.pad_id, device)
            rows, cols = (y != -100).nonzero(as_tuple=True)
            return dict(x=x, positions=None, mask=None, rows=rows, cols=cols, targets=y[rows, cols],
                        owners=seq[rows, cols])
        n, units = len(indices), []
        for k, i in enumerate(indices.tolist()):
            prompt, chosen, rejected = self.pairs[i]
            p, c = len(prompt), len(chosen) - 1  # a completion's last token is only a target
            tokens = prompt + chosen[:-1] + rejected[:-1]
            positions = list(range(p)) + list(range(p, p + c)) + list(range(p, p + len(rejected) - 1))
            branch = [0] * p + [1] * c + [2] * (len(rejected) - 1)
            scored = [(p - 1 + t, target, k) for t, target in enumerate(chosen)]
            scored += [(p - 1, rejected[0], n + k)]
            scored += [(p + c + t, target, n + k) for t, target in enumerate(rejected[1:])]
            units.append((tokens, positions, branch, scored))
        return branched_rows(units, best_fit_decreasing([len(u[0]) for u in units], 2 * self.max_length), self.pad_id,
                             device)

    def state_dict(self):
        return {**self.sampler.state_dict(), 'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)
        self.batches_drawn = state['batches_drawn']


# -----------------------------------------------------------------------------
# prompts for online RL (train_rl.py): the model writes the completions, a reward scores them

def rl_prompt(record):
    """The prompt messages of an RL JSONL record, ending in a user turn; ValueError if malformed:
        {"prompt": P, ...}          P a string (one user turn) or a list of messages
        {"messages": [...], ...}    the conversation; a final assistant turn (a reference answer) is left out
        {"conversations": [...]}    ShareGPT's, likewise
    The record's other fields are the reward function's (e.g. the number tasks' "response")."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if 'prompt' in record:
        prompt = record['prompt']
        if not isinstance(prompt, (str, list)):
            raise ValueError(f'"prompt" must be a string or a list of {{"role": ..., "content": ...}} messages, '
                             f'got {json.dumps(prompt)[:80]}')
        messages = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else message_list(prompt, 'prompt')
    elif 'messages' in record or 'conversations' in record:
        messages = conversation(record)
        if messages and messages[-1]['role'] == 'assistant':
            messages = messages[:-1]
    else:
        raise ValueError(f'an RL prompt needs "prompt" (a string or messages), "messages" or ShareGPT\'s '
                         f'"conversations"; got keys {sorted(record)}')
    if not messages or messages[-1]['role'] != 'user':
        raise ValueError("the prompt must end with a user turn, which the model answers")
    return messages


def reference_reply(record):
    """The final assistant turn of an RL record's "messages" (or ShareGPT's "conversations"): the reference
    answer rl_prompt leaves out; None if there is none."""
    messages = conversation(record) if isinstance(record, dict) else None
    return messages[-1] if messages and messages[-1]['role'] == 'assistant' else None


def rl_reference(tokenizer, record):
    """The reference answer of an RL record for held-out exact match: its "response", else its reference turn's
    text (a turn calling tools: the calls as a published model's template writes them); None without one."""
    if isinstance(record.get('response'), str):
        return record['response']
    turn = reference_reply(record)
    # nanotrain's own template writes no calls (it refuses them)
    if turn is None or (turn.get('tool_calls') and not hasattr(tokenizer, 'reply_text')):
        return None
    return reply_reference(tokenizer, rl_prompt(record) + [turn], chat_tools(record))


def load_prompt_split(path, tokenizer, max_prompt_length, skip_malformed=False):
    """Read and tokenize one JSONL split of RL prompts: a list of (prompt ids, record), the ids rendered with the
    chat template up to the assistant's turn (tokenizer.encode_prompt). A prompt longer than max_prompt_length
    tokens is dropped (cutting it would change the question) and counted; a malformed line is an error naming
    path:line, or with skip_malformed skipped and counted."""
    if not os.path.isfile(path):
        raise UserError(f"prompt file {path} does not exist. Point rl_data at a folder holding train.jsonl and "
                        f"val.jsonl (test.jsonl optional), or leave it '' for the embedded number tasks.")
    parsed, skipped = read_jsonl(path, lambda record: (tokenizer.encode_prompt(rl_prompt(record), chat_tools(record)),
                                                       record), skip_malformed)
    prompts = [(ids, record) for ids, record in parsed if len(ids) <= max_prompt_length]
    dropped = len(parsed) - len(prompts)
    print(f"{path}: {len(prompts):,} prompts ({dropped} longer than max_prompt_length={max_prompt_length} dropped, "
          f"{skipped} malformed lines skipped)")
    if not prompts:
        raise UserError(f"{path} holds no usable prompts ({skipped} malformed lines skipped, {dropped} longer than "
                        f"max_prompt_length={max_prompt_length}). Each line must be one JSON object, e.g. "
                        f"{{\"prompt\": \"What is 2+2?\", \"response\": \"4\"}}; raise max_prompt_length if they are "
                        f"too long.")
    return prompts
