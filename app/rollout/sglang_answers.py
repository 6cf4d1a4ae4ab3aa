"""Reading SGLang's ``/generate`` answers: the checks of app/rollout/sglang.py's module docstring, apart from the
HTTP client, so that a malformed answer is a `RolloutResponseError` naming the server and the request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.rollout.base import Completion

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(RuntimeError):
    """Base of the errors the SGLang client raises."""


class RolloutResponseError(SGLangError):
    """A server answered 2xx with a body that does not fit SGLang's documented shape."""


def parse_generate(
    payload: Any,
    chunk: list[list[int]],
    n: int,
    *,
    url: str,
    what: str,
    version_of: Callable[[Any], int],
    adapter: tuple[int, str] | None = None,
) -> list[Completion]:
    """The completions of one ``/generate`` answer (``len(chunk) * n`` items, prompt-major), every item checked
    (app/rollout/sglang.py's module docstring); ``version_of`` maps a ``weight_version`` label to a policy
    version, ``adapter`` is the (version, name) of the LoRA adapter the request named."""
    def bad(message: str) -> RolloutResponseError:
        return RolloutResponseError(f"{url}: malformed answer to {what}: {message}")

    items = [payload] if isinstance(payload, dict) else payload
    if not isinstance(items, list) or len(items) != len(chunk) * n:
        got = f"{len(items)} items" if isinstance(items, list) else type(payload).__name__
        raise bad(f"expected a list of {len(chunk)} prompts x n={n} = {len(chunk) * n} items, got {got}")
    completions = []
    for k, item in enumerate(items):
        prompt_index, sample = divmod(k, n)
        where = f"item {k} (prompt {prompt_index}, sample {sample})"
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            raise bad(f"{where} has no meta_info object")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise bad(f"{where} has no meta_info.output_token_logprobs (was return_logprob honoured?)")
        output_ids = item.get("output_ids")
        if output_ids is None:  # servers with a tokenizer may answer text; the ids are in the triples
            output_ids = [t[1] for t in triples if isinstance(t, list) and len(t) >= 2]
        if not isinstance(output_ids, list) or len(output_ids) != len(triples):
            raise bad(
                f"{where} has {len(output_ids) if isinstance(output_ids, list) else output_ids!r} "
                f"output_ids but {len(triples)} output_token_logprobs"
            )
        logprobs = []
        for j, (token, triple) in enumerate(zip(output_ids, triples, strict=True)):
            if not (
                isinstance(triple, list)
                and len(triple) >= 2
                and isinstance(triple[0], (int, float))
                and not isinstance(triple[0], bool)
            ):
                raise bad(
                    f"{where} output_token_logprobs[{j}] = {triple!r} is not [logprob, token_id, text]"
                )
            if triple[1] != token:
                raise bad(
                    f"{where} output_token_logprobs[{j}] is for token {triple[1]}, output_ids has {token}"
                )
            logprobs.append(float(triple[0]))
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind not in _FINISH_REASONS:
            raise bad(f"{where} has finish_reason {reason!r}; expected type stop, length or abort")
        extra: dict[str, Any] = {"server": url, "weight_version": meta.get("weight_version")}
        version = version_of(meta.get("weight_version"))
        spans = meta.get("weight_versions")
        if isinstance(spans, list) and spans:
            extra["weight_versions"] = [
                {
                    "version": version_of(s.get("version")),
                    "start": s.get("start"),
                    "end": s.get("end"),
                }
                for s in spans
                if isinstance(s, dict)
            ]
            if extra["weight_versions"]:
                version = min(s["version"] for s in extra["weight_versions"])
        if adapter is not None:  # the base weights never change: the adapter named is the version
            version = adapter[0]
            extra["adapter"] = adapter[1]
        if kind == "abort" and isinstance(reason, dict) and reason.get("message"):
            extra["abort_message"] = reason["message"]
        completions.append(
            Completion(
                prompt_ids=list(chunk[prompt_index]),
                output_ids=[int(t) for t in output_ids],
                output_logprobs=logprobs,
                finish_reason=_FINISH_REASONS[kind],
                policy_version=version,
                meta=extra,
            )
        )
    return completions
