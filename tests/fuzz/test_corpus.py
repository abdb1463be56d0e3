"""The fixed corpus of bad inputs (tests/fuzz/corpus.py), every case built at test time in its own folder:
each ends with exit 0/2/3, no traceback, one line naming the file or field (or a rejected request's line
naming it), and every file of the folder (inputs, an existing --out) untouched on failure.

CI runs the cases that stop before the simulator (planner and readers, in-process) and a handful of
``memplan run`` cases; ``python3 -m tests.fuzz.corpus`` runs them all and prints the counts by class."""

from __future__ import annotations

import pytest

from tests.fuzz.corpus import Case, cases, run_case

#: The simulator cases CI runs: one of each kind of refusal before the device is touched, and a file of
#: bad request lines that are each rejected in their own line.
SIM_CASES = (
    "run bfloat16 activations, float32 KV, prompt 3",
    "request seed=18446744073709551616",
    "request top_k=4294967297",
    "--prompt-ids max_new_tokens over max_context",
    "flag --prompt-len 10**13",
    "flag --seed -1",
    "run --out into a missing folder",
    "run --out equal to --requests",
    "checkpoint truncated in the data",
    "checkpoint with a int64 tensor",
    "checkpoint with a tensor in two shards",
    "run --plan: non-UTF-8 bytes",
)

ALL = cases()
SELECTED = [case for case in ALL if not case.sim or case.name in SIM_CASES]


def test_the_corpus_holds_250_bad_inputs_over_the_seven_classes():
    bad = [case for case in ALL if case.bad]
    assert len(bad) >= 250
    assert {case.klass for case in bad} == set(range(1, 8))
    assert len({case.name for case in ALL}) == len(ALL)
    assert set(SIM_CASES) <= {case.name for case in ALL}


@pytest.mark.parametrize("case", SELECTED, ids=[f"{case.klass}-{case.name}" for case in SELECTED])
def test_case_is_refused_clearly_and_loses_nothing(case: Case, tmp_path):
    outcome = run_case(case, tmp_path, timeout_s=120)
    assert outcome.kind == "ok", f"{outcome.kind}: {outcome.detail}"
