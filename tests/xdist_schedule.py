"""A pytest-xdist scheduler for a suite whose wall time is set by a few long tests.

xdist's ``--dist load`` hands each worker a first chunk of a quarter of its share of the
suite (about 37 consecutive tests here). Collected longest first, the long tests then all
land on the first worker, which runs them one after another while the others finish and
sit idle: 42 minutes, of which the last ten with one worker busy (measured; see
docs/performance.md, "Test suite").

This scheduler sends one test at a time, longest first (LPT scheduling), with one rule
for xdist's queue: a worker starts a test only once it holds the next one (it needs
``nextitem`` for fixture teardown), so the test queued behind a long test waits for it.
That queued test is therefore always a short one while short ones remain.
"""

from __future__ import annotations

from typing import Callable

from xdist.scheduler.load import LoadScheduling


class LongestFirstScheduling(LoadScheduling):
    def __init__(self, config, log, is_long: Callable[[str], bool]):
        super().__init__(config, log)
        self._is_long = is_long
        self._long: set[int] = set()

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:  # a node was added later: top everyone up
            for node in self.nodes:
                self.check_schedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        self.pending[:] = range(len(self.collection))  # collection order: longest first (conftest.py)
        self._long = {i for i, nodeid in enumerate(self.collection) if self._is_long(nodeid)}
        for node in self.nodes:
            self._top_up(node)
        if not self.pending:
            for node in self.nodes:
                node.shutdown()

    def check_schedule(self, node, duration: float = 0) -> None:
        if node.shutting_down:
            return
        if self.pending:
            self._top_up(node)
        else:
            node.shutdown()

    def _top_up(self, node) -> None:
        """Keep two tests on the node: the running one and the next."""
        queue = self.node2pending[node]
        while len(queue) < 2 and self.pending:
            behind_long = bool(queue) and queue[-1] in self._long
            want_long = not behind_long
            pick = next((i for i in self.pending if (i in self._long) == want_long), self.pending[0])
            self.pending.remove(pick)
            queue.append(pick)
            node.send_runtest_some([pick])
