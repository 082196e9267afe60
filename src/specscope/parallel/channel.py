"""The control channel: rank 0 hands every other rank what to do next, one pickled object
per message, over a gloo group of its own (CPU tensors: no device sync, on any backend).

A message is one broadcast of a fixed-size buffer (length header, then the pickle) when it
fits, which a step's plan does; a larger one (a long new prompt) takes a second broadcast
of the rest. `gather` collects one object from every rank on rank 0 (profile summaries).

Rank 0 may send from two threads (the engine thread, and the heartbeat that keeps idle
ranks from timing out): a lock keeps every message whole and in order. The other ranks only
ever receive, from their one loop. The lock is re-entrant so that a caller can hold it
over a request and its reply (send, then gather) with no heartbeat in between.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

HEADER = 8  # bytes of the little-endian message length


class Channel:
    def __init__(self, rank: int, size: int, group: dist.ProcessGroup,
                 capacity: int = 1 << 15) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.buf = torch.zeros(capacity, dtype=torch.uint8)
        self.lock = threading.RLock()
        self.last_send = time.monotonic()
        self.messages = 0  # sent or received
        self.broadcasts = 0  # of them, over one buffer (the rest needed a second)

    def send(self, obj: Any) -> None:
        """Rank 0: one message to every other rank."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n, cap = len(data), self.buf.numel() - HEADER
        with self.lock:
            view = self.buf.numpy()
            view[:HEADER] = list(n.to_bytes(HEADER, "little"))
            view[HEADER:HEADER + min(n, cap)] = memoryview(data)[:cap]
            dist.broadcast(self.buf, src=0, group=self.group)
            if n > cap:
                rest = torch.frombuffer(bytearray(data[cap:]), dtype=torch.uint8)
                dist.broadcast(rest, src=0, group=self.group)
            self.last_send = time.monotonic()
            self.messages += 1
            self.broadcasts += 1 + (n > cap)

    def recv(self) -> Any:
        """Every other rank: the next message rank 0 sent."""
        dist.broadcast(self.buf, src=0, group=self.group)
        head = self.buf.numpy()
        n = int.from_bytes(head[:HEADER].tobytes(), "little")
        cap = self.buf.numel() - HEADER
        data = head[HEADER:HEADER + min(n, cap)].tobytes()
        if n > cap:
            rest = torch.empty(n - cap, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.numpy().tobytes()
        self.messages += 1
        return pickle.loads(data)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's obj on rank 0 (in rank order); None elsewhere."""
        out = [None] * self.size if self.rank == 0 else None
        with self.lock:
            dist.gather_object(obj, out, dst=0, group=self.group)
        return out
