"""The out-of-place LoRA walk (`dppo_trl.weights.stream`) on sharded parameters, one process per `torchrun` rank (gloo).

Used by `tests/system/test_multiprocess.py`. Every rank builds the same bf16 PEFT Qwen3-MoE (LoRA on attention and,
through `target_parameters`, on the fused experts; a `modules_to_save` norm) and streams it unsharded (the reference),
then twice sharded, every rank iterating:

- DeepSpeed ZeRO-3 (every parameter a partition): records the most bytes of partitions gathered at any yielded tensor;
- FSDP2 (`fully_shard` on each decoder layer and the root, on a CPU mesh): every parameter a `DTensor` shard.

Writes `rank{r}.json` to `--out`: per layout, whether the stream equals the reference (names, dtypes, values bit for
bit) and whether the local shards are unchanged afterwards; for ZeRO-3 the peak gathered bytes, the largest gather
unit's bytes and the whole model's.

    torchrun --nproc_per_node 2 --master_port P tests/scripts/sharded_lora_sync.py --out DIR
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os

from dppo_dev.offline import set_offline_env

set_offline_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from dppo_dev.tiny_models import build_tiny_model  # noqa: E402
from dppo_trl.weights.stream import merged_named_weights, sync_units  # noqa: E402


def build():
    model, _ = build_tiny_model("qwen3_moe", dtype=torch.bfloat16, num_layers=3)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        modules_to_save=["model.norm"],
        init_lora_weights=False,  # non-zero, as after training
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(model, config)


def same_stream(stream, reference: list[tuple[str, torch.Tensor]]) -> bool:
    got = [(name, tensor.detach().clone()) for name, tensor in stream]
    return [n for n, _ in got] == [n for n, _ in reference] and all(
        a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, reference)
    )


def zero3(model, reference) -> dict:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    units = sync_units(model)  # sizes from the unsharded model
    largest_unit = max(sum(p.numel() * p.element_size() for p in gather) for _, gather in units)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
    }
    deepspeed.initialize(model=model, config=config)
    params = list(model.parameters())
    shards = [p.ds_tensor.detach().clone() for p in params]
    peak, got = 0, []
    for name, tensor in merged_named_weights(model):
        available = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
        peak = max(peak, sum(int(p.ds_numel) * p.element_size() for p in available))
        got.append((name, tensor.detach().clone()))
    return {
        "equal": same_stream(got, reference),
        "shards_unchanged": all(torch.equal(p.ds_tensor, s) for p, s in zip(params, shards)),
        "partitioned": all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params),
        "peak_gathered_bytes": peak,
        "largest_unit_bytes": largest_unit,
        "model_bytes": sum(int(p.ds_numel) * p.element_size() for p in params),
    }


def fsdp2(model, reference) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    shards = [p.to_local().clone() for p in params]
    return {
        "equal": same_stream(merged_named_weights(model), reference),
        "shards_unchanged": all(torch.equal(p.to_local(), s) for p, s in zip(params, shards)),
        "sharded": all(isinstance(p, DTensor) for p in params),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--watchdog", type=float, default=0)
    args = parser.parse_args()
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = build()
    reference = [(name, tensor.detach().clone()) for name, tensor in merged_named_weights(model)]
    result = {"rank": dist.get_rank(), "tensors": len(reference)}
    result["zero3"] = zero3(copy.deepcopy(model), reference)
    result["fsdp2"] = fsdp2(copy.deepcopy(model), reference)
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()
