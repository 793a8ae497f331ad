"""The mode registry: what a round sends and how the shard is updated, one file per mode.

A mode subclasses :class:`~ds_lowcomm.modes.base.Mode`, declares its JSON options as a dataclass
``Options`` (validated as the ``"lowcomm": {"<name>": {...}}`` sub-object by
:mod:`ds_lowcomm.config`, which is handed :data:`MODES`), and is listed here. The registry imports
the modes; no mode imports it.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Type

from ds_lowcomm.modes.acco import Acco
from ds_lowcomm.shard.context import ModeContext
from ds_lowcomm.modes.base import Mode
from ds_lowcomm.modes.demo import Demo
from ds_lowcomm.modes.desloc import Desloc
from ds_lowcomm.modes.zero1 import Zero1

MODES: Dict[str, Type[Mode]] = {cls.name: cls for cls in (Zero1, Acco, Demo, Desloc)}

for _cls in MODES.values():
    if not dataclasses.is_dataclass(_cls.Options):
        raise TypeError(f"{_cls.__name__}.Options must be a dataclass")

__all__ = ["MODES", "Mode", "ModeContext"]
