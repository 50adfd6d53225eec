"""JSON Schema of ``metrics.json`` (:class:`~regress.records.RunMetrics`), with each field's docstring.

The schema is checked in as ``regress/report/metrics.schema.json``; a test regenerates it and
fails when RunMetrics changes without the file (``python -m regress.report.schema`` rewrites it).
"""

from __future__ import annotations

import ast
import inspect
import json
from typing import Any

from regress.noise.record import MeasureTest, NoiseTest
from regress.power.record import PowerFigure
from regress.records import LatencyComparison, LatencyStats, RunMetrics

DOCUMENTED_DEFS = (LatencyStats, LatencyComparison, NoiseTest, MeasureTest, PowerFigure)
"""Records nested in RunMetrics whose fields' docstrings the schema carries too (under ``$defs``)."""


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal written under it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def metrics_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) a ``metrics.json`` validates against."""
    schema = RunMetrics.model_json_schema(mode="serialization")
    for name, text in _attribute_docstrings(RunMetrics).items():
        if name in schema["properties"]:
            schema["properties"][name]["description"] = text
    for cls in DOCUMENTED_DEFS:
        definition = schema.get("$defs", {}).get(cls.__name__)
        if definition is None:
            continue
        for name, text in _attribute_docstrings(cls).items():
            if name in definition.get("properties", {}):
                definition["properties"][name]["description"] = text
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "metrics.schema.json", **schema}


def schema_text() -> str:
    """The schema file's exact text."""
    return json.dumps(metrics_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    from regress.report import METRICS_SCHEMA
    from regress.storage import atomic_write_text

    atomic_write_text(METRICS_SCHEMA, schema_text())
    print(METRICS_SCHEMA)
