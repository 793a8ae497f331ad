"""NCCL's environment, checked without a GPU: the start-up warning for CUDA_DEVICE_MAX_CONNECTIONS=1
under a mode that overlaps communication, and the estimate of an NCCL communicator's buffers."""
from __future__ import annotations

import logging

import pytest
import torch

from ds_lowcomm.comm.topology import warn_one_hardware_queue
from ds_lowcomm.config import LowCommConfigError, parse
from ds_lowcomm.modes import MODES
from workers import config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("mode, options, env, cuda, warns", [
    ("zero1", {"zero1": {"overlap": True}}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, True, True),
    ("acco", {}, {"CUDA_DEVICE_MAX_CONNECTIONS": " 1 "}, True, True),
    ("automatic", {}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, True, True),  # may pick an overlapping mode
    ("zero1", {}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, True, False),  # no overlap: nothing to lose
    ("zero1", {"zero1": {"overlap": True}}, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, True, False),
    ("zero1", {"zero1": {"overlap": True}}, {}, True, False),
    ("zero1", {"zero1": {"overlap": True}}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, False, False),  # not CUDA
], ids=["zero1-overlap", "acco", "automatic", "zero1", "eight", "unset", "cpu"])
def test_one_hardware_queue_under_an_overlapping_mode_is_named_with_its_fix(caplog, mode, options, env, cuda, warns):
    cfg = parse(config(mode, **options), MODES)
    with caplog.at_level(logging.WARNING, logger="ds_lowcomm"):
        assert warn_one_hardware_queue(cfg, MODES, env, cuda=cuda) is warns
    if warns:
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in caplog.text and repr(mode) in caplog.text
        assert "Unset CUDA_DEVICE_MAX_CONNECTIONS for this job" in caplog.text
    else:
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds_lowcomm"):  # once per node: local rank 0 says it
        assert warn_one_hardware_queue(cfg, MODES, dict(env, LOCAL_RANK="1"), cuda=cuda) is warns
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in caplog.text


def test_initialize_warns_before_building_anything(caplog, monkeypatch):
    """``deepspeed.initialize`` with ds_lowcomm checks the variable right after the config is
    validated (here the missing model stops it just after)."""
    import ds_lowcomm.integration.initialize as init

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="ds_lowcomm"), pytest.raises(LowCommConfigError, match="model"):
        init.initialize(model=None, config=config("zero1", zero1={"overlap": True}))
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in caplog.text and "Unset CUDA_DEVICE_MAX_CONNECTIONS" in caplog.text
