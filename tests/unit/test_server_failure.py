"""Which failures `stop_on_server_failure` (both trainers' `train()`) turns into `VLLMServerError`: a failed request
to the server, or any error once the server no longer answers `/health` (the asynchronous trainer's rollout worker
reports its failed requests only as text); any other error with a healthy server propagates unchanged."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from dppo_trl.hardening.server_failure import VLLMServerError, server_answers, stop_on_server_failure


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there: connections are refused


class _Healthy:
    """A real HTTP server answering `/health` with 200, for the block's duration."""

    def __enter__(self) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _worker_failure() -> RuntimeError:
    # What TRL's AsyncRolloutWorker.check_health raises when its child process failed (the cause is text only).
    return RuntimeError("Rollout worker child has failed; see chained exception.")


def test_an_error_while_the_server_is_down_names_the_server_and_the_checkpoint(tmp_path):
    url = _closed_port_url()
    assert not server_answers(url)
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    with pytest.raises(VLLMServerError) as info, stop_on_server_failure(url, str(tmp_path), "Bound: 1 step."):
        raise _worker_failure()
    error = info.value
    assert error.url == url and error.checkpoint == str(tmp_path / "checkpoint-3")
    assert isinstance(error.__cause__, RuntimeError)
    message = str(error)
    assert message.startswith(f"The vLLM server at {url} stopped answering (RuntimeError: Rollout worker child")
    assert f"--resume_from_checkpoint {tmp_path / 'checkpoint-3'}" in message and message.endswith("Bound: 1 step.")


def test_a_failed_request_is_the_servers_failure_even_if_it_answers_again(tmp_path):
    with _Healthy() as url:
        with pytest.raises(VLLMServerError, match="no checkpoint was saved"):
            with stop_on_server_failure(url, str(tmp_path), ""):
                try:
                    raise requests.ConnectionError("reset by peer")
                except requests.ConnectionError as error:
                    raise RuntimeError("sync failed") from error


def test_other_errors_with_a_healthy_server_propagate_unchanged(tmp_path):
    with _Healthy() as url:
        assert server_answers(url)
        with pytest.raises(RuntimeError, match="child has failed") as info:
            with stop_on_server_failure(url, str(tmp_path), ""):
                raise _worker_failure()
    assert type(info.value) is RuntimeError


def test_without_a_server_nothing_is_reinterpreted(tmp_path):
    with pytest.raises(requests.ConnectionError), stop_on_server_failure(None, str(tmp_path), ""):
        raise requests.ConnectionError("not a vLLM server")
    with pytest.raises(KeyboardInterrupt), stop_on_server_failure(_closed_port_url(), str(tmp_path), ""):
        raise KeyboardInterrupt  # not an Exception: never turned into a server error
