"""A request's prompt as a vLLM engine tokenizes it, for precise prefix scoring on real vLLM.

vLLM names a KV block by a hash chain over the prompt's *token ids* (`wakegate.kvevents.
vllm_block_hashes` reproduces the chain from the ids). To credit the endpoint whose engine holds a
request's prefix, the gateway must get the same ids the engine will: render a chat request with
the model's own chat template and tokenize the text with the model's own tokenizer, as vLLM's
OpenAI server does (the template adds the special tokens, so the text is encoded without adding
more; a completion's string prompt is encoded with them).

:class:`EnginePrompt` reads a Hugging Face model folder's ``tokenizer.json`` (the `tokenizers`
format) and ``tokenizer_config.json`` (``chat_template`` and the special tokens a template may
name). Templates render in a sandbox with the helpers Hugging Face templates expect
(``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now``) and the same
whitespace rules (``trim_blocks``, ``lstrip_blocks``).

Requests it cannot render as the engine would (tools, non-text content parts, a custom template
in the body) give None: they are scored without precise credit, never with a wrong one.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["EnginePrompt", "PromptError"]

MAX_TOKENS = 65536
"""Token ids computed per request at most (longer prompts are cut: only leading blocks score)."""

SEGMENTS = 2048
"""Pieces of text between special tokens whose token ids are kept (least recently used dropped)."""


class PromptError(Exception):
    """The model folder has no usable tokenizer or chat template."""


def _special(config: Mapping[str, Any], name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, Mapping):  # an AddedToken: {"content": ..., ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class EnginePrompt:
    """The token ids an engine serving the model in ``folder`` gives a request's prompt."""

    __slots__ = ("_cache", "_ids", "_specials", "_split", "_template", "_tokenizer", "folder", "hits", "misses")

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise PromptError("the `tokenizers` package is not installed") from exc
        try:
            self._tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise PromptError(f"{self.folder / 'tokenizer.json'}: {exc}") from exc
        config: Mapping[str, Any] = {}
        config_file = self.folder / "tokenizer_config.json"
        if config_file.exists():
            try:
                loaded = json.loads(config_file.read_text())
            except (OSError, ValueError) as exc:
                raise PromptError(f"{config_file}: {exc}") from exc
            config = loaded if isinstance(loaded, Mapping) else {}
        self._specials = {
            name: value
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (value := _special(config, name)) is not None
        }
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = self.folder / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.exists():
            template = jinja_file.read_text()
        self._template = _compile(template) if isinstance(template, str) else None
        self._split, self._ids = _segmenter(self.folder / "tokenizer.json")
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self.hits = self.misses = 0

    def token_ids(self, body: Mapping[str, Any] | None) -> list[int] | None:
        """The prompt's token ids for a chat or completion request body, or None when the gateway
        cannot know them exactly."""
        if body is None:
            return None
        messages = body.get("messages")
        if messages is not None:
            text = self.chat_text(body)
            if text is None:
                return None
            return self._encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self._tokenizer.encode(prompt, add_special_tokens=True).ids[:MAX_TOKENS]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt[:MAX_TOKENS]
        return None

    def chat_text(self, body: Mapping[str, Any]) -> str | None:
        """A chat request rendered by the model's chat template, or None (see the module docstring)."""
        if self._template is None:
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        if body.get("tools") or body.get("chat_template") or body.get("chat_template_kwargs"):
            return None
        conversation = _conversation(messages)
        if conversation is None:
            return None
        add_generation_prompt = body.get("add_generation_prompt", True)
        if body.get("continue_final_message"):
            return None
        try:
            text: str = self._template.render(
                messages=conversation,
                add_generation_prompt=bool(add_generation_prompt),
                tools=None,
                documents=None,
                **self._specials,
            )
        except Exception:  # a template may raise_exception() on what it does not accept
            return None
        return text


    def _encode(self, text: str) -> list[int]:
        """``text`` tokenized without added specials; piece by piece where that is exact (see
        :func:`_segmenter`), each piece's ids kept, so a long system prompt shared by many requests
        is tokenized once and each request pays only for what differs."""
        if self._split is None:
            return self._tokenizer.encode(text, add_special_tokens=False).ids[:MAX_TOKENS]
        ids: list[int] = []
        cache = self._cache
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token
                ids.append(self._ids[piece])
            elif piece:
                got = cache.get(piece)
                if got is None:
                    self.misses += 1
                    got = self._tokenizer.encode(piece, add_special_tokens=False).ids
                    cache[piece] = got
                    if len(cache) > SEGMENTS:
                        cache.popitem(last=False)
                else:
                    self.hits += 1
                    cache.move_to_end(piece)
                ids += got
            if len(ids) >= MAX_TOKENS:
                break
        return ids[:MAX_TOKENS]


def _segmenter(path: Path) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A pattern that splits text at the tokenizer's added tokens (captured), and their ids; or
    None where encoding piece by piece might differ from encoding the whole text.

    `tokenizers` takes added tokens out of the text first and pre-tokenizes each piece between
    them on its own, so with a byte-level pre-tokenizer (GPT-2, Llama 3, Qwen and most current
    models), no normalizer and added tokens that strip nothing around them, the ids of the whole
    are the pieces' ids in order. Anything else (a normalizer, SentencePiece's metaspace that
    treats the first piece apart, added tokens with ``lstrip``/``rstrip``/``single_word``) is
    encoded whole."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, {}
    pre = spec.get("pre_tokenizer") or {}
    added = spec.get("added_tokens") or []
    if spec.get("normalizer") or pre.get("type") != "ByteLevel" or not added:
        return None, {}
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None, {}
    ids = {t["content"]: t["id"] for t in added if isinstance(t.get("content"), str) and t["content"]}
    if not ids:
        return None, {}
    # Longest first, as the tokenizer matches the longest added token at a position.
    alternatives = "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True))
    return re.compile(f"({alternatives})"), ids


def _conversation(messages: Sequence[Any]) -> list[dict[str, Any]] | None:
    """Messages as a chat template sees them: text parts of a content list joined by newlines."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return None
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    return None
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            return None
        if message.get("tool_calls"):
            return None
        out.append({"role": message["role"], "content": content})
    return out


def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}…{% endgeneration %}`` (marks assistant tokens for training): the body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise PromptError(f"chat template: {exc}") from exc
