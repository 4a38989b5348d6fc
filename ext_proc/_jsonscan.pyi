"""Types of the C extension ``_jsonscan.c`` (intake's scan and the estimate's per-element loops)."""

from typing import Any

def scan(body: bytes, max_elements: int, max_containers: int, max_strings: int, max_depth: int, max_outside: int,
         max_fractions: int, /) -> tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int, int]:
    """(containers, elements, strings, depth, over, keys, escapes, unicode escapes, fractions, numbers, arrays,
    escapes in non-ASCII strings, bytes of non-ASCII keys, non-ASCII strings, bytes of non-ASCII strings with escapes) —
    ``bodycost.Counts``: counts outside strings;
    ``over`` 0, or the cap passed (1 elements, 2 containers, 3 strings, 4 depth, 5 bytes outside strings,
    whitespace an eighth each, 6 non-integer numbers), where the pass stopped."""

def token_ids(body: bytes, key: bytes, /) -> tuple[int, int, int, int, int] | None:
    """(start, end, lists, total, longest): the top-level member ``key`` when it is a list of integers
    (lists -1) or a list of lists of integers; None otherwise, or when the key is written with escapes or
    given twice."""

def all_ints(value: list[Any], /) -> bool:
    """Whether every item is exactly an int (not a bool, float, str, container or None)."""

def walk_tokens(value: Any, ratio: float, opaque: frozenset[str], skipped: frozenset[str], media_tokens: int,
                into: list[str] = ..., /) -> int | None:
    """``Estimator._walk`` with a characters-per-token ratio; None for a type orjson does not make. With
    ``into``, the strings are appended to it (for a tokenizer) and only the media parts' tokens returned."""

def bad_message(messages: list[Any], chat: bool, /) -> int:
    """The index of the first message the estimate refuses, or -1."""
