"""The packaged default model (SmolLM2-135M-Instruct) answering a chat through the server."""

from __future__ import annotations

import openai
from server_utils import live_server, start_test_engine

from platform_core.config import EngineConfig
from platform_core.entrypoints.openai.api_server import default_model_name


def test_smollm2_knows_the_capital_of_france():
    config = EngineConfig.from_flat(
        dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20
    )  # no model: the packaged default
    name = default_model_name(config.model.model)
    assert name == "smollm2-135m-instruct"
    engine = start_test_engine(config)
    try:
        with live_server(engine, name) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            assert [m.id for m in client.models.list().data] == [name]
            response = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=30,
            )
    finally:
        engine.shutdown()
    answer = response.choices[0].message.content
    assert "Paris" in answer, answer
    assert response.choices[0].finish_reason == "stop"  # ended its turn with <|im_end|>
