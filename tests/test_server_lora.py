"""LoRA adapters over HTTP, driven by the real ``openai`` client: ``--lora-modules``, a request's
``model`` picking its adapter, ``/v1/models``, and ``/v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` (checked at load, behind the API key, unload while streaming).

Adapters are random PEFT adapters of the served tiny model, made with peft. Whether an adapter's
tokens are exactly right is the engine tests' (``test_lora_engine``); here it must change them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import (
    MODEL_NAME,
    engine_config,
    expect_error,
    free_port,
    live_server,
    start_test_engine,
)

from platform_core.cli.serve import add_serve_parser
from platform_core.entrypoints.engine_args import engine_config_from_args
from platform_core.entrypoints.openai.api_server import models_from_args
from platform_core.entrypoints.openai.lora_modules import LoRAModulePath, parse_lora_module
from platform_core.entrypoints.openai.serving_models import served_models
from platform_core.errors import ConfigError, InvalidRequestError
from tests.lora_utils import make_adapter

API_KEY = "lora-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
LORA_KEYS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
PROMPT = "The capital of France is"
STATIC = ("sql", "poet")  # served with --lora-modules
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def adapter_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters of the served model: ``sql``, ``poet``, ``late`` (rank 8, q/v), ``big`` (rank
    16, above --max-lora-rank 8) and ``pickled`` (``late`` saved as a pickle only)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    dirs = {name: root / name for name in ("sql", "poet", "late", "big", "pickled")}
    targets = ("q_proj", "v_proj")
    for seed, name in enumerate(("sql", "poet"), start=1):
        make_adapter(hf_model, dirs[name], targets, rank=8, seed=seed, scale=0.5)
    late = make_adapter(hf_model, dirs["late"], targets, rank=8, seed=3, scale=0.5)
    late.save_pretrained(dirs["pickled"], safe_serialization=False)
    make_adapter(hf_model, dirs["big"], targets, rank=16, seed=4)
    return dirs


@pytest.fixture(scope="module")
def engine(model_dir, probe):
    engine = start_test_engine(engine_config(model_dir, **LORA_KEYS), probe)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base_url(engine, model_dir, adapter_dirs):
    modules = [LoRAModulePath("sql", str(adapter_dirs["sql"]))]
    modules.append(LoRAModulePath("poet", str(adapter_dirs["poet"]), "poet-base"))
    models = served_models(engine_config(model_dir, **LORA_KEYS), MODEL_NAME, modules)
    with live_server(engine, api_key=API_KEY, models=models) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0)


def _post(url: str, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def _load(url: str, name: str, path: Path | str) -> httpx.Response:
    return _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def _unload(url: str, **body: object) -> httpx.Response:
    return _post(url, "/v1/unload_lora_adapter", body)


def _complete(client: openai.OpenAI, model: str, max_tokens: int = 8) -> str:
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=IGNORE_EOS
    )
    assert response.model == model
    return response.choices[0].text


def _served(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]


def test_models_lists_the_base_model_then_each_adapter(client, engine, adapter_dirs):
    cards = [m.model_dump() for m in client.models.list().data]
    assert [c["id"] for c in cards] == [MODEL_NAME, *STATIC]
    base, sql, poet = cards
    assert base["parent"] is None and base["root"] == MODEL_NAME
    assert (sql["root"], sql["parent"]) == (str(adapter_dirs["sql"]), MODEL_NAME)
    assert (poet["root"], poet["parent"]) == (str(adapter_dirs["poet"]), "poet-base")
    for card in (sql, poet):
        assert card["object"] == "model"
        assert card["max_model_len"] == engine.max_model_len
        assert (card["owned_by"], card["created"]) == (base["owned_by"], base["created"])


def test_a_request_picks_its_adapter_by_model(client, base_url):
    base = _complete(client, MODEL_NAME)
    sql, poet = _complete(client, "sql"), _complete(client, "poet")
    assert len({base, sql, poet}) == 3, "each adapter must change the greedy tokens"
    assert _complete(client, "sql") == sql  # the same adapter, the same tokens
    chat = client.chat.completions.create(
        model="poet", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "poet" and chat.choices[0].message.content is not None
    stream = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    assert {chunk.model for chunk in stream} == {"sql"}
    tokens = _post(base_url, "/tokenize", {"model": "sql", "prompt": PROMPT})
    assert tokens.status_code == 200, tokens.text


def test_beam_search_runs_with_the_adapter(client):
    def beams(model: str) -> list[str]:
        response = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=6,
            n=2,
            extra_body={"use_beam_search": True, **IGNORE_EOS},
        )
        assert response.model == model
        return [choice.text for choice in response.choices]

    assert beams("sql") != beams(MODEL_NAME)


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-adapter", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )


def test_load_use_unload_then_the_name_is_gone(client, base_url, adapter_dirs):
    loaded = _load(base_url, "late", adapter_dirs["late"])
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'late' added successfully."
    assert "late" in _served(client)
    first = _complete(client, "late")
    assert first != _complete(client, MODEL_NAME)
    unloaded = _unload(base_url, lora_name="late")
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'late' removed successfully."
    assert "late" not in _served(client)
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    expect_error(_unload(base_url, lora_name="late"), 404, "lora_name")
    # Loaded again (a new id): the same weights give the same tokens.
    assert _load(base_url, "late", adapter_dirs["late"]).status_code == 200
    assert _complete(client, "late") == first
    assert _unload(base_url, lora_name="late").status_code == 200


def test_bad_loads_are_400s_and_the_server_serves_on(client, base_url, adapter_dirs, tmp_path):
    missing = expect_error(_load(base_url, "gone", tmp_path / "missing"), 400, "lora_path")
    assert f"{tmp_path / 'missing'}: " in missing["message"] and "directory" in missing["message"]
    big = expect_error(_load(base_url, "big", adapter_dirs["big"]), 400, "lora_path")
    assert "r=16" in big["message"] and "--max-lora-rank" in big["message"], big
    assert not (adapter_dirs["pickled"] / "adapter_model.safetensors").exists()
    pickled = expect_error(_load(base_url, "pickled", adapter_dirs["pickled"]), 400, "lora_path")
    assert "adapter_model.bin" in pickled["message"] and "safetensors" in pickled["message"]
    duplicate = expect_error(_load(base_url, "sql", adapter_dirs["late"]), 400, "lora_name")
    assert "already served" in duplicate["message"]
    expect_error(_load(base_url, MODEL_NAME, adapter_dirs["late"]), 400, "lora_name")
    expect_error(_post(base_url, "/v1/load_lora_adapter", {"lora_name": "x"}), 400, "lora_path")
    expect_error(_load(base_url, "", adapter_dirs["late"]), 400, "lora_name")
    expect_error(_unload(base_url), 400)
    expect_error(_unload(base_url, lora_int_id=10**6), 404, "lora_name")
    assert _served(client) == [MODEL_NAME, *STATIC]
    assert _complete(client, "sql")


def test_load_and_unload_need_the_api_key(base_url, adapter_dirs):
    body = {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}
    assert _post(base_url, "/v1/load_lora_adapter", body, headers=None).status_code == 401
    wrong = {"authorization": "Bearer nope"}
    assert _post(base_url, "/v1/load_lora_adapter", body, headers=wrong).status_code == 401
    unload = {"lora_name": "sql"}
    assert _post(base_url, "/v1/unload_lora_adapter", unload, headers=None).status_code == 401
    models = httpx.get(base_url + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == [MODEL_NAME, *STATIC]


def test_unloading_an_adapter_lets_its_running_stream_finish(client, base_url, adapter_dirs, steps):
    assert _load(base_url, "streamed", adapter_dirs["late"]).status_code == 200
    expected = _complete(client, "streamed", max_tokens=48)
    steps.delay = 0.02  # 48 tokens take about a second: the unload lands mid-stream
    stream = client.completions.create(
        model="streamed",
        prompt=PROMPT,
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = iter(stream)
    first = next(chunks)
    assert _unload(base_url, lora_name="streamed").status_code == 200
    rest = list(chunks)
    assert len(rest) > 5, "the stream had ended before the unload"
    assert {c.model for c in [first, *rest]} == {"streamed"}
    # The whole stream ran with the adapter, after the unload too.
    assert "".join(c.choices[0].text for c in [first, *rest] if c.choices) == expected
    finishes = [c.choices[0].finish_reason for c in rest if c.choices]
    assert finishes[-1] == "length"
    assert rest[-1].usage.completion_tokens == 48
    with pytest.raises(openai.NotFoundError):
        _complete(client, "streamed")


def test_without_enable_lora_adapters_are_refused(engine, model_dir, adapter_dirs):
    models = served_models(engine_config(model_dir), MODEL_NAME)
    with live_server(engine, models=models) as url:
        refused = expect_error(_load(url, "late", adapter_dirs["late"]), 400, "lora_name")
        assert "--enable-lora" in refused["message"]
        expect_error(_unload(url, lora_name="sql"), 400, "lora_name")
        no_adapter = _post(url, "/v1/completions", {"model": "sql", "prompt": PROMPT})
        expect_error(no_adapter, 404, "model")
    with pytest.raises(ConfigError, match="--enable-lora"):
        served_models(engine_config(model_dir), MODEL_NAME, [LoRAModulePath("sql", "/x")])


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_lora_modules_flag_takes_both_spellings_in_order(model_dir, adapter_dirs):
    poet = json.dumps({"name": "poet", "path": str(adapter_dirs["poet"]), "base_model_name": "b"})
    args = _serve_args(
        f"--model={model_dir}",
        "--enable-lora",
        "--max-lora-rank=8",
        "--lora-modules",
        f"sql={adapter_dirs['sql']}",
        poet,
        "--lora-modules",
        f"late={adapter_dirs['late']}",
    )
    models = models_from_args(args, engine_config_from_args(args))
    lora = [models.resolve(name) for name in ("sql", "poet", "late")]
    assert [(r.lora_int_id, r.lora_path) for r in lora] == [
        (1, str(adapter_dirs["sql"])),
        (2, str(adapter_dirs["poet"])),
        (3, str(adapter_dirs["late"])),
    ]
    assert lora[1].base_model_name == "b"
    assert models.resolve(models.base_name) is None
    models.unload("late", None)
    assert models.add("late", str(adapter_dirs["late"])).lora_int_id == 4  # ids are not reused


def test_several_api_servers_take_adapters_from_the_flag_only(model_dir, adapter_dirs):
    config = engine_config(model_dir, **LORA_KEYS)
    sql = LoRAModulePath("sql", str(adapter_dirs["sql"]))
    models = served_models(config, MODEL_NAME, [sql], runtime_updates=False)
    assert models.resolve("sql") is not None
    with pytest.raises(InvalidRequestError, match="--api-server-count"):
        asyncio.run(models.load("late", str(adapter_dirs["late"])))
    with pytest.raises(InvalidRequestError, match="--api-server-count"):
        models.unload("sql", None)


@pytest.mark.parametrize(
    "text",
    [
        "no-equals-sign",
        "=path",
        "name=",
        '{"name": "x"}',
        '{"name": "x", "path": 1}',
        '{"name": "x", "path": "/p", "rank": 8}',
        "{not json",
    ],
)
def test_malformed_lora_modules_are_usage_errors(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lora_module(text)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--enable-lora", "--max-lora-rank=8", "--lora-modules", "big={big}"), "--max-lora-rank"),
        (("--lora-modules", "sql={sql}"), "--lora-modules needs --enable-lora"),
    ],
)
def test_serve_refuses_bad_lora_modules_before_starting_the_engine(
    model_dir, adapter_dirs, flags, message
):
    flags = tuple(flag.format(**adapter_dirs) for flag in flags)
    command = [sys.executable, "-m", "platform_core.cli.main", "serve", f"--model={model_dir}"]
    command += [f"--port={free_port()}", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: --lora-modules" in done.stderr and message in done.stderr, done.stderr
