"""The engine backend interface.

A backend runs inside the engine process, in the candidate's own environment (which has
the engine, torch and transformers but not regress's dependencies), so this module imports
only the standard library and numpy.

A backend does four things: load a model, render a prompt to token ids with the model's
tokenizer (chat template for ``messages``), generate free-running with per-position top-k
logprobs, and score given token sequences teacher-forced (logprobs of each given token and
the top-k at its position). It also names the software it ran on (:meth:`EngineBackend.versions`),
so that a run records the versions that matter for that backend.
"""

from __future__ import annotations

import abc
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, ClassVar

import numpy as np

from regress.errors import ChatTemplateMissing  # noqa: F401  (raised by render_prompt; re-exported)

ProgressCallback = Callable[[int], None]
"""Called with the number of requests finished since the last call."""


@dataclass
class LogprobRows:
    """Per-position logprobs along a token sequence (see :class:`regress.records.LogprobTrack`)."""

    token_logprobs: np.ndarray  # float32 [n]
    top_ids: np.ndarray  # int32 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k]

    @classmethod
    def empty(cls, k: int) -> "LogprobRows":
        return cls(
            np.zeros(0, np.float32), np.full((0, k), -1, np.int32), np.full((0, k), -np.inf, np.float32)
        )


LOGPROB_TOLERANCE = 1e-4
"""How far above 0 a logprob may lie (float rounding) and still be a logprob."""


def rows_problem(rows: LogprobRows, k: int, vocab_size: int | None = None) -> str | None:
    """What makes ``rows`` not the logprob rows of a top-``k`` (None: nothing wrong), for a reply
    that crossed into regress from an engine: one row of ``k`` per token, every logprob a number
    <= 0 or -inf (never NaN or +inf), every top-k id in ``0 .. vocab_size - 1`` (the -1 padding
    marker included) and once per row, each row best first, and no chosen token more likely than
    its row's best. Positions are counted from 0."""
    token_lp, top_ids, top_lp = rows.token_logprobs, rows.top_ids, rows.top_logprobs
    n = len(token_lp)
    if token_lp.ndim != 1 or top_ids.shape != (n, k) or top_lp.shape != (n, k):
        return f"logprob rows shaped {top_ids.shape} and {top_lp.shape} for {n} tokens and a top-{k}"
    for what, values in (("the chosen token's logprob", token_lp), ("a top-k logprob", top_lp)):
        bad = np.isnan(values) | (values > LOGPROB_TOLERANCE)
        if bad.any():
            where = np.argwhere(bad)[0]
            return (f"{what} at position {int(where[0])} is {float(values[tuple(where)])!r} "
                    "(a logprob is a finite number <= 0; NaN: the token is missing from its row)")
    bound = vocab_size if vocab_size is not None else np.iinfo(np.int32).max + 1
    bad = (top_ids < 0) | (top_ids >= bound)
    if bad.any():
        where = np.argwhere(bad)[0]
        return (f"top-k token id {int(top_ids[tuple(where)])} at position {int(where[0])} is outside the "
                f"vocabulary (0 .. {bound - 1})")
    if n and k > 1:
        ordered = np.sort(top_ids, axis=1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if repeated.any():
            return f"the top-k row at position {int(np.argmax(repeated))} names a token twice"
        with np.errstate(invalid="ignore"):  # -inf - -inf
            rising = (np.diff(top_lp, axis=1) > LOGPROB_TOLERANCE).any(axis=1)
        if rising.any():
            return f"the top-k row at position {int(np.argmax(rising))} is not best first"
    if n:
        above = token_lp > top_lp[:, 0] + LOGPROB_TOLERANCE
        if above.any():
            i = int(np.argmax(above))
            return (f"the chosen token at position {i} ({float(token_lp[i])!r}) is more likely than the best of "
                    f"its top-k ({float(top_lp[i, 0])!r})")
    return None


@dataclass
class RawGeneration:
    """One prompt's free-running output as the engine returned it."""

    output_token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: LogprobRows
    timing: dict[str, float] | None = None
    """Request timing where the backend measures it (the ``server`` backend): ``ttft_s``, send to
    the first token, and ``total_s``, send to the last chunk (seconds)."""
    prompt_token_ids: list[int] | None = None
    """The prompt token ids the engine actually used, where it built them itself (the ``server``
    backend's chat endpoint applies the server's chat template); None: the rendered ids sent.
    These become the run's prompt tokens and the prompt that teacher forcing feeds."""


@dataclass
class GenerationRequest:
    """One prompt, already tokenized, with its resolved sampling (a dict of ResolvedSampling fields)."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]


class EngineBackend(abc.ABC):
    """One loaded model. Subclasses register under :attr:`name` in :mod:`regress.backends`."""

    name: ClassVar[str]

    def __init__(self, spec: dict[str, Any]):
        """``spec`` is :meth:`regress.records.CandidateSpec.engine_spec` as a dict."""
        self.spec = spec

    @abc.abstractmethod
    def load(self) -> dict[str, Any]:
        """Load the model. Returns facts for the manifest: ``resolved_path``, ``revision``,
        ``dtype``, ``quantization``, ``engine_args`` (as passed), and ``effective``: what the
        engine applied, read back from it (:class:`regress.records.EffectiveConfig` fields, any
        of them left out when the backend cannot tell)."""

    @abc.abstractmethod
    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the engine uses."""

    @abc.abstractmethod
    def generate(
        self, requests: list[GenerationRequest], progress: ProgressCallback
    ) -> list[RawGeneration]:
        """Generate for all requests as one batch submission (the shard is the batch)."""

    @abc.abstractmethod
    def teacher_force(
        self, sequences: list[tuple[list[int], list[int]]], k: int, progress: ProgressCallback
    ) -> list[LogprobRows]:
        """For each (prompt ids, completion ids), the logprob of every completion token given
        everything before it, and the top-k at that position."""

    def close(self) -> None:
        """Release the engine."""

    def reset_cache(self) -> bool:
        """Forget what earlier requests computed (a prefix cache), so that the next request is
        computed as on a freshly loaded engine. True when nothing of them is left to reuse; the
        default, False, says the backend cannot tell (a warm engine is then not reused where a
        fresh one is needed: :meth:`regress.replay.warm.WarmEngines.acquire`)."""
        return False

    def sampling_applied(self, sampling: dict[str, Any]) -> dict[str, Any] | None:
        """The engine's own sampling parameters for one resolved sampling, as the engine holds
        them after construction (JSON values); None when the backend has no such object."""
        return None

    def versions(self) -> dict[str, str | None]:
        """Versions of the software this backend runs on, recorded in the run's manifest
        (``None``: not installed). Subclasses add their engine's packages to these."""
        return {"python": platform.python_version(), "numpy": np.__version__}

    def render(self, payload: dict[str, Any], chat_template: str | None = None) -> list[int]:
        """Token ids of a prompt payload (``{"prompt": str}`` or ``{"messages": [...]}``)."""
        return render_prompt(self.get_tokenizer(), payload, chat_template)


MAX_SAMPLING_APPLIED = 20
"""Most distinct samplings whose engine parameters a shard (and a manifest) records."""


def sampling_key(sampling: dict[str, Any]) -> str:
    """What makes two resolved samplings distinct for the record of the engine's parameters: every
    field but a sample's number and seed (the samples of one prompt count once)."""
    import json

    return json.dumps({k: v for k, v in sampling.items() if k not in ("sample", "samples", "seed")},
                      sort_keys=True, default=str)


def json_value(value: Any) -> Any:
    """``value`` as plain JSON: enums by name, sets as sorted lists, other objects as text."""
    import enum

    if isinstance(value, enum.Enum):  # before int and str: IntEnum and StrEnum members are both
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((json_value(v) for v in value), key=str)
    if hasattr(value, "item"):  # a numpy scalar
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)


def tokenizer_facts(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """The tokenizer as loaded (:class:`regress.records.TokenizerFacts` fields); ``chat_template``
    is the candidate's own template, else the tokenizer's is taken."""
    import hashlib

    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        template = None
    try:
        vocab_size: int | None = len(tokenizer)
    except TypeError:
        vocab_size = getattr(tokenizer, "vocab_size", None)

    def token_id(name: str) -> int | None:
        value = getattr(tokenizer, name, None)
        return value if isinstance(value, int) else None

    # Engines wrap the tokenizer in classes of their own (vLLM's cached tokenizer): name the
    # tokenizer's class, the first one not defined by the engine.
    cls = next((c for c in type(tokenizer).__mro__ if not c.__module__.startswith("vllm")), type(tokenizer))
    return {
        "class_name": cls.__name__,
        "vocab_size": vocab_size,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest() if template else None,
    }


def read_chat_template(spec: dict[str, Any]) -> str | None:
    """The candidate's own chat template file's text (None when it names none or it is unreadable)."""
    path = spec.get("chat_template")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def distribution_versions(*names: str) -> dict[str, str | None]:
    """The installed version of each distribution (``None`` where it is not installed)."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def render_prompt(tokenizer: Any, payload: dict[str, Any], chat_template: str | None = None) -> list[int]:
    """Tokenize a text prompt the way vLLM does (special tokens added), or render a chat with
    the model's template and then tokenize without adding special tokens again (the template
    already holds them)."""
    if "messages" in payload:
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatTemplateMissing(
                "the model's tokenizer has no chat template, so 'messages' prompts cannot be "
                "rendered; set the candidate's 'chat_template' to a Jinja file, or use 'prompt'"
            )
        text = tokenizer.apply_chat_template(
            payload["messages"], chat_template=template, add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(payload["prompt"]))


def top_k_rows(logprobs: np.ndarray, token_ids: np.ndarray, k: int) -> LogprobRows:
    """From full log-softmax rows [n, vocab] and the token at each row, the LogprobRows.

    Ties are broken by lower token id first, as a stable sort would, so that two runs with
    equal logits report the same top-k order.
    """
    logprobs = np.asarray(logprobs, dtype=np.float32)
    n = logprobs.shape[0]
    if n == 0:
        return LogprobRows.empty(k)
    order = np.argsort(-logprobs, axis=1, kind="stable")[:, :k]
    top_lp = np.take_along_axis(logprobs, order, axis=1)
    chosen = logprobs[np.arange(n), np.asarray(token_ids, dtype=np.int64)]
    return LogprobRows(chosen.astype(np.float32), order.astype(np.int32), top_lp.astype(np.float32))
