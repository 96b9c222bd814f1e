"""The vLLM server's API key, sent by a server-mode trainer on every device (CPU and GPU alike).

TRL's `VLLMClient` sends no `Authorization` header, so it cannot reach a vLLM server started with `--api-key` (or
`VLLM_API_KEY` in its environment), which guards the `/v1` routes. `api_key_client_class(VLLMClient, key)` is the
subclass that adds `Authorization: Bearer <key>` to its session. This is not a CPU patch: it is what any
`DPPOTrainer` in server mode gets when `$VLLM_API_KEY` is set in its environment, on CUDA as on the CPU. Without the
variable nothing is swapped for it (`dppo_trl.backends.cpu.construction.server_client_class`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["API_KEY_ENV", "api_key_client_class"]

# vLLM's own variable, so one `export` serves the server and the trainer.
API_KEY_ENV = "VLLM_API_KEY"


def api_key_client_class(base: type, api_key: str) -> type:
    """A subclass of TRL's `VLLMClient` (`base`) that sends `api_key` as a bearer token with every request."""

    class APIKeyVLLMClient(base):
        """TRL's `VLLMClient`, sending the vLLM server's API key (`$VLLM_API_KEY`) as a bearer token."""

        def check_server(self, *args: Any, **kwargs: Any) -> Any:
            # `VLLMClient.__init__` calls this right after creating its session and before its first /v1 request
            # (pinned in tests/trl_contract.py), so the header set here covers every request the client makes.
            self.session.headers["Authorization"] = f"Bearer {api_key}"
            return super().check_server(*args, **kwargs)

    return APIKeyVLLMClient
