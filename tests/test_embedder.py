"""The OpenVINO encoder's threads (regress.metrics.embedder.OpenVinoEncoder): a request's first
inference of an input shape never overlaps another's (OpenVINO can deadlock when two requests
meet a new shape at once), shapes already seen run in parallel, and rows land in input order."""

from __future__ import annotations

import threading
import time

import numpy as np

from regress.metrics.embedder import OpenVinoEncoder


class _Request:
    """Stands in for an OpenVINO infer request: records how many inferences of a shape it has
    not run before overlap, across all requests."""

    def __init__(self, shared: dict) -> None:
        self.shared, self.seen = shared, set()

    def infer(self, feeds):
        ids = feeds["input_ids"]
        new = ids.shape not in self.seen
        with self.shared["lock"]:
            self.shared["running"] += 1
            self.shared["new_running"] += new
            self.shared["most_new"] = max(self.shared["most_new"], self.shared["new_running"])
            self.shared["most"] = max(self.shared["most"], self.shared["running"])
        time.sleep(0.02)
        with self.shared["lock"]:
            self.shared["running"] -= 1
            self.shared["new_running"] -= new
        self.seen.add(ids.shape)
        return [np.repeat(ids[:, :1].astype(np.float32), 4, axis=1)]


class _Tokenizer:
    pass


def _encoder(requests: int) -> tuple[OpenVinoEncoder, dict]:
    shared = {"lock": threading.Lock(), "running": 0, "new_running": 0, "most_new": 0, "most": 0}
    enc = OpenVinoEncoder.__new__(OpenVinoEncoder)
    enc.dim, enc.batch_size, enc.sort_by_length, enc.tokenizer = 4, 2, False, _Tokenizer()
    enc.requests = [_Request(shared) for _ in range(requests)]
    enc._new_shape = threading.Lock()
    enc._shapes_seen = [set() for _ in enc.requests]
    return enc, shared


def test_first_inference_of_a_shape_runs_alone_and_seen_shapes_overlap(monkeypatch) -> None:
    import regress.metrics.embedder as E

    # Feeds: one row per text holding its index, padded to the text's length (shapes repeat).
    def feeds(tokenizer, texts):
        width = max(len(t) for t in texts)
        return {"input_ids": np.array([[int(t.split("-")[0])] * width for t in texts])}

    monkeypatch.setattr(E, "token_feeds", feeds)
    enc, shared = _encoder(requests=2)
    texts = [f"{i}-" + "x" * (i % 3) for i in range(40)]
    out = enc.encode(texts)
    assert shared["most_new"] == 1  # never two first-time shapes at once
    assert shared["most"] == 2  # but known shapes ran on both requests together
    assert [int(row[0]) for row in out] == list(range(40))
