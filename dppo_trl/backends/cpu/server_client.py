"""TRL's `VLLMClient` for a CPU trainer: weights reach the server as a file instead of over NCCL.

TRL pushes weights to a `vllm_mode="server"` server over an NCCL group (`VLLMClient.init_communicator` raises on a
CPU trainer) and vLLM has no CPU weight-transfer backend. `cpu_sync_client_class(VLLMClient)` is a subclass that,
when the trainer's device is the CPU, skips the communicator and receives TRL's own weight stream (`sync_weights`
is untouched, so every rank still iterates the parameters and PEFT merge/unmerge and ZeRO-3 gathers apply): rank 0
hands it to `weight_sync.reload_server_weights_from_file`; TRL then resets the prefix cache. On CUDA it is TRL's
client unchanged. It also sends `$VLLM_API_KEY` as a bearer token when set, which TRL's client cannot.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from dppo_trl.backends.cpu.vllm_server import WORKER_EXTENSION
from dppo_trl.backends.cpu.weight_sync import reload_server_weights_from_file

logger = logging.getLogger(__name__)

__all__ = ["API_KEY_ENV", "cpu_sync_client_class"]

# Trainers send this key (vLLM's own variable, so one `export` serves the server and the trainer).
API_KEY_ENV = "VLLM_API_KEY"


def _is_cpu_device(device: Any) -> bool:
    # TRL reads a bare int as a CUDA index.
    return not isinstance(device, int) and torch.device(device).type == "cpu"


def cpu_sync_client_class(base: type) -> type:
    """A subclass of TRL's `VLLMClient` (`base`) that syncs weights through a file when the trainer runs on the CPU."""

    class CPUWeightSyncVLLMClient(base):
        """TRL's `VLLMClient`; on a CPU trainer, weights reach the server as a file instead of over NCCL."""

        dppo_original_class = base
        file_sync = False

        def check_server(self, *args: Any, **kwargs: Any) -> Any:
            # `VLLMClient.__init__` calls this right after creating its session and before its first /v1 request,
            # so the key set here covers every request the client makes.
            api_key = os.environ.get(API_KEY_ENV)
            if api_key:
                self.session.headers["Authorization"] = f"Bearer {api_key}"
            return super().check_server(*args, **kwargs)

        def init_communicator(self, device: Any = 0) -> Any:
            if not _is_cpu_device(device):
                return super().init_communicator(device)
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
