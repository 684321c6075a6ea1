"""A custom objects module that names its classes in a ``CUSTOM_OBJECTS`` dict (not registered)."""

from __future__ import annotations

from tests.keras_custom import Scale

CUSTOM_OBJECTS = {"jt>Scale": Scale}
