"""The named cost profiles and :func:`load_profile`: above both the profile model (:mod:`.profile`) and the
published profiles fitted with it (:mod:`.published`), so neither imports the other's caller."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .errors import ProfileError
from .profile import CostProfile
from .published import CASES, h200_profile

PROFILE_NAMES = ("measured", *CASES)


def load_profile(spec: str | CostProfile) -> CostProfile:
    """A named profile (:data:`PROFILE_NAMES`) or a JSON file's."""
    if isinstance(spec, CostProfile):
        return spec
    if spec == "measured":
        text = resources.files("kvshuttle.planner").joinpath("data", "measured.json").read_text("utf-8")
        return CostProfile.from_dict(json.loads(text), source="measured")
    if spec in PROFILE_NAMES[1:]:
        return h200_profile(spec)
    path = Path(spec)
    if not path.is_file():
        raise ProfileError(f"no profile {spec!r}: use one of {', '.join(PROFILE_NAMES)} or a JSON file")
    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: not a readable JSON profile: {exc}") from None
    return CostProfile.from_dict(data, source=str(path))

