"""Grammar engines behind one small interface: xgrammar (the default) and llguidance.

An engine turns a ``StructuredOutputsParams`` into a ``CompiledGrammar`` for one tokenizer in two
steps: ``prepare`` builds the tokenizer-independent grammar (fast; a constraint the engine cannot
take is an ``InvalidRequestError`` naming the problem), ``compile`` specializes it to the
vocabulary (slow for large vocabularies: run off the engine loop). A compiled grammar makes one
``GrammarMatcher`` per output sequence; the matcher tracks the tokens accepted so far and writes
the next token's bitmask (bit ``t % 32`` of word ``t // 32``: 1 means allowed).
"""

from __future__ import annotations

import json
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch

from platform_core.errors import InvalidRequestError
from platform_core.structured_outputs_params import PARAM, StructuredOutputsParams

_ANY_OBJECT = '{"type": "object"}'
# xgrammar prefixes its messages with a time and a C++ source location.
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarMatcher(Protocol):
    """The grammar state of one output sequence."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar forbids it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar accepted its end (a stop token after a complete match)."""
        ...


class CompiledGrammar(Protocol):
    """A grammar specialized to the vocabulary; makes matchers."""

    def matcher(self) -> GrammarMatcher:
        """A matcher at the start of the grammar."""
        ...


class GrammarEngine(ABC):
    """Prepares and compiles constraints for one tokenizer and vocabulary size.

    ``stop_token_ids`` are the tokens that end a sequence: allowed once the grammar is complete.
    The vocabulary-dependent state is built on first ``compile`` (thread-safe), not at start-up.
    """

    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._lock = threading.Lock()
        self._vocab_state: Any = None

    @abstractmethod
    def prepare(self, params: StructuredOutputsParams) -> Any:
        """The engine's grammar for ``params``; ``InvalidRequestError`` if it cannot take it."""

    @abstractmethod
    def compile(self, prepared: Any) -> CompiledGrammar:
        """Specialize a ``prepare`` result to the vocabulary (may take a while)."""

    def _vocab(self, build: Callable[[], Any]) -> Any:
        with self._lock:
            if self._vocab_state is None:
                self._vocab_state = build()
            return self._vocab_state


def _refuse(engine: str, exc: Exception) -> InvalidRequestError:
    message = _NATIVE_PREFIX.sub("", str(exc).strip())
    return InvalidRequestError(f"{engine} cannot use this {PARAM} constraint: {message}", PARAM)


class XGrammarEngine(GrammarEngine):
    """xgrammar: JSON schema, regex, choice, EBNF (GBNF) and structural tags."""

    name = "xgrammar"

    def prepare(self, params: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else _ANY_OBJECT
                if schema is True:
                    return xgr.Grammar.builtin_json_grammar()
                if _has_length_bounded_string(schema):
                    raise ValueError(
                        "a string with minLength/maxLength and no pattern (xgrammar 0.2 lets "
                        "such strings hold raw control characters: the output would not be "
                        "valid JSON)"
                    )
                return xgr.Grammar.from_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema),
                    any_whitespace=not params.disable_any_whitespace,
                )
            if kind == "regex":
                return xgr.Grammar.from_regex(params.regex)
            if kind == "choice":
                literals = (json.dumps(c, ensure_ascii=False) for c in params.choice)
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(literals))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(params.grammar)
            return _structural_tag(xgr, params.structural_tag)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _refuse(self.name, exc) from None

    def compile(self, prepared: Any) -> CompiledGrammar:
        compiler = self._vocab(self._compiler)
        return _XGrammarCompiled(compiler.compile_grammar(prepared))

    def _compiler(self) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgr.GrammarCompiler(info, max_threads=1)


# Keywords whose value maps names to subschemas (a property may be called "maxLength"), and
# keywords whose value is data, not a schema.
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions"))
_DATA = frozenset(("enum", "const", "default", "examples"))


def _has_length_bounded_string(node: Any) -> bool:
    """Whether a JSON schema bounds a string's length without a pattern anywhere."""
    if isinstance(node, list):
        return any(_has_length_bounded_string(item) for item in node)
    if not isinstance(node, dict):
        return False
    if ("maxLength" in node or "minLength" in node) and "pattern" not in node:
        return True
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            if any(_has_length_bounded_string(v) for v in value.values()):
                return True
        elif key not in _DATA and _has_length_bounded_string(value):
            return True
    return False


def _structural_tag(xgr: Any, tag: dict[str, Any]) -> Any:
    """vLLM's ``{"structures": [{begin, schema, end}], "triggers": [...]}`` form, or xgrammar's
    own structural-tag object as it is."""
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(json.dumps(tag))
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))


class _XGrammarCompiled:
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def matcher(self) -> GrammarMatcher:
        import xgrammar as xgr

        return _XGrammarMatcher(xgr.GrammarMatcher(self._compiled))


class _XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class GuidanceEngine(GrammarEngine):
    """llguidance: JSON schema, regex, choice and Lark or GBNF grammars (no structural tags)."""

    name = "guidance"

    def prepare(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        kind = params.kind
        try:
            if kind == "json":
                schema = params.json
                schema = {} if schema is True else schema
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema),
                    overrides={"whitespace_flexible": not params.disable_any_whitespace},
                )
            elif kind == "json_object":
                grammar = llguidance.grammar_from("json_schema", _ANY_OBJECT)
            elif kind == "regex":
                grammar = llguidance.grammar_from("regex", params.regex)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(params.choice))
            elif kind == "grammar":
                grammar = llguidance.grammar_from("grammar", params.grammar)
            else:
                raise ValueError("structural tags are not supported (use xgrammar)")
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _refuse(self.name, exc) from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise _refuse(self.name, ValueError(error))
        return grammar

    def compile(self, prepared: Any) -> CompiledGrammar:
        return _GuidanceCompiled(self._vocab(self._tokenizer), prepared)

    def _tokenizer(self) -> Any:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(
            self.tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids
        )


class _GuidanceCompiled:
    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar

    def matcher(self) -> GrammarMatcher:
        import llguidance

        return _GuidanceMatcher(llguidance.LLMatcher(self._tokenizer, self._grammar))


class _GuidanceMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()


GRAMMAR_ENGINES: dict[str, type[GrammarEngine]] = {
    XGrammarEngine.name: XGrammarEngine,
    GuidanceEngine.name: GuidanceEngine,
}
# What ``structured_outputs_backend`` names, in the order ``auto`` tries them.
ENGINE_ORDER = {
    "auto": ("xgrammar", "guidance"),
    "xgrammar": ("xgrammar",),
    "guidance": ("guidance",),
}
