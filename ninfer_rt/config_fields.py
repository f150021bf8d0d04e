"""Typed, validating access to the JSON objects of config.json (and of a stored ModelSpec).

Every failure is a ConfigError naming the file and the dotted field path; bools are not numbers.
"""

from __future__ import annotations

import math
from typing import Any

from ninfer_rt.errors import ConfigError


class Fields:
    """Typed access to one JSON object of config.json; errors name the file and the dotted field path.

    A null value counts as absent (the default applies); bools are not numbers (`type(x) is int`).
    """

    def __init__(self, obj: dict, source: str, prefix: str):
        self.obj, self.source, self.prefix = obj, source, prefix

    def error(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.prefix}{key} {what}")

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def _absent(self, key: str, what: str) -> ConfigError:
        return self.error(key, "is missing" if key not in self.obj else f"must be {what}, got None")

    def get_int(self, key: str, default: int | None = None, minimum: int = 1, maximum: int | None = None) -> int:
        value = self.obj.get(key)
        if value is None:
            if default is None:
                raise self._absent(key, "an integer")
            return default
        if type(value) is not int:
            raise self.error(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.error(key, f"must be <= {maximum:,}, got {value:,}")
        return value

    def get_float(self, key: str, default: float | None = None, above: float | None = None,
                  minimum: float | None = None) -> float:
        value = self.obj.get(key)
        if value is None:
            if default is None:
                raise self._absent(key, "a number")
            return default
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self.error(key, f"must be a finite number, got {value!r}")
        if above is not None and not value > above:
            raise self.error(key, f"must be > {above}, got {value}")
        if minimum is not None and not value >= minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return float(value)

    def get_bool(self, key: str, default: bool | None = None) -> bool:
        value = self.obj.get(key)
        if value is None and default is not None:
            return default
        if type(value) is not bool:
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def get_dict(self, key: str) -> dict | None:
        value = self.obj.get(key)
        if value is not None and not isinstance(value, dict):
            raise self.error(key, f"must be an object, got {type(value).__name__}")
        return value

    def get_int_list(self, key: str) -> tuple[int, ...]:
        value = self.obj.get(key)
        if not (isinstance(value, list) and all(type(i) is int and i >= 0 for i in value)):
            raise self.error(key, f"must be a list of non-negative integers, got {value!r}")
        return tuple(value)


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """An `eos_token_id`-style value (null, an id, or a list of ids) as a tuple."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(type(i) is int and i >= 0 for i in items):
        raise ConfigError(f"{where} must be a token id or a list of token ids, got {value!r}")
    return tuple(items)
