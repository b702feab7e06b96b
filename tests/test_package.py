"""Importing pagedserve sets libgomp's wait policy before torch loads it (pagedserve/__init__):
idle OpenMP threads sleep instead of spinning, unless the user chose a policy or spin count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import pagedserve, os; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize("env, policy", [({}, "PASSIVE"),
                                         ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                         ({"GOMP_SPINCOUNT": "10000"}, "None")])
def test_wait_policy_default_and_user_choice(env, policy):
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", SHOW], env={**base, **env}, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == policy
