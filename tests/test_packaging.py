"""A non-editable install (`pip install .`, as scripts/device.sh does) carries every Python
package of fadsl: pyproject's explicit list names each folder with an __init__.py."""

from __future__ import annotations

import tomllib

from conftest import ROOT


def test_every_package_is_listed():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "fadsl").rglob("__init__.py")
    }
    assert found <= listed, f"missing from pyproject's packages: {sorted(found - listed)}"
