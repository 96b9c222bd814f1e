"""DPPO training against a running vLLM server, one process per `torchrun` rank (CPU, gloo).

Used by `tests/system/test_vllm_server.py`; writes rank 0's `log_history` (and the world size) to `--output_json`:

    torchrun --nproc_per_node 2 --master_port P tests/scripts/train_vllm_server.py \
        --model DIR --port SERVER_PORT --divergence topk_tv --output_json OUT.json
"""

import argparse
import json

from dppo_dev.offline import set_offline_env

set_offline_env()

from trainer_setup import byte_mean_reward, make_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--divergence", default="binary_tv")
    parser.add_argument("--top_k", type=int, default=4)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--steps_per_generation", type=int, default=2)
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()

    trainer = make_trainer(
        args.model,
        args.output_dir,
        reward_funcs=byte_mean_reward,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=args.port,
        vllm_server_timeout=60,
        divergence=args.divergence,
        divergence_top_k=args.top_k,
        max_steps=args.max_steps,
        steps_per_generation=args.steps_per_generation,
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    "world_size": trainer.accelerator.num_processes,
                    "distributed_type": str(trainer.accelerator.distributed_type),
                    "file_sync": trainer.vllm_generation.vllm_client.file_sync,
                    "log_history": trainer.state.log_history,
                },
                f,
            )


if __name__ == "__main__":
    main()
