"""lm-eval (``local-completions``) against a live server, checked against the same requests
computed with transformers on the same tiny model and tokenizer.

Both tasks are written here: a multiple-choice one (loglikelihood: ``echo`` + ``logprobs`` +
``max_tokens: 1`` with token-id prompts, what lm-eval sends) and a ``generate_until`` one, with
their data in JSONL files; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from server_utils import MODEL_NAME

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev extra")

QUESTIONS = [
    ("The cat sat on the", ["mat", "dog", "tree", "sky"], 0),
    ("Water is", ["wet", "dry", "loud", "square"], 0),
    ("One plus one is", ["two", "three", "blue", "cold"], 0),
    ("The sun rises in the", ["east", "west", "north", "sea"], 0),
    ("Hello, my name", ["is", "was", "be", "are"], 0),
    ("A chat about", ["models", "cats", "rain", "code"], 2),
]
# Log-likelihoods of the server (float32 engine kernels) and of transformers differ in the last
# bits; 1e-3 nats over a few tokens is far below the gap between distinct choices.
LOGLIKELIHOOD_TOLERANCE = 1e-3
MAX_GEN_TOKS = 8


def _write_tasks(directory: Path) -> list[str]:
    mc = directory / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    gen = directory / "gen.jsonl"
    gen.write_text(
        "".join(json.dumps({"question": q, "answer": c[a]}) + "\n" for q, c, a in QUESTIONS)
    )
    (directory / "tiny_mc.yaml").write_text(
        f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""
    )
    (directory / "tiny_gen.yaml").write_text(
        f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
    )
    return ["tiny_mc", "tiny_gen"]


def _evaluate(model_args: str, tasks: list[str], directory: Path) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(directory)),
        batch_size=1,
        log_samples=True,
    )


def _responses(results: dict[str, Any], task: str) -> list[Any]:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in samples]


class _Reference:
    """The same requests computed with transformers (lm-eval's ``hf`` model needs accelerate,
    which is not a dependency here): lm-eval's own context/continuation split, greedy decoding."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        """As lm-eval scores it: the whole text's tokens split after the context's."""
        whole, context_ids = self._ids(context + continuation), self._ids(context)
        targets = whole[len(context_ids) :]
        with torch.no_grad():
            logits = self.model(torch.tensor([whole])).logits[0].log_softmax(-1)
        rows = logits[len(context_ids) - 1 : len(whole) - 1]
        picked = rows[torch.arange(len(targets)), torch.tensor(targets)]
        return float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(targets)).all())

    def generate(self, context: str, until: str, max_new_tokens: int) -> str:
        ids = torch.tensor([self._ids(context)])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        text = self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        # The random model often stops inside a UTF-8 character made of byte tokens: the engine's
        # incremental detokenizer drops such an unfinished character, decode() writes U+FFFD.
        return text.split(until)[0].rstrip("\ufffd")


def test_lm_eval_scores_match_transformers(base_url, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    tasks = _write_tasks(tmp_path)
    served = _evaluate(
        f"model={MODEL_NAME},base_url={base_url}/v1/completions,tokenizer={model_dir},"
        "tokenizer_backend=huggingface,tokenized_requests=True,max_length=256,num_concurrent=1,"
        "max_retries=1",
        tasks,
        tmp_path,
    )
    reference = _Reference(model_dir)

    # Multiple choice (loglikelihood): every choice agrees, so the accuracy is the same exactly.
    got = _responses(served, "tiny_mc")
    assert len(got) == len(QUESTIONS)
    correct = 0
    for (question, choices, answer), doc_got in zip(QUESTIONS, got):
        want = [reference.loglikelihood(question, " " + choice) for choice in choices]
        assert len(doc_got) == len(want) == 4
        for (ll_got, greedy_got), (ll_want, greedy_want) in zip(doc_got, want):
            assert math.isfinite(ll_got) and ll_got < 0
            assert abs(ll_got - ll_want) < LOGLIKELIHOOD_TOLERANCE, (doc_got, want)
            assert greedy_got == greedy_want
        correct += max(range(4), key=lambda i: want[i][0]) == answer
    assert served["results"]["tiny_mc"]["acc,none"] == correct / len(QUESTIONS)

    # generate_until: greedy continuations are the same text, so the score is the same.
    got = [text for (text,) in _responses(served, "tiny_gen")]
    want = [reference.generate(q, "\n", MAX_GEN_TOKS) for q, _, _ in QUESTIONS]
    assert got == want and any(got), got
    matches = sum(w == c[a] for w, (_, c, a) in zip(want, QUESTIONS))
    assert served["results"]["tiny_gen"]["exact_match,none"] == matches / len(QUESTIONS)
