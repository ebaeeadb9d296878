"""The documentation cannot rot: the README's programs run, the strategy's argument page is generated from
the code and up to date, and the documents' links point at files and anchors that exist."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from helpers.paths import ROOT

README = os.path.join(ROOT, "README.md")
PROGRAM_MARK = "<!-- program: tests/meta/test_docs.py runs this block -->"
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                      "MASTER_ADDR", "MASTER_PORT")


def readme_programs(path=README):
    """The README's ```python blocks marked as complete programs, in order."""
    text = open(path, encoding="utf-8").read()
    return re.findall(re.escape(PROGRAM_MARK) + r"\n```python\n(.*?)```", text, re.S)


def write_readme_programs(folder):
    """Each marked program as ``folder/readme_<n>.py`` (examples/smoke.sh runs them too); returns the paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for n, program in enumerate(readme_programs(), 1):
        path = os.path.join(folder, f"readme_{n}.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        paths.append(path)
    return paths


def _generator():
    spec = importlib.util.spec_from_file_location("gen_strategy_arguments",
                                                  os.path.join(ROOT, "docs", "gen_strategy_arguments.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_use_it_is_a_program_with_data_and_fit():
    programs = readme_programs()
    use_it = README_SECTION("Use it")
    assert PROGRAM_MARK in use_it, "the 'Use it' section must hold a complete, tested program"
    assert any("trainer.fit(" in p and "DataLoader(" in p for p in programs), programs


def README_SECTION(title):  # noqa: N802 (reads like the heading it names)
    text = open(README, encoding="utf-8").read()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_readme_programs_run(tmp_path):
    """Every marked program as a user runs it: saved as a file, ``python file.py``, from an empty folder.
    The 'Use it' program trains on 2 CPU processes that Lightning starts; it must learn."""
    paths = write_readme_programs(tmp_path)
    assert len(paths) >= 2, paths
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    for path in paths:
        done = subprocess.run([sys.executable, path], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=420)
        assert done.returncode == 0, f"{os.path.basename(path)}:\n" + done.stdout[-3000:] + done.stderr[-3000:]
        if "trainer.fit(" in open(path).read():
            found = re.search(r"^train_loss ([\d.]+)$", done.stdout, re.M)
            assert found, done.stdout[-2000:]
            # a uniform guess over the 64 tokens scores ln 64 = 4.16; 30 steps bring it to ~1.6 (lr 0: ~4.2)
            assert float(found.group(1)) < 3.0, found.group(0)


def test_strategy_arguments_page_is_up_to_date():
    generator = _generator()
    current = open(generator.PAGE, encoding="utf-8").read()
    assert current == generator.render(), (
        f"docs/strategy_arguments.md is out of date with MegatronStrategy: run `{generator.COMMAND}`")


def test_argument_page_refuses_an_undocumented_argument():
    from lightning_megatron import MegatronStrategy

    class WithNewArgument(MegatronStrategy):
        __doc__ = MegatronStrategy.__doc__

        def __init__(self, new_knob: int = 3, **kwargs):
            super().__init__(**kwargs)

    generator = _generator()
    with pytest.raises(SystemExit, match="new_knob: no meaning"):
        generator.render(WithNewArgument)
    WithNewArgument.__doc__ += "\n    Args:\n        new_knob: a documented knob.\n"
    with pytest.raises(SystemExit, match="new_knob: no CONSTRAINTS entry"):
        generator.render(WithNewArgument)


def test_argument_page_reads_the_docstring():
    generator = _generator()
    documented = generator.docstring_args(
        "Summary.\n\n    Args:\n        a / b /\n        c: shared\n            text.\n        d: own.\n\n    After.\n")
    assert documented == {"a": ("shared text.", True), "b": ("shared text.", True), "c": ("shared text.", True),
                          "d": ("own.", False)}


DOCUMENTS = ["README.md", "examples/README.md", "docs/launching.md", "docs/references.md",
             "docs/strategy_arguments.md"]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_links_point_at_files_and_anchors_that_exist(document):
    path = os.path.join(ROOT, document)
    text = open(path, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue   # a web address
        file, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        assert os.path.exists(linked), f"{document}: {target} does not exist"
        if anchor and linked.endswith(".md"):
            body = open(linked, encoding="utf-8").read()
            headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                        for h in re.findall(r"^#+ (.*)$", body, re.M)}
            ids = set(re.findall(r'<a id="([^"]+)"', body))
            assert anchor in headings | ids, f"{document}: no anchor #{anchor} in {file or document}"


@pytest.mark.parametrize("document", ["README.md", "examples/README.md", "docs/launching.md"])
def test_seed_shorthand_is_linked_to_its_reference(document):
    """'seed 00N' means nothing to a reader: where a user document says it, it links to docs/references.md."""
    text = open(os.path.join(ROOT, document), encoding="utf-8").read()
    bare = [m.group(0) for m in re.finditer(r"(?<!\[)seeds? \d{3}(?!\]\()", text)]
    assert not bare, f"{document}: {bare} without a link to docs/references.md"
