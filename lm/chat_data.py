r"""
Fine-tuning data: chat examples for supervised fine-tuning (train.py training_type='sft' | 'lora'),
preference pairs for DPO (train_dpo.py) and prompts for online RL (train_rl.py), read from JSONL,
encoded with the chat template of lm/tokenizer.py, and batched padded or packed.

SFT examples, one per line; the three JSONL formats map to turns as:
    {"prompt": P, "response": R}                   -> user P, assistant R
    {"instruction": I, "input": X, "output": O}     -> user I + "\n\n" + X (just I if X is empty), assistant O
    {"messages": [{"role": ..., "content": ...}]}   -> as given (at least one assistant turn)

Preference pairs, a prompt with a chosen and a rejected completion; JSONL formats, one pair per line:
    {"prompt": P, "chosen": C, "rejected": R}   P: a string (one user turn) or a list of messages;
                                                 C, R: strings, or [{"role": "assistant", "content": ...}]
    {"chosen": [messages], "rejected": [messages]}   implicit prompt: whole conversations, the same up
                                                     to their last turn, which is the assistant's reply
    {"chosen": "\n\nHuman: ...\n\nAssistant: ...", "rejected": "..."}   Anthropic HH: whole transcripts
                                                     as strings, read as the implicit prompt's messages
The prompt is rendered with the chat template up to its final <|assistant|> (as SFT's prompts are);
a completion is the reply's content and the <|end|> that closes it (the EOS token).
"""

import json
import os
import re

import torch

from configurator import UserError
from lm.tokenizer import CHAT_ROLES
from run.device import to_device


# -----------------------------------------------------------------------------
# supervised fine-tuning (train.py training_type='sft' | 'lora'): chat examples from JSONL

def string_field(value, key):
    if not isinstance(value, str):
        raise ValueError(f'"{key}" must be a string, got {type(value).__name__}')
    return value


def message_list(value, key):
    """value checked to be a list of {"role", "content"} messages (roles of the template); ValueError if not."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError(f'"{key}" must be a list of {{"role": ..., "content": ...}} objects, got '
                         f'{json.dumps(value)[:80]}')
    for m in value:
        if m.get('role') not in CHAT_ROLES:
            raise ValueError(f"message role {m.get('role')!r} in \"{key}\" is not one of {', '.join(CHAT_ROLES)}")
        string_field(m.get('content'), 'content')
    return [{'role': m['role'], 'content': m['content']} for m in value]


def chat_messages(record):
    """A JSONL record in any of the three formats as a list of {'role', 'content'}; ValueError if malformed."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if 'messages' in record:
        messages = message_list(record['messages'], 'messages')
        if not any(m['role'] == 'assistant' for m in messages):
            raise ValueError('"messages" has no assistant turn, so there is nothing to learn')
        return messages
    if 'prompt' in record and 'response' in record:
        return [{'role': 'user', 'content': string_field(record['prompt'], 'prompt')},
                {'role': 'assistant', 'content': string_field(record['response'], 'response')}]
    if 'instruction' in record and 'output' in record:
        user = string_field(record['instruction'], 'instruction')
        if string_field(record.get('input', ''), 'input'):
            user += '\n\n' + record['input']
        return [{'role': 'user', 'content': user},
                {'role': 'assistant', 'content': string_field(record['output'], 'output')}]
    raise ValueError(f"unknown format (keys {sorted(record)}); use {{\"prompt\", \"response\"}}, Alpaca "
                     f"{{\"instruction\", \"input\", \"output\"}} or "
                     f"{{\"messages\": [{{\"role\", \"content\"}}, ...]}}")


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
    (conversations, examples), examples as (ids, labels). A malformed line is an error naming
    path:line, or with skip_malformed skipped and counted. An example longer than max_length tokens
    is cut to its first max_length tokens (overlong='truncate'; dropped if no response token is
    left) or dropped (overlong='drop'). The counts are printed; no examples left is an error."""
    if overlong not in ('truncate', 'drop'):
        raise UserError(f"overlong={overlong!r} is not supported; use 'truncate' or 'drop'.")
    if not os.path.isfile(path):
        raise UserError(f"SFT data file {path} does not exist. Point sft_data at a folder holding train.jsonl "
                        f"and val.jsonl (test.jsonl optional), or leave it '' for the embedded number tasks.")
    conversations, examples, truncated, dropped = [], [], 0, 0

    def parse(record):
        messages = chat_messages(record)
        # a char tokenizer rejects unknown characters
        return messages, *tokenizer.encode_chat(messages)
    parsed, skipped = read_jsonl(path, parse, skip_malformed)
    for messages, ids, labels in parsed:
        conversations.append(messages)
        if len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
            if overlong == 'drop' or all(label == -100 for label in labels[1:]):
                dropped += 1
                continue
            truncated += 1
        examples.append((ids, labels))
    print(f"{path}: {len(examples):,} examples ({truncated} truncated and {dropped} dropped at max_length="
          f"{max_length} by overlong={overlong!r}, {skipped} malformed lines skipped)")
    if not examples:
        raise UserError(f"{path} holds no usable examples ({skipped} malformed lines skipped, {dropped} longer "
                        f"than max_length={max_length} dropped). Each line must be one JSON example, e.g. "
                        f"{{\"prompt\": \"What is 2+2?\", \"response\": \"4\"}}; raise max_length if they are "
                        f"too long.")
    return conversations, examples


def load_sft_data(folder, tokenizer, max_length, overlong='truncate', skip_malformed=False):
    """An SFT data folder's (train examples, val examples, held-out conversations): the held-out ones,
    for exact match, are test.jsonl's, else val.jsonl's. Each split is read by load_sft_split."""
    def read_split(name):
        return load_sft_split(os.path.join(folder, f'{name}.jsonl'), tokenizer, max_length, overlong, skip_malformed)
    _, train_examples = read_split('train')
    val_conversations, val_examples = read_split('val')
    held_out = read_split('test')[0] if os.path.exists(os.path.join(folder, 'test.jsonl')) else val_conversations
    return train_examples, val_examples, held_out


def pack_rows(items, lengths, capacity):
    """Items grouped into rows of at most capacity tokens: first fit, longest first."""
    rows, room = [], []
    for n, i in sorted(zip(lengths, items), key=lambda pair: -pair[0]):
        r = next((r for r, free in enumerate(room) if free >= n), None)
        if r is None:
            rows.append([i])
            room.append(capacity - n)
        else:
            rows[r].append(i)
            room[r] -= n
    return rows


def build_rows(rows, inputs, targets, pad_id, device='cpu'):
    """Tensors (B, T) for rows of sequences (each row a list of indices into inputs/targets), right-
    padded to the longest row: x (pad_id on padding), y (-100 on padding), doc_ids (the sequence's
    place in its row, -1 on padding) and seq (the sequence's index, -1 on padding)."""
    T = max(sum(len(inputs[i]) for i in row) for row in rows)
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


class SFTBatches:
    """Batches of tokenized chat examples: (ids, labels) pairs.

    Like TokenBatches, every rank draws the indices of the whole global batch (same seed, same draws)
    and takes its own contiguous slice. Examples come in a shuffled order, reshuffled every epoch.
    Length bucketing: bucket_batches global batches' worth of examples at a time are sorted by length
    and cut into global batches of similar lengths, served in random order, so a micro-batch (padded
    to its longest example) carries little padding. With pack=True several examples share a row of up
    to max_length tokens, and doc_ids keep attention inside each example."""

    def __init__(self, examples, seed, pad_id, max_length, pack=False, bucket_batches=1):
        # position t predicts labels[t + 1]
        self.inputs = [torch.tensor(ids[:-1]) for ids, _ in examples]
        self.targets = [torch.tensor(labels[1:]) for _, labels in examples]
        self.lengths = torch.tensor([len(ids) - 1 for ids, _ in examples])
        self.label_counts = torch.tensor([int((targets != -100).sum()) for targets in self.targets])
        self.pad_id, self.max_length, self.pack, self.bucket_batches = pad_id, max_length, pack, bucket_batches
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(examples), generator=self.generator)
        self.position = 0       # next place in order
        self.pending = []       # global batches of the current bucket, not yet served
        self.batches_drawn = 0

    def _take(self, n, max_len):
        """The next n indices of the shuffled order that are at most max_len long; a new shuffle each epoch."""
        taken = []
        while n:
            if self.position == len(self.order):
                self.order = torch.randperm(len(self.lengths), generator=self.generator)
                self.position = 0
            rest = self.order[self.position:]
            fits = (self.lengths[rest] <= max_len).nonzero().flatten()[:n]
            self.position += int(fits[-1]) + 1 if len(fits) == n else len(rest)
            taken.append(rest[fits])
            n -= len(fits)
        return torch.cat(taken)

    def sample(self, n, max_len=None):
        """Indices of the next global batch of n examples; max_len (a length curriculum) skips longer ones."""
        # (a resumed run may use another global batch)
        if not self.pending or len(self.pending[-1]) != n:
            pool = self._take(n * self.bucket_batches, self.max_length if max_len is None else max_len)
            batches = pool[self.lengths[pool].argsort(stable=True)].split(n)
            self.pending = [batches[i] for i in torch.randperm(len(batches), generator=self.generator)]
        self.batches_drawn += 1
        return self.pending.pop()

    def count_tokens(self, indices):
        return int(self.lengths[indices].sum())

    def count_labels(self, indices):
        """Positions with a label (the ones that go through the output layer)."""
        return int(self.label_counts[indices].sum())

    def _rows(self, indices):
        if not self.pack:
            return [[i] for i in indices]
        return pack_rows(indices, [len(self.inputs[i]) for i in indices], self.max_length)

    def get(self, indices, device='cpu'):
        """(x, y, doc_ids) for the examples at indices, right-padded to the longest row (y is -100 on
        padding and prompts). doc_ids (B, T) numbers the examples of each packed row (-1 on padding);
        None without packing, where no mask is needed: causal attention never sees the padding after a token."""
        x, y, doc_ids, _ = build_rows(self._rows(indices.tolist()), self.inputs, self.targets, self.pad_id, device)
        return x, y, doc_ids if self.pack else None

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'order': self.order, 'position': self.position,
                'pending': list(self.pending), 'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])
        self.order, self.position = state['order'], state['position']
        self.pending, self.batches_drawn = list(state['pending']), state['batches_drawn']


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
    """(prompt messages, chosen text, rejected text) of a JSONL record; ValueError if malformed.
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
            return value
        if not isinstance(value, list):
            raise ValueError(f'"{key}" must be the reply as a string (the usual form) or as [{{"role": "assistant", '
                             f'"content": ...}}]; got {json.dumps(value)[:80]}')
        messages = message_list(value, key)
        if len(messages) != 1 or messages[0]['role'] != 'assistant':
            raise ValueError(f'"{key}" must be one assistant reply: a string or [{{"role": "assistant", '
                             f'"content": ...}}], got {len(messages)} message(s) after the prompt')
        return messages[0]['content']
    return prompt, reply(chosen, 'chosen'), reply(rejected, 'rejected')


def encode_pair(tokenizer, prompt, chosen, rejected):
    """Token ids (prompt, chosen completion, rejected completion). Each completion is tokenized
    together with its prompt and split at the prompt's length, after checking that the prompt's
    tokens are unchanged by what follows them."""
    prompt_ids = tokenizer.encode_prompt(prompt)
    completions = []
    for reply in (chosen, rejected):
        ids = tokenizer.encode_chat(prompt + [{'role': 'assistant', 'content': reply}])[0]
        if ids[:len(prompt_ids)] != prompt_ids:
            raise ValueError("the prompt's tokens change when a completion follows it; the chat template must "
                             "end the prompt on a special token")
        completions.append(ids[len(prompt_ids):])
    return prompt_ids, *completions


def load_preference_split(path, tokenizer, max_length, max_prompt_length, skip_malformed=False):
    """Read and tokenize one JSONL split of preference pairs: returns (references, pairs).
    references: (full prompt ids, chosen text) per pair, for exact-match evaluation. pairs: (prompt,
    chosen, rejected) token ids fitted to max_length: the prompt keeps its last max_prompt_length
    tokens, each completion its first max_length - len(prompt); a pair with a completion left empty, or
    with chosen == rejected (as given, or once cut), is dropped. A malformed line is an error naming
    path:line, or with skip_malformed skipped and counted."""
    if not os.path.isfile(path):
        raise UserError(f"preference data file {path} does not exist. Point dpo_data at a folder holding "
                        f"train.jsonl and val.jsonl (test.jsonl optional), or leave it '' for the embedded pairs.")
    references, pairs, prompts_cut, completions_cut, dropped, identical = [], [], 0, 0, 0, 0

    def parse(record):
        prompt, chosen, rejected = preference_pair(record)
        return chosen, *encode_pair(tokenizer, prompt, chosen, rejected)
    parsed, skipped = read_jsonl(path, parse, skip_malformed)
    for chosen, prompt_ids, chosen_ids, rejected_ids in parsed:
        references.append((prompt_ids, chosen))
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
    get() serves chosen and rejected completions in one batch, so one forward pass scores both."""

    def __init__(self, pairs, seed, pad_id, max_length, pack=False):
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
        self.pad_id, self.max_length, self.pack = pad_id, max_length, pack
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(self.n_pairs, generator=self.generator)
        self.position = 0
        self.batches_drawn = 0

    def sample(self, n):
        """Pair indices of the next global batch of n pairs, in shuffled order; a new shuffle each epoch."""
        taken = []
        while n:
            if self.position == self.n_pairs:
                self.order, self.position = torch.randperm(self.n_pairs, generator=self.generator), 0
            taken.append(self.order[self.position:self.position + n])
            self.position += len(taken[-1])
            n -= len(taken[-1])
        self.batches_drawn += 1
        return torch.cat(taken)

    def count_tokens(self, indices):
        return int(self.lengths[indices].sum())

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
        to 2 * max_length tokens, first fit."""
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
        packed = pack_rows(range(n), [len(u[0]) for u in units], 2 * self.max_length)
        return branched_rows(units, packed, self.pad_id, device)

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'order': self.order, 'position': self.position,
                'batches_drawn': self.batches_drawn}

    def load_state_dict(self, state):
        if len(state['order']) != self.n_pairs:
            raise UserError(f"the checkpoint's sampler drew from {len(state['order'])} training pairs, the data now "
                            f"has {self.n_pairs}: the training data changed. Restore it, or start a new run.")
        self.generator.set_state(state['generator'])
        self.order, self.position, self.batches_drawn = state['order'], state['position'], state['batches_drawn']


# -----------------------------------------------------------------------------
# prompts for online RL (train_rl.py): the model writes the completions, a reward scores them

def rl_prompt(record):
    """The prompt messages of an RL JSONL record, ending in a user turn; ValueError if malformed:
        {"prompt": P, ...}          P a string (one user turn) or a list of messages
        {"messages": [...], ...}    the conversation; a final assistant turn (a reference answer) is left out
    The record's other fields are the reward function's (e.g. the number tasks' "response")."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if 'prompt' in record:
        prompt = record['prompt']
        if not isinstance(prompt, (str, list)):
            raise ValueError(f'"prompt" must be a string or a list of {{"role": ..., "content": ...}} messages, '
                             f'got {json.dumps(prompt)[:80]}')
        messages = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else message_list(prompt, 'prompt')
    elif 'messages' in record:
        messages = message_list(record['messages'], 'messages')
        if messages and messages[-1]['role'] == 'assistant':
            messages = messages[:-1]
    else:
        raise ValueError(f'an RL prompt needs "prompt" (a string or messages) or "messages"; got keys {sorted(record)}')
    if not messages or messages[-1]['role'] != 'user':
        raise ValueError("the prompt must end with a user turn, which the model answers")
    return messages


def load_prompt_split(path, tokenizer, max_prompt_length, skip_malformed=False):
    """Read and tokenize one JSONL split of RL prompts: a list of (prompt ids, record), the ids rendered with the
    chat template up to the assistant's turn (tokenizer.encode_prompt). A prompt longer than max_prompt_length
    tokens is dropped (cutting it would change the question) and counted; a malformed line is an error naming
    path:line, or with skip_malformed skipped and counted."""
    if not os.path.isfile(path):
        raise UserError(f"prompt file {path} does not exist. Point rl_data at a folder holding train.jsonl and "
                        f"val.jsonl (test.jsonl optional), or leave it '' for the embedded number tasks.")
    parsed, skipped = read_jsonl(path, lambda record: (tokenizer.encode_prompt(rl_prompt(record)), record),
                                 skip_malformed)
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


class PromptSampler:
    """Indices of the prompts of each RL step, in shuffled order, a new shuffle each epoch; every rank draws the
    same global batch (same seed) and takes its own slice."""

    def __init__(self, n_prompts, seed):
        self.n_prompts = n_prompts
        self.generator = torch.Generator().manual_seed(seed)
        self.order, self.position = torch.randperm(n_prompts, generator=self.generator), 0

    def sample(self, n):
        taken = []
        while n:
            if self.position == self.n_prompts:
                self.order, self.position = torch.randperm(self.n_prompts, generator=self.generator), 0
            taken.append(self.order[self.position:self.position + n])
            self.position += len(taken[-1])
            n -= len(taken[-1])
        return torch.cat(taken)

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'order': self.order, 'position': self.position}

    def load_state_dict(self, state):
        if len(state['order']) != self.n_prompts:
            raise UserError(f"the checkpoint's sampler drew from {len(state['order'])} training prompts, the data "
                            f"now has {self.n_prompts}: the training data changed. Restore it, or start a new run.")
        self.generator.set_state(state['generator'])
        self.order, self.position = state['order'], state['position']
