"""`dppo-trl train-async`: AsyncDPPOTrainer (TRL's experimental `AsyncGRPOTrainer` with DPPO's trust region).

Same options, recipes and checks as `dppo-trl train`, with `AsyncDPPOConfig` in place of `DPPOConfig`. Rollouts come
from a vLLM server at `--vllm_server_base_url`; on a machine without CUDA the run starts a CPU server for itself
unless that URL is given (`--start_server`), and stops it after training, on error and on preemption alike.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from dppo_trl.cli.inputs import load_training_data, model_init_kwargs, prepare_output_dir, resolve_rewards
from dppo_trl.cli.options import AsyncTrainScriptArguments, CLIError, ParsedRun, parse_run
from dppo_trl.cli.train import PreparedRun, default_rewards

PROG = "dppo-trl train-async"


def parse(argv: Sequence[str] | None = None, return_remaining: bool = False) -> ParsedRun:
    from dppo_trl import AsyncDPPOConfig

    return parse_run(
        argv,
        AsyncTrainScriptArguments,
        AsyncDPPOConfig,
        asynchronous=True,
        prog=PROG,
        return_remaining=return_remaining,
    )


def starts_server(run: ParsedRun) -> bool:
    if run.script_args.start_server is not None:
        return bool(run.script_args.start_server)
    import torch

    return not torch.cuda.is_available() and "vllm_server_base_url" not in run.explicit


def check_served_model(base_url: str, model: str) -> None:
    """The server at `base_url` must serve `model` under that name: TRL's rollout worker asks for it by name, and a
    404 there stops the worker while the trainer keeps waiting. An unreachable server is left to the trainer's own
    wait (`vllm_server_timeout`)."""
    import requests

    key = os.environ.get("VLLM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = requests.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
        served = [entry["id"] for entry in response.json()["data"]] if response.status_code == 200 else None
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return
    if served is not None and model not in served:
        raise CLIError(
            f"--vllm_server_base_url {base_url} serves {', '.join(map(repr, served))}, not --model_name_or_path "
            f"{model!r}: the rollout worker asks for the model by that name. Pass the name the server was started "
            f"with, or start it with `dppo-trl vllm-serve --model {model}`."
        )


def prepare(run: ParsedRun) -> PreparedRun:
    from trl import get_quantization_config

    from dppo_trl.cli.inputs import check_source

    script_args, training_args, model_args = run.script_args, run.training_args, run.model_args
    if model_args.model_name_or_path is None:
        raise CLIError("no --model_name_or_path: pass a Hub model id or a local model folder.")
    check_source("--model_name_or_path", model_args.model_name_or_path, "model")
    if get_quantization_config(model_args) is not None:
        raise CLIError(
            "--load_in_4bit/--load_in_8bit: AsyncGRPOTrainer takes no quantization config. Drop the option, or train "
            "with `dppo-trl train`."
        )
    if starts_server(run) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CLIError(
            "--start_server runs one server for a single training process. With several processes, start it "
            "yourself (`dppo-trl vllm-serve --model ...`) and pass --vllm_server_base_url."
        )
    if not starts_server(run):
        check_served_model(training_args.vllm_server_base_url, model_args.model_name_or_path)
    for recipe, options in run.recipes:
        recipe.check(options, script_args, training_args)
    reward_funcs = resolve_rewards(script_args, default_rewards(run))
    prepare_output_dir(script_args.overwrite_output_dir, training_args)
    train_dataset, _ = load_training_data(script_args, run.dataset_args, training_args)
    return PreparedRun(run, reward_funcs, train_dataset, None)


def train(prepared: PreparedRun, callbacks: list | None = None):
    """Start the server if asked, build the AsyncDPPOTrainer, train, save, stop the server; returns the trainer."""
    from trl import get_peft_config

    from dppo_trl import AsyncDPPOTrainer
    from dppo_trl.cli.server import load_tokenizer, start_cpu_server, stop_server

    run = prepared.run
    script_args, training_args, model_args = run.script_args, run.training_args, run.model_args
    model = model_args.model_name_or_path
    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    processing_class = None
    for recipe, _ in run.recipes:
        processing_class = processing_class or recipe.processing_class(model)
    server = None
    if starts_server(run):
        log_path = os.path.join(training_args.output_dir, "vllm_server.log")
        print(f"Starting a CPU vLLM server for {model} (log: {log_path})", flush=True)
        server, training_args.vllm_server_base_url = start_cpu_server(
            model, log_path, max_model_len=script_args.server_max_model_len
        )
    try:
        trainer = AsyncDPPOTrainer(
            model=model,
            reward_funcs=prepared.reward_funcs,
            args=training_args,
            train_dataset=prepared.train_dataset,
            processing_class=processing_class or load_tokenizer(model),
            peft_config=get_peft_config(model_args),
            callbacks=callbacks,
        )
        for recipe, options in run.recipes:
            recipe.attach(trainer, options, script_args, True)
        # A SIGTERM under --enable_jit_checkpoint raises TrainingPreempted (exit 143) here, after its checkpoint:
        # the server is stopped below and no final model is saved.
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        processes = trainer.accelerator.num_processes
        trainer.accelerator.print(f"Training completed on {processes} process{'es' if processes > 1 else ''}.")
        for recipe, options in run.recipes:
            recipe.finish(trainer, options, True)
        trainer.save_model(training_args.output_dir)
        trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
        if training_args.push_to_hub:
            trainer.push_to_hub(dataset_name=script_args.dataset_name)
    finally:
        if server is not None:
            stop_server(server)
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        prepared = prepare(parse(argv))
    except CLIError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    train(prepared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
