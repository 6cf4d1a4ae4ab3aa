"""Reading an sglang-router's GET /workers answer (app/rollout/router.py); the live router: tests/sglang/test_router.py."""

import pytest

from app.rollout.router import RouterWorkersError, worker_urls

ROUTER = "http://r:30000"


def test_worker_urls_in_order_without_slash_or_duplicates_healthy_or_not():
    payload = {
        "workers": [
            {"id": "a", "url": "http://10.0.0.2:30000/", "is_healthy": True},
            {"id": "b", "url": "http://10.0.0.3:30000", "is_healthy": False},
            {"id": "c", "url": "http://10.0.0.2:30000", "is_healthy": True},
        ],
        "total": 3,
    }
    assert worker_urls(ROUTER, payload) == ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
    assert worker_urls(ROUTER, {"workers": []}) == []


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("HTTP 404 not found", r"http://r:30000: GET /workers answered .*is this an sglang-router"),
        ({"model_path": "x"}, r"not \{'workers': \[...\]\}"),
        ({"workers": [{"id": "a"}]}, r"GET /workers entry 0 has no http\(s\) url"),
        ({"workers": [{"url": "10.0.0.2:30000"}]}, r"entry 0 has no http\(s\) url"),
        ({"workers": ["http://a:1"]}, r"entry 0 has no http\(s\) url"),
    ],
)
def test_answers_that_are_not_a_router_s_are_refused_with_what_came_back(payload, message):
    with pytest.raises(RouterWorkersError, match=message):
        worker_urls(ROUTER, payload)
