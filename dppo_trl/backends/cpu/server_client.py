"""TRL's `VLLMClient` for a CPU trainer: weights reach the server as a file instead of over NCCL.

TRL pushes weights to a `vllm_mode="server"` server over an NCCL group (`VLLMClient.init_communicator` raises on a
CPU trainer) and vLLM has no CPU weight-transfer backend. `cpu_sync_client_class(VLLMClient)` is a subclass that
skips the communicator and receives TRL's own weight stream (`sync_weights` is untouched, so every rank still
iterates the trainer's walk, `_iter_named_params`, with its ZeRO-3 gathers and, for a DPPO LoRA model, the
out-of-place merge of `dppo_trl.weights.stream`): rank 0 hands it to
`weight_sync.reload_server_weights_from_file`; TRL then resets the prefix cache.

It is installed only for a trainer whose device is the CPU (`dppo_trl.backends.cpu.construction.server_client_class`
decides); a CUDA trainer keeps TRL's NCCL sync. The API key, which every device sends, is not part of it
(`dppo_trl/backends/server_auth.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from dppo_trl.backends.cpu.vllm_server import WORKER_EXTENSION
from dppo_trl.backends.cpu.weight_sync import reload_server_weights_from_file

logger = logging.getLogger(__name__)

__all__ = ["cpu_sync_client_class"]


def cpu_sync_client_class(base: type) -> type:
    """A subclass of TRL's `VLLMClient` (`base`) that syncs weights through a file (for a CPU trainer only)."""

    class CPUWeightSyncVLLMClient(base):
        """TRL's `VLLMClient` for a CPU trainer: weights reach the server as a file instead of over NCCL."""

        file_sync = False

        def init_communicator(self, device: Any = 0) -> Any:
            # Fails with TRL's own message (restart with VLLM_SERVER_DEV_MODE=1) when the sync endpoints are missing.
            info = self.get_server_info()
            extension = info.get("parallel_config", {}).get("worker_extension_cls")
            if extension != WORKER_EXTENSION:
                raise RuntimeError(
                    f"The vLLM server at {self.base_url} cannot take weights from a CPU trainer: it runs without "
                    f"`--worker-extension-cls {WORKER_EXTENSION}` (found {extension!r}). Start it with "
                    "`python -m dppo_trl.backends.cpu.vllm_server --model ...`, which sets it, or add that option to "
                    "its command."
                )
            self.file_sync = True
            logger.info("CPU trainer: vLLM server weights are synced through a safetensors file and reload_weights.")
            return None

        def update_named_params(self, metadata: Any, named_params: Any) -> Any:
            if not self.file_sync:
                return super().update_named_params(metadata, named_params)
            reload_server_weights_from_file(self, named_params)
            return None

    return CPUWeightSyncVLLMClient
