"""One home per public name (issue #33 item 4): no object is exported from two modules' `__all__`; a renamed name
lives on for one release as a deprecated alias, listed in the one table islands._deprecated.ALIASES."""

import collections
import importlib
import re
import types
import warnings
from pathlib import Path

import pytest

import islands
from islands._deprecated import ALIASES, REMOVED_IN

SRC = Path(islands.__file__).parent
SCALARS = (str, bytes, int, float, bool, type(None))  # equal constants may be one interned object: not a name's home


def exporting_modules() -> dict[str, types.ModuleType]:
    """Every islands module that declares `__all__` (found in the source, so nothing else is imported)."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        if not re.search(r"^__all__\b", path.read_text(encoding="utf-8"), re.MULTILINE):
            continue
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = importlib.import_module(name)
    return found


def test_every_public_object_has_one_home():
    homes: dict[int, list[str]] = collections.defaultdict(list)
    for name, module in exporting_modules().items():
        for public in module.__all__:
            obj = getattr(module, public)
            if isinstance(obj, (types.ModuleType, *SCALARS)):
                continue
            homes[id(obj)].append(f"{name}.{public}")
    twice = sorted(where for where in homes.values() if len(where) > 1)
    assert not twice, "exported from more than one module's __all__:\n" + "\n".join(map(str, twice))


def test_the_documented_namespaces_are_the_homes():
    assert "DiLoCo" in islands.outer.__all__ and "DiLoCo" not in importlib.import_module("islands.sync.outer").__all__
    assert "Krum" in islands.robust.__all__ and "Krum" not in importlib.import_module("islands.aggregate").__all__
    assert "Trainer" in islands.__all__ and "Trainer" not in importlib.import_module("islands.loop").__all__
    assert "Pipeline" in islands.inner.__all__


@pytest.mark.parametrize("old,new", sorted(ALIASES.items()))
def test_a_deprecated_alias_resolves_to_its_new_name_with_a_warning(old, new):
    (old_module, old_name), (new_module, new_name) = old, new
    module, target = importlib.import_module(old_module), importlib.import_module(new_module)
    assert old_name not in module.__all__ and new_name in target.__all__
    with pytest.warns(
        DeprecationWarning,
        match=rf"{old_module}\.{old_name} is deprecated .*{REMOVED_IN}.*"
        rf"{new_module}\.{new_name}",
    ):
        assert getattr(module, old_name) is getattr(target, new_name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(target, new_name)  # the new name is quiet
    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        module.NotAName  # noqa: B018 - the attribute access is what must raise


def test_the_control_plane_view_no_longer_shadows_the_observe_package():
    import islands.control

    assert islands.control.observe_job.__module__ == "islands.runtime.elastic.membership"
    assert isinstance(islands.observe, types.ModuleType)
    with pytest.warns(DeprecationWarning):
        from islands.control import observe  # noqa: F401 - the old spelling still imports, for one release
    with pytest.warns(DeprecationWarning):
        from islands.robust import Median
    assert Median is islands.robust.CoordinateMedian


def test_the_deprecations_are_documented():
    text = (SRC.parents[1] / "docs" / "deprecations.md").read_text(encoding="utf-8")
    for (old_module, old_name), (new_module, new_name) in ALIASES.items():
        assert f"{old_module}.{old_name}" in text and f"{new_module}.{new_name}" in text
