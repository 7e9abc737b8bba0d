"""Whether every requirement of this project, with the extras named, is installed all the way down.

    python3 scripts/requirements_met.py test,ray,deploy

Exits 0 when each requirement of pyproject.toml (and of each installed requirement, with the extras
asked of it) is installed at a version its specifier allows; else exits 1, naming the first one that
is not. scripts/setup.sh asks this first: pip's resolver takes about 6 s even when nothing is missing.
"""

import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh machine: pip installs it with the rest
    sys.exit("requirements not met: packaging is not installed")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def unmet(pyproject: Path, extras: list[str]) -> str | None:
    """The first requirement not installed as asked (with why), or None when every one is."""
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        return f"no such extra in {pyproject.name}: {', '.join(unknown)}"
    pending = [(Requirement(text), "") for text in project.get("dependencies", [])]
    pending += [(Requirement(text), extra) for extra in extras for text in optional[extra]]
    checked: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        try:
            installed = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            return f"{requirement}: not installed"
        if not requirement.specifier.contains(installed.version, prereleases=True):
            return f"{requirement}: {installed.version} is installed"
        asked = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if asked in checked:
            continue
        checked.add(asked)
        # Its own requirements: those without an extra, and those of each extra asked of it.
        for text in installed.requires or []:
            child = Requirement(text)
            for context in ("", *sorted(requirement.extras)):
                if child.marker is None or child.marker.evaluate({"extra": context}):
                    pending.append((child, context))
                    break
    return None


def main(argv: list[str]) -> int:
    extras = [name for name in (argv[0] if argv else "").split(",") if name]
    problem = unmet(PYPROJECT, extras)
    if problem is not None:
        print(f"requirements not met: {problem}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
