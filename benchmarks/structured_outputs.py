"""Structured outputs: throughput with a JSON schema on every request vs unconstrained (#22).

Side by side in one process, on the default model (SmolLM2-135M-Instruct) unless ``--model``:

- ``--requests`` chat prompts asking for a JSON record, all submitted at once, once with a JSON
  schema on every request and once without; output tokens/s of each (``--rounds`` alternating
  rounds, the constrained run first in odd rounds, so neither gets the warmer machine) and the
  ratio. The unconstrained run generates exactly as many tokens per request as the constrained
  one did (``ignore_eos``), so both run the same batch sizes step by step;
- grammar compile time with the model's tokenizer: cold (first use of a schema, its grammar
  engine's vocabulary tables included), each further cold schema, and cached.

    python benchmarks/structured_outputs.py [--requests 64] [--max-tokens 128] [--rounds 2]
        [--backend auto|xgrammar|guidance] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from platform_core import LLM, SamplingParams
from platform_core.entrypoints.chat_template import render_chat
from platform_core.structured_output.manager import StructuredOutputManager
from platform_core.structured_outputs_params import StructuredOutputsParams

RECORD = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "country": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[A-Za-z ]{1,30}$"},
            "maxItems": 3,
        },
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito"]


def prompts(llm: LLM, count: int) -> list[dict]:
    """Chat prompts asking for a JSON record of a city, as token ids."""
    tokenizer = llm.get_tokenizer()
    out = []
    for i in range(count):
        messages = [
            {
                "role": "user",
                "content": f"Describe {CITIES[i % len(CITIES)]} as JSON with city, country, "
                "population_millions and landmarks.",
            }
        ]
        out.append({"prompt_token_ids": render_chat(tokenizer, messages, True, None)})
    return out


def throughput(
    llm: LLM, batch: list[dict], params: SamplingParams | list[SamplingParams]
) -> tuple[float, list[int]]:
    """Output tokens/s of one batch, and each request's output tokens."""
    started = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return sum(lengths) / seconds, lengths


def compile_times(llm: LLM, backend: str) -> dict[str, float]:
    """Milliseconds to prepare and compile schemas with a fresh manager on the model's vocab."""
    engine = llm.llm_engine
    manager = StructuredOutputManager(
        backend, engine.tokenizer, engine.vocab_size, engine.eos_token_ids
    )

    def compile_ms(params: StructuredOutputsParams) -> float:
        started = time.perf_counter()
        manager.check(params)
        manager._compile(params).result()
        return 1e3 * (time.perf_counter() - started)

    first = compile_ms(StructuredOutputsParams(json=RECORD))
    # Distinct grammars (xgrammar also caches by grammar text): a property renamed each time.
    others = [
        compile_ms(
            StructuredOutputsParams(
                json={**RECORD, "properties": {**RECORD["properties"], f"note_{i}": RECORD}}
            )
        )
        for i in range(5)
    ]
    cached = [compile_ms(StructuredOutputsParams(json=RECORD)) for _ in range(5)]
    manager.shutdown()
    return {
        "cold_first_ms": first,
        "cold_median_ms": statistics.median(others),
        "cached_median_ms": statistics.median(cached),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        structured_outputs_backend=args.backend,
        max_num_seqs=max(args.requests, 1),
    )
    batch = prompts(llm, args.requests)
    schema = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        structured_outputs=StructuredOutputsParams(json=RECORD),
    )
    _, lengths = throughput(llm, batch, schema)  # warm up; the lengths to match
    params = {
        "json_schema": schema,
        "unconstrained": [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
        ],
    }
    runs: dict[str, list[tuple[float, list[int]]]] = {name: [] for name in params}
    for round_index in range(args.rounds):
        order = list(params)
        for name in order if round_index % 2 == 0 else order[::-1]:
            runs[name].append(throughput(llm, batch, params[name]))
    report = {
        name: {
            "output_tok_s": [round(t, 1) for t, _ in values],
            "output_tokens": [sum(n) for _, n in values],
        }
        for name, values in runs.items()
    }
    ratios = [c / u for (c, _), (u, _) in zip(runs["json_schema"], runs["unconstrained"])]
    report["ratio_constrained_over_unconstrained"] = [round(r, 3) for r in ratios]
    report["compile"] = {k: round(v, 2) for k, v in compile_times(llm, args.backend).items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
