"""What an integer argument is, for every front class and textbook: one rule, so that no
two of them disagree.

An integer argument is a value ``operator.index`` takes (a Python int, a numpy or torch
integer scalar), never a bool (``True`` is an int to Python, never a count to a user),
a float or a string.

Example::

    >>> int_argument(numpy.int64(3), "chunk_bytes", low=1)
    3
    >>> int_argument(True, "chunk_bytes", low=1)
    Traceback (most recent call last):
    ValueError: chunk_bytes must be an int >= 1; got True
"""

from __future__ import annotations

import operator


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer argument: ``operator.index`` takes it, and it is not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def int_argument(
    value: object,
    name: str,
    *,
    low: int | None = None,
    high: int | None = None,
    error: type = ValueError,
    must: str | None = None,
) -> int:
    """``value`` as an int in ``[low, high]`` (either bound may be None), or ``error``
    naming ``name`` (prefix it with the method) and what it must be (``must``, e.g.
    ``"a positive int"``; by default "an int" and the range)."""
    if is_int(value):
        number = operator.index(value)
        if (low is None or number >= low) and (high is None or number <= high):
            return number
    if low is not None and high is not None:
        bounds = f" in [{low}, {high}]"
    elif low is not None:
        bounds = f" >= {low}"
    else:
        bounds = "" if high is None else f" <= {high}"
    raise error(f"{name} must be {must or 'an int' + bounds}; got {value!r}")
