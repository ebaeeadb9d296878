"""Run a function on N local processes joined into one torch.distributed world, with a hard timeout.

Every distributed test of the project goes through :func:`run_on_ranks`: an exception on any
rank fails the call with that rank's traceback, a rank that dies without reporting fails it
with its exit code, and a hang fails it after ``timeout`` seconds (each rank also dumps its
Python stack to stderr shortly before, so the hang is visible). Survivors are killed, never
left behind.

One failure is not the function's: on a loaded machine gloo's TCP mesh setup (``connectFullMesh``,
run by ``init_process_group`` and by every ``new_group``) now and then loses a connection. When a
rank reports that error, raised from within ``torch.distributed``, the whole run starts again with a
fresh world, at most ``MESH_RETRIES`` times. Any other failure is reported at once, never retried.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

MAX_WORLD_SIZE = 8
# The fork server imports these once; each rank is then a fork of it (~20 ms instead of ~1 s).
# Imported once by the fork server, so each rank starts with them: without Lightning, torchmetrics and
# dynamo here every rank imported them anew (~5 s of CPU each; the package itself imports lazily). A module
# that is not installed is skipped by the server.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.nn.functional", "torch._dynamo", "pytest",
                      "lightning.pytorch", "torchmetrics", "lightning_megatron", "lightning_megatron.tensor_parallel",
                      "lightning_megatron.adapter.strategy", "lightning_megatron.models", "lightning_megatron.moe"]
_GRACE_AFTER_ERROR_S = 3.0   # how long other ranks may still report once one has failed
_GRACE_AFTER_DEATH_S = 5.0   # how long a dead rank's last message may take to arrive (busy CI machines)
MESH_RETRIES = 2             # fresh starts after gloo's connectFullMesh failure (then the failure is reported)
# What gloo raises (a RuntimeError) when a pair of its TCP mesh cannot connect, e.g.
# "Gloo connectFullMesh failed with [.../gloo/transport/tcp/pair.h:311] Connect timeout [none]".
_GLOO_CONNECT_FAILURE = "Gloo connectFullMesh failed with"


class MultiRankError(AssertionError):
    """One or more ranks failed, died or hung; the message holds what each of them reported.

    ``mesh_failure`` is true when a rank failed with gloo's transient connectFullMesh error."""

    def __init__(self, message: str, mesh_failure: bool = False) -> None:
        super().__init__(message)
        self.mesh_failure = mesh_failure


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, init_file: str, port: int, backend: str, timeout: float,
            init_process_group: bool, fn: Callable[..., Any], args: tuple, kwargs: dict,
            results: "mp.Queue") -> None:
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    # Leave a second or two before the parent's deadline so a hung rank's stack reaches stderr.
    faulthandler.dump_traceback_later(max(timeout - 2.0, 1.0), exit=False)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share a few cores: one thread each avoids thrashing
    try:
        if init_process_group:
            store = dist.FileStore(init_file, world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
        result = fn(*args, **kwargs)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
        status = "mesh_failure" if _is_gloo_mesh_failure(err) else "error"
        results.put((rank, status, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the result is already reported
                pass


def _is_gloo_mesh_failure(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is gloo's connectFullMesh RuntimeError,
    raised while ``torch.distributed`` set up a group: not an error the run's function raised itself."""
    import torch.distributed

    dist_dir = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep
    seen = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RuntimeError) and _GLOO_CONNECT_FAILURE in str(current):
            tb = current.__traceback__
            while tb is not None:
                if os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(dist_dir):
                    return True
                tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                 backend: str = "gloo", init_process_group: bool = True,
                 start_method: Optional[str] = None, **kwargs: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes; return each rank's result, by rank.

    ``fn`` must be importable (a module-level function) and its result picklable by
    ``torch.save``. Each process has ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set
    (so a launcher such as Lightning can initialize itself when ``init_process_group=False``);
    otherwise the world is already initialized on ``backend`` when ``fn`` starts. ``start_method`` defaults
    to ``$LIGHTNING_MEGATRON_RANKS_START_METHOD``, else ``"forkserver"`` (a clean copy of the preloaded
    modules); ``tests/mutations.py`` sets ``"fork"`` in its single-threaded children, whose ranks then start
    without importing anything again.
    """
    start_method = start_method or os.environ.get("LIGHTNING_MEGATRON_RANKS_START_METHOD") or "forkserver"
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be an integer in [1, {MAX_WORLD_SIZE}], got {world_size!r}.")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}.")
    for attempt in range(MESH_RETRIES + 1):
        try:
            return _run_once(fn, world_size, args, kwargs, timeout, backend, init_process_group, start_method)
        except MultiRankError as err:
            # gloo's TCP mesh setup (init_process_group, new_group) occasionally loses a connection on a
            # loaded machine: start the whole run again with a fresh world, a bounded number of times.
            # Failures of the function itself are never retried.
            if not err.mesh_failure:
                raise
            if attempt == MESH_RETRIES:
                raise MultiRankError(f"gloo's connectFullMesh failed on all {MESH_RETRIES + 1} attempts; the "
                                     f"last one:\n{err}", mesh_failure=True) from None
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float, backend: str,
              init_process_group: bool, start_method: str) -> List[Any]:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    results: "mp.Queue" = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="lm_ranks_") as tmp:
        init_file = os.path.join(tmp, "store")
        port = _free_port()
        # typeshed's BaseContext, what get_context(str) returns, lacks Process; every real context has it
        procs = [
            ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,  # type: ignore[attr-defined]
                        args=(rank, world_size, init_file, port, backend, timeout,
                              init_process_group, fn, args, kwargs, results))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            outcome = _collect(procs, results, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)
            results.close()
    return outcome


def _collect(procs: List["mp.Process"], results: "mp.Queue", timeout: float) -> List[Any]:
    import torch

    world_size = len(procs)
    start = time.monotonic()
    deadline = start + timeout
    done: Dict[int, Any] = {}
    failures: Dict[int, str] = {}
    mesh_failure = genuine_failure = False
    died_at: Dict[int, float] = {}
    while len(done) + len(failures) < world_size:
        now = time.monotonic()
        if now >= deadline:
            break
        try:
            rank, status, payload = results.get(timeout=min(0.2, deadline - now))
        except queue_module.Empty:
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in done or rank in failures or proc.is_alive():
                    continue
                died_at.setdefault(rank, now)
                if now - died_at[rank] > _GRACE_AFTER_DEATH_S:
                    failures[rank] = f"rank {rank} exited with code {proc.exitcode} without reporting a result"
                    deadline = min(deadline, now + _GRACE_AFTER_ERROR_S)
            continue
        if status == "ok":
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            failures[rank] = payload
            mesh_failure = mesh_failure or status == "mesh_failure"
            genuine_failure = genuine_failure or status == "error"
            # Peers of a failed rank usually block in a collective: give them a moment, then stop.
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
    for rank, proc in enumerate(procs):   # died without a word while we waited for the others
        if rank not in done and rank not in failures and not proc.is_alive() and proc.exitcode not in (None, 0):
            failures[rank] = f"rank {rank} exited with code {proc.exitcode} without reporting a result"
    if failures:
        # a run in which the function itself failed on some rank is never retried, whatever gloo did elsewhere:
        # the retry could succeed and hide that failure
        mesh_failure = mesh_failure and not genuine_failure
        silent = [r for r in range(world_size) if r not in done and r not in failures]
        parts = [f"--- rank {rank} ---\n{failures[rank]}" for rank in sorted(failures)]
        if silent:
            parts.append(f"ranks {silent} had not finished (killed after the failure above)")
        raise MultiRankError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(parts),
                             mesh_failure=mesh_failure)
    if len(done) < world_size:
        hung = [r for r in range(world_size) if r not in done]
        raise MultiRankError(
            f"ranks {hung} of {world_size} did not finish within {timeout:.0f} s (a hang, e.g. a "
            f"collective that not every rank entered); their stacks were dumped to stderr."
        )
    return [done[rank] for rank in range(world_size)]
