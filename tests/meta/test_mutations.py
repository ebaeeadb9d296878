"""The planted bugs of ``tests/mutations.py`` (wrong dp/cp/tp divisors in every reduction path, missing
tied-embedding and sequence-parallel reduces, the MoE balancing-loss scale off by cp, the RNG state
restored before the resumed DataLoader iterator, ...) each make a named test fail."""

import json
import subprocess
import sys

import pytest

from helpers.paths import ROOT
from mutations import MUTATIONS, UNMUTATED


CI_MUTATIONS = [m for m in MUTATIONS if m.ci]   # the rest: python tests/mutations.py (about 15 s each)


@pytest.fixture(scope="module")
def verdicts():
    """Every CI mutation's pytest exit code from one warm runner (tests/mutations.py: torch and Lightning
    imported once, a forked child per mutation whose ranks are forks of it, two at a time), rather than a
    fresh interpreter per plant; with the unmutated control's."""
    done = subprocess.run([sys.executable, "tests/mutations.py", "--ci", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mutation", CI_MUTATIONS, ids=[m.name for m in CI_MUTATIONS])
def test_planted_bug_is_caught(verdicts, mutation):
    code, _, last = verdicts[mutation.name]
    assert code == 1, f"{mutation.name} survived {', '.join(mutation.tests)} (pytest exit {code}): {last}"


def test_the_runner_passes_the_same_tests_unmutated(verdicts):
    """Without it a kill could be the warm runner's own failure (its forked ranks), not the plant's."""
    code, _, last = verdicts[UNMUTATED]
    assert code == 0, f"the CI mutations' tests fail without any plant under tests/mutations.py (exit {code}): {last}"


def test_every_planted_bug_still_has_its_place_and_its_tests():
    """Every mutation (those run only by ``python tests/mutations.py`` too) names text that occurs exactly once in
    its file and test ids that exist: code moves and renames must carry the plants along."""
    for mutation in MUTATIONS:
        with open(f"{ROOT}/{mutation.path}", encoding="utf-8") as source:
            assert source.read().count(mutation.old) == 1, mutation.name
    ids = sorted({test for mutation in MUTATIONS for test in mutation.tests})
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *ids],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
