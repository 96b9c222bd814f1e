"""A CPU vLLM server for the asynchronous recipe and the benchmarks that compare against it: the library's own
(`dppo_trl.cli.server`, what `dppo-trl train-async --start_server` runs), re-exported for the examples."""

from dppo_trl.cli.server import load_tokenizer, start_cpu_server, stop_server

__all__ = ["load_tokenizer", "start_cpu_server", "stop_server"]
