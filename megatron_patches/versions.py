"""The Megatron-Core versions megatron_patches is tested with, and the check of the one imported.

MEGATRON_CORE_FLOOR is the oldest release CI runs (docs/megatron.md#versions); pyproject.toml's
`megatron` extra names the same floor, and tests/megatron/test_versions.py checks that the two
agree. Older releases are refused
by `apply()` with the version found, where they would fail in obscure places (with 0.16.1,
22 of 23 tests in tests/megatron/test_dispatcher.py failed); 0.17 and 0.18 are not tested.

Which release each patched Megatron function was checked on, and what changed since: patches.py
(its fingerprints per release in fingerprints.py).

`python -m megatron_patches.versions` prints the one line scripts/test.sh writes before the
tests: which Megatron-Core they run against, and from where.

Kept free of imports from this package.
"""

from __future__ import annotations

MEGATRON_CORE_FLOOR = "0.19"


def imported_megatron_core() -> tuple[str, str]:
    """(version, folder) of the megatron.core that `import megatron.core` gives (a Megatron-LM
    checkout first on sys.path wins over the installed package)."""
    import os

    import megatron.core
    from megatron.core import package_info

    return package_info.__version__, os.path.dirname(os.path.abspath(megatron.core.__file__))


def describe() -> str:
    version, folder = imported_megatron_core()
    return f"Megatron-Core {version} from {folder}"


def check_megatron_core(version: str | None = None) -> None:
    """Raise RuntimeError when the imported Megatron-Core is older than MEGATRON_CORE_FLOOR."""
    folder = None
    if version is None:
        version, folder = imported_megatron_core()
    from packaging.version import Version  # a dependency of megatron-core

    if Version(version).release < Version(MEGATRON_CORE_FLOOR).release:
        where = f" (from {folder})" if folder else ""
        raise RuntimeError(
            f"megatron_patches needs Megatron-Core >= {MEGATRON_CORE_FLOOR}, found {version}{where}: "
            f"pip install 'megatron-core>={MEGATRON_CORE_FLOOR}' (tested versions: docs/megatron.md#versions)"
        )


if __name__ == "__main__":
    print(describe())
