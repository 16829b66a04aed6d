"""Background imports (training/background_imports.py): orbax is imported beside the first training steps."""

from __future__ import annotations

import json
import sys

import pytest

from training.background_imports import import_in_background

pytestmark = pytest.mark.unit


def test_background_import_gives_the_module_once():
    future = import_in_background("json")
    assert future.result() is json
    mod = import_in_background("colorsys").result()
    assert mod is sys.modules["colorsys"] and import_in_background("colorsys").result() is mod
