"""SGLangClient: the RolloutEngine that drives one or more SGLang servers over their native HTTP API.

The same client talks to a real SGLang server (GPU, or CPU for tests) and to trustbatch's built-in CPU server,
which speaks the same subset of the API (shapes as read from SGLang 0.5.23's source and seen live; tests/sglang checks them).

What it sends (token ids in, token ids out; no text):
- ``POST /generate {"input_ids": [[...], ...], "sampling_params": {max_new_tokens, temperature, top_p, n,
  stop_token_ids[, sampling_seed]}, "return_logprob": true}``, one request per ``batch_size`` prompts.
  SGLang rejects unknown ``sampling_params`` keys with 400, so only those keys are ever sent. EOS needs no
  entry: SGLang stops on it unless ``ignore_eos``.
- ``POST /update_weights_from_disk {"model_path", "weight_version"}`` to every server at once.
- ``GET /health``, ``GET /model_info``, ``GET /server_info``, ``POST /flush_cache``, ``POST /pause_generation {"mode"}``,
  ``POST /continue_generation``.

How it reads a ``/generate`` answer: a flat, prompt-major list of ``len(prompts) * n`` items
(``[p0s0, p0s1, p1s0, p1s1]``), each ``{"output_ids", "meta_info": {"output_token_logprobs": [[logprob, token_id,
text|null], ...], "finish_reason": {"type": "stop"|"length"|"abort", ...}, "weight_version": str,
"weight_versions": [{"version", "start", "end"}]}}``. Every item is checked (count, one logprob per output id,
the logprob's token id equal to the output id, a known finish reason); a mismatch raises
``RolloutResponseError`` naming the server and the request, because training on misaligned behaviour logprobs
would be silently wrong.

Weight versions. SGLang's ``weight_version`` is a string; trustbatch's ``policy_version`` an int. The client
pushes ``str(version)``, so every version it set comes back numeric and maps by ``int()``. A label it did not
set (SGLang's default ``"default"``, a ``--weight-version v0`` given at launch) means weights loaded before the
client's first push: it maps to the client's ``policy_version`` at the moment the label is first seen (the
constructor's ``policy_version``, 0 by default) and keeps that value for the life of the client. A completion
whose tokens were produced by several versions (``weight_versions`` spans, an update landing mid-generation)
gets the *oldest* of them as ``policy_version``, so a staleness bound on it is never too lenient; the spans
themselves are in ``Completion.meta["weight_versions"]`` (versions as ints).

LoRA adapters (``rollout.sglang.lora_adapters``, SGLang on GPUs started with ``--enable-lora``). A version can
arrive as a PEFT adapter directory (``WeightSource(path=..., adapter=True)``) instead of full weights:
``POST /load_lora_adapter {"lora_name": "tb-<client>-v<N>", "lora_path": <dir>}`` on every server (the name is
unique to this client, so a server reused across runs never answers with another run's adapter of the same
version), and from then on every ``/generate`` and probe request names it (``"lora_path"``: SGLang's field takes
the adapter's *name*). A request that names no adapter is answered by the base model, silently, so once a client
has loaded one it never sends a request without it. A completion's ``policy_version`` is the version of the
adapter its request named when it was sent (the base weights, and so SGLang's ``weight_version`` label, never
change). A server that answers that it never loaded the adapter (restarted, or a worker new behind a router) gets
the resident ones (``reload_adapters``) and the request is sent once more. ``unload_adapters`` removes all but
the newest ``keep`` (``POST /unload_lora_adapter``; SGLang waits for the requests that use one before it goes);
the fleet keeps ``max_lag + 1`` resident.

Failures. Connection errors, timeouts (``timeout_s`` bounds each request as a whole) and 5xx answers are
retried up to ``max_retries`` times with exponential back-off and jitter (so is 429, "busy"); a ``/generate`` request moves to the
next server on each retry, a per-server call (weight update, cache flush) retries the same server. When the
retries run out: ``RolloutServerError`` naming the URL(s) and the last error. A 4xx is the client's fault and
is never retried: ``RolloutRequestError`` carrying the server's message. Concurrency is bounded per server
(``max_concurrency`` requests in flight each); requests go round-robin over the servers, continuing across
calls.

Weights over a process group (NCCL/gloo, ``rollout.sglang.weight_sync.method=distributed``): the requests
(/init_weights_update_group, /update_weights_from_distributed inside /begin_weight_update ...
/end_weight_update, /destroy_weights_update_group) and the broadcasts that pair with them live together in
app/rollout/weight_sync.py, which sends them through this client's ``post_once`` (never retried) and
``server_info``. This module imports nothing of it; the section's settings are in app/rollout/sglang_config.py.

Behind an sglang-router (``rollout.sglang.router``): ``/generate`` goes through the router, which spreads it over
its workers; everything that must reach every worker (weight updates, the publication check's probe, health,
``/model_info``) goes to the workers themselves, because the router answers 404 to the weight-update routes
and forwards ``/model_info`` to one worker only. ``healthy_workers`` reads them from the router's
``GET /workers`` (app/rollout/router.py) and keeps those that answer ``/health``: the fleet takes them before
every push, so a worker that died behind the router is left out and one that came back gets the next version
(until then its completions carry its old ``weight_version``, and the staleness bound judges them by it).

Not covered here: starting servers (``connect`` only attaches to running ones and waits for their health;
app/rollout/sglang_server.py starts real SGLang servers) and streaming.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx

from app.rollout.base import Completion, ProbeReading, SamplingParams, WeightSource
from app.rollout.router import worker_urls
from app.rollout.sglang_answers import RolloutResponseError, SGLangError, parse_generate
from app.rollout.sglang_config import SGLangClientConfig
from app.rollout.sglang_config import (
    WeightSyncConfig as WeightSyncConfig,  # re-exported: the section lives there
)

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 30.0
"""Cap of one back-off sleep, whatever the attempt number."""
_HEALTH_PROBE_TIMEOUT_S = 10.0
"""Time limit of one GET /health probe; SGLang answers it at once unless it runs a health generation."""


class RolloutServerError(SGLangError):
    """A server could not be reached, timed out, answered 5xx past every retry, or never became healthy."""


class RolloutRequestError(SGLangError):
    """A server rejected a request (HTTP 4xx, or ``success: false``); retrying would not help."""


class SGLangClient:
    """A RolloutEngine over the native HTTP API of one or more SGLang servers.

    Use it as an async context manager, or call ``close()``; build it inside the event loop that uses it.

    Args:
        cfg: servers, time limits, concurrency, retries, batching.
        policy_version: version of the weights the servers hold now, reported for weight labels this client
            did not set (see the module docstring).
    """

    def __init__(self, cfg: SGLangClientConfig, *, policy_version: int = 0) -> None:
        if not cfg.urls and not cfg.router:
            raise ValueError(
                "rollout.sglang.urls is empty: give the URL(s) of running SGLang servers, "
                "e.g. rollout.sglang.urls=[http://127.0.0.1:30000], or rollout.sglang.router"
            )
        self.cfg = cfg
        self.router = cfg.router.rstrip("/") or None
        self.urls = [url.rstrip("/") for url in cfg.urls]
        """The servers every update, probe and health check goes to (behind a router: its workers, set by
        ``wait_healthy`` at first and then by the fleet before each push, from ``healthy_workers``)."""
        self.policy_version = int(policy_version)
        self._labels: dict[str, int] = {}
        self.adapter: tuple[int, str] | None = None
        """(version, name) of the LoRA adapter every new request names; None: no adapter (full weights)."""
        self.adapters: dict[int, Path] = {}
        """The adapters loaded on the servers, by version: their directories (a restarted server gets them)."""
        self._adapter_prefix = f"tb-{secrets.token_hex(4)}-v"
        self._next_server = 0
        self._slots = {url: asyncio.Semaphore(cfg.max_concurrency) for url in self._targets}
        self._rng = random.Random()
        # + room for health/admin calls; behind a router the workers are not known yet (the slots bound requests).
        connections = None if self.router else len(self.urls) * (cfg.max_concurrency + 4)
        # trust_env=False: an http_proxy in the environment must not capture in-cluster or loopback servers.
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections or 64),
            trust_env=False,
        )

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # ---------------------------------------------------------------- generation

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, progress: Callable[[int], None] | None = None
    ) -> list[Completion]:
        """Sample ``params.n`` completions of every prompt; prompt-major (p0s0, p0s1, ..., p1s0, ...).
        ``progress(k)`` (optional) is told as each request's k completions arrive."""
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; SGLang needs at least one input token")
        size = self.cfg.batch_size
        chunks = [prompts[start : start + size] for start in range(0, len(prompts), size)]
        first = self._next_server
        self._next_server = (first + len(chunks)) % len(self._targets)
        tasks = [
            asyncio.ensure_future(
                self._generate_chunk(
                    chunk,
                    params,
                    index=i,
                    num_chunks=len(chunks),
                    start=i * size,
                    first_server=(first + i) % len(self._targets),
                    progress=progress,
                )
            )
            for i, chunk in enumerate(chunks)
        ]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            # One request failed for good: stop the others instead of letting them run on unobserved.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [completion for chunk_completions in results for completion in chunk_completions]

    async def _generate_chunk(
        self,
        chunk: list[list[int]],
        params: SamplingParams,
        *,
        index: int,
        num_chunks: int,
        start: int,
        first_server: int,
        progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": params.n,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            # One seed per request, so that splitting a call into requests does not repeat the same draws.
            sampling["sampling_seed"] = params.seed + index
        body = {"input_ids": [list(p) for p in chunk], "sampling_params": sampling, "return_logprob": True}
        what = f"/generate request {index + 1}/{num_chunks} (prompts {start}..{start + len(chunk) - 1})"
        sent: list[tuple[int, str] | None] = [None]

        def name_the_adapter(body: dict) -> None:
            # The version the request is sent under (once it holds a slot), whatever is loaded while it runs.
            sent[0] = self.adapter
            if sent[0] is not None:
                body["lora_path"] = sent[0][1]

        for attempt in range(2):
            try:
                url, payload = await self._call("POST", "/generate", body, what=what, servers=self._rotation(first_server),
                                                limit=True, on_send=name_the_adapter)  # fmt: skip
                break
            except RolloutRequestError as exc:
                if attempt or sent[0] is None or "never been loaded" not in str(exc):
                    raise
                # A server that lost its adapters (restarted, or a worker new behind a router): give them back.
                log.warning("%s; loading the resident adapters on every server and sending it again", exc)
                await self.reload_adapters()
        completions = parse_generate(
            payload, chunk, params.n, url=url, what=what, version_of=self._version_of, adapter=sent[0]
        )
        if progress is not None:
            progress(len(completions))
        return completions

    async def score(self, ids: list[int]) -> list[ProbeReading]:
        """The input-token logprobs of ``ids`` (``logprob_start_len: 0``, one greedy token) from every server,
        each read from that server alone, with the weight version it answered under."""
        if len(ids) < 2:
            raise ValueError("scoring needs at least two tokens (the first one has no log-probability)")
        body = {
            "input_ids": list(ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        adapter = self.adapter
        if adapter is not None:
            body["lora_path"] = adapter[1]
        label = None if adapter is None else str(adapter[0])
        return list(await asyncio.gather(*(self._score_one(url, body, adapter_label=label) for url in self.urls)))

    async def _score_one(self, url: str, body: dict, *, adapter_label: str | None = None) -> ProbeReading:
        """One server's reading; ``adapter_label``: the version of the adapter the probe names, which is what the
        server answers with (SGLang rejects a name it never loaded) instead of its unchanged ``weight_version``."""
        what = f"/generate of the {len(body['input_ids'])}-token probe text (logprob_start_len 0)"
        _, answer = await self._call("POST", "/generate", body, what=what, servers=[url])
        item = answer[0] if isinstance(answer, list) and answer else answer
        meta = item.get("meta_info") if isinstance(item, dict) else None
        triples = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        ids = body["input_ids"]
        if not isinstance(triples, list) or len(triples) != len(ids):
            raise RolloutResponseError(
                f"{url}: answer to {what} has no meta_info.input_token_logprobs with {len(ids)} entries "
                f"(got {type(triples).__name__}{f' of {len(triples)}' if isinstance(triples, list) else ''}); "
                "the server must honour logprob_start_len"
            )
        logprobs = []
        for t, (triple, token) in enumerate(zip(triples[1:], ids[1:], strict=True), start=1):
            if not (isinstance(triple, list) and len(triple) >= 2 and triple[1] == token):
                raise RolloutResponseError(f"{url}: input_token_logprobs[{t}] = {triple!r} is not for token {token}")
            value = triple[0]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RolloutResponseError(f"{url}: input_token_logprobs[{t}] = {triple!r} has no finite logprob")
            logprobs.append(float(value))
        label = adapter_label or meta.get("weight_version")
        return ProbeReading(url, None if label is None else str(label), logprobs)

    def adapter_name(self, version: int) -> str:
        """The name version ``version``'s adapter is loaded under on the servers."""
        return f"{self._adapter_prefix}{int(version)}"

    def _version_of(self, label: Any) -> int:
        """SGLang weight_version label -> policy version (module docstring: numeric, else first-seen)."""
        if label is None:
            return self.policy_version
        label = str(label)
        try:
            return int(label)
        except ValueError:
            return self._labels.setdefault(label, self.policy_version)

    # ---------------------------------------------------------------- weights

    async def update_weights(
        self, source: WeightSource, version: int, *, abort_all_requests: bool = False
    ) -> None:
        """Load new weights on every server (concurrently) and tag them ``str(version)``.

        The update waits for the requests in flight (their tokens all come from the old weights) unless
        ``abort_all_requests``: they then end at once with finish_reason "abort"."""
        if source.adapter:
            await self.load_adapter(Path(source.path), version)
            return
        if source.path is None:
            raise ValueError(
                "SGLangClient cannot send an in-memory state_dict over HTTP: save the weights as a Hugging "
                "Face directory (safetensors + config) and pass WeightSource(path=...), or push it over a "
                "process group with app.rollout.weight_sync.DistributedWeightSync (NCCL/gloo)"
            )
        # Absolute: a server given by URL resolves a relative path against its own working directory, not ours.
        body = {"model_path": str(Path(source.path).resolve()), "weight_version": str(int(version))}
        if abort_all_requests:
            body["abort_all_requests"] = True
        await asyncio.gather(*(self._update_one(url, body) for url in self.urls))
        self.policy_version = int(version)

    async def _update_one(self, url: str, body: dict) -> None:
        what = f"/update_weights_from_disk (model_path={body['model_path']}, weight_version={body['weight_version']})"
        try:
            _, answer = await self._call("POST", "/update_weights_from_disk", body, what=what, servers=[url])
        except RolloutRequestError as exc:
            if "cache was not flushed" not in str(exc):
                raise
            await self.finish_unflushed_update(url, body["weight_version"])
            return
        if not (isinstance(answer, dict) and answer.get("success") is True):
            message = answer.get("message") if isinstance(answer, dict) else answer
            raise RolloutRequestError(f"{url}: {what} was not applied: {message!r}")

    # ---------------------------------------------------------------- LoRA adapters

    async def load_adapter(self, path: Path, version: int, *, urls: list[str] | None = None) -> None:
        """Load the PEFT adapter directory ``path`` under `adapter_name` on every server (or on ``urls``), then
        name it in every new request (module docstring). A version loaded before on every server (a publish
        retried after a failed check) is replaced: unloaded, then loaded again. A server that holds it already
        otherwise (a push resent after a server failed) keeps it."""
        version = int(version)
        replace = urls is None and version in self.adapters
        body = {"lora_name": self.adapter_name(version), "lora_path": str(Path(path).resolve())}
        await asyncio.gather(*(self._load_adapter_one(url, body, replace=replace) for url in (urls or self.urls)))
        self.adapters[version] = Path(path)
        if urls is None:
            self.adapter = (version, body["lora_name"])
            self.policy_version = version

    async def reload_adapters(self, urls: list[str] | None = None) -> None:
        """Load every resident adapter (oldest first) on every server, or on ``urls``, that lacks it: a server
        that came back from the base model, or a worker new behind a router."""
        for version, path in sorted(self.adapters.items()):
            await self.load_adapter(path, version, urls=urls or list(self.urls))

    async def _load_adapter_one(self, url: str, body: dict, *, replace: bool) -> None:
        what = f"/load_lora_adapter (lora_name={body['lora_name']}, lora_path={body['lora_path']})"
        for attempt in range(2):
            try:
                _, answer = await self._call("POST", "/load_lora_adapter", body, what=what, servers=[url])
            except RolloutRequestError as exc:
                if "already loaded" not in str(exc):
                    raise RolloutRequestError(
                        f"{exc} (the server must run with --enable-lora, --max-lora-rank >= the adapter's rank and "
                        "--lora-target-modules covering its modules: rollout.sglang.launch does this for servers "
                        "it starts)"
                    ) from None
                if replace and attempt == 0:
                    await self._unload_adapter_one(url, body["lora_name"])
                    continue
                # Loaded by this client already (the name is its own): a push resent after a server failed, or
                # SGLang's own reload from that directory (a request named it) won the race after the unload.
                return
            if not (isinstance(answer, dict) and answer.get("success") is True):
                message = answer.get("error_message") if isinstance(answer, dict) else answer
                raise RolloutRequestError(f"{url}: {what} was not applied: {message!r}")
            return

    async def unload_adapters(self, keep: int) -> None:
        """Unload every adapter but the newest ``keep`` (>= 1) from every server. An adapter the server already
        evicted (SGLang's ``--max-loaded-loras``) counts as gone."""
        if keep < 1:
            raise ValueError(f"keep={keep}: the adapter new requests name must stay loaded")
        for version in sorted(self.adapters)[:-keep]:
            await asyncio.gather(*(self._unload_adapter_one(url, self.adapter_name(version)) for url in self.urls))
            del self.adapters[version]

    async def _unload_adapter_one(self, url: str, name: str) -> None:
        try:
            await self._call("POST", "/unload_lora_adapter", {"lora_name": name},
                             what=f"/unload_lora_adapter (lora_name={name})", servers=[url])  # fmt: skip
        except RolloutRequestError as exc:
            if "does not exist" not in str(exc):
                raise

    # ---------------------------------------------------------------- health and admin

    async def health(self) -> bool:
        """True when every server answers GET /health with 200."""
        probes = await asyncio.gather(*(self.probe(url, _HEALTH_PROBE_TIMEOUT_S) for url in self.urls))
        return all(ok for ok, _ in probes)

    async def healthy_workers(self, timeout_s: float = _HEALTH_PROBE_TIMEOUT_S) -> list[str]:
        """Behind a router: the workers it lists (GET /workers) that answer GET /health, sorted; each call within
        about ``timeout_s``. RolloutServerError when the router does not answer or no worker does. Only the
        fleet's push (one at a time) makes them ``urls``, so membership never changes under a weight update."""
        assert self.router is not None
        try:
            async with asyncio.timeout(timeout_s):
                _, payload = await self._call(
                    "GET", "/workers", None, what="GET /workers", servers=[self.router], max_retries=0
                )
        except TimeoutError as exc:
            raise RolloutServerError(f"{self.router}: GET /workers got no answer in {timeout_s:g} s") from exc
        except RolloutRequestError as exc:
            payload = str(exc)  # a 4xx: not a router; worker_urls says so
        listed = worker_urls(self.router, payload)
        probes = await asyncio.gather(*(self.probe(url, timeout_s) for url in listed))
        healthy = sorted(url for url, (ok, _) in zip(listed, probes, strict=True) if ok)
        if not healthy:
            lines = "; ".join(f"{url} ({detail})" for url, (_, detail) in zip(listed, probes, strict=True))
            raise RolloutServerError(
                f"no worker behind the router {self.router} answers GET /health here: {lines or 'none listed'}. "
                "Weight updates go to the workers themselves (the router has no route for them): each must be "
                "reachable from the trainer at the URL the router lists (start the router with worker URLs "
                "that every trainer node can reach, not 127.0.0.1 of another machine)"
            )
        for url in sorted(set(listed) - set(healthy)):
            log.warning("worker %s behind the router %s does not answer GET /health: it gets no weights until it "
                        "does", url, self.router)  # fmt: skip
        return healthy

    async def wait_healthy(self, timeout_s: float | None = None, *, poll_s: float = 0.5) -> None:
        """Poll GET /health until every server answers 200; RolloutServerError after ``timeout_s``.

        ``timeout_s`` defaults to ``cfg.health_timeout_s``. The error names each server that never became
        healthy with its last status or connection error. Behind a router: until the router and at least one
        of its workers answer (``healthy_workers``); the first time, those become ``urls``.
        """
        limit = self.cfg.health_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        if self.router is not None:
            while True:
                try:
                    healthy = await self.healthy_workers(max(min(_HEALTH_PROBE_TIMEOUT_S, deadline - loop.time()), 0.05))
                except RolloutServerError as exc:
                    if loop.time() >= deadline:
                        raise RolloutServerError(
                            f"not healthy after {limit:g} s (rollout.sglang.health_timeout_s): {exc}"
                        ) from exc
                    await asyncio.sleep(min(poll_s, max(deadline - loop.time(), 0.0)))
                    continue
                if not self.urls:  # the first time (connect): nothing is in flight yet
                    self.urls = healthy
                    self._slots[self.router] = asyncio.Semaphore(self.cfg.max_concurrency * len(healthy))
                return
        pending = {url: "not probed" for url in self.urls}
        while True:
            remaining = deadline - loop.time()
            urls = list(pending)
            probes = await asyncio.gather(
                *(self.probe(url, max(min(_HEALTH_PROBE_TIMEOUT_S, remaining), 0.05)) for url in urls)
            )
            for url, (ok, detail) in zip(urls, probes, strict=True):
                if ok:
                    del pending[url]
                else:
                    pending[url] = detail
            if not pending:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                lines = "; ".join(f"{url} (last: {detail})" for url, detail in pending.items())
                raise RolloutServerError(
                    f"SGLang server(s) not healthy after {limit:g} s (rollout.sglang.health_timeout_s): {lines}. "
                    "Check that they are running and finished loading, and their logs."
                )
            await asyncio.sleep(min(poll_s, remaining))

    async def probe(self, url: str, timeout_s: float) -> tuple[bool, str]:
        """One GET /health of one server: (healthy?, what it answered or why it did not)."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._http.get(url + "/health", timeout=httpx.Timeout(timeout_s))
        except (TimeoutError, httpx.TimeoutException):
            return False, f"GET /health timed out after {timeout_s:g} s"
        except httpx.TransportError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        if response.status_code == 200:
            return True, "HTTP 200"
        return False, f"HTTP {response.status_code} {_message(response)}".rstrip()

    async def model_info(self, url: str | None = None) -> dict:
        """GET /model_info of one server (the first by default): model_path, weight_version, ..."""
        target = self.urls[0] if url is None else url.rstrip("/")
        _, answer = await self._call("GET", "/model_info", None, what="GET /model_info", servers=[target])
        if not isinstance(answer, dict):
            raise RolloutResponseError(f"{target}: /model_info answered {answer!r}, not a JSON object")
        return answer

    async def server_info(self, url: str | None = None) -> dict:
        """GET /server_info of one server (the first by default): tp_size and the rest of its launch settings."""
        target = self.urls[0] if url is None else url.rstrip("/")
        _, answer = await self._call("GET", "/server_info", None, what="GET /server_info", servers=[target])
        if not isinstance(answer, dict):
            raise RolloutResponseError(f"{target}: /server_info answered {answer!r}, not a JSON object")
        return answer

    async def flush_cache(self) -> None:
        """Drop every server's prefix (radix) cache; SGLang refuses (4xx) while requests are running."""
        await self._on_every_server("POST", "/flush_cache", None)

    async def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "abort") -> None:
        """Pause every server: abort in-flight requests, retract them to the queue, or freeze them in place."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation mode must be abort, retract or in_place, got {mode!r}")
        await self._on_every_server("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """Resume every server after ``pause_generation``."""
        await self._on_every_server("POST", "/continue_generation", {})

    async def _on_every_server(self, method: str, path: str, body: dict | None) -> None:
        await asyncio.gather(
            *(self._call(method, path, body, what=f"{method} {path}", servers=[url]) for url in self.urls)
        )

    # ---------------------------------------------------------------- what both weight-update paths use
    # Updates from disk (above) and the distributed method (app/rollout/weight_sync.py).

    async def finish_unflushed_update(self, url: str, version: str | None) -> None:
        """Complete an update SGLang applied but answered 400 "the cache was not flushed".

        SGLang 0.5.23 loads the weights under its model-update lock, then flushes the radix cache; the flush is
        refused when requests reached the scheduler in between (after ``abort_all_requests``, or new requests
        arriving as the lock is released), and it then also skips the ``weight_version`` label. Stale prefix KV
        must not be reused under the new weights, and a bare /flush_cache retry loses the same race while
        rollouts keep coming. So, as the engine allows: pause with ``retract`` (running requests go back to the
        queue and drop their KV; new /generate calls wait), flush (a paused engine ignores its queue), set the
        label with /update_weight_version, and continue; retracted requests then recompute their KV with the
        new weights.
        """
        log.info(
            "%s: weights %s loaded but the cache was not flushed; retract, flush, label, continue",
            url,
            version,
        )
        await self.post_once(
            url, "/pause_generation", {"mode": "retract"}, what="/pause_generation (retract)"
        )
        try:
            await self.post_once(url, "/flush_cache", None, what="/flush_cache after a weight update")
            if version is not None:
                await self.post_once(
                    url,
                    "/update_weight_version",
                    {"new_version": version, "abort_all_requests": False},
                    what="/update_weight_version after a weight update",
                )
        finally:
            await self.post_once(url, "/continue_generation", {}, what="/continue_generation")

    async def post_once(self, url: str, path: str, body: dict | None, *, what: str) -> Any:
        """One POST to one server, never retried; 4xx or ``success: false`` raise RolloutRequestError.

        For requests that must not be repeated: a weight-update request pairs with collectives on the trainer
        side (app/rollout/weight_sync.py), and a repeated one would wait for broadcasts that never come."""
        _, answer = await self._call("POST", path, body, what=what, servers=[url], max_retries=0)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RolloutRequestError(f"{url}: {what} failed: {answer.get('message')!r}")
        return answer

    # ---------------------------------------------------------------- transport

    @property
    def _targets(self) -> list[str]:
        """Where /generate goes: the router, or the servers."""
        return [self.router] if self.router else self.urls

    def _rotation(self, first: int) -> list[str]:
        targets = self._targets
        return [targets[(first + k) % len(targets)] for k in range(len(targets))]

    def _backoff(self, retry: int) -> float:
        return min(self.cfg.backoff_s * 2 ** (retry - 1), _MAX_BACKOFF_S) * (0.5 + self._rng.random())

    async def _call(
        self,
        method: str,
        path: str,
        body: dict | None,
        *,
        what: str,
        servers: list[str],
        limit: bool = False,
        max_retries: int | None = None,
        on_send: Callable[[dict], None] | None = None,
    ) -> tuple[str, Any]:
        """One request with retries; attempt k goes to ``servers[k % len(servers)]``. Returns (url, body).

        ``max_retries`` overrides ``cfg.max_retries`` (0 for requests that must not be repeated); ``on_send(body)``
        runs right before each attempt is sent (with ``limit``, once it holds its server's slot)."""
        attempts = (self.cfg.max_retries if max_retries is None else max_retries) + 1
        tried: list[str] = []
        error = ""
        for attempt in range(attempts):
            url = servers[attempt % len(servers)]
            if url not in tried:
                tried.append(url)
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            try:
                if limit:
                    async with self._slots[url]:
                        if on_send is not None:
                            on_send(body)
                        response = await self._send(method, url + path, body)
                else:
                    if on_send is not None:
                        on_send(body)
                    response = await self._send(method, url + path, body)
            except (TimeoutError, httpx.TimeoutException):
                error = f"{url}: timed out after {self.cfg.timeout_s:g} s (rollout.sglang.timeout_s)"
                continue
            except httpx.TransportError as exc:
                error = f"{url}: {type(exc).__name__}: {exc or 'connection failed'}"
                continue
            if response.status_code >= 500 or response.status_code == 429:  # 429: busy, come back later
                error = f"{url}: HTTP {response.status_code} {_message(response)}".rstrip()
                continue
            if response.status_code >= 400:
                raise RolloutRequestError(
                    f"{url} rejected {what} with HTTP {response.status_code}: {_message(response)}"
                )
            return url, _decode(response)
        raise RolloutServerError(
            f"{what} failed after {attempts} attempt(s) on {', '.join(tried)}; last error: {error}"
        )

    async def _send(self, method: str, url: str, body: dict | None) -> httpx.Response:
        # httpx's timeouts bound each read; the outer timeout bounds the whole request, so a server that
        # trickles bytes cannot hold a request past timeout_s either. asyncio.timeout, not asyncio.wait_for:
        # on Python 3.11 wait_for swallows a cancellation that arrives as the request completes.
        async with asyncio.timeout(self.cfg.timeout_s):
            return await self._http.request(method, url, json=body)


SGLangEngine = SGLangClient
"""The name under which the rollout-engine choice refers to this client."""


async def connect(cfg: SGLangClientConfig, *, policy_version: int = 0) -> SGLangClient:
    """Attach to running SGLang servers at ``cfg.urls`` and wait (``cfg.health_timeout_s``) until all are healthy."""
    client = SGLangClient(cfg, policy_version=policy_version)
    try:
        await client.wait_healthy()
    except BaseException:
        await client.close()
        raise
    return client


def _decode(response: httpx.Response) -> Any:
    """The JSON body, or the text for the routes that answer plain text (/flush_cache)."""
    try:
        return response.json()
    except ValueError:
        return response.text


def _message(response: httpx.Response) -> str:
    """The server's own error message: SGLang's ``{"error": ...}`` (``{"error_message": ...}`` from its LoRA routes),
    FastAPI's ``{"detail": ...}``, or the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500]
    if isinstance(body, dict):
        for key in ("error", "error_message", "detail", "message"):
            if key in body:
                value = body[key]
                if isinstance(value, dict) and "message" in value:
                    value = value["message"]
                return str(value)[:500]
    return str(body)[:500]
