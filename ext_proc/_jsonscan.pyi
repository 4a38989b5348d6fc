"""Types of the C extension ``_jsonscan.c`` (intake's structural scan)."""

def scan(body: bytes, max_elements: int, max_containers: int, max_strings: int, /) -> tuple[int, int, int, int]:
    """(containers, elements, strings, over): counts outside strings; ``over`` 0, or the cap passed
    (1 elements, 2 containers, 3 strings), where the pass stopped."""

def all_ints(value: list[object], /) -> bool:
    """Whether every item is exactly an int (not a bool, float, str, container or None)."""
