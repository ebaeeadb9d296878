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
