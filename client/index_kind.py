"""The names of the page indexes (selectors), apart from their torch code so that a
command's options can list them without importing torch."""

from __future__ import annotations

import enum


class IndexKind(enum.Enum):
    HIERARCHICAL = "hierarchical"
    QUEST = "quest"
    MEAN_KEY = "meankey"
    LOWRANK = "lowrank"
    KEYCODES = "keycodes"
    ORACLE = "oracle"
