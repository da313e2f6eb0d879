"""Type tests shared by the argument checks of every layer, defined once so the layers agree.

``True`` is not one token, ``40.5`` is not 40 tokens, and ``10**400`` is an int but not a float: each test answers
without raising, so a check can turn any wrong value into its own named error.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

import numpy as np

Real = int | float | np.integer[Any] | np.floating[Any]


def is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[Real]:
    """A Python or numpy integer or float, not a bool (complex, str, None, arrays are not)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def as_float(value: object) -> float | None:
    """``float(value)`` for a real number that fits a float (NaN and infinities included), else None."""
    if not is_real(value):
        return None
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        return None


def is_finite(value: object) -> bool:
    """A real number that is finite as a float (an int too large for a float is not)."""
    number = as_float(value)
    return number is not None and math.isfinite(number)
