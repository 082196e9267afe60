"""Starting the tensor-parallel ranks and watching them.

Two ways in, one rendezvous (torch.distributed's env://: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK):

- **one host, started by specscope** (`serve --tensor-parallel-size N`, `LLM(...,
  tensor_parallel_size=N)`): this process is rank 0; it picks a free port and starts ranks
  1..N-1 as child processes (`python -m specscope.engine.tp_worker`, the LLM's arguments
  pickled on their stdin; NCCL_NVLS_ENABLE=0 in their environment and ours: NVLink
  multicast stays off). A watchdog thread polls the children: one that exits is a failure,
  reported at once (the server exits non-zero naming the rank and its exit status).
- **torchrun** (any number of hosts): the environment is already set; every process joins.

The data plane is the default process group (gloo on the CPU, NCCL on GPUs); the control
channel (channel.py) a gloo group of its own. Both have the collective timeout
`--dist-timeout`, so a rank that hangs fails the others within it, never silently; rank 0
sends a heartbeat on the channel while idle, so that waiting ranks time out only when rank 0
is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from specscope.parallel.channel import Channel
from specscope.parallel.group import TPGroup

log = logging.getLogger("specscope.tp")

DEFAULT_DIST_TIMEOUT = 600.0  # seconds; SGLang's --dist-timeout, torch's NCCL default
# The least time the children get to start and join (importing torch, loading a shard),
# whatever the collective timeout: a short --dist-timeout is about hangs, not start-up.
RENDEZVOUS_TIMEOUT = 300.0
# What a failed rank does to this process: "raise" (the Python API: the next call raises)
# or "exit" (the server: log, stop the other ranks, exit 1). Set by the CLI.
_policy = {"on_failure": "raise"}


def exit_on_rank_failure(on: bool = True) -> None:
    """A failed rank ends this process (exit status 1) instead of failing the next call."""
    _policy["on_failure"] = "exit" if on else "raise"


@dataclass(frozen=True)
class Heartbeat:
    """Rank 0 is alive and idle."""


@dataclass(frozen=True)
class Stop:
    """Rank 0 is done: every rank leaves its loop and exits 0."""


@dataclass(frozen=True)
class Call:
    """Run method `name` of the rank's LLM with these arguments on every rank (gather:
    rank 0 collects each rank's result)."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    gather: bool = False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent() -> None:
    """In a child, before exec: die with the parent (Linux), so no rank outlives rank 0
    (PR_SET_PDEATHSIG: strictly, with the thread that started it, the one building the
    LLM)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Launcher:
    """Ranks 1..size-1 of a one-host group as child processes, and their watchdog."""

    def __init__(self, size: int, payload: dict, env: dict[str, str],
                 on_failure: Callable[[str], None]) -> None:
        self.on_failure = on_failure
        self.failure: str | None = None
        self._stopping = threading.Event()
        self.procs: list[tuple[int, subprocess.Popen]] = []
        blob = pickle.dumps(payload)
        for r in range(1, size):
            child_env = {**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)}
            p = subprocess.Popen([sys.executable, "-m", "specscope.engine.tp_worker"],
                                 stdin=subprocess.PIPE, env=child_env,
                                 preexec_fn=_exit_with_parent if os.name == "posix" else None)
            p.stdin.write(blob)
            p.stdin.close()
            self.procs.append((r, p))
            log.info("tensor parallel: started rank %d of %d (pid %d)", r, size, p.pid)
        self._thread = threading.Thread(target=self._watch, name="specscope-tp-watchdog",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for r, p in self.procs:
                code = p.poll()
                if code is not None and not self._stopping.is_set():
                    self.failure = (f"tensor-parallel rank {r} (pid {p.pid}) died: "
                                    f"{_status(code)}")
                    self.on_failure(self.failure)
                    return

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the children to exit (they were told to stop), then kill what is left."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for _, p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()

    def kill(self) -> None:
        self._stopping.set()
        for _, p in self.procs:
            if p.poll() is None:
                p.kill()


class TPRuntime:
    """This process's place in a tensor-parallel group: the data plane (`group`), the
    control channel, and on rank 0 of a group it started, the launcher of the others."""

    def __init__(self, group: TPGroup, channel: Channel, timeout: float) -> None:
        self.group, self.channel, self.timeout = group, channel, timeout
        self.failure: str | None = None
        self.launcher: Launcher | None = None  # set by the launch that started the others
        self._stop = threading.Event()
        self._closed = False
        if self.is_driver and group.size > 1:
            threading.Thread(target=self._heartbeat, name="specscope-tp-heartbeat",
                             daemon=True).start()

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def is_driver(self) -> bool:
        """Rank 0: the scheduler, the tokenizer, the server; the others follow it."""
        return self.group.rank == 0

    def fail(self, reason: str) -> None:
        """A rank failed: recorded (the next call raises it), or, under the server's
        policy, the end of this process."""
        if self.failure is None:
            self.failure = reason
            log.error("%s; the tensor-parallel group cannot go on", reason)
        if _policy["on_failure"] == "exit":
            if self.launcher is not None:
                self.launcher.kill()
            logging.shutdown()
            os._exit(1)

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"{self.failure}; the tensor-parallel group cannot go on")

    def _heartbeat(self) -> None:
        every = min(30.0, self.timeout / 4)
        while not self._stop.wait(every / 2):
            if time.monotonic() - self.channel.last_send < every:
                continue
            try:
                self.channel.send(Heartbeat())
            except Exception as e:  # the ranks are gone or hung
                self.fail(f"tensor-parallel heartbeat failed ({type(e).__name__}: {e})")
                return

    def shutdown(self) -> None:
        """Rank 0: tell every rank to stop, wait for the children, leave the group."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.is_driver and self.failure is None:
            try:
                self.channel.send(Stop())
            except Exception as e:
                log.warning("tensor parallel: could not stop the ranks (%s)", e)
        if self.launcher is not None:
            (self.launcher.kill if self.failure else self.launcher.stop)()
        if dist.is_initialized():
            dist.destroy_process_group()


def start(size: int, device_type: str, payload: dict[str, Any] | None,
          timeout: float = DEFAULT_DIST_TIMEOUT) -> TPRuntime | None:
    """Join (torchrun, or a child this module started) or start (rank 0 on one host) a
    tensor-parallel group of `size` ranks; None for size 1 outside any launch. payload:
    what the children need to build the same model (the LLM's arguments); None: this
    process cannot start children (an in-memory model), so it must be launched."""
    env_size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 and env_size == 1:
        return None
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group: one "
                           "tensor-parallel LLM per process (close() the other first)")
    # NVLink multicast (NVLS) stays off in every rank (ours; the children inherit it).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if env_size != 1:
        if env_size != size:
            raise ValueError(f"the launcher started {env_size} processes (WORLD_SIZE) but "
                             f"--tensor-parallel-size is {size}; they must agree")
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        return _join(rank, local, size, "env://", device_type, timeout, None)
    if payload is None:
        raise ValueError(f"tensor parallelism over {size} ranks of an in-memory model needs "
                         f"a launcher: run under torchrun --nproc-per-node {size}")
    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs on this host; "
                         f"torch sees {torch.cuda.device_count()} (torchrun spans hosts)")
    # Not launched: start the others ourselves. Our own environment is left as it was
    # (a later process started from here must not think it is a rank of this group).
    port = _free_port()
    env = {"WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "NCCL_NVLS_ENABLE": os.environ["NCCL_NVLS_ENABLE"]}
    return _join(0, 0, size, f"tcp://127.0.0.1:{port}", device_type, timeout,
                 (size, payload, env))


def _join(rank: int, local: int, size: int, init_method: str, device_type: str,
          timeout: float, launcher_args: tuple | None) -> TPRuntime:
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    delta = datetime.timedelta(seconds=timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    pending = _PendingLaunch(launcher_args)  # children first: the rendezvous waits for all
    # The groups form under the rendezvous timeout (ranks come up at their own pace),
    # then every collective gets the collective timeout.
    wait = datetime.timedelta(seconds=max(timeout, RENDEZVOUS_TIMEOUT))
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=size, timeout=wait)
        control = dist.new_group(backend="gloo", timeout=wait)
        for g in (None, control):
            _set_timeout(delta, g)
    except Exception as e:
        pending.kill()
        if pending.failure is not None:
            raise RuntimeError(f"{pending.failure}; the tensor-parallel group did not "
                               f"form") from e
        raise
    runtime = TPRuntime(TPGroup(rank, size, None, device), Channel(rank, size, control),
                        timeout)
    pending.hand_to(runtime)
    log.info("tensor parallel: rank %d of %d on %s (%s data plane, gloo control channel, "
             "%.0f s collective timeout)", rank, size, device, backend, timeout)
    return runtime


def _set_timeout(delta: datetime.timedelta, group: dist.ProcessGroup | None) -> None:
    """The collective timeout of a formed group (torch's _set_pg_timeout; without it, on
    an older torch, the group keeps the rendezvous timeout)."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        log.warning("this torch cannot set a group's timeout after it forms; collectives "
                    "time out after the rendezvous timeout instead")
        return
    setter(delta, group)


class _PendingLaunch:
    """Children started before the rendezvous (it waits for every rank), handed to the
    runtime once the group exists; killed if the rendezvous fails."""

    def __init__(self, launcher_args: tuple | None) -> None:
        self.failure: str | None = None
        self.launcher = None if launcher_args is None else Launcher(
            *launcher_args, on_failure=self._early)

    def _early(self, reason: str) -> None:
        self.failure = reason
        log.error("%s before the group formed", reason)
        if _policy["on_failure"] == "exit":
            self.kill()
            logging.shutdown()
            os._exit(1)

    def kill(self) -> None:
        if self.launcher is not None:
            self.launcher.kill()

    def hand_to(self, runtime: TPRuntime) -> None:
        if self.launcher is None:
            return
        self.launcher.on_failure = runtime.fail
        runtime.launcher = self.launcher
        if self.failure is not None:
            runtime.fail(self.failure)
