"""How far the tracker lets a route's first hop run ahead of the tokens it has read:
far enough that Extends are rare, never past the generation's last step (a turn that
ends at max_tokens leaves nothing run ahead to cut back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshnet.model.sampling import SamplingParams
from meshnet.tracker.routing.generation import Generation
from meshnet.tracker.routing.relay import _extends, _run_end


def _drive(first_step: int, max_tokens: int) -> tuple[list[int], int]:
    """The run ends the driver sets while reading each step of a generation, as its
    autorun and ring steps do: (every end set, the Extends sent)."""
    gen = Generation("g", (), 0.0, SamplingParams(max_tokens=max_tokens), first_step=first_step)
    link = SimpleNamespace(autorun_until=0)
    ends, extends = [], 0
    for step in range(first_step, first_step + max_tokens):
        if link.autorun_until <= step:
            link.autorun_until = _run_end(gen, step, step)
            ends.append(link.autorun_until)
        elif _extends(gen, link, step):  # type: ignore[arg-type]
            link.autorun_until = _run_end(gen, step, link.autorun_until)
            ends.append(link.autorun_until)
            extends += 1
        assert link.autorun_until > step  # the step read is always in the run
    return ends, extends


@pytest.mark.parametrize("first_step", [0, 7])
@pytest.mark.parametrize("max_tokens", [1, 5, 16, 17, 33, 64, 200])
def test_a_run_covers_the_generation_in_one_start_and_never_passes_its_end(
    first_step: int, max_tokens: int
) -> None:
    ends, extends = _drive(first_step, max_tokens)
    assert ends[-1] == first_step + max_tokens  # no step run past the last
    assert ends == sorted(ends)
    assert len(ends) == extends + 1  # started once
    assert extends <= max_tokens // 16  # an Extend at most every 16 tokens
