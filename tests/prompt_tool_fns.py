"""Tools for tests/test_prompt_tools.py, importable by the sandbox's child (tests/ is on its path)."""


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text to upper-case.
    """
    return text.upper()


def undocumented(a: int) -> int:
    return a


def unhinted(a):  # noqa: ANN001, ANN201  (what cannot be described)
    """Return a.

    Args:
        a: A value.
    """
    return a
