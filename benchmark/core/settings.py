"""What every settings dataclass (training recipe, method settings) raises for a value outside
its allowed range. Types are checked by the config schema; ranges by ``__post_init__``."""
from __future__ import annotations


class SettingsError(ValueError):
    """A setting outside its allowed range; the message reads ``key=value: expected ...``.

    The runner prefixes the config path (``methods.swag.``) when it reports one.
    """

    def __init__(self, key: str, value: object, expected: str) -> None:
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key}={value!r}: expected {expected}")

    def __reduce__(self):
        return type(self), (self.key, self.value, self.expected)


def require(ok: bool, key: str, value: object, expected: str) -> None:
    """Raise ``SettingsError(key, value, expected)`` unless ``ok``."""
    if not ok:
        raise SettingsError(key, value, expected)
