"""A small DPPO run for the fault tests (`tests/system/test_faults.py`): prints `STEP n` after each optimizer step so a test
knows when to strike, and writes `{"global_step", "steps", "patches"}` to `--output_json` when training returns.

    python tests/scripts/fault_train.py --model DIR --output_dir OUT --generation colocate --max_steps 200 \
        --output_json OUT.json [--server_port P] [--resume_from_checkpoint CKPT]
"""

import argparse
import json
import os

from dppo_dev.offline import set_offline_env

set_offline_env()

from trainer_setup import byte_mean_reward, make_trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class PrintSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"STEP {state.global_step}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--output_json", required=True)
    parser.add_argument("--generation", choices=["transformers", "colocate", "server"], default="transformers")
    parser.add_argument("--server_port", type=int)
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--request_timeout", type=float, default=30)
    parser.add_argument("--ddp_timeout", type=int, default=1800)
    parser.add_argument("--resume_from_checkpoint")
    args = parser.parse_args()
    print(f"RANK {os.environ.get('RANK', '0')} PID {os.getpid()}", flush=True)

    config = dict(
        max_steps=args.max_steps,
        steps_per_generation=2,
        enable_jit_checkpoint=True,
        ddp_timeout=args.ddp_timeout,
    )
    if args.save_steps:
        config.update(save_strategy="steps", save_steps=args.save_steps)
    if args.generation == "colocate":
        config.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.05)
    elif args.generation == "server":
        config.update(
            use_vllm=True,
            vllm_mode="server",
            vllm_server_host="127.0.0.1",
            vllm_server_port=args.server_port,
            vllm_server_timeout=args.request_timeout,
        )
    trainer = make_trainer(args.model, args.output_dir, reward_funcs=byte_mean_reward, **config)
    trainer.add_callback(PrintSteps())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.accelerator.is_main_process:
        steps = [e["step"] for e in trainer.state.log_history if "loss" in e]
        with open(args.output_json, "w") as f:
            json.dump({"global_step": trainer.state.global_step, "steps": steps}, f)


if __name__ == "__main__":
    main()
