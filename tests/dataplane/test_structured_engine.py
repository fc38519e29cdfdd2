"""Structured outputs in the engine: constrained requests share batches with free ones over
several adapters; every constrained output matches its grammar, and the free requests' tokens
are exactly those of a run without the constrained ones (seeded sampling does not depend on
what else is in the batch)."""

from __future__ import annotations

import json
import re

from loraplane.dataplane.sampling import SamplingParams
from loraplane.dataplane.structured import Constraint
from tests.dataplane.conftest import Family
from tests.dataplane.test_engine import make_engine, prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tier": {"enum": ["free", "pro"]},
    },
    "required": ["name", "age", "tier"],
    "additionalProperties": False,
}


def test_constrained_and_free_requests_share_batches_over_adapters(
    families: dict[str, Family],
) -> None:
    engine, refs = make_engine(families["llama"], max_num_batched_tokens=64)
    compiler = engine.grammars()
    constraints = [
        Constraint("json", json.dumps(SCHEMA)),
        Constraint("regex", "[a-z]{3,6}-[0-9]{2}"),
        Constraint("choice", json.dumps(["alpha", "beta", "gamma"])),
        Constraint("grammar", 'start: ("yes" | "no") " " NUM\nNUM: /[0-9]{1,3}/'),
    ]
    free_names = ["r4", None, "r64", "r16"]
    free = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
            for i in range(4)]  # fmt: skip
    batch = prompts(8, seed=41)
    alone = engine.generate(batch[4:], free, [refs[n] if n else None for n in free_names])

    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=80, grammar=compiler.compile(c))
        for i, c in enumerate(constraints)
    ]
    names = ["r16", "r64", None, "r4", *free_names]
    outs = engine.generate(batch, [*constrained, *free], [refs[n] if n else None for n in names])
    data = json.loads(outs[0].text)
    assert set(data) == {"name", "age", "tier"} and data["tier"] in ("free", "pro")
    assert isinstance(data["age"], int) and 0 <= data["age"] <= 120 and len(data["name"]) <= 6
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", outs[1].text), outs[1].text
    assert outs[2].text in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"(yes|no) [0-9]{1,3}", outs[3].text), outs[3].text
    for out in outs[:4]:
        assert out.finish_reason == "stop" and out.error is None
    # the free requests: token for token what they produced without the constrained ones
    assert [o.token_ids for o in outs[4:]] == [o.token_ids for o in alone]
