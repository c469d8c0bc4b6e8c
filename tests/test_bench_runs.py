"""bench/spec_methods.py's closed loop: at concurrency c, c requests in flight until the last
ones drain, each finished one replaced at once by the next; outputs in prompt order."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from conftest import make_engine, random_prompts

from engine import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _load_spec_methods():
    """bench/spec_methods.py by path, with bench/ on sys.path only while it imports (its
    results_file helper); bench/ left there would shadow packages."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("spec_methods_bench",
                                                      ROOT / "bench/spec_methods.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_the_closed_loop_keeps_c_requests_in_flight_and_returns_outputs_in_order(tiny_model):
    run = _load_spec_methods().run
    engine = make_engine(tiny_model)
    prompts = random_prompts([5, 9, 7, 12, 6, 8, 10], seed=3)
    # unequal lengths: requests finish at different steps, so refills happen mid-run
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (3, 9, 5, 2, 8, 4, 6)]
    in_flight, step = [], engine.step

    def counted_step():
        in_flight.append(engine.num_running + engine.num_waiting)
        return step()

    engine.step = counted_step
    outputs, tokens, seconds = run(engine, prompts, params, 3)
    assert max(in_flight) == 3
    # full until the queue empties: every step before the last admission had 3 in flight
    first_short = next(i for i, n in enumerate(in_flight) if n < 3)
    assert all(n < 3 for n in in_flight[first_short:])
    assert [len(o) for o in outputs] == [3, 9, 5, 2, 8, 4, 6] and tokens == 37 and seconds > 0
    alone = make_engine(tiny_model)
    for prompt, p, out in zip(prompts, params, outputs):
        assert alone.generate([prompt], p)[0].output_token_ids == out
