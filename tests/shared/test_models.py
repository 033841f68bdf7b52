"""Tests for model specs, offline loading and self-drafts (shared.runtime.model_spec,
shared.runtime.model_cache, shared.runtime.gguf, shared.runtime.layer_skip,
shared.runtime.fingerprint, shared.runtime.models) and edge_agent.model.lm (incremental
decoding)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from edge_agent.model.lm import CausalLM, ContextLengthError
from shared.runtime.fingerprint import tokenizer_hash
from shared.runtime.model_cache import cache_dir, file_sha256
from shared.runtime.model_spec import ModelSpecError, SpecKind, parse_model_spec
from shared.runtime.models import LoadedModel, load_model
from testkit.tiny_models import build_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A 3-layer tiny model, for layer-skip drafts."""
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny3"), layers=3, seed=2)
    return load_model(str(folder))


def full_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Reference: one uncached forward over the whole sequence. [len(ids), vocab]"""
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([ids]), use_cache=False)
    logits: torch.Tensor = out.logits[0].float()
    return logits


# ----------------------------------------------------------------------------- specs


def test_parse_specs(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = parse_model_spec(str(tiny_model_dir))
    assert folder.kind is SpecKind.FOLDER and folder.path == tiny_model_dir.resolve()

    gguf = tmp_path / "m.gguf"
    with pytest.raises(ModelSpecError, match=r"m\.gguf"):
        parse_model_spec(str(gguf))
    gguf.write_bytes(b"GGUF")
    assert parse_model_spec(str(gguf)).kind is SpecKind.GGUF

    skip = parse_model_spec("self:skip=10,4")
    assert skip.kind is SpecKind.SELF and skip.skip == (4, 10) and skip.keep is None
    keep = parse_model_spec("self:keep=8")
    assert keep.keep == 8 and keep.skip == ()

    for bad in ("self:skip=", "self:skip=4,4", "self:keep=0", "self:drop=3", "", "no such thing"):
        with pytest.raises(ModelSpecError):
            parse_model_spec(bad)
    with pytest.raises(ModelSpecError, match="not in the local Hugging Face cache"):
        parse_model_spec("nobody-wanspec/definitely-not-cached-model")
    # A folder that is not a model: one line naming what it lacks (transformers' own error
    # was 40 lines ending in a note about tokenizer packages).
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(ModelSpecError, match=r"it lacks config\.json and a tok"):
        parse_model_spec(str(empty))
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelSpecError, match=r"it lacks a tokenizer \(tokenizer"):
        parse_model_spec(str(empty))


def test_parse_default() -> None:
    spec = parse_model_spec("default")
    assert spec.kind is SpecKind.DEFAULT and spec.kind == "default"  # a str enum
    assert spec.path is not None and spec.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANSPEC_CACHE_DIR", str(tmp_path / "w"))
    assert cache_dir() == tmp_path / "w"
    monkeypatch.delenv("WANSPEC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "wanspec"


def test_file_sha256_memo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANSPEC_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "blob.bin"
    f.write_bytes(b"abc")
    expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert file_sha256(f) == expected
    index = json.loads((tmp_path / "cache" / "hashes.json").read_text())
    assert index[str(f.resolve())]["sha256"] == expected
    f.write_bytes(b"abcd")  # size changes: must rehash, not reuse the memo
    assert file_sha256(f) != expected


def test_failed_conversion_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANSPEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not really a gguf file")
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        load_model(str(gguf))
    converted = tmp_path / "cache" / "converted"
    assert not converted.exists() or list(converted.iterdir()) == []


# ----------------------------------------------------------------------------- loading

# Run in a fresh interpreter: this pytest process already has HF_HUB_OFFLINE set (conftest) and
# every module imported. The third-party packages are imported before the environment is
# snapshotted, so only what our own modules do at import is measured (importing transformers'
# modeling code sets TORCHINDUCTOR_CACHE_DIR, which is not ours).
_IMPORT_THEN_LOAD = """
import json, os, sys
import huggingface_hub.constants, tokenizers, torch, transformers
import transformers.modeling_utils

before = dict(os.environ)
import testkit.tiny_models, shared.runtime.fingerprint, shared.runtime.gguf
import shared.runtime.layer_skip
import shared.runtime.model_cache, shared.runtime.model_spec, shared.runtime.models
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
offline_after_import = huggingface_hub.constants.is_offline_mode()

loaded = shared.runtime.models.load_model(sys.argv[1])
with torch.inference_mode():
    logits = loaded.model(input_ids=torch.tensor([[1, 5, 6]])).logits
print(json.dumps({
    "changed_by_import": changed,
    "offline_after_import": offline_after_import,
    "offline_after_load": huggingface_hub.constants.is_offline_mode(),
    "env_after_load": [os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE")],
    "vocab_size": loaded.vocab_size,
    "logits_shape": list(logits.shape),
}))
"""


def test_import_has_no_side_effects_and_load_goes_offline(tiny_model_dir: Path) -> None:
    offline_vars = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in offline_vars}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # a hub request, if any, would fail, not download
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_THEN_LOAD, str(tiny_model_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["changed_by_import"] == []
    assert got["offline_after_import"] is False
    assert got["offline_after_load"] is True
    assert got["env_after_load"] == ["1", "1"]
    assert got["vocab_size"] == 64 and got["logits_shape"] == [1, 3, 64]


def test_tiny_models(tiny_model_dir: Path, tiny_draft_dir: Path, tiny: LoadedModel) -> None:
    draft = load_model(str(tiny_draft_dir))
    assert tiny.vocab_size == draft.vocab_size == 64
    assert tiny.fingerprint.tokenizer_hash == draft.fingerprint.tokenizer_hash
    assert tiny.fingerprint.model_name == tiny_model_dir.name
    assert not torch.equal(tiny.model.lm_head.weight, draft.model.lm_head.weight)
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    ids = tiny.tokenizer("t1 t2 t3", add_special_tokens=False).input_ids
    assert ids == [5, 6, 7]
    assert tiny.tokenizer.decode(ids) == "t1 t2 t3"
    assert tiny.tokenizer.eos_token_id == 2 and tiny.tokenizer.pad_token_id == 3
    prompt = tiny.tokenizer.apply_chat_template(
        [{"role": "user", "content": "t1"}], tokenize=False, add_generation_prompt=True
    )
    assert "t1" in prompt


def test_tokenizer_hash_depends_on_vocab(tmp_path: Path, tiny: LoadedModel) -> None:
    other = load_model(str(build_tiny_model(tmp_path / "v80", vocab_size=80)))
    assert tokenizer_hash(other.tokenizer) != tokenizer_hash(tiny.tokenizer)
    assert tokenizer_hash(tiny.tokenizer) == tiny.fingerprint.tokenizer_hash


def test_self_draft_shares_weights(tiny3: LoadedModel) -> None:
    draft = load_model("self:skip=1", base=tiny3)
    assert draft.name.endswith(":skip=1")
    assert draft.model.config.num_hidden_layers == 2
    assert [layer.self_attn.layer_idx for layer in draft.model.model.layers] == [0, 1]
    target_layers = tiny3.model.model.layers
    draft_layers = draft.model.model.layers
    # draft layer 1 is target layer 2: same storage, not a copy
    assert (
        draft_layers[1].mlp.up_proj.weight.data_ptr()
        == target_layers[2].mlp.up_proj.weight.data_ptr()
    )
    emb = tiny3.model.model.embed_tokens.weight
    assert draft.model.model.embed_tokens.weight.data_ptr() == emb.data_ptr()
    assert draft.model.lm_head.weight is draft.model.model.embed_tokens.weight
    for name, tensor in [*draft.model.named_parameters(), *draft.model.named_buffers()]:
        assert tensor.device.type == "cpu", name
    assert draft.fingerprint.tokenizer_hash == tiny3.fingerprint.tokenizer_hash

    ids = [4, 9, 17, 30]
    assert not torch.allclose(full_logits(draft, ids), full_logits(tiny3, ids))
    runner = CausalLM(draft)
    for i, t in enumerate(ids):
        step = runner.extend([t])
        torch.testing.assert_close(step[0], full_logits(draft, ids[: i + 1])[-1])


def test_self_draft_keep_all_equals_target(tiny3: LoadedModel) -> None:
    draft = load_model("self:keep=3", base=tiny3)
    ids = [4, 9, 17, 30, 5]
    torch.testing.assert_close(full_logits(draft, ids), full_logits(tiny3, ids))
    keep1 = load_model(parse_model_spec("self:keep=1"), base=tiny3)
    assert keep1.model.config.num_hidden_layers == 1


def test_self_draft_errors(tiny3: LoadedModel) -> None:
    with pytest.raises(ModelSpecError, match="base"):
        load_model("self:skip=1")
    with pytest.raises(ModelSpecError, match="out of range"):
        load_model("self:skip=3", base=tiny3)
    with pytest.raises(ModelSpecError, match="keep=4"):
        load_model("self:keep=4", base=tiny3)
    with pytest.raises(ModelSpecError, match="every layer"):
        load_model("self:skip=0,1,2", base=tiny3)


# ----------------------------------------------------------------------------- CausalLM

SEQ = [1, 7, 12, 40, 5, 5, 63, 22, 9, 31]


def test_kv_pool_grows_and_rolls_back_by_pointer(tiny: LoadedModel) -> None:
    """A pool of 2 pages of 64 tokens doubles as the sequence outgrows it (rows keep their
    place); a rollback moves the length pointer and frees whole pages; the logits still equal
    full forwards, before and after."""
    seq = [int(x) for x in np.random.default_rng(3).integers(4, 64, 300)]
    lm = CausalLM(tiny, capacity=100)
    assert lm.kv_capacity == 128
    a = lm.extend(seq[:120])
    b = lm.extend(seq[120:300])  # grows: 128 → 256 → 300 needs 5 pages
    assert lm.kv_capacity >= 300 and lm.kv_length == 300
    ref = full_logits(tiny, seq)
    torch.testing.assert_close(torch.cat([a, b]), ref, atol=1e-4, rtol=1e-4)
    lm.crop(70)  # pages past 70 go back to the pool; nothing is copied
    assert lm.kv_length == 70 and lm._pool.pages_used == 2
    c = lm.extend([5, 6, 7])
    ref2 = full_logits(tiny, [*seq[:70], 5, 6, 7])
    torch.testing.assert_close(c, ref2[-3:], atol=1e-4, rtol=1e-4)


def test_incremental_matches_full_forward(tiny: LoadedModel) -> None:
    ref = full_logits(tiny, SEQ)
    lm = CausalLM(tiny)
    rows = [lm.extend([t]) for t in SEQ]
    got = torch.cat(rows)
    assert got.shape == (len(SEQ), tiny.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert lm.length == len(SEQ) and lm.tokens == tuple(SEQ)
    torch.testing.assert_close(lm.last_logits, ref[-1], atol=1e-4, rtol=1e-4)

    # chunked prefill + multi-token extend (the verifier's pattern)
    lm2 = CausalLM(tiny)
    a = lm2.extend(SEQ[:4])
    b = lm2.extend(SEQ[4:])
    torch.testing.assert_close(torch.cat([a, b]), ref, atol=1e-4, rtol=1e-4)

    # greedy decoding: token by token equals argmax of full forwards
    lm3 = CausalLM(tiny)
    logits = lm3.extend([1])[-1]
    out = [1]
    for _ in range(8):
        nxt = int(logits.argmax())
        out.append(nxt)
        logits = lm3.extend([nxt])[-1]
    assert all(int(full_logits(tiny, out[: i + 1])[-1].argmax()) == out[i + 1] for i in range(8))


def test_crop_then_extend_matches_fresh(tiny: LoadedModel) -> None:
    lm = CausalLM(tiny)
    lm.extend(SEQ)
    ref_full = full_logits(tiny, SEQ)
    lm.crop(6)
    assert lm.length == 6 and lm.tokens == tuple(SEQ[:6])
    # logits predicting token 6 are still there, without recomputation
    torch.testing.assert_close(lm.last_logits, ref_full[5], atol=1e-4, rtol=1e-4)
    other = [3, 44, 17]
    got = lm.extend(other)
    ref = full_logits(tiny, SEQ[:6] + other)
    torch.testing.assert_close(got, ref[6:], atol=1e-4, rtol=1e-4)
    assert lm.kv_length == 9

    lm.crop(lm.length)  # no-op
    assert lm.length == 9
    lm.crop(0)
    assert lm.length == 0
    with pytest.raises(ValueError):
        _ = lm.last_logits
    torch.testing.assert_close(lm.extend(SEQ), ref_full, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        lm.crop(len(SEQ) + 1)
    with pytest.raises(ValueError):
        lm.crop(-1)
    lm.reset()
    assert lm.length == 0 and lm.kv_length == 0


def test_logits_window_recompute(tiny: LoadedModel) -> None:
    lm = CausalLM(tiny, logits_window=2)
    ref = full_logits(tiny, SEQ)
    lm.extend(SEQ[:5])
    for t in SEQ[5:]:
        lm.extend([t])
    assert len(lm._rows) == 2
    lm.crop(4)  # row 3 was evicted: recomputed on demand
    torch.testing.assert_close(lm.last_logits, ref[3], atol=1e-4, rtol=1e-4)
    assert lm.tokens == tuple(SEQ[:4])
    with pytest.raises(ValueError):
        CausalLM(tiny, logits_window=0)


def test_extend_validation(tiny: LoadedModel) -> None:
    lm = CausalLM(tiny)
    with pytest.raises(ValueError):
        lm.extend([])
    with pytest.raises(ValueError):
        lm.extend([64])
    with pytest.raises(ValueError):
        lm.extend([-1])
    assert lm.length == 0
    last = lm.extend(SEQ, last_rows=2)
    assert last.shape == (2, 64)
    torch.testing.assert_close(last, full_logits(tiny, SEQ)[-2:], atol=1e-4, rtol=1e-4)
    lm.crop(len(SEQ) - 1)
    torch.testing.assert_close(lm.last_logits, full_logits(tiny, SEQ)[-2], atol=1e-4, rtol=1e-4)
    lm.crop(3)  # rows before the last_rows window were never computed: recomputed
    torch.testing.assert_close(lm.last_logits, full_logits(tiny, SEQ)[2], atol=1e-4, rtol=1e-4)


def test_context_length_guard(tiny: LoadedModel) -> None:
    lm = CausalLM(tiny)
    assert lm.max_length == 512
    lm.extend([4] * 510)
    with pytest.raises(ContextLengthError, match="512"):
        lm.extend([4, 4, 4])
    assert lm.length == 510
    lm.extend([4, 4])
    assert lm.length == 512


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_default_model_offline() -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    t0 = time.perf_counter()
    target = load_model("default")
    load_s = time.perf_counter() - t0
    assert target.vocab_size == 49152
    assert target.fingerprint.vocab_size == 49152
    tok = target.tokenizer
    ids = tok("Hello world", add_special_tokens=False).input_ids
    assert tok.decode(ids) == "Hello world"

    draft = load_model("self:skip=4", base=target)
    assert draft.model.config.num_hidden_layers == 29
    t_emb = target.model.model.embed_tokens.weight
    assert draft.model.model.embed_tokens.weight.data_ptr() == t_emb.data_ptr()
    assert draft.model.lm_head.weight.data_ptr() == t_emb.data_ptr()
    # draft layer 4 is target layer 5
    assert (
        draft.model.model.layers[4].self_attn.q_proj.weight.data_ptr()
        == target.model.model.layers[5].self_attn.q_proj.weight.data_ptr()
    )
    assert draft.fingerprint.tokenizer_hash == target.fingerprint.tokenizer_hash

    lm_t, lm_d = CausalLM(target), CausalLM(draft)
    lt = lm_t.extend(ids)
    ld = lm_d.extend(ids)
    assert lt.shape == ld.shape == (len(ids), 49152)
    assert torch.isfinite(ld).all()
    lm_d.extend([int(ld[-1].argmax())])
    assert lm_d.last_logits.shape == (49152,)
    print(f"default model load: {load_s:.1f}s")


def test_conversion_bars_stay_out_of_a_service_log(capsys: pytest.CaptureFixture[str]) -> None:
    """Off a terminal the GGUF conversion's own tqdm bars are swallowed (a service's log got
    "Converting and de-quantizing GGUF tensors…" lines); outside it a bar is drawn."""
    from tqdm import tqdm

    from shared.runtime.gguf import _quiet_bars

    with _quiet_bars():
        for _ in tqdm(range(3), desc="Converting inside", disable=False):
            pass
    for _ in tqdm(range(3), desc="Drawn outside", disable=False):
        pass
    err = capsys.readouterr().err
    assert "Converting inside" not in err and "Drawn outside" in err
