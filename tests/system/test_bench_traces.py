"""The benchmark's prompt sets and acceptance traces (bench/lib/prompts.py,
bench/lib/traces.py, bench/studies/traces.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from bench.lib.prompts import (
    DATA,
    DATASETS,
    SPEC_BENCH_CATEGORIES,
    Prompt,
    Split,
    encode,
    load_prompts,
)
from bench.lib.traces import Trace, TraceSet, load_traces, save_traces
from bench.studies.traces import SMOKE_LENGTH, SMOKE_PROMPTS, record
from bench.studies.traces import main as traces_main
from edge_agent.model.lm import CausalLM
from edge_agent.runtime.text import eos_ids
from shared.runtime.models import LoadedModel, load_model
from testkit.tiny_models import build_tiny_model

# ------------------------------------------------------------------------------ prompt sets


def test_prompt_sets_have_the_documented_sizes() -> None:
    measured = load_prompts(Split.MEASURED)
    tuning = load_prompts(Split.TUNING)
    assert len(measured) == 44
    assert len(tuning) == 22
    m = Counter(p.dataset for p in measured)
    t = Counter(p.dataset for p in tuning)
    for dataset in ("gsm8k", "chat", "humaneval"):
        assert (m[dataset], t[dataset]) == (8, 4)
    for category in SPEC_BENCH_CATEGORIES:
        assert (m[category], t[category]) == (4, 2)
    assert set(m) == set(t) == set(DATASETS)
    assert all(p.split == Split.MEASURED for p in measured)
    assert all(p.split == Split.TUNING for p in tuning)


def test_prompt_sets_are_disjoint_and_named_by_index() -> None:
    measured = load_prompts(Split.MEASURED)
    tuning = load_prompts(Split.TUNING)
    names = [p.name for p in measured + tuning]
    assert len(set(names)) == len(names)
    assert not {p.text for p in measured} & {p.text for p in tuning}
    assert [p.name for p in measured if p.dataset == "gsm8k"] == [f"gsm8k/{i}" for i in range(8)]
    assert [p.name for p in tuning if p.dataset == "gsm8k"] == [f"gsm8k/{i}" for i in range(8, 12)]
    assert [p.name for p in tuning if p.dataset == "rag"] == ["rag/4", "rag/5"]
    # Dataset order, then index order.
    order = [DATASETS.index(p.dataset) for p in measured]
    assert order == sorted(order)


def test_prompts_chat_flag_and_text() -> None:
    measured = load_prompts(Split.MEASURED)
    by = {p.name: p for p in measured}
    assert not by["humaneval/0"].chat
    assert by["humaneval/0"].text.startswith("from typing import List")
    assert all(p.chat for p in measured if p.dataset != "humaneval")
    spec = [json.loads(line) for line in (DATA / "spec_bench.jsonl").read_text().splitlines()]
    first_translation = next(r for r in spec if r["category"] == "translation")
    assert by["translation/0"].text == first_translation["turns"][0]
    gsm8k = json.loads((DATA / "gsm8k_subset.jsonl").read_text().splitlines()[3])
    assert by["gsm8k/3"].text == gsm8k["question"]


def test_per_dataset_caps_each_dataset() -> None:
    prompts = load_prompts(Split.TUNING, per_dataset=1)
    assert [p.name for p in prompts] == [
        "gsm8k/8", "chat/8", "humaneval/8", "translation/4", "summarization/4", "qa/4",
        "math_reasoning/4", "rag/4",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="per_dataset"):
        load_prompts(Split.MEASURED, per_dataset=-1)


def test_encode_raw_keeps_the_last_400_tokens(
    target: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = " ".join(["the"] * 450 + ["end"])
    raw = [int(t) for t in target.tokenizer(text)["input_ids"]]
    assert len(raw) > 400
    raw_prompt = Prompt("humaneval/0", "humaneval", Split.MEASURED, text, chat=False)
    chat_prompt = Prompt("chat/0", "chat", Split.MEASURED, text, chat=True)
    assert encode(target, raw_prompt) == raw[-400:]
    # A chat prompt goes through the tokenizer's chat template, whole.
    templated = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    if hasattr(templated, "keys"):
        templated = templated["input_ids"]
    assert encode(target, chat_prompt) == [int(t) for t in templated]
    assert len(encode(target, chat_prompt)) > 400
    # Without a chat template, a chat prompt is tokenized raw.
    monkeypatch.setattr(target.tokenizer, "chat_template", None)
    assert encode(target, chat_prompt) == raw[-400:]


def test_data_files_match_their_notices() -> None:
    spec = [json.loads(line) for line in (DATA / "spec_bench.jsonl").read_text().splitlines()]
    assert Counter(r["category"] for r in spec) == {c: 6 for c in SPEC_BENCH_CATEGORIES}
    notice = (DATA / "spec_bench_LICENSE").read_text()
    for needle in (
        "hemingkx/Spec-Bench",
        "fd2c1cd7d2201ef71db4c5f4e455008f017967bf",
        "data/spec_bench/question.jsonl",
        "unmodified",
        "Apache License",
        "Version 2.0",
    ):
        assert needle in notice
    assert (DATA / "gsm8k_LICENSE").is_file()
    assert len((DATA / "gsm8k_subset.jsonl").read_text().splitlines()) == 12
    assert len((DATA / "chat_prompts.jsonl").read_text().splitlines()) == 12
    readme = (DATA / "README.md").read_text()
    for name in ("gsm8k_subset.jsonl", "chat_prompts.jsonl", "spec_bench.jsonl"):
        assert name in readme


# ------------------------------------------------------------------------------ traces


def _trace(path: tuple[int, ...], top: tuple[tuple[int, ...], ...]) -> Trace:
    return Trace(
        name="gsm8k/0",
        dataset="gsm8k",
        split=Split.MEASURED,
        prompt=(5, 6),
        path=path,
        eos=False,
        draft_top=top,
        draft_top_p=tuple(tuple(1.0 / len(r) for _ in r) for r in top),
    )


def test_trace_rank_and_draft_ok() -> None:
    t = _trace((7, 8, 9), ((7, 1, 2), (1, 8, 2), (1, 2, 3)))
    assert [t.draft_ok(j) for j in range(3)] == [True, False, False]
    assert [t.rank(j) for j in range(3)] == [0, 1, None]
    assert t.agreement() == pytest.approx(1 / 3)


def _prompts() -> list[Prompt]:
    return (
        load_prompts(Split.MEASURED, per_dataset=1)[:3]
        + load_prompts(Split.TUNING, per_dataset=1)[:1]
    )


@pytest.fixture(scope="module")
def traces(target: LoadedModel, draft: LoadedModel) -> list[Trace]:
    return record(target, draft, _prompts(), 24)


def test_path_is_the_targets_greedy_generation(target: LoadedModel, traces: list[Trace]) -> None:
    eos = eos_ids(target)
    assert eos
    assert max(len(t.path) for t in traces) > 1
    for t in traces:
        ids = torch.tensor([list(t.prompt)])
        out = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
        assert list(t.path) == out[0, ids.shape[1] :].tolist(), t.name
        assert t.eos == (t.path[-1] in eos)
        assert len(t.path) == 24 or t.eos
        assert all(tok not in eos for tok in t.path[:-1])


def test_draft_top_follows_the_drafts_incremental_steps(
    draft: LoadedModel, traces: list[Trace]
) -> None:
    for t in traces:
        assert len(t.draft_top) == len(t.draft_top_p) == len(t.path)
        lm = CausalLM(draft)
        row = lm.extend(list(t.prompt))[-1]
        for j, tok in enumerate(t.path):
            greedy = int(row.argmax())
            assert t.draft_top[j][0] == greedy, (t.name, j)
            probs = torch.softmax(row.to(torch.float64), dim=-1)
            assert t.draft_top_p[j][0] == pytest.approx(float(probs[greedy]), abs=1e-5)
            assert len(t.draft_top[j]) == 8
            assert list(t.draft_top_p[j]) == sorted(t.draft_top_p[j], reverse=True)
            assert sum(t.draft_top_p[j]) <= 1.0 + 1e-9
            row = lm.extend([tok])[-1]


def test_save_load_round_trips_byte_identically(traces: list[Trace], tmp_path: Path) -> None:
    ts = TraceSet(
        target="tiny:seed=0",
        draft="tiny:seed=1",
        length=24,
        top_k=8,
        provenance={"commit": "abc", "date": "2026-01-01T00:00:00Z"},
        traces=tuple(traces),
    )
    a, b = tmp_path / "a.json.gz", tmp_path / "b.json.gz"
    save_traces(a, ts)
    loaded = load_traces(a)
    assert loaded == ts
    save_traces(b, loaded)
    assert a.read_bytes() == b.read_bytes()
    assert loaded.measured() == traces[:3]
    assert loaded.tuning() == traces[3:]
    assert loaded.by_name("gsm8k/8") == traces[3]
    with pytest.raises(KeyError):
        loaded.by_name("gsm8k/99")


def test_cli_smoke_with_two_workers_matches_record(tmp_path: Path) -> None:
    out = tmp_path / "traces.json.gz"
    assert traces_main(["--smoke", "--workers", "2", "--out", str(out)]) == 0
    got = load_traces(out)
    # The smoke run's models: the same seeds, so the same weights.
    target = load_model(str(build_tiny_model(tmp_path / "t", vocab_size=256, seed=0)))
    draft = load_model(str(build_tiny_model(tmp_path / "d", vocab_size=256, seed=1)))
    prompts = load_prompts(Split.MEASURED)[:SMOKE_PROMPTS]
    assert list(got.traces) == record(target, draft, prompts, SMOKE_LENGTH)
    assert (got.length, got.top_k) == (SMOKE_LENGTH, 8)
    assert "commit" in got.provenance
