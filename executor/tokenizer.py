"""A checkpoint's tokenizer: HF ``tokenizers`` on its tokenizer.json, its chat template through jinja2.

``Tokenizer.from_directory(DIR)`` reads DIR/tokenizer.json, the special tokens and
``clean_up_tokenization_spaces`` of DIR/tokenizer_config.json (special_tokens_map.json fills the
special tokens it lacks) and the chat template (DIR/chat_template.jinja, else tokenizer_config.json's
``chat_template``; a named set of templates uses "default"). A directory without tokenizer.json
has no tokenizer (None): its checkpoint serves ids only.

The three operations are transformers' own, so a model served here sees the ids HF would feed it:

- ``encode(text)``: ``tokenizer(text)["input_ids"]`` (the backend with its special-token post-processor);
- ``encode_chat(messages)``: ``apply_chat_template(messages, add_generation_prompt=True)``: messages
  without their None-valued keys, reasoning fields aliased as transformers aliases them, the template
  rendered by a sandboxed jinja2 environment set up like transformers' (``trim_blocks``,
  ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a non-escaping ``tojson``)
  with the special tokens (``bos_token``, ``eos_token``, ...) as variables, then encoded without
  special tokens;
- ``decode(ids)``: ``decode(ids, skip_special_tokens=True)`` (with transformers' clean-up of spaces
  before punctuation where tokenizer_config.json asks for it and the model is not BPE).

``IncrementalDetokenizer`` turns a growing id list into text deltas for streaming (vLLM's prefix and
read offsets): a delta is released once the text decoded so far does not end in an incomplete
character.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: The named special tokens a chat template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: Names of a message's reasoning; transformers fills the first and "thinking" from whichever is given.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: Decoded text ending in this (an incomplete UTF-8 sequence) is not released by the streaming detokenizer.
REPLACEMENT_CHARACTER = "\ufffd"


class TokenizerError(ValueError):
    """Text input that cannot be tokenized: no tokenizer files, no chat template, a bad message or template."""


@dataclass(frozen=True)
class Tokenizer:
    """A checkpoint's tokenizer (see the module docstring); build it with ``from_directory``."""

    backend: Any  # tokenizers.Tokenizer
    source: str  # the directory, for error messages
    chat_template: str | None
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ... as the chat template sees them
    clean_up_spaces: bool
    _compiled: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer | None:
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        from tokenizers import Tokenizer as Backend

        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            backend = Backend.from_file(str(path))
        except Exception as error:  # the Rust library raises plain Exceptions for a malformed file
            raise TokenizerError(f"{path}: cannot load: {error}") from None
        config = _read_json_object(directory / TOKENIZER_CONFIG_FILE)
        legacy = _read_json_object(directory / SPECIAL_TOKENS_FILE)
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_text(config.get(name, legacy.get(name)))
            if token is not None:
                special[name] = token
        return cls(backend, str(directory), _chat_template(directory, config), special,
                   bool(config.get("clean_up_tokenization_spaces", False)))

    # ---------------------------------------------------------------- text -> ids

    def encode(self, text: str) -> list[int]:
        """The ids of a plain prompt, special tokens added as the tokenizer's post-processor adds them."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
        """The chat template rendered over ``messages`` with the generation prompt (transformers' way)."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: no chat template (chat_template.jinja or tokenizer_config.json's "
                                 "chat_template); give a \"prompt\" instead of \"messages\"")
        chat = _template_messages(messages)
        import jinja2

        try:
            return self._template().render(messages=chat, tools=None, documents=None, add_generation_prompt=True,
                                           **{**self.special_tokens, **template_kwargs})
        except jinja2.TemplateError as error:
            raise TokenizerError(f"{self.source}: chat template: {error}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> list[int]:
        """The ids of a chat: its rendered template encoded without added special tokens."""
        return self.backend.encode(self.render_chat(messages, **template_kwargs), add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---------------------------------------------------------------- ids -> text

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        text = self.backend.decode(list(ids), skip_special_tokens=True)
        if self.clean_up_spaces and type(self.backend.model).__name__ != "BPE":
            text = clean_up_tokenization(text)
        return text

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def _template(self) -> Any:
        compiled = self._compiled.get("chat")
        if compiled is None:
            compiled = self._compiled["chat"] = compile_chat_template(self.chat_template, self.source)
        return compiled


class IncrementalDetokenizer:
    """Text deltas of a growing id list: ``add(ids)`` returns the text they complete (maybe "").

    ``ids[prefix:read]`` are the ids of the last released delta, decoded again as context for the
    ids after them, so that a token's leading space or a character split over several byte-level
    tokens comes out as the whole decode gives it (text-generation-inference's and vLLM's offsets).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # released so far
        self._prefix = 0
        self._read = 0

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in ids)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read])
        new_text = self.tokenizer.decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: spaces before punctuation and English contractions."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


def compile_chat_template(template: str, source: str) -> Any:
    """A jinja2 template in a sandbox set up as transformers sets it up for chat templates: the same
    options, filters and globals (its ``dict`` and ``namespace`` refuse underscore names, as there)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """transformers' ``{% generation %}`` block (it marks assistant tokens there): the body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, dict(*args, **kwargs))

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                               namespace=TemplateNamespace)
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise TokenizerError(f"{source}: chat template line {error.lineno}: {error.message}") from None


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: plain dicts without None values, reasoning aliased."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise TokenizerError("messages: expected a non-empty list of {\"role\": ..., \"content\": ...} objects")
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise TokenizerError(f"messages[{index}]: expected an object with \"role\" and \"content\"")
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in REASONING_FIELDS if plain.get(key) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        chat.append(plain)
    return chat


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    path = directory / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except OSError as error:
            raise TokenizerError(f"{path}: cannot read: {error.strerror}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, Mapping)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{directory / TOKENIZER_CONFIG_FILE}: chat_template: expected a string")
    return template


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise TokenizerError(f"{path}: cannot read: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{path}: malformed JSON at line {error.lineno}: {error.msg}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data
