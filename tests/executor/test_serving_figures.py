"""ServingFigures from an engine report built by hand: counts, rates and percentiles against values worked out
here, the rejected request left out, and the rendered lines and markdown row."""

from __future__ import annotations

from executor.engine import EngineReport, RequestResult
from executor.scheduler import SchedulerStats
from executor.serving_figures import MARKDOWN_HEADERS, ServingFigures, markdown_header


def _report() -> EngineReport:
    results = [
        # arrives at 0.5 s, tokens at 1.0, 1.5, 2.5 s: TTFT 0.5 s, gaps 0.5 and 1.0 s
        RequestResult(0, 10, [1, 2, 3], "length", None, 0.5, [1.0, 1.5, 2.5]),
        # arrives at 0, tokens at 2.0 and 2.25 s: TTFT 2.0 s, gap 0.25 s
        RequestResult(1, 6, [4, 5], "length", None, 0.0, [2.0, 2.25]),
        RequestResult(2, 99, [], "rejected", "context: too long", 0.0, []),
    ]
    stats = SchedulerStats(steps=4, admitted=2, finished=2, rejected=1, preemptions=0, peak_kv_pages_used=3,
                           peak_logical_pages=3, peak_slots_used=0, peak_running=2, kv_pages_usable=10,
                           recurrent_slots=0, prefix_hit_tokens=0, prefix_query_tokens=0, prefix_evictions=0)
    return EngineReport(results, stats, prefix_caching=True, overlap=True, steps=4, wall_s=4.0,
                        allocations_after_warmup=None)


def test_figures_count_the_requests_that_ran():
    figures = ServingFigures.of(_report())
    assert (figures.requests, figures.prompt_tokens, figures.output_tokens) == (2, 16, 5)
    assert (figures.output_tokens_per_s, figures.total_tokens_per_s, figures.requests_per_s) == (1.25, 5.25, 0.5)
    # Inclusive quantiles interpolate at position q x (n - 1) of the sorted values.
    # TTFTs 0.5 and 2.0 s: p50 at 0.5, the mean; p99 at 0.99: 0.5 + 0.99 x 1.5.
    assert figures.ttft_ms_p50 == 1250.0 and abs(figures.ttft_ms_p99 - 1985.0) < 1e-9
    # A request's TPOT: (last token - first) / (tokens - 1): 1.5 / 2 = 0.75 s and 0.25 / 1 = 0.25 s;
    # p50 the mean, p99 0.25 + 0.99 x 0.5.
    assert figures.tpot_ms_p50 == 500.0 and abs(figures.tpot_ms_p99 - 745.0) < 1e-9
    # Gaps 0.25, 0.5, 1.0 s (the first token's wait is TTFT, not a gap): p50 at 1: 0.5 s; p99 at 1.98: 0.5 + 0.98 x 0.5.
    assert figures.itl_ms_p50 == 500.0 and abs(figures.itl_ms_p99 - 990.0) < 1e-9
    assert (figures.ttft_samples, figures.tpot_samples, figures.itl_samples) == (2, 2, 3)


def test_figures_render_as_lines_and_a_markdown_row():
    figures = ServingFigures.of(_report())
    throughput, ttft, tpot, itl = figures.lines()
    assert throughput == ("throughput: 1.2 output tokens/s, 5.2 total tokens/s, 0.50 requests/s (2 requests, "
                          "16 prompt + 5 output tokens in 4.000 s)")
    assert ttft == "TTFT: p50 1,250.000 ms, p99 1,985.000 ms (2 samples)"
    assert tpot == "TPOT: p50 500.000 ms, p99 745.000 ms (2 requests)"
    assert itl == "ITL: p50 500.000 ms, p99 990.000 ms (3 gaps)"
    header = markdown_header(["model"], ["ideal s"]).splitlines()
    assert header[0] == "| model | " + " | ".join(MARKDOWN_HEADERS) + " | ideal s |"
    assert header[1].count("---:") == len(MARKDOWN_HEADERS) + 1
    assert figures.markdown_row(["tiny"], ["1.00"]) == (
        "| tiny | 2 | 1.2 | 5.2 | 0.50 | 1,250.0 | 1,985.0 | 500.00 | 745.00 | 500.00 | 990.00 | 4.00 | 1.00 |")


def test_figures_from_samples_match_the_engine_reports():
    """Another engine's counts and samples (the benchmark's HF run) give the same figures as the report's."""
    assert (ServingFigures.from_samples(2, 16, 5, 4.0, [0.5, 2.0], [0.75, 0.25], [0.25, 0.5, 1.0])
            == ServingFigures.of(_report()))
    one = ServingFigures.from_samples(1, 3, 1, 2.0, [0.125], [], [])
    assert (one.ttft_ms_p50, one.ttft_ms_p99, one.tpot_ms_p50, one.tpot_samples) == (125.0, 125.0, None, 0)
    assert one.markdown_cells()[6:10] == ["n/a"] * 4
