"""Schema-driven fuzzing of the HTTP API: schemathesis reads the server's own ``/openapi.json``
and calls every operation in-process (ASGI, no network) with generated valid and invalid
inputs. No input may cause a 5xx; every 4xx is an OpenAI error object; the KV pool survives."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from server_utils import MODEL_NAME, assert_engine_clean, engine_config, start_test_engine
from text_model import save_text_model

from platform_core.entrypoints.openai.api_server import build_app

MAX_EXAMPLES = 40  # per operation
CALLS: Counter[str] = Counter()  # operation -> inputs sent, for the closing test
STATUSES: Counter[int] = Counter()  # status code -> responses, over all operations


@pytest.fixture(scope="module")
def engine(tmp_path_factory, probe):
    model_dir = save_text_model(tmp_path_factory.mktemp("fuzz-model"))
    # A short context bounds how long any generated request can generate.
    engine = start_test_engine(engine_config(model_dir, max_model_len=64), probe)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(engine):
    return schemathesis.openapi.from_asgi("/openapi.json", build_app(engine, MODEL_NAME))


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_input_causes_a_server_error(case):
    response = case.call()
    CALLS[f"{case.operation.method.upper()} {case.operation.path}"] += 1
    STATUSES[response.status_code] += 1
    case.validate_response(response, checks=[not_a_server_error])
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)


def test_the_engine_is_intact_after_fuzzing(engine, probe):
    assert CALLS["POST /v1/completions"] >= MAX_EXAMPLES // 2, CALLS
    assert CALLS["POST /v1/chat/completions"] >= MAX_EXAMPLES // 2, CALLS
    # Both accepted and rejected inputs were generated, not only one kind.
    assert STATUSES[200] > 0 and STATUSES[400] > 0, STATUSES
    assert_engine_clean(engine, probe)
    assert engine.is_running
    print(f"\nfuzzed inputs per operation: {dict(CALLS)} (total {sum(CALLS.values())})")
    print(f"responses by status: {dict(sorted(STATUSES.items()))}")
