"""Sampling per sequence inside the batched step: each sequence of one batch gets exactly the
tokens `kvq generate` gives it alone (greedy bit-exact, seeded sampling equal), with its own
stops, penalties and logprobs."""

from __future__ import annotations

import pytest
import torch

from kvq import wire
from kvq.coordinator.engine import Engine, Sequence
from kvq.model import Backbone, SeqStep
from kvq.model.generate import Sampling, generate
from kvq.text import Tokenizer, load_tokenizer
from kvq.tools.synth import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Backbone, Tokenizer]:
    path = tmp_path_factory.mktemp("eng") / "m.gguf"
    make_tiny(path, layers=2, experts=8, experts_used=2, seed=5, tokenizer="bpe")
    return Backbone.from_gguf(path), load_tokenizer(path)


def run(engine: Engine) -> dict[str, Sequence]:
    out: dict[str, Sequence] = {}
    while engine.busy:
        for seq in engine.step(None, lambda seqs: None):
            out[seq.request_id] = seq
    return out


PARAMS = {
    "greedy": wire.SamplingParams(),
    "hot": wire.SamplingParams(temperature=1.3, seed=11),
    "nucleus": wire.SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=12),
    "penalized": wire.SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
}


@pytest.mark.slow
def test_each_sequence_of_a_batch_matches_local_generation(
    model: tuple[Backbone, Tokenizer],
) -> None:
    bb, tok = model
    engine = Engine(bb, tok, n_slots=len(PARAMS))
    prompts = {name: tok.encode(f"prompt of {name}") for name in PARAMS}
    for name, p in PARAMS.items():
        engine.admit(name, prompts[name], 20, b"", p)
    got = run(engine)
    for name, p in PARAMS.items():
        s = Sampling(
            p.temperature, p.top_k, p.top_p, p.seed, p.presence_penalty, p.frequency_penalty
        )
        assert got[name].generated == generate(bb, prompts[name], 20, sampling=s), name
    # the penalties change the greedy path (else the test above would prove nothing for them)
    assert got["penalized"].generated != generate(bb, prompts["penalized"], 20)


def test_stop_strings_stop_tokens_and_logprobs(model: tuple[Backbone, Tokenizer]) -> None:
    bb, tok = model
    prompt = tok.encode("the end")
    greedy = generate(bb, prompt, 16)
    text = tok.decode(greedy)
    stop = text[5:8]
    start = text.find(stop)
    engine = Engine(bb, tok, n_slots=3)
    engine.admit("s", prompt, 16, b"", wire.SamplingParams(stop=[stop]))
    engine.admit("t", prompt, 16, b"", wire.SamplingParams(stop_token_ids=[greedy[4]]))
    engine.admit("l", prompt, 3, b"", wire.SamplingParams(logprobs=3))
    streamed: dict[str, str] = {"s": "", "t": "", "l": ""}
    lps: list[wire.TokenLogprob] = []
    done: dict[str, Sequence] = {}
    while engine.busy:

        def sink(seqs: list[Sequence]) -> None:
            for q in seqs:
                streamed[q.request_id] += q.new_text
                if q.request_id == "l" and q.new_logprob is not None:
                    lps.append(q.new_logprob)
                    assert q.new_top is not None and len(q.new_top) == 3

        done |= {q.request_id: q for q in engine.step(None, sink)}
    assert done["s"].finish == "stop" and done["s"].completion == text[:start]
    assert streamed["s"] == text[:start], "the stop string is never handed out"
    k = greedy.index(greedy[4])
    assert done["t"].finish == "stop" and done["t"].generated == greedy[:k]
    cache, step = bb.new_cache(), list(prompt)
    for lp in lps:
        with torch.inference_mode():
            ref = torch.log_softmax(bb.forward([SeqStep(step, cache)])[0].float(), -1)
        assert lp.token_id == int(ref.argmax()) and lp.logprob == pytest.approx(
            float(ref.max()), abs=1e-5
        )
        step = [lp.token_id]


def test_cancel_frees_the_slot(model: tuple[Backbone, Tokenizer]) -> None:
    bb, tok = model
    engine = Engine(bb, tok, n_slots=2)
    engine.admit("a", tok.encode("a"), 50, b"")
    engine.admit("b", tok.encode("b"), 50, b"")
    engine.step(None, lambda seqs: None)
    (gone,) = engine.cancel({"a", "nobody"})
    assert gone.request_id == "a" and gone.finish == "cancelled"
    assert engine.free == 1 and [s.request_id for s in engine.active] == ["b"]
