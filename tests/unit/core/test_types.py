"""The records' own rules: which termination causes remove a replica's row."""

from __future__ import annotations

from fleetserve.core.types import TerminationCause, deletes_row


def test_only_failures_and_preemptions_keep_their_rows() -> None:
    kept = {c for c in TerminationCause if not deletes_row(c)}
    assert kept == {TerminationCause.FAILURE, TerminationCause.PREEMPTION}
    assert deletes_row(TerminationCause.HOST_LOST)  # its processes are orphans elsewhere
    assert not deletes_row(None)  # a replica not being stopped keeps its row


def test_the_causes_are_the_words_stored_in_the_column() -> None:
    # replicas.termination_cause is String(16); migration 0009 writes these words.
    assert {c.value for c in TerminationCause} == {
        "scale_down",
        "rollout",
        "user",
        "service_down",
        "host_lost",
        "failure",
        "preemption",
    }
    assert max(len(c.value) for c in TerminationCause) <= 16
