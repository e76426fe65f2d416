"""Typed errors shared by every layer: a configuration that cannot run exactly is refused with one."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration: ``knob`` names the setting, the message says what works."""

    def __init__(self, knob: str, message: str) -> None:
        super().__init__(f"{knob}: {message}")
        self.knob = knob
        self.detail = message
