"""``bash examples/smoke.sh --fast``: the README's first command (4 steps) and the recipes
no other test runs (mnli.yaml and race.yaml at their TP2 layout on CPU, gpt_tiny.yaml pipeline parallel),
as a user types them; the full walk-through (``bash examples/smoke.sh``) is for a person on a new machine."""

import glob
import os
import re
import signal
import subprocess
import sys

from helpers.paths import ROOT

SMOKE = os.path.join(ROOT, "examples", "smoke.sh")


def test_smoke_fast():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHON"] = sys.executable
    # its own process group: a timeout ends the script and every rank it started, not the script alone
    proc = subprocess.Popen(["bash", SMOKE, "--fast"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=560)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError("examples/smoke.sh --fast ran over 560 s:\n" + stdout[-4000:] + stderr[-4000:])
    assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
    assert re.search(r"^smoke: all \d+ steps passed in \d+ s \(fast mode\)$", stdout, re.M), stdout[-2000:]


def test_smoke_walks_through_every_recipe_and_the_first_command():
    script = open(SMOKE, encoding="utf-8").read()
    for recipe in sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml"))):
        assert f"examples/{os.path.basename(recipe)}" in script, f"examples/smoke.sh does not run {recipe}"
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    first = re.search(r"python -m lightning_megatron fit --config (\S+)", readme).group(1)
    assert f"--config {first}" in script, first
