"""The figures a serving run is compared on, computed once from an engine report and rendered the same way by
``memplan run``'s report (executor.run_report) and the serving benchmark (bench/serve.py).

- requests: those the engine ran (rejected ones are left out); prompt and output tokens are theirs;
- wall: the engine run's wall time, from its start (before the first arrival) to its last read-back;
- output tokens/s = output tokens / wall; total tokens/s = (prompt + output tokens) / wall (every prompt token
  counts, also one the prefix cache held); requests/s = requests / wall;
- TTFT: a request's first token time less its arrival time (queueing included), per request;
- TPOT: a request's mean gap between its tokens after the first (its last token time less its first, over its
  tokens less one), per request of two or more tokens (vLLM's time per output token);
- ITL: the gaps between a request's consecutive tokens, pooled over the requests (vLLM's inter-token latency):
  a step that stalls decode rows shows in its tail, where a request's TPOT averages it with the others;
- percentiles: ``percentile_ms`` (inclusive quantiles), in ms; None without samples.

``ServingFigures.of`` reads an engine report; ``from_samples`` takes the same counts and latency samples from
any engine (the benchmark's HF transformers run), so both render alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from executor.scheduler import FINISH_REJECTED

if TYPE_CHECKING:
    from executor.engine import EngineReport

#: The columns ``ServingFigures.markdown_cells`` fills, in order.
MARKDOWN_HEADERS = ("requests", "output tok/s", "total tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
                    "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "wall s")


@dataclass(frozen=True)
class ServingFigures:
    """Throughput and latency of one engine run (see the module docstring)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    itl_ms_p50: float | None
    itl_ms_p99: float | None
    ttft_samples: int
    tpot_samples: int
    itl_samples: int

    @classmethod
    def of(cls, report: EngineReport) -> ServingFigures:
        ran = [r for r in report.results if r.finish_reason != FINISH_REJECTED]
        return cls.from_samples(len(ran), sum(r.prompt_len for r in ran), sum(len(r.output_ids) for r in ran),
                                report.wall_s, report.ttfts, report.tpots, report.itls)

    @classmethod
    def from_samples(cls, requests: int, prompt_tokens: int, output_tokens: int, wall_s: float,
                     ttfts_s: Sequence[float], tpots_s: Sequence[float], itls_s: Sequence[float]) -> ServingFigures:
        """The figures of ``requests`` that ran in ``wall_s``, from their TTFTs, TPOTs and token gaps in seconds."""

        def percentile(values: Sequence[float], q: int) -> float | None:
            return percentile_ms(values, q) if values else None

        return cls(requests, prompt_tokens, output_tokens, wall_s, percentile(ttfts_s, 50), percentile(ttfts_s, 99),
                   percentile(tpots_s, 50), percentile(tpots_s, 99), percentile(itls_s, 50), percentile(itls_s, 99),
                   len(ttfts_s), len(tpots_s), len(itls_s))

    def _per_s(self, count: int) -> float:
        return count / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def output_tokens_per_s(self) -> float:
        return self._per_s(self.output_tokens)

    @property
    def total_tokens_per_s(self) -> float:
        return self._per_s(self.prompt_tokens + self.output_tokens)

    @property
    def requests_per_s(self) -> float:
        return self._per_s(self.requests)

    def lines(self) -> list[str]:
        """The throughput line, then the TTFT, TPOT and ITL lines."""
        return [f"throughput: {self.output_tokens_per_s:,.1f} output tokens/s, {self.total_tokens_per_s:,.1f} total "
                f"tokens/s, {self.requests_per_s:,.2f} requests/s ({self.requests} requests, "
                f"{self.prompt_tokens:,} prompt + {self.output_tokens:,} output tokens in {self.wall_s:.3f} s)",
                f"TTFT: {_percentiles(self.ttft_ms_p50, self.ttft_ms_p99, self.ttft_samples)}",
                f"TPOT: {_percentiles(self.tpot_ms_p50, self.tpot_ms_p99, self.tpot_samples, 'requests')}",
                f"ITL: {_percentiles(self.itl_ms_p50, self.itl_ms_p99, self.itl_samples, 'gaps')}"]

    def markdown_cells(self) -> list[str]:
        """The MARKDOWN_HEADERS cells."""
        return [f"{self.requests:,}", _number(self.output_tokens_per_s, 1), _number(self.total_tokens_per_s, 1),
                _number(self.requests_per_s, 2), _number(self.ttft_ms_p50, 1), _number(self.ttft_ms_p99, 1),
                _number(self.tpot_ms_p50, 2), _number(self.tpot_ms_p99, 2), _number(self.itl_ms_p50, 2),
                _number(self.itl_ms_p99, 2), _number(self.wall_s, 2)]

    def markdown_row(self, leading: Sequence[str] = (), trailing: Sequence[str] = ()) -> str:
        """A markdown table row: ``leading`` cells, the MARKDOWN_HEADERS cells, ``trailing`` cells."""
        return markdown_line([*leading, *self.markdown_cells(), *trailing])


def request_tpot_s(token_times_s: Sequence[float]) -> float | None:
    """A request's TPOT from its token times: its mean gap after the first token; None below two tokens."""
    if len(token_times_s) < 2:
        return None
    return (token_times_s[-1] - token_times_s[0]) / (len(token_times_s) - 1)


def token_gaps_s(token_times_s: Sequence[float]) -> list[float]:
    """A request's ITL samples from its token times: the gaps between consecutive tokens."""
    return [later - earlier for earlier, later in zip(token_times_s, token_times_s[1:])]


def percentile_ms(values_s: Sequence[float], q: int) -> float:
    """The ``q``-th percentile (1-99) of ``values_s`` in ms: inclusive quantiles (linear interpolation at
    q x (n - 1) / 100 of the sorted values); one value is itself, none is NaN."""
    if len(values_s) > 1:
        return 1e3 * statistics.quantiles(values_s, n=100, method="inclusive")[q - 1]
    return 1e3 * values_s[0] if values_s else math.nan


def markdown_header(leading: Sequence[str] = (), trailing: Sequence[str] = ()) -> str:
    """The header and alignment lines of a table of ``markdown_row``s: ``leading`` columns left-aligned, the
    figures' and ``trailing`` ones right-aligned."""
    headers = [*leading, *MARKDOWN_HEADERS, *trailing]
    return "\n".join([markdown_line(headers),
                      markdown_line(["---"] * len(leading) + ["---:"] * (len(headers) - len(leading)))])


def markdown_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _number(value: float | None, digits: int) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def _percentiles(p50: float | None, p99: float | None, samples: int, unit: str = "samples") -> str:
    if p50 is None or p99 is None:
        return f"n/a (no {unit})"
    return f"p50 {p50:,.3f} ms, p99 {p99:,.3f} ms ({samples} {unit})"
