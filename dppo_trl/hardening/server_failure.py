"""A vLLM server that dies (or stops answering) under a server-mode run ends training with one named error.

Both trainers train inside `stop_on_server_failure`. An exception out of `train()` is read as the server's failure
when a request to the server failed (a `requests` exception anywhere in its chain: a reset or refused connection,
a request timeout), or when the server no longer answers `/health` (one probe, `HEALTH_PROBE_TIMEOUT` seconds). The
asynchronous trainer needs the probe: its rollout worker is a child process that reports a failed generation request
only as text (`RuntimeError("Rollout worker child has failed ...")`). Anything else (a bug, a reward function's
error while the server is healthy) propagates unchanged.

`VLLMServerError` names the server, the last complete checkpoint and the command that resumes from it. How soon the
failure is noticed depends on the trainer (`bound`, stated in the message and in docs/faults.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dppo_trl.hardening.checkpoints import latest_complete_checkpoint
from dppo_trl.hardening.preemption import resume_command

__all__ = ["HEALTH_PROBE_TIMEOUT", "VLLMServerError", "server_answers", "stop_on_server_failure"]

HEALTH_PROBE_TIMEOUT = 5.0  # seconds: a live server answers /health at once


class VLLMServerError(RuntimeError):
    """Training stopped because the vLLM server at `url` stopped answering; `checkpoint` is the last complete one."""

    def __init__(self, url: str, checkpoint: str | None, message: str):
        super().__init__(message)
        self.url = url
        self.checkpoint = checkpoint


def server_answers(url: str, timeout: float = HEALTH_PROBE_TIMEOUT) -> bool:
    """Whether the server at `url` answers `GET /health` with 200 within `timeout` seconds."""
    import requests

    try:
        return requests.get(f"{url.rstrip('/')}/health", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def _request_failed(error: BaseException) -> bool:
    import requests

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, requests.RequestException):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def server_failure_message(url: str, error: BaseException, checkpoint: str | None, bound: str) -> str:
    resume = (
        f"restart it and resume with `{resume_command(checkpoint)}` (or `--resume_from_checkpoint latest` with the "
        "examples' training scripts)"
        if checkpoint
        else "restart it and train again (no checkpoint was saved)"
    )
    first_line = next(iter(str(error).splitlines()), "")
    return (
        f"The vLLM server at {url} stopped answering ({type(error).__name__}: {first_line}). Training stopped; "
        f"{resume}. {bound}"
    )


@contextlib.contextmanager
def stop_on_server_failure(url: str | None, output_dir: str, bound: str) -> Iterator[None]:
    """Run training inside: a failure of the server at `url` (module docstring) becomes `VLLMServerError`.

    `url` None (no server: colocate or transformers generation) leaves every exception as it is. `output_dir` is
    where the run's checkpoints are; `bound` says how soon this trainer notices a dead or hung server.
    """
    if url is None:
        yield
        return
    try:
        yield
    except Exception as error:
        if not (_request_failed(error) or not server_answers(url)):
            raise
        checkpoint = latest_complete_checkpoint(output_dir)
        raise VLLMServerError(url, checkpoint, server_failure_message(url, error, checkpoint, bound)) from error
