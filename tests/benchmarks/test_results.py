"""The bench's table: a target that ran on one backend of several is named under it."""

from __future__ import annotations

from kvroute.benchmarks.results import BackendShare, TargetResult, format_table


def result(target: str, shares: dict[str, float]) -> TargetResult:
    return TargetResult(
        target=target,
        workload="agent-sessions:16",
        requests=128,
        errors=0,
        hit_rate_observed=0.7,
        hit_rate_predicted=None,
        ttft_p50_s=0.06,
        ttft_p99_s=0.1,
        throughput_rps=4.0,
        backend_share={url: BackendShare(requests=share, prompt_tokens=share) for url, share in shares.items()},
    )


def test_a_target_on_one_backend_of_several_is_named() -> None:
    table = format_table(
        [
            result("round_robin", {"http://a": 0.5, "http://b": 0.5}),
            result("peer:sglang-router", {"http://a": 0.0, "http://b": 1.0}),
            result("cache_aware", {"http://a": 0.62, "http://b": 0.38}),
            result("round_robin@one-engine", {"http://a": 1.0}),
        ]
    )
    notes = table.split("one backend", 1)[1].splitlines()[1:]
    assert notes == ["  agent-sessions:16 / peer:sglang-router: 100% of prompt tokens to http://b, one of 2 backends"]


def test_no_note_when_every_target_spreads() -> None:
    assert "one backend" not in format_table([result("round_robin", {"http://a": 0.5, "http://b": 0.5})])
