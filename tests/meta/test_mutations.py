"""The planted bugs of ``tests/mutations.py`` (wrong dp/cp/tp divisors in every reduction path, missing
tied-embedding and sequence-parallel reduces, the MoE balancing-loss scale off by cp, the RNG state
restored before the resumed DataLoader iterator, ...) each make a named test fail."""

import pytest

from mutations import MUTATIONS, run


CI_MUTATIONS = [m for m in MUTATIONS if m.ci]   # the rest: python tests/mutations.py (about 20 s each)


@pytest.mark.parametrize("mutation", CI_MUTATIONS, ids=[m.name for m in CI_MUTATIONS])
def test_planted_bug_is_caught(mutation):
    killed, _, last = run(mutation)
    assert killed, f"{mutation.name} survived {', '.join(mutation.tests)}: {last}"


def test_every_planted_bug_still_has_its_place_and_its_tests():
    """Every mutation (those run only by ``python tests/mutations.py`` too) names text that occurs exactly once in
    its file and test ids that exist: code moves and renames must carry the plants along."""
    import subprocess
    import sys

    from helpers.paths import ROOT

    for mutation in MUTATIONS:
        with open(f"{ROOT}/{mutation.path}", encoding="utf-8") as source:
            assert source.read().count(mutation.old) == 1, mutation.name
    ids = sorted({test for mutation in MUTATIONS for test in mutation.tests})
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
