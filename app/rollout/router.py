"""Reading an sglang-router's workers (``rollout.sglang.router``): what the client must reach past the router.

sglang-router 0.3.2 (checked against two real SGLang 0.5.23 CPU servers, tests/sglang/test_router.py) forwards
``/generate`` with its logprobs and ``weight_version`` unchanged, but answers 404 to every weight-update route
(``/update_weights_from_disk``, ``/init_weights_update_group``, ``/update_weights_from_distributed``, ...), and
sends ``/model_info`` to one worker only. So the client generates through the router and updates, probes and
health-checks each worker at the URL that ``GET /workers`` lists for it:
``{"workers": [{"id", "url", "is_healthy", ...}, ...], "total": N, ...}``.
"""

from __future__ import annotations

from typing import Any


class RouterWorkersError(ValueError):
    """The router's ``GET /workers`` answer is not the documented shape."""


def worker_urls(router: str, payload: Any) -> list[str]:
    """The worker URLs in a ``GET /workers`` answer, in its order, without a trailing slash; duplicates once.

    Every listed worker is returned, healthy or not by the router's own checks: its health checks lag (60 s
    apart by default, three failures to mark a worker down), so the client probes each worker itself."""
    if not isinstance(payload, dict) or not isinstance(payload.get("workers"), list):
        raise RouterWorkersError(
            f"{router}: GET /workers answered {str(payload)[:200]!r}, not {{'workers': [...]}}: is this an "
            "sglang-router (0.3 or later)? rollout.sglang.router takes a router; give servers in rollout.sglang.urls"
        )
    urls: list[str] = []
    for i, worker in enumerate(payload["workers"]):
        url = worker.get("url") if isinstance(worker, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RouterWorkersError(f"{router}: GET /workers entry {i} has no http(s) url: {str(worker)[:200]!r}")
        url = url.rstrip("/")
        if url not in urls:
            urls.append(url)
    return urls
