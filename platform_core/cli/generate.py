"""The ``generate`` subcommand of ``platform-core``: complete prompts offline and print them.

Each prompt is printed followed by its continuation (``The capital of France is Paris.``), one
prompt after another, separated by a blank line. A request that failed prints its error on
stderr and the command exits 1 once every prompt was tried.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from platform_core.entrypoints.engine_args import add_engine_args, engine_config_from_args

DEMO_PROMPT = "The capital of France is"
# Long enough for a few sentences to end at EOS, short enough to finish in seconds on a CPU; the
# engine caps it at the room the context leaves.
DEFAULT_MAX_TOKENS = 256
FAILED_EXIT_STATUS = 1


def _cmd_generate(args: argparse.Namespace) -> int:
    from platform_core.entrypoints.llm import LLM
    from platform_core.sampling_params import SamplingParams

    llm = LLM(config=engine_config_from_args(args))
    overrides = {
        k: v
        for k, v in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("top_k", args.top_k),
            ("seed", args.sampling_seed),
        )
        if v is not None
    }
    params = SamplingParams(
        **{**llm.engine.default_sampling, **overrides, "max_tokens": args.max_tokens}
    )
    status = 0
    for i, prompt in enumerate(args.prompt or [DEMO_PROMPT]):
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        if output.error is not None:
            print(f"error: the request for prompt {i + 1} failed: {output.error}", file=sys.stderr)
            status = FAILED_EXIT_STATUS
            continue
        print(("\n" if i else "") + prompt + output.outputs[0].text, flush=True)
    return status


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``generate`` to a ``platform-core`` subparsers object; return its parser."""
    generate = subparsers.add_parser(
        "generate",
        help="complete one or more prompts offline and print each prompt with its continuation",
        description=__doc__,
    )
    generate.add_argument(
        "--prompt", action="append", help=f"prompt text (repeatable; default {DEMO_PROMPT!r})"
    )
    generate.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="most tokens to generate per prompt; generation ends earlier at EOS or when the "
        f"context is full (default: {DEFAULT_MAX_TOKENS})",
    )
    generate.add_argument("--temperature", type=float, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(generate)
    generate.set_defaults(func=_cmd_generate)
    return generate
