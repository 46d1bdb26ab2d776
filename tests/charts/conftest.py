"""Fixtures for the Helm chart checks: the default and the all-features renders."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from chart_support import ALL_ON, HELM, template


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    if not HELM.is_file():
        pytest.skip(f"{HELM} not found: run tools/fetch-helm.sh to install helm")
    return template()


@pytest.fixture
def all_on_docs(tmp_path: Path) -> list[dict[str, Any]]:
    return template(ALL_ON, tmp_path=tmp_path)
