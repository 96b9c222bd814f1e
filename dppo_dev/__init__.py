"""Development scaffolding for dppo-trl's tests, benchmarks and demo data; not part of the installed package.

- `tiny_models`: byte tokenizer and tiny Qwen3 / Qwen3-MoE models built from code (no Hub access).
- `offline`: the environment for offline runs.
- `tiny_math`: the generator of the bundled tiny math set and of the tiny pretrained model.
- `topk_reference`: the differentiable fused top-K gather (design A) and the full-logits references.
- `bench_env`: what the vLLM benchmarks share (prompts, machine and software description, JSON output).

Installed editable with `dapo_math` as the `dppo-trl-dev` distribution (`dev/pyproject.toml`, `scripts/setup.sh`).
"""
