"""Request timeouts for TRL's `VLLMClient` (server mode), which sends without one.

Applied on every device (a hung server hangs a GPU run as much as a CPU one), on the trainer's own client instance
after it is built: not a CPU patch, so it lives outside `dppo_trl/backends/cpu/`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["bound_server_requests"]


def bound_server_requests(client: Any, timeout: float | None) -> None:
    """Bound every request of a TRL `VLLMClient` to `timeout` seconds without an answer, not retried (None: no bound).

    TRL's session sends without a timeout, so a hung server hangs training, and its `Retry(read=5)` would repeat a
    timed-out generation five times. Connection retries (a killed server refuses connections) keep TRL's backoff,
    about 1 min in all.
    """
    if timeout is None:
        return
    from requests.adapters import HTTPAdapter

    class TimeoutAdapter(HTTPAdapter):
        def send(self, request, **kwargs):
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = timeout
            return super().send(request, **kwargs)

    current = client.session.get_adapter(client.base_url)
    retries = current.max_retries.new(read=0)
    adapter = TimeoutAdapter(max_retries=retries, pool_maxsize=getattr(current, "_pool_maxsize", 10))
    for prefix in ("http://", "https://"):
        client.session.mount(prefix, adapter)
