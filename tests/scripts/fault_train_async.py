"""`examples/train_dapo_math_async.py` as the fault tests run it (`tests/system/test_faults.py`): the example's own
`main` with its own arguments, plus a callback that prints `STEP n` after each optimizer step so a test knows when
to strike.

    python tests/scripts/fault_train_async.py --output_dir OUT --enable_jit_checkpoint true --max_steps 500 ...
"""

import sys

from dppo_dev.offline import set_offline_env

set_offline_env()

from train_dapo_math_async import main  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class PrintSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        print(f"STEP {state.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:], callbacks=[PrintSteps()])
