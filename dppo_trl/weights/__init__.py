"""The policy's weights as the rollout engine receives them.

`dppo_trl.weights.lora_merge` computes a LoRA model's merged weights out of place (the frozen base is never written)
and `dppo_trl.weights.stream` walks the model one decoder layer at a time under ZeRO-3 / FSDP2, yielding the names,
dtypes and shapes TRL's own syncs yield. Neither imports TRL: the rooms (`dppo_trl.trainers.trl116`) put the walk in
TRL's sync paths.
"""
