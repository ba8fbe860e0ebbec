"""``platform-core chat``: talk to a model in the terminal, or send ``--message`` turns."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from platform_core.engine.llm_engine import LLMEngine
from platform_core.entrypoints.chat_template import Message, render_chat
from platform_core.entrypoints.engine_args import add_engine_args, engine_config_from_args
from platform_core.sampling_params import SamplingParams


def stream_reply(engine: LLMEngine, messages: list[Message], params: SamplingParams) -> str:
    """Generate one reply, printing text as it grows; return the whole reply."""
    prompt = render_chat(engine.tokenizer, messages)
    request_id = engine.new_request_id()
    engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    printed = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                sys.stdout.write(text[len(printed) :])
                sys.stdout.flush()
                printed = text
    except KeyboardInterrupt:
        engine.abort_request([request_id])
    sys.stdout.write("\n")
    return printed


def _turns(messages: list[str] | None) -> Iterable[str]:
    if messages:
        yield from messages
        return
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if line.strip() in ("exit", "quit"):
            return
        if line.strip():
            yield line


def run_chat(args: argparse.Namespace) -> int:
    engine = LLMEngine(engine_config_from_args(args))
    params = SamplingParams(
        **{**engine.default_sampling, "max_tokens": args.max_tokens}
        | ({} if args.temperature is None else {"temperature": args.temperature})
    )
    history: list[Message] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    for turn in _turns(args.message):
        history.append({"role": "user", "content": turn})
        reply = stream_reply(engine, history, params)
        history.append({"role": "assistant", "content": reply})
    return 0


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``chat`` sub-command."""
    chat = subparsers.add_parser("chat", help="chat with the model (REPL, or --message turns)")
    chat.add_argument("--message", action="append", help="a user turn (repeatable); no REPL")
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=None)
    add_engine_args(chat)
    chat.set_defaults(func=run_chat)
