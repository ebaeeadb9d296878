"""What the hang detector decides from every rank's published position (pure functions; ``distributed/hang.py``
publishes and reads them).

A record is what one rank's watcher published: ``ticks`` (its heartbeat's update count), ``seq`` (step starts and
ends so far: comparable across ranks), ``where`` (its position in words), ``python`` (its main thread's Python
location), ``waiting`` (in a collective or pipeline exchange that needs the peers), ``finished`` (its run ended).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Mapping, Sequence

__all__ = ["is_stuck", "who_differs", "hang_message", "rank_list"]

Record = Mapping[str, Any]


DEAD_RANK_SETTING = "LIGHTNING_MEGATRON_DEAD_RANK_S"


def is_stuck(records: Mapping[int, Record], quiet_s: Mapping[int, float], timeout_s: float) -> bool:
    """Every rank has started its first step, and no rank whose run goes on has moved (heartbeat or Python
    location) for ``timeout_s``: the setup before the first step (checkpoint loading, compilation of the model's
    construction) is never judged."""
    running = [r for r, rec in records.items() if not rec["finished"]]
    if not running or any(rec["seq"] == 0 for rec in records.values()):
        return False
    return all(quiet_s.get(r, 0.0) >= timeout_s for r in running)


def who_differs(records: Mapping[int, Record]) -> List[int]:
    """The ranks that differ from the others in a run that is stuck; empty when none stands out.

    1. ranks whose run ended while others' goes on (e.g. one rank ran out of batches);
    2. ranks outside any collective while others wait in one (stalled in Python, or in a collective we cannot
       see): what the others wait for;
    3. otherwise, by progress (``seq``): the ranks outside the one largest group of equal progress; with no
       single largest group, the ranks that went ahead when all wait in collectives (they passed one that the
       others are in: skipped it), else the ranks behind (the others went on without them);
    4. at equal progress, by place (position and Python location): the ranks outside the one largest group, or all
       of them when there is none (e.g. two ranks in two different collectives).
    """
    finished = sorted(r for r, rec in records.items() if rec["finished"])
    running = sorted(r for r in records if r not in finished)
    if finished and running:
        return finished
    outside = [r for r in running if not records[r]["waiting"]]
    if outside and len(outside) < len(running):
        return outside
    seqs = {r: records[r]["seq"] for r in running}
    if len(set(seqs.values())) == 1:   # the same progress: compare places
        places = {r: (records[r]["where"], records[r]["python"]) for r in running}
        return _outside_the_largest_group(places) if len(set(places.values())) > 1 else []
    by_progress = _outside_the_largest_group(seqs)
    if len(by_progress) < len(running):
        return by_progress
    pick = max(seqs.values()) if not outside else min(seqs.values())
    return [r for r in running if seqs[r] == pick]


def _outside_the_largest_group(keys: Mapping[int, Any]) -> List[int]:
    """The ranks whose key differs from the one most common key; all of them when no key is the most common."""
    counts = Counter(keys.values()).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return sorted(keys)
    return sorted(r for r, key in keys.items() if key != counts[0][0])


def rank_list(ranks: Sequence[int]) -> str:
    """"rank 3", "ranks 0, 1" or "ranks 0-7"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _line(rec: Record) -> str:
    if rec["finished"]:
        return "its run ended (it left the fit)"
    state = "waiting in a collective" if rec["waiting"] else "not in a collective"
    return f"{rec['where']}; {state}; Python at {rec['python']}"


def hang_message(records: Mapping[int, Record], quiet_s: float, setting: str) -> str:
    """One message, the same on every rank: who differs, then where every rank is (ranks at one place grouped),
    those that differ first."""
    differ = who_differs(records)
    groups: Dict[str, List[int]] = {}
    for rank in sorted(records, key=lambda r: (r not in differ, r)):
        groups.setdefault(_line(records[rank]), []).append(rank)
    if differ and len(differ) == len(records) > 1:
        head = f"{rank_list(differ)} are at different places"
    elif differ:
        verb = "differs" if len(differ) == 1 else "differ"
        head = f"{rank_list(differ)} {verb} from the others"
    else:
        head = "no rank stands out (every rank is at the same place: a collective or kernel that not every " \
               "member joined, or one slow operation)"
    body = "\n".join(f"  {rank_list(ranks)}: {line}" for line, ranks in groups.items())
    return (f"lightning_megatron: the run is stuck: no rank has made progress for {quiet_s:.0f} s ({setting}); "
            f"{head}:\n{body}")


def dead_rank_message(silent: List[int], records: Mapping[int, Record], dead_after_s: float,
                      after_sigterm: bool = False) -> str:
    """The verdict for ranks whose watcher stopped publishing: their processes are gone (or frozen whole)."""
    ranks = ", ".join(map(str, silent))
    why = ("after this process was sent SIGTERM: the launcher is ending the run" if after_sigterm
           else f"{DEAD_RANK_SETTING}={dead_after_s:g}")
    lines = [f"lightning_megatron: rank{'s' if len(silent) > 1 else ''} {ranks} stopped answering for "
             f"{dead_after_s:g} s ({why}): the process ended without a word (killed, out of memory?) or froze; "
             f"every rank ends."]
    lines += [f"  rank {r}: last seen {records[r]['where']}" for r in silent]
    return "\n".join(lines)
