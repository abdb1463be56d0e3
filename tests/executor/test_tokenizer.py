"""The checkpoint's tokenizer against transformers on the same saved files: plain prompts, chat templates
(``apply_chat_template`` with the generation prompt, special-token variables, a Qwen3-style template with
reasoning and ``{% generation %}`` blocks), decoding with special tokens skipped; the streaming
detokenizer's deltas add up to the whole decode; stop strings and held-back streaming; the checkpoint's
generation defaults (EOS ids, sampling with do_sample) and their errors; output lines flushed one by one."""

from __future__ import annotations

import json

import pytest

from executor.generation import (GenerationDefaults, RequestText, Sampling, SamplingParams, read_generation_defaults,
                                 resolve_sampling)
from executor.tokenizer import Tokenizer, TokenizerError
from executor.workload import OutputWriter
from planner.errors import ConfigError
from tests.executor.checkpoints import hf_tokenizer, save_tokenizer

VOCAB = 256
CONVERSATION = [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "two plus two", "name": None}]
#: A template in the shape of Qwen3's: reasoning content, a loop with loop controls, a namespace, tojson,
#: a {% generation %} block and an enable_thinking switch.
REASONING_TEMPLATE = (
    "{%- set ns = namespace(last_user=0) -%}"
    "{%- for message in messages -%}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{% continue %}{% endif %}"
    "<|im_start|>{{ message.role }}\n"
    "{%- if message.role == 'assistant' %}{% generation %}"
    "{%- if message.reasoning_content and loop.index0 > ns.last_user %}<think>{{ message.reasoning_content }}</think>"
    "{%- endif %}{{ message.content }}{% endgeneration %}"
    "{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}"
    "{{ {'n': messages | length} | tojson }}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(directory, VOCAB)
    return Tokenizer.from_directory(directory), hf_tokenizer(str(directory))


def test_prompts_and_chats_encode_as_transformers_encodes_them(saved):
    ours, theirs = saved
    for text in ["the capital of france is", "hello there, how are you?", "zebra xylophone", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    expected = theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True)["input_ids"]
    assert ours.encode_chat(CONVERSATION) == expected
    rendered = ours.render_chat(CONVERSATION)
    assert rendered == theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert "<|im_end|><|im_end|>" in rendered  # the eos_token variable after the assistant turn


def test_a_qwen3_style_template_renders_as_transformers_renders_it(tmp_path):
    save_tokenizer(tmp_path, VOCAB, chat_template=REASONING_TEMPLATE)
    ours, theirs = Tokenizer.from_directory(tmp_path), hf_tokenizer(str(tmp_path))
    chat = [{"role": "system", "content": "tiny"}, {"role": "user", "content": "two plus two"},
            {"role": "assistant", "content": "four", "reasoning_content": "add"}, {"role": "user", "content": "and?"},
            {"role": "assistant", "content": "six", "thinking": "add more"}]
    for kwargs in ({}, {"enable_thinking": False}):
        rendered = ours.render_chat(chat, **kwargs)
        assert rendered == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs)
    assert "<think>add more</think>six" in ours.render_chat(chat)  # "thinking" aliased to reasoning_content
    assert "<think>add</think>" not in ours.render_chat(chat)  # reasoning before the last user turn is dropped
    assert ours.render_chat(chat, enable_thinking=False).endswith("<|im_start|>assistant<think>\n\n</think>")


def test_decode_skips_special_tokens_like_transformers(saved):
    ours, theirs = saved
    ids = [1, 40, 82, 2, 0, 78, 200, 167, 2, 47]  # <|im_start|>, <|im_end|>, <|endoftext|> among words
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in ours.decode(ids)


def test_streamed_deltas_add_up_to_the_whole_decode(saved):
    ours, _ = saved
    ids = [125, 164, 128, 2, 76, 150, 36, 35, 14, 1, 91, 10, 240, 241, 5, 6, 7]
    detokenizer = ours.detokenizer()
    deltas = [detokenizer.add([token]) for token in ids]
    assert "".join(deltas) == ours.decode(ids) == detokenizer.text
    assert sum(1 for delta in deltas if delta) > len(ids) // 2  # the text arrives as it is generated


class _ByteLevel:
    """A stand-in tokenizer whose ids are UTF-8 bytes: a character split over several ids decodes to U+FFFD
    until its last byte arrives (byte-level BPE's behaviour)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def detokenizer(self):
        from executor.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self)


def test_a_character_split_over_ids_is_released_whole():
    from executor.tokenizer import IncrementalDetokenizer

    detokenizer = IncrementalDetokenizer(_ByteLevel())
    deltas = [detokenizer.add([b]) for b in "añ€b".encode()]
    assert deltas == ["a", "", "ñ", "", "", "€", "b"]


def test_stop_strings_end_the_text_and_streaming_holds_back_what_may_begin_one():
    shown: list[str] = []
    text = RequestText(_ByteLevel(), stop=["END", "\n\n"], on_text=shown.append)
    stopped = [text.add(list(piece.encode())) for piece in ("hel", "lo E", "N", "D more")]
    assert stopped == [False, False, False, True]
    assert "".join(shown) == "hello "  # "E" and "EN" were held back: they could begin "END"
    ids = list("hello END more".encode())
    assert text.finish(ids) == "hello " and "".join(shown) == "hello "
    plain: list[str] = []
    unstopped = RequestText(_ByteLevel(), on_text=plain.append)
    assert not unstopped.add(list(b"ab")) and plain == ["ab"]  # nothing held back without stop strings
    assert unstopped.finish(list(b"abc")) == "abc" and "".join(plain) == "abc"


def test_generation_defaults_from_the_checkpoint_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "text_config": {"eos_token_id": 6}}))
    defaults = read_generation_defaults(tmp_path, VOCAB)
    assert defaults.eos_ids == (5,) and defaults.eos_source.endswith("config.json")
    assert defaults.sampling == Sampling()  # no generation_config.json: greedy
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7, 8, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.05,
         "min_p": 0.0}))
    defaults = read_generation_defaults(tmp_path, VOCAB)
    assert defaults.eos_ids == (7, 8) and defaults.eos_source.endswith("generation_config.json")
    assert defaults.unapplied == ("repetition_penalty 1.05",)  # min_p 0 is neutral
    sampling = defaults.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.6, 0.95, 50)  # HF's top_k default
    assert "top_k from HF's default" in sampling.describe()
    flags = resolve_sampling(sampling, top_p=0.8)
    assert (flags.temperature, flags.top_p, flags.top_k) == (0.6, 0.8, 50) and "top_p from --top-p" in flags.describe()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert read_generation_defaults(tmp_path, VOCAB).sampling.is_greedy
    assert read_generation_defaults(None, VOCAB) == GenerationDefaults()


@pytest.mark.parametrize("content, field", [({"eos_token_id": 256}, "eos_token_id"),
                                            ({"eos_token_id": "2"}, "eos_token_id"),
                                            ({"do_sample": True, "top_p": 0.0}, "top_p"),
                                            ({"do_sample": True, "temperature": -1}, "temperature")])
def test_a_bad_generation_config_names_the_file_and_field(tmp_path, content, field):
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ConfigError) as error:
        read_generation_defaults(tmp_path, VOCAB)
    assert error.value.field == field and "generation_config.json" in str(error.value)


def test_sampling_params_are_bounded():
    assert SamplingParams(stop="x").stop == ("x",)
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -0.1}, {"max_new_tokens": 0}, {"stop": [""]},
                {"seed": 2**63}, {"max_tokens": 3}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_missing_chat_template_and_bad_messages_are_tokenizer_errors(tmp_path):
    save_tokenizer(tmp_path, VOCAB, chat_template=None)
    tokenizer = Tokenizer.from_directory(tmp_path)
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.encode_chat(CONVERSATION)
    assert Tokenizer.from_directory(tmp_path / "absent") is None
    (tmp_path / "tokenizer.json").write_text("{")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_directory(tmp_path)


def test_output_lines_are_flushed_as_they_are_written(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    out.chmod(0o640)
    partial = tmp_path / "out.jsonl.partial"
    writer = OutputWriter(out, None)
    writer.write({"request": 3})
    assert json.loads(partial.read_text()) == {"request": 3}  # on disk before the next line, file still open
    assert out.read_text() == "old\n"  # OUT untouched until the run ends
    writer.write({"request": 0})
    writer.commit()
    assert [json.loads(line)["request"] for line in out.read_text().splitlines()] == [3, 0]
    assert not partial.exists() and out.stat().st_mode & 0o777 == 0o640


def test_an_unfinished_output_leaves_out_untouched_and_keeps_the_partial_lines(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    writer = OutputWriter(out, None)
    writer.write({"request": 1})
    writer.close()  # the run failed before commit()
    assert out.read_text() == "old\n"
    assert json.loads((tmp_path / "out.jsonl.partial").read_text()) == {"request": 1}
