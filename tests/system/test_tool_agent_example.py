"""`examples/train_tool_agent.py` shrunk: the sync default (vLLM colocate, top-K) trains, evaluates before and after on
the held-out split with the real tool, and writes its summary and trust-region PNG; the GPU recipe parses."""

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "examples", "recipes", "agents", "qwen3_1.7b_calculator_agent.yaml")


@pytest.fixture(scope="module")
def tool_agent():
    import train_tool_agent  # pytest puts `examples/` on `sys.path`

    return train_tool_agent


@pytest.mark.vllm
@pytest.mark.slow
def test_sync_default_shrunk(tool_agent, tmp_path, master_port):
    out = str(tmp_path / "run")
    argv = ["--max_steps", "4", "--steps_per_generation", "2", "--eval_problems", "16", "--output_dir", out]
    summary = tool_agent.main(argv)
    assert summary["trainer"] == "DPPOTrainer" and summary["divergence"] == "topk_tv" and summary["steps"] == 4
    for when in ("before", "after"):
        stats = summary[when]
        assert set(stats) == {"accuracy", "tool_call_rate", "malformed_rate", "mean_turns"}
        assert all(0.0 <= stats[k] <= 1.0 for k in ("accuracy", "tool_call_rate", "malformed_rate"))
        assert 1.0 <= stats["mean_turns"] <= 3.0  # one reply, plus at most max_tool_calling_iterations=2 more
    assert summary["before"]["malformed_rate"] > 0  # the bundled agent starts imperfect
    assert os.path.getsize(summary["plot"]) > 1000
    saved = json.load(open(os.path.join(out, "summary.json")))
    assert saved["after"] == summary["after"]
    assert any("dppo/mask_ratio_neg_adv" in entry for entry in saved["log_history"])  # the trust-region panel's data
    assert any(entry.get("tools/call_frequency", 0) > 0 for entry in saved["log_history"])


def test_gpu_recipe_parses(tool_agent):
    # bf16 needs the GPU the recipe is for; everything else parses as written.
    script_args, args = tool_agent._parse(["--config", RECIPE, "--bf16", "false"])
    assert not script_args.use_async and args.use_vllm and args.divergence == "topk_tv"
    assert script_args.model_name_or_path == "Qwen/Qwen3-1.7B"
    assert args.top_p == 1.0 and args.top_k == 0  # truncated sampling would need the kept-set support
