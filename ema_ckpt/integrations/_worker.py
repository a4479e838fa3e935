"""The worker process of :class:`~ema_ckpt.integrations._background.BackgroundFolds`:
:func:`ema_ckpt.watch` over a folder until it is idle for ``idle`` seconds or gets SIGTERM
(then one last pass), its events as JSON lines.

The SIGTERM handler is set before anything heavy is imported (:mod:`ema_ckpt.watching` loads
torch, seconds): a training that ends while the worker starts still gets its last pass. The
handler only sets an event, so it may run anywhere, an import's C++ initialisation included
(it raises nothing that would have to unwind through it)."""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import Any


def _print(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    stop = threading.Event()  # first: the handler sets it, whenever the signal comes

    def on_sigterm(signum: int, frame: object) -> None:  # the training ended: a last pass, then exit
        # once is enough: a second SIGTERM run inside this one's set() would wait for its lock forever
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)  # main() runs in the main thread, as signal.signal requires

    from ..errors import EmaCkptError
    from ..watching import watch

    job = json.loads(argv[0])
    try:
        result = watch(job["folder"], out=job["out"], interval=1.0, stop_when_idle=float(job.get("idle", 0)),
                       stop=stop, use_inotify=False, ignore=job.get("ignore", ()),
                       on_fold=lambda f: _print({"event": "fold", "steps": f.steps, "step": f.step,
                                                 "seconds": f.seconds}),
                       on_error=lambda message: _print({"event": "error", "message": message}), **job["options"])
    except EmaCkptError as err:
        _print({"event": "error", "message": str(err).splitlines()[0]})
        return 1
    _print({"event": "stopped", "step": result.step})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
