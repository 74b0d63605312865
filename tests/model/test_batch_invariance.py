"""X17 on every family's tiny model: a sequence's logits are the same bits alone or beside any
other sequences of a step (prompts and decode tokens, any count and lengths), and a MoE
layer's output the same bits whatever the slice grid and wherever each slice ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq.model import Backbone
from kvq.model.cache import SeqStep
from kvq.model.experts import expert_forward, slice_terms
from kvq.model.moe_sum import combine, inside
from kvq.tools.synth import make_tiny

FAMILIES = [
    ("qwen3moe", "", "f32"),
    ("qwen2moe", "", "f32"),
    ("mixtral", "", "f32"),
    ("olmoe", "", "f32"),
    ("glm4moe", "", "f32"),
    ("deepseek2", "v3", "f32"),
    ("gpt-oss", "", "f32"),
    ("qwen35moe", "", "f32"),
    ("llama4", "", "f32"),
    ("qwen3moe", "", "q4_k_m"),
    ("gpt-oss", "", "mxfp4"),
    ("deepseek2", "v3", "q4_k_m"),
]
_models: dict[str, Backbone] = {}


@pytest.fixture(params=FAMILIES, ids=lambda f: f"{f[0]}-{f[2]}")
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    arch, variant, quant = request.param
    key = f"{arch}-{quant}"
    if key not in _models:
        path = tmp_path_factory.mktemp("inv") / f"{key}.gguf"
        hidden = 64 if quant == "f32" else 256
        make_tiny(
            path,
            arch=arch,
            variant=variant,
            quant=quant,
            layers=3,
            experts_used=4,  # of 8: a slice can hold 2 of a token's experts, not the first
            hidden=hidden,
            expert_ffn=hidden,
            seed=3,
        )
        _models[key] = Backbone.from_gguf(path)
    return _models[key]


TOKENS = st.lists(st.integers(0, 255), min_size=1, max_size=40)
# each other sequence: its prompt so far (already in its cache, maybe none) and its new tokens
OTHERS = st.lists(st.tuples(st.lists(st.integers(0, 255), max_size=12), TOKENS), max_size=4)


def _logits(bb: Backbone, target: tuple[list[int], list[int]], others: list, place: int):  # type: ignore[no-untyped-def]
    """The target's logits row when its new tokens run at `place` among the others' (each
    sequence's earlier tokens run alone first, as a cache that was filled before)."""
    seqs = [*others[:place], target, *others[place:]]
    steps = []
    for before, new in seqs:
        cache = bb.new_cache()
        if before:
            bb.forward([SeqStep(list(before), cache)])
        steps.append(SeqStep(list(new), cache))
    return bb.forward(steps)[place]


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(prompt=TOKENS, decode=st.booleans(), others=OTHERS, place=st.integers(0, 4))
def test_a_sequences_logits_do_not_depend_on_its_batch(
    family: Backbone,
    prompt: list[int],
    decode: bool,
    others: list,
    place: int,  # type: ignore[type-arg]
) -> None:
    target = (prompt, [7]) if decode else ([], prompt)  # a decode token, or a whole prompt
    place = place % (len(others) + 1)
    alone = _logits(family, target, [], 0)
    got = _logits(family, target, others, place)
    assert torch.equal(got, alone), (got - alone).abs().max()


def _grid(e: int, cuts: list[int], places: list[int]) -> list[tuple[int, int]]:
    """The expert ranges one call each computes: the layer's `e` experts cut at `cuts` into
    slices, slice i placed at `places[i]` (the coordinator, a worker, another), and
    neighbouring slices of one place computed in one call."""
    bounds = sorted({c % e for c in cuts} - {0})
    slices = list(zip([0, *bounds], [*bounds, e], strict=True))
    calls: list[tuple[int, int, int]] = []
    for i, (lo, hi) in enumerate(slices):
        place = places[i % len(places)]
        if calls and calls[-1][2] == place:
            calls[-1] = (calls[-1][0], hi, place)
        else:
            calls.append((lo, hi, place))
    return [(lo, hi) for lo, hi, _ in calls]


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(1, 12),
    cuts=st.lists(st.integers(1, 1000), max_size=7),
    places=st.lists(st.integers(0, 2), min_size=1, max_size=8),
    more=st.lists(st.booleans(), min_size=12, max_size=12),
    seed=st.integers(0, 10**6),
)
def test_a_tokens_moe_output_does_not_depend_on_where_its_experts_ran(
    family: Backbone, rows: int, cuts: list[int], places: list[int], more: list[bool], seed: int
) -> None:
    """Any slice grid, any placement of the slices, each call over the rows that reach its
    experts and perhaps others: the terms added in the fixed order (`combine`, what
    `LayerCall.finish` does) are the bits of one `expert_forward` over the layer (what
    `kvq generate` and a stage holder compute), for the batch and for each row alone."""
    layer = min(family.experts)
    sl = family.experts[layer]
    g = torch.Generator().manual_seed(seed)
    h, e = sl.hidden, sl.expert_end
    x = torch.randn(rows, h, generator=g)  # [T, H]
    k = family.meta.expert_used_count
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)])  # [T, k]
    w = torch.rand(rows, k, generator=g)  # [T, k]
    parts = []
    for lo, hi in _grid(e, cuts, places):
        mask = inside(ids, lo, hi)  # [T, k]
        sub = (mask.any(dim=1) | torch.tensor(more[:rows])).nonzero().squeeze(1)  # [R]
        parts.append((mask, slice_terms(sl, x[sub], ids[sub], w[sub], lo, hi)))
    got = combine(ids, h, x.dtype, parts)  # [T, H]
    whole = expert_forward(sl, x, ids, w)  # [T, H]
    assert torch.equal(got, whole), (got - whole).abs().max()
    t = rows - 1  # the last row alone, in one call and in the grid's calls
    assert torch.equal(expert_forward(sl, x[t:], ids[t:], w[t:])[0], whole[t])
    alone = [
        (m[t:], slice_terms(sl, x[t:], ids[t:], w[t:], lo, hi))
        for (m, _), (lo, hi) in zip(parts, _grid(e, cuts, places), strict=True)
    ]
    assert torch.equal(combine(ids[t:], h, x.dtype, alone)[0], whole[t])


def test_a_prompt_read_in_pieces_is_read_alike_in_every_batch(tmp_path: Path) -> None:
    """The engine cuts a prompt where `generate(chunk=)` does, whatever the other prompts."""
    from kvq.coordinator.engine import Engine
    from kvq.model.generate import generate
    from kvq.text import ByteTokenizer

    make_tiny(tmp_path / "m.gguf", seed=3)
    bb = Backbone.from_gguf(tmp_path / "m.gguf")
    prompts = [list(range(1, 20)), list(range(30, 43)), list(range(50, 55)), list(range(60, 81))]
    engine = Engine(bb, ByteTokenizer(), n_slots=4, prefill_chunk=8)
    for i, p in enumerate(prompts):
        engine.admit(str(i), p, 6, b"")
    done = []
    while engine.active:
        done += engine.step(None, lambda seqs: None)
    got = {s.request_id: s.generated for s in done}
    for i, p in enumerate(prompts):
        assert got[str(i)] == generate(bb, p, 6, chunk=8, stop_at_eos=False)
