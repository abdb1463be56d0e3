"""Checkpoint directories as users have them, built for tests: a random HF model saved by
``save_pretrained`` (one file, or shards of a small ``max_shard_size``), a tokenizer trained here with
the ``tokenizers`` library and saved by transformers (tokenizer.json, tokenizer_config.json,
chat_template.jinja), and a generation_config.json."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from planner.config import ModelConfig
from tests.hf_reference import hf_model

#: A chat template in the Qwen style: a default system turn, <|im_start|> role headers, eos_token
#: after assistant turns (a special-token variable), the generation prompt.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\ntiny<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the capital of france is paris and the capital of italy is rome",
    "a tiny model writes tiny words about the sea and the sky",
    "you are a tiny model\nsay hello to the user\nhello there, how are you?",
    "two plus two is four; three plus three is six!",
    "system user assistant: the quick brown fox jumps over the lazy dog",
]


def train_tokenizer(vocab_size: int):
    """A small BPE (Metaspace pre-tokenizer and decoder, like SentencePiece) of ``vocab_size`` ids: the chat
    special tokens first (ids 0, 1, 2), the corpus's merges, then added words up to the size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS, "<unk>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    # Words for the ids the corpus left unused, so every id a random model samples has text.
    tokenizer.add_tokens([f"w{index}" for index in range(tokenizer.get_vocab_size(), vocab_size)])
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer


def save_tokenizer(directory: Path, vocab_size: int, chat_template: str | None = CHAT_TEMPLATE):
    """transformers' PreTrainedTokenizerFast over ``train_tokenizer``, saved into ``directory``; returned."""
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size), eos_token="<|im_end|>",
                                           pad_token="<|endoftext|>", unk_token="<unk>", chat_template=chat_template)
    hf_tokenizer.save_pretrained(directory)
    return hf_tokenizer


def save_checkpoint(directory: Path, model: ModelConfig, *, seed: int, max_shard_size: str | None = None,
                    eos_token_id: int | list[int] | None = None, tokenizer: bool = True) -> torch.nn.Module:
    """A random HF model of ``model``'s shape saved into ``directory`` (sharded when ``max_shard_size`` is
    given), with the test tokenizer and, given ``eos_token_id``, a generation_config.json that names it.
    Returns the HF model (float32, eval)."""
    hf = hf_model(model, seed=seed)
    if eos_token_id is not None:
        hf.generation_config.eos_token_id = eos_token_id
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(directory, **kwargs)
    if tokenizer:
        save_tokenizer(directory, model.vocab_size)
    return hf


@functools.cache
def hf_tokenizer(directory: str):
    """transformers' tokenizer of a saved checkpoint (the reference the tests compare with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def hf_generate(hf: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """HF generate's new ids for one prompt, greedy unless kwargs say otherwise; stops at the model's
    generation_config EOS as HF does."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()
