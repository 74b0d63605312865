"""What shapes a sequence's logits inside the batched step (X14): a grammar (constrained
decoding over the model's own vocabulary: every answer parses and validates, with random
weights), `logit_bias` (added before the mask), and the prompt's log-probabilities (equal to
a forward pass of the whole prompt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvq import wire
from kvq.coordinator.engine import Engine, Sequence
from kvq.model import Backbone, KVCache, SeqStep
from kvq.model.generate import generate
from kvq.text import Tokenizer, load_tokenizer
from kvq.tools.synth import make_tiny

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from kvq.text.grammar import compile_grammar  # noqa: E402  (needs llguidance)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def _model(path: Path, tokenizer: str) -> tuple[Backbone, Tokenizer]:
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=5, tokenizer=tokenizer)
    return Backbone.from_gguf(path), load_tokenizer(path)


@pytest.fixture(scope="module", params=["bpe", "bytes"])
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Backbone, Tokenizer]:
    return _model(tmp_path_factory.mktemp("c") / "m.gguf", request.param)


def run(engine: Engine) -> dict[str, Sequence]:
    out: dict[str, Sequence] = {}
    while engine.busy:
        for seq in engine.step(None, lambda seqs: None):
            out[seq.request_id] = seq
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)  # 100 answers of up to 400 tokens; 120 s on a busy 2-CPU run
def test_every_answer_under_a_schema_parses_and_validates(
    model: tuple[Backbone, Tokenizer],
) -> None:
    bb, tok = model
    grammar = compile_grammar("json_schema", json.dumps(SCHEMA))
    engine = Engine(bb, tok, n_slots=8)
    answers: dict[str, Sequence] = {}
    for batch in range(100 // 8 + 1):
        for i in range(min(8, 100 - batch * 8)):
            n = batch * 8 + i
            p = wire.SamplingParams(temperature=1.0, seed=n, grammar=grammar)
            engine.admit(f"r{n}", tok.encode(f"answer {n}"), 400, b"", p)
        answers |= run(engine)
    assert len(answers) == 100
    for seq in answers.values():
        doc = json.loads(tok.decode(seq.generated))
        jsonschema.validate(doc, SCHEMA)
        assert seq.finish in ("eos", "stop")


def test_greedy_under_a_grammar_and_a_regex(model: tuple[Backbone, Tokenizer]) -> None:
    bb, tok = model
    engine = Engine(bb, tok, n_slots=2)
    regex = wire.SamplingParams(grammar=compile_grammar("regex", "[0-9]{3}-[a-c]{2}"))
    choice = wire.SamplingParams(grammar=compile_grammar("choice", json.dumps(["yes", "no"])))
    engine.admit("re", tok.encode("x"), 40, b"", regex)
    engine.admit("choice", tok.encode("y"), 40, b"", choice)
    got = run(engine)
    import re

    assert re.fullmatch("[0-9]{3}-[a-c]{2}", tok.decode(got["re"].generated))
    assert tok.decode(got["choice"].generated) in ("yes", "no")


def test_logit_bias_is_added_before_sampling(model: tuple[Backbone, Tokenizer]) -> None:
    bb, tok = model
    prompt = tok.encode("bias")
    plain = generate(bb, prompt, 6)
    banned = {t: -100.0 for t in set(plain)}
    forced = tok.encode("z", add_bos=False)[0]
    engine = Engine(bb, tok, n_slots=2)
    engine.admit("ban", prompt, 6, b"", wire.SamplingParams(logit_bias=banned))
    engine.admit("force", prompt, 6, b"", wire.SamplingParams(logit_bias={forced: 100.0}))
    got = run(engine)
    assert not set(got["ban"].generated) & set(plain)
    assert got["force"].generated == [forced] * 6


def test_prompt_logprobs_equal_a_forward_of_the_whole_prompt(
    model: tuple[Backbone, Tokenizer],
) -> None:
    bb, tok = model
    prompt = tok.encode("the quick brown fox jumps")
    engine = Engine(bb, tok, n_slots=2, prefill_chunk=4)
    engine.admit("lp", prompt, 2, b"", wire.SamplingParams(prompt_logprobs=2))
    engine.admit("other", tok.encode("another prompt that is longer"), 3, b"")
    got = run(engine)["lp"]
    assert [p.token_id for p in got.prompt_lp] == prompt
    assert got.prompt_lp[0].logprob is None
    cache: KVCache = bb.new_cache()
    want = []
    for i, t in enumerate(prompt[:-1]):  # one position at a time: the reference
        logits = bb.forward([SeqStep([t], cache)])[0]
        want.append(float(torch.log_softmax(logits.float(), -1)[prompt[i + 1]]))
    assert [p.logprob for p in got.prompt_lp[1:]] == pytest.approx(want, abs=1e-5)
    assert all(len(p.top) == 2 for p in got.prompt_lp[1:])
    assert got.generated == generate(bb, prompt, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)  # 100 answers on a 32,000-token vocabulary
def test_every_answer_on_the_small_preset_validates(tmp_path: Path) -> None:
    """The `small` preset (random weights, a 32,000-token vocabulary): 100 of 100 answers
    under the schema parse and validate, 25 sequences a batch."""
    from kvq.tools.synth.presets import preset_named, write_preset

    path = tmp_path / "small.gguf"
    write_preset(path, preset_named("small"))
    bb, tok = Backbone.from_gguf(path), load_tokenizer(path)
    grammar = compile_grammar("json_schema", json.dumps(SCHEMA))
    engine = Engine(bb, tok, n_slots=25)
    answers: dict[str, Sequence] = {}
    for batch in range(4):
        for i in range(25):
            n = batch * 25 + i
            p = wire.SamplingParams(temperature=1.0, seed=n, grammar=grammar)
            engine.admit(f"r{n}", tok.encode(f"answer {n}"), 400, b"", p)
        answers |= run(engine)
    assert len(answers) == 100
    valid = 0
    for seq in answers.values():
        jsonschema.validate(json.loads(tok.decode(seq.generated)), SCHEMA)
        assert seq.finish in ("eos", "stop")
        valid += 1
    assert valid == 100
