"""Every Cleave process started with this folder on ``PYTHONPATH`` logs at DEBUG.

Cleave has no log-level flag (it logs at INFO); the secrets test wants what a debugging
operator would see, including the libraries' own debug lines (aiohttp, redis-py, asyncio),
so it forces the level wherever ``logging.basicConfig`` is called. Python imports
``sitecustomize`` at start-up in every interpreter, children and grandchildren included.
"""

from __future__ import annotations

import logging
from typing import Any

_basic_config = logging.basicConfig


def _debug_basic_config(**kwargs: Any) -> None:
    _basic_config(**{**kwargs, "level": logging.DEBUG})


logging.basicConfig = _debug_basic_config
