"""The real default model (SmolLM2-135M, converted GGUF) loaded offline and served for real."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cloud_verifier.engine.targets import TorchTarget
from shared.maths.sampling import SamplingParams
from shared.wire.messages import SUBPROTOCOL, Hello, Propose, Verdict
from testkit.net.stream_ws import StreamWS
from testkit.probe import ProbeClient, auth_headers
from tests.verifiers import ready, verifier_app


@pytest.mark.slow
async def test_default_model_verifies_through_the_service(aiohttp_client: Any) -> None:
    app = verifier_app(None, auth=["slow-token"], model="default", device="cpu")
    client = await aiohttp_client(app)
    state = await ready(app, timeout=240)  # the real model, on the CPU
    target = state.engine.require_target()
    assert isinstance(target, TorchTarget)
    assert target.vocab_size == 49152 and "SmolLM2" in target.fingerprint.model_name
    assert (await client.get("/health")).status == 200

    tok = target.loaded.tokenizer
    prompt = tok("The capital of France is", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():  # reference: greedy continuation by full forwards
        ids = list(prompt)
        for _ in range(6):
            logits = target.loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    cont = ids[len(prompt) :]

    ws = StreamWS(
        await client.ws_connect(
            "/v1/session", headers=auth_headers("slow-token"), protocols=(SUBPROTOCOL,)
        )
    )
    pc = ProbeClient(ws)
    await pc.hello(Hello(fingerprint=target.fingerprint, sampling=SamplingParams(0.0)))
    draft = [*cont[:3], (cont[3] + 1) % 49152]
    await pc.send(Propose(0, 0, 0, np.array(draft), np.ones(4, np.float32), fixed=np.array(prompt)))
    v = await pc.recv_as(Verdict)
    assert (v.accepted, v.token) == (3, cont[3])
    await pc.send(
        Propose(1, 1, len(prompt) + 3, np.array(cont[4:6]), np.ones(2, np.float32),
                fixed=np.array([v.token]), want_bonus=True)
    )  # fmt: skip
    v2 = await pc.recv_as(Verdict)
    assert v2.accepted == 2 and v2.bonus is not None
    assert "Paris" in tok.decode(cont)
