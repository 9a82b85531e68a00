"""
The data a GPT run trains and evaluates on, set up from its config keys before the loop starts:

- gpt_run_data: train.py's, token windows of data_dir (pretraining) or chat examples of sft_data
  (training_type 'sft' | 'lora', the embedded number tasks when sft_data is '').
- preference_run_data: train_dpo.py's, the preference pairs of dpo_data (the embedded number-task pairs
  when dpo_data is '').
- prompt_run_data: train_rl.py's, the prompts of rl_data (the embedded number tasks when rl_data is '').

Each gives the batches, the fixed held-out indices an eval scores, and the held-out prompts exact match
answers; a fine-tuning run also the hash of its training file, which a resumed run must still match.
"""
import hashlib
import json
import os
from typing import NamedTuple

import torch

from configurator import UserError
from lm.token_data import TokenBatches, eval_offsets
from lm.chat_data import PreferenceBatches, SFTBatches, load_preference_split, load_prompt_split, load_sft_data
from lm.tokenizer import prompt_and_answer
from run.run_folder import training_data_hash
from run.runtime import prepare_once
from tasks.number_tasks import NUMBER_TASKS_DIR, PREFERENCES_DIR, prepare_number_tasks


class GPTRunData(NamedTuple):
    train_batches: object  # TokenBatches, or SFTBatches when fine-tuning
    val_batches: object
    val_indices: torch.Tensor  # the fixed held-out windows or examples an eval scores
    sample_prompt: list  # the token ids the final sample starts from
    exact_match_prompts: list  # (prompt ids, reference text) pairs
    train_data_hash: str  # None when pretraining


class PreferenceRunData(NamedTuple):
    train_batches: PreferenceBatches
    val_batches: PreferenceBatches
    val_indices: torch.Tensor
    exact_match_prompts: list
    train_data_hash: str
    val_path: str  # val.jsonl, whose hash the precomputed reference log-probs depend on


def gpt_run_data(config, data_dir, tokenizer, ckpt, compute):
    """The GPTRunData of a train.py run (config: its config keys; ckpt: the continued run's checkpoint, or
    None). Pretraining samples data_dir's token windows, starts its sample from a newline and has no
    exact-match prompts nor data hash; fine-tuning reads chat examples with tokenizer (a chat tokenizer) and
    samples from the first held-out prompt. Rank 0 prepares the embedded number tasks once (compute:
    compute_init's)."""
    seed, eval_examples = config['seed'], config['eval_iters'] * config['batch_size']
    if config['training_type'] == 'from_scratch':
        block_size = config['block_size']
        train_batches = TokenBatches(os.path.join(data_dir, 'train.bin'), block_size, seed)
        val_batches = TokenBatches(os.path.join(data_dir, 'val.bin'), block_size, seed)
        val_indices = eval_offsets(val_batches.n_tokens, block_size, eval_examples)
        return GPTRunData(train_batches, val_batches, val_indices, tokenizer.encode('\n'), [], None)
    max_length, sft_data = config['max_length'], config['sft_data']
    if max_length > config['block_size']:
        raise UserError(f"max_length={max_length} is longer than block_size={config['block_size']}; lower max_length.")
    if not sft_data:
        prepare_once(prepare_number_tasks, compute)
        sft_data = NUMBER_TASKS_DIR
    train_examples, val_examples, held_out = load_sft_data(sft_data, tokenizer, max_length, config['overlong'],
                                                           config['skip_malformed'])
    exact_match_prompts = [prompt_and_answer(tokenizer, messages)
                           for messages in held_out[:config['exact_match_examples']]]
    sample_prompt = prompt_and_answer(tokenizer, held_out[0])[0]
    train_batches = SFTBatches(train_examples, seed, tokenizer.eos_id, max_length, config['pack'],
                               config['bucket_batches'])
    val_batches = SFTBatches(val_examples, seed, tokenizer.eos_id, max_length, config['pack'])
    val_indices = torch.arange(min(len(val_examples), eval_examples))
    train_data_hash = training_data_hash(os.path.join(sft_data, 'train.jsonl'), ckpt, config['out_dir'], 'sft_data')
    return GPTRunData(train_batches, val_batches, val_indices, sample_prompt, exact_match_prompts, train_data_hash)


def preference_run_data(config, tokenizer, block_size, ckpt, compute):
    """The PreferenceRunData of a train_dpo.py run (config: its config keys; tokenizer: the chat tokenizer;
    block_size: the model's; ckpt: the continued run's checkpoint, or None). Rank 0 prepares the embedded
    number-task pairs once (compute: compute_init's)."""
    max_length, max_prompt_length, dpo_data = config['max_length'], config['max_prompt_length'], config['dpo_data']
    if not dpo_data:
        prepare_once(prepare_number_tasks, compute, out_dir=PREFERENCES_DIR, seed=1, preferences=True)
        dpo_data = PREFERENCES_DIR
    if max_length > block_size:
        raise UserError(f"max_length={max_length} is longer than the model's block_size={block_size}; "
                        f"lower max_length.")
    if max_prompt_length >= max_length:
        raise UserError(f"max_prompt_length={max_prompt_length} must leave room for a completion in "
                        f"max_length={max_length}; lower it.")

    def load_split(path):
        return load_preference_split(path, tokenizer, max_length, max_prompt_length, config['skip_malformed'])

    train_path, val_path, test_path = (os.path.join(dpo_data, f'{name}.jsonl') for name in ('train', 'val', 'test'))
    _, train_pairs = load_split(train_path)
    val_references, val_pairs = load_split(val_path)
    exact_match_examples = config['exact_match_examples']
    held_out = (load_split(test_path)[0] if exact_match_examples and os.path.exists(test_path) else val_references)
    train_batches = PreferenceBatches(train_pairs, config['seed'], tokenizer.eos_id, max_length, config['pack'])
    val_batches = PreferenceBatches(val_pairs, config['seed'], tokenizer.eos_id, max_length, config['pack'])
    val_indices = torch.arange(min(len(val_pairs), config['eval_pairs']))
    train_data_hash = training_data_hash(train_path, ckpt, config['out_dir'], 'dpo_data')
    return PreferenceRunData(train_batches, val_batches, val_indices, held_out[:exact_match_examples], train_data_hash,
                             val_path)


class PromptRunData(NamedTuple):
    train_prompts: list  # (prompt ids, record, where) of train.jsonl
    eval_prompts: list  # the same of the held-out split (test.jsonl, else val.jsonl), first eval_prompts
    exact_match_prompts: list  # (prompt ids, reference text) of held-out rows with a "response"
    train_data_hash: str
    train_prompts_hash: str  # of the tokenized prompts alone: a fixed reward field does not change it


def prompt_run_data(config, tokenizer, ckpt, compute):
    """The PromptRunData of a train_rl.py run (config: its config keys; tokenizer: the chat tokenizer; ckpt: the
    continued run's checkpoint, or None). Rank 0 prepares the embedded number tasks once (compute:
    compute_init's)."""
    rl_data = config['rl_data']
    if not rl_data:
        prepare_once(prepare_number_tasks, compute)
        rl_data = NUMBER_TASKS_DIR

    def load_split(name):
        path = os.path.join(rl_data, f'{name}.jsonl')
        prompts = load_prompt_split(path, tokenizer, config['max_prompt_length'], config['skip_malformed'])
        return [(ids, record, f'{path} (prompt {i + 1})') for i, (ids, record) in enumerate(prompts)]

    train_path, test_path = os.path.join(rl_data, 'train.jsonl'), os.path.join(rl_data, 'test.jsonl')
    train_prompts = load_split('train')
    held_out = load_split('test' if os.path.exists(test_path) else 'val')
    exact_match_prompts = [(ids, record['response']) for ids, record, _ in held_out
                           if isinstance(record.get('response'), str)][:config['exact_match_examples']]
    prompts_hash = hashlib.sha256(json.dumps([ids for ids, _, _ in train_prompts]).encode()).hexdigest()
    same_prompts = bool(ckpt) and ckpt.get('train_prompts_hash') == prompts_hash
    train_data_hash = training_data_hash(train_path, ckpt, config['out_dir'], 'rl_data', same_prompts)
    return PromptRunData(train_prompts, held_out[:config['eval_prompts']], exact_match_prompts, train_data_hash,
                         prompts_hash)
