"""Graph analyses and transforms over the traced model."""

from __future__ import annotations

__all__: list[str] = []
