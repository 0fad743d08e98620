"""The warning a stage-3 rank on CPU gives when glibc's per-thread malloc caches are on."""

from __future__ import annotations

import os
import platform
import warnings

import pytest
from torch import nn

import flatshard
from flatshard.toolkit import malloc
from flatshard.toolkit.testing import run_distributed

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({}, ["glibc.malloc.tcache_count=0"]),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, ["glibc.malloc.tcache_count=0"]),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"}, []),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, []),
    ],
)
def test_missing_tunables_reads_the_environment(env, missing):
    assert malloc.missing_tunables(env) == (missing if GLIBC else [])


def _wrap_without_tunables(stage: int) -> list[str]:
    os.environ.pop("GLIBC_TUNABLES", None)  # as under torchrun (the harness sets it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            flatshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), stage=stage)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.skipif(not GLIBC, reason="the warning is about glibc's malloc")
def test_stage_3_on_cpu_warns_once_with_the_line_to_export():
    said = run_distributed(_wrap_without_tunables, 2, 3, timeout=60)
    for messages in said:
        assert len(messages) == 1, messages
        assert "export GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in messages[0]
    assert run_distributed(_wrap_without_tunables, 2, 2, timeout=60) == [[], []]  # (stage 2: no gathers)


def _count_warnings() -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flatshard.shard(nn.Sequential(nn.Linear(4, 4)), stage=3)
    return sum(issubclass(w.category, RuntimeWarning) for w in caught)


def test_ranks_the_harness_starts_have_the_tunables_and_no_warning():
    assert run_distributed(_count_warnings, 2, timeout=60) == [0, 0]
