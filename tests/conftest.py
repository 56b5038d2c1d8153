"""Shared fixtures: golden files and the example specs."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.fa"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite golden files (generated/ and tests/golden/) instead of comparing",
    )


class Golden:
    def __init__(self, update: bool) -> None:
        self.update = update

    def check(self, path: Path, actual: str) -> None:
        """Compare ``actual`` with the golden file; rewrite it under --update-golden."""
        if self.update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(actual)
            return
        if not path.exists():
            pytest.fail(
                f"golden file {path.relative_to(ROOT)} is missing; "
                "run `pytest --update-golden` and review the diff"
            )
        expected = path.read_text()
        assert actual == expected, (
            f"{path.relative_to(ROOT)} is out of date; run `pytest --update-golden` "
            "and review the diff"
        )


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Golden:
    return Golden(request.config.getoption("--update-golden"))


@pytest.fixture(params=EXAMPLES, ids=[p.stem for p in EXAMPLES])
def example(request: pytest.FixtureRequest) -> Path:
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked slow run only when asked for: `pytest -m slow`."""
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow lane: run with `pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
