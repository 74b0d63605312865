"""lm-eval's `multiple_choice` end to end against `kvq api` (X14): `lm-eval run --model
local-completions` with the remote tokenizer (`GET /tokenizer_info`, `POST /tokenize`) on a
small multiple-choice task written here, and each choice's log-likelihood equal to kvq's own
forward pass. Runs where lm-eval is installed (the `clients` test extra)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MODEL, System

from kvq.model import Backbone, KVCache, SeqStep
from kvq.text import Tokenizer, load_tokenizer

pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Paris is in", "choices": ["France", "Spain", "the sea", "Peru"], "answer": 0},
]
TASK = """task: kvq_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def loglikelihood(bb: Backbone, tok: Tokenizer, context: str, continuation: str) -> float:
    """The sum of the continuation's token log-probabilities after the context, split as
    lm-eval splits (the whole encoded, the context's trailing spaces moved to the
    continuation), one position at a time."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation, add_bos=False)
    n_ctx = len(tok.encode(context, add_bos=False))
    cache: KVCache = bb.new_cache()
    total = 0.0
    for i, t in enumerate(whole[:-1]):
        logits = bb.forward([SeqStep([t], cache)])[0]
        if i + 1 >= n_ctx:
            total += float(torch.log_softmax(logits.float(), -1)[whole[i + 1]])
    return total


def test_multiple_choice_log_likelihoods_equal_a_forward_pass(
    system: System, tmp_path: Path
) -> None:
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kvq_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    args = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "local-completions",
        "--model_args",
        f"base_url={system.url}/v1/completions,model={MODEL},"
        "tokenizer_backend=remote,num_concurrent=1,max_retries=1",
        "--tasks",
        "kvq_mc",
        "--include_path",
        str(tasks),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
    ]
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(args, capture_output=True, text=True, timeout=280, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "kvq_mc" in run.stdout and "acc" in run.stdout, run.stdout[-2000:]
    print(run.stdout[-1500:])  # lm-eval's table (pytest -s shows it)
    files = list(out.rglob("samples_kvq_mc_*.jsonl"))
    samples = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(DOCS)))
    bb, tok = Backbone.from_gguf(system.model_path), load_tokenizer(system.model_path)
    for s in samples:
        doc = DOCS[s["doc_id"]]
        pairs = [tuple(a.values()) for a in s["arguments"].values()]  # (context, continuation)
        assert [c for _, c in pairs] == [" " + c for c in doc["choices"]]  # its target delimiter
        got = [float(r[0][0]) for r in s["resps"]]
        want = [loglikelihood(bb, tok, ctx, cont) for ctx, cont in pairs]
        assert got == pytest.approx(want, abs=1e-4), (doc, got, want)
        assert s["acc"] == float(max(range(len(got)), key=got.__getitem__) == doc["answer"])
