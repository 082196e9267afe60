"""A tensor-parallel rank other than 0: it follows rank 0 until told to stop.

`python -m specscope.engine.tp_worker` is what parallel/launch.py starts for ranks 1..N-1
on one host: it reads the LLM's arguments (pickled, on stdin) and builds the same LLM, which
joins the group, loads this rank's shard and then `follow`s: each message rank 0 sends is a
step to run (its plan, engine/step_broadcast.py), a call to make on every rank
(set_spec, enable_profiling, ...; with `gather`, its result goes back to rank 0), a
heartbeat, or the stop. Under torchrun the same `follow` runs inside LLM(...) on every rank
but 0.

Any error ends the process with status 1: rank 0's watchdog (or torchrun) sees it and fails
the group, and rank 0's next collective fails instead of waiting.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from typing import Any

from specscope.engine.step_broadcast import MirrorScheduler, StepMessage
from specscope.parallel.launch import Call, Heartbeat, Stop

log = logging.getLogger("specscope.tp")


def follow(llm: Any) -> None:
    """Run what rank 0 sends until it sends Stop."""
    channel = llm.tp.channel
    while True:
        msg = channel.recv()
        if isinstance(msg, StepMessage):
            scheduler = llm.engine.scheduler
            assert isinstance(scheduler, MirrorScheduler)
            scheduler.incoming = msg
            llm.step()
        elif isinstance(msg, Call):
            result = getattr(llm, msg.name)(*msg.args, **msg.kwargs)
            if msg.gather:
                channel.gather(result)
        elif isinstance(msg, Stop):
            return
        elif not isinstance(msg, Heartbeat):
            raise RuntimeError(f"tensor-parallel rank {llm.tp.rank}: unexpected message "
                               f"{type(msg).__name__} from rank 0")


def main() -> int:
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    payload = pickle.load(sys.stdin.buffer)
    from specscope.engine.llm import LLM

    try:
        LLM(**payload)  # joins, loads its shard, follows rank 0, raises SystemExit(0)
    except SystemExit:
        raise
    except BaseException:
        log.exception("tensor-parallel rank %s failed", rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
