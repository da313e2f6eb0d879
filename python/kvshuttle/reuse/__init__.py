"""The reuse read: decide -> claim -> read -> wait -> finish for one request, or recompute with a reason.

It sits above the policy and the transfer engine and uses both; nothing below imports it.
"""

from __future__ import annotations

from .read import ReuseReader
from .results import Failure, ReuseArgumentError, ReuseResult

__all__ = ["Failure", "ReuseArgumentError", "ReuseReader", "ReuseResult"]
