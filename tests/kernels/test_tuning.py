"""``lowprec.kernels.tuning``: one object the launchers read at launch time, changed for a
``with`` block by ``override``."""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels import tuning
from lowprec.kernels.fp8_args import kernel_fp8_args
from lowprec.kernels.grid import launches


def test_override_sets_and_restores():
    before = dict(vars(tuning.tuning))
    with tuning.override(hw_cvt=False, col_mode=3, block_gluon=False) as t:
        assert t is tuning.tuning
        assert (t.hw_cvt, t.col_mode, t.block_gluon) == (False, 3, False)
    assert vars(tuning.tuning) == before


def test_override_restores_after_an_error_and_a_dict_changed_inside():
    before = dict(tuning.tuning.split_both)
    with pytest.raises(RuntimeError):
        with tuning.override(split_both=dict(before)):
            tuning.tuning.split_both["pertensor"] = not before["pertensor"]
            raise RuntimeError
    assert tuning.tuning.split_both == before


def test_override_refuses_unknown_names():
    before = tuning.tuning.hw_cvt
    with pytest.raises(AttributeError):
        with tuning.override(hw_cvt=not before, no_such_switch=1):
            pass
    assert tuning.tuning.hw_cvt == before


def test_launchers_read_tuning_at_launch_time():
    assert launches(True, True, "pertensor") == [(True, True)]
    with tuning.override(split_both=dict.fromkeys(tuning.tuning.split_both, True)):
        assert launches(True, True, "pertensor") == [(True, False), (False, True)]
        assert launches(True, False, "pertensor") == [(True, False)]
    with tuning.override(hw_cvt=False, col_mode=3):
        args = kernel_fp8_args(torch.float8_e4m3fn)
    assert (args["HW_CVT"], args["COL_MODE"]) == (False, 3)
    assert kernel_fp8_args(torch.float8_e4m3fn)["HW_CVT"] is True
