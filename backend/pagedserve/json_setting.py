"""Settings given as a JSON object (--hf-overrides, --speculative-config, chat template kwargs, ...),
as text on the command line or in the environment, or as a dict from Python. Torch-free."""

from __future__ import annotations

import json
from typing import Any


def parse_json_object(value: str | dict[str, Any] | None, field: str, of: str) -> dict[str, Any]:
    """The object (a copy; empty for None). ValueError naming `field` for text that is not JSON or a
    value that is not an object (`of` says what its keys are)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{field}: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: must be a JSON object of {of}, got {type(value).__name__}")
    return dict(value)
