"""Batches assembled off the training thread.

`Prefetcher(make, after, depth)` runs `make(key)` on a background thread for the next keys, keeping
up to `depth` batches ready; `get(key)` returns the one made ahead, or starts again from `key` when
asked out of order. A batch is a function of its key alone, so prefetching never changes training."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Hashable

IDLE_S = 10.0


class Prefetcher:
    def __init__(self, make: Callable[[Hashable], object], after: Callable[[Hashable], Hashable], depth: int = 2):
        self.make, self.after, self.depth = make, after, depth
        self._thread = self._expected = None

    def get(self, key):
        if self._thread is None or key != self._expected:
            self._start(key)
        while True:
            try:
                k, batch, err = self._queue.get(timeout=0.2)
                break
            except queue.Empty:
                if not self._thread.is_alive():  # ended while idle: start again from here
                    self._start(key)
        assert k == key, (k, key)
        self._expected = self.after(key)
        if err is not None:
            self.close()
            raise err
        return batch

    def _start(self, key):
        self.close()
        self._queue: queue.Queue = queue.Queue(self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(key, self._queue, self._stop), daemon=True,
                                        name="zoo-batches")
        self._thread.start()

    def _run(self, key, q: queue.Queue, stop: threading.Event):
        while not stop.is_set():
            try:
                item = (key, self.make(key), None)
            except BaseException as e:  # handed to the training thread
                item = (key, None, e)
            since = time.monotonic()
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    if time.monotonic() - since > IDLE_S:
                        return
            if item[2] is not None:
                return
            key = self.after(key)

    def close(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
