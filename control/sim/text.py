"""What the simulator generates and how it counts tokens: deterministic words, embeddings.

Tokens, as this simulator counts them
-------------------------------------
* A prompt token is a whitespace-separated word (``len(text.split())``). Chat
  prompts count the words of every message's text content (string content, or
  the ``text`` of ``{"type": "text"}`` parts); roles and the chat template are
  free. A completions prompt given as token ids (a list of ints) counts one per id.
* Generated text is deterministic: token ``i`` is ``WORDS[i % len(WORDS)]``,
  joined by single spaces, so a streamed answer concatenates to exactly the
  non-streamed one and ``completion_tokens == len(text.split())``.
* A request generates ``max_tokens`` (or ``max_completion_tokens``; default
  ``--max-tokens-default``) tokens and finishes with ``"length"``, unless
  ``--eos-after-tokens N`` is set and smaller, in which case it finishes with
  ``"stop"`` after N tokens.
"""

from __future__ import annotations

import hashlib
import json
import struct
from functools import lru_cache

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    "seven", "small", "robots", "hum", "softly", "under", "bright", "stars", "and",
    "one", "old", "lighthouse", "keeps", "watch", "across", "calm", "grey", "water",
    "until", "morning", "comes", "again",
)  # fmt: skip
NW = len(WORDS)
dumps = json.JSONEncoder(separators=(",", ":")).encode
#: JSON-encoded token pieces: the first token has no leading space, later ones do.
FIRST_JSON = tuple(dumps(w).encode() for w in WORDS)
NEXT_JSON = tuple(dumps(" " + w).encode() for w in WORDS)


@lru_cache(maxsize=4096)
def generated_text(n: int) -> str:
    """The deterministic text of ``n`` generated tokens."""
    return " ".join([WORDS[i % NW] for i in range(n)])


@lru_cache(maxsize=4096)
def generated_words(n: int) -> tuple[str, ...]:
    """The tokens of :func:`generated_text` ``(n)``."""
    return tuple(WORDS[i % NW] for i in range(n))


def count_words(text: str) -> int:
    return len(text.split())


def embedding_vector(data: bytes, dim: int) -> list[float]:
    """A deterministic unit vector of ``dim`` floats derived from ``data``."""
    raw = hashlib.shake_128(data).digest(2 * dim)
    vec = [x / 32767.5 - 1.0 for x in struct.unpack(f"<{dim}H", raw)]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [v / norm for v in vec]
