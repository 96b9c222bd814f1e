"""One rank of `tests/integration/test_async_dppo.py::test_policy_version_is_read_once_per_step_on_every_rank` (torchrun, 2 ranks).

Builds an `AsyncDPPOTrainer` (its vLLM server is never contacted: nothing trains), moves the main process's
`model_version` the way TRL's weight sync does (main process only) and writes `<out>/rank<R>.json` with what
`_policy_version()` returned on this rank: after the first read of a step, after a version change within the same
step, and at the next step.

Usage: `torchrun --nproc_per_node 2 --master_port P tests/scripts/async_policy_version.py --model M --out DIR`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os

from dppo_dev.offline import set_offline_env

set_offline_env()

from datasets import Dataset  # noqa: E402

from dppo_trl import AsyncDPPOConfig, AsyncDPPOTrainer  # noqa: E402


def constant_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--watchdog", type=float, default=0)
    args = parser.parse_args()
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)

    config = AsyncDPPOConfig(
        output_dir=os.path.join(args.out, "trainer"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        token_budget=0,
        vllm_server_base_url="http://127.0.0.1:1",
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1="}]] * 4})
    trainer = AsyncDPPOTrainer(model=args.model, reward_funcs=constant_reward, args=config, train_dataset=dataset)
    main_process = trainer.accelerator.is_main_process

    if main_process:
        trainer.model_version = 5  # a weight sync happened (TRL bumps it on the main process only)
    first = trainer._policy_version()
    if main_process:
        trainer.model_version = 6  # within the same optimizer step: not read again
    same_step = trainer._policy_version()
    trainer.state.global_step += 1  # the next optimizer step
    next_step = trainer._policy_version()

    result = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "versions": [first, same_step, next_step],
    }
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
