"""The kernels' switches are read from the environment once, until ``reread``."""

from __future__ import annotations

import os

from engine.models import quantized_matmul_cuda as kernel
from engine.models.kernel_switches import reread, switch

NAME = "MLX_DESK_TEST_SWITCH"


def test_a_switch_keeps_its_first_read_until_reread():
    os.environ.pop(NAME, None)
    reread()
    try:
        assert switch(NAME, "7") == "7"
        os.environ[NAME] = "3"  # behind the switches' back: not seen yet
        assert switch(NAME, "7") == "7"
        reread()
        assert switch(NAME, "7") == "3"
    finally:
        os.environ.pop(NAME, None)
        reread()


def test_monkeypatch_makes_the_kernels_read_again(monkeypatch):
    assert kernel.columns(1) == 2 * kernel.COLUMNS
    monkeypatch.setenv(kernel.COLUMNS_ENV, "4")
    assert kernel.columns(1) == kernel.COLUMNS
    monkeypatch.delenv(kernel.COLUMNS_ENV)
    assert kernel.columns(1) == 2 * kernel.COLUMNS
