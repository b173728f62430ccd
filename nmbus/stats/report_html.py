"""Render the statistics summary as one self-contained HTML page.

No network, no external files: the figures are embedded as JSON and drawn as
inline SVG by a small script in the page. When every chart is drawn the page
sets ``data-charts-rendered="<n>"`` on ``<html>``; any script error sets
``data-script-errors``. Tests and people check those two attributes.

Standard library only, so the job can run where nmbus is not installed.
"""

from __future__ import annotations

import html
import json
import math
import re
from datetime import UTC, datetime
from typing import Any

from . import report_page

# A queue is "failing" at or above FAIL_RED, "degraded" at or above FAIL_AMBER.
FAIL_RED = 0.05
FAIL_AMBER = 0.01


# The failure-rate bar is on a log scale: empty at 0, a sliver below BAR_FLOOR, then
# a quarter of the bar for each tenfold up to full at 100 %. A linear bar is either
# full for every queue worth a look (0.1 % already) or invisible for most.
BAR_FLOOR = 0.0001
BAR_SLIVER = 2.0


def failure_bar(rate: float | None) -> float:
    """The width, in percent of the bar, that draws failure rate ``rate`` (0 to 1)."""
    if not rate or rate <= 0:
        return 0.0
    share = math.log10(min(rate, 1.0) / BAR_FLOOR) / -math.log10(BAR_FLOOR)
    return max(BAR_SLIVER, min(100.0, 100.0 * share))


def status(metrics: dict[str, Any]) -> str:
    """ok / degraded / failing / idle, from the failure rate of a queue or the bus."""
    rate = metrics.get("failure_rate")
    if not metrics.get("total"):
        return "idle"
    if rate is not None and rate >= FAIL_RED:
        return "failing"
    if rate is not None and rate >= FAIL_AMBER:
        return "degraded"
    return "ok"


def top_failed_error(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The error with the most failed messages; None when every errored message recovered."""
    failed = [e for e in summary.get("top_errors", []) if e.get("failed")]
    return max(failed, key=lambda e: e["failed"]) if failed else None


def failed_card_status(summary: dict[str, Any]) -> str:
    """The FAILED card's colour: the worst queue's, as the banner says, once anything failed."""
    if not summary["overall"].get("failed"):
        return status(summary["overall"])
    worst = {status(q) for q in summary["queues"]} | {status(summary["overall"])}
    return next((x for x in ("failing", "degraded") if x in worst), "ok")


def window_sentence(summary: dict[str, Any]) -> str:
    """How the charts are cut, in words: ``one point per minute (chosen from the data)``."""
    window = summary.get("window") or "hour"
    chosen = " (from the data's time span)" if summary.get("window_chosen") else ""
    return f"one point per {window}{chosen}"


def when(value: Any) -> str:
    """An ISO 8601 time as ``2024-03-01 09:40:00`` in UTC, to the second; other text as is."""
    if not isinstance(value, str):
        return "" if value is None else str(value)
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def thresholds_sentence() -> str:
    """When a queue needs attention, in words (the banner's and the cards' colours)."""
    return (
        f"a queue needs attention when {FAIL_AMBER:.0%} or more of its messages fail "
        f"(degraded), {FAIL_RED:.0%} or more (failing)"
    )


def _n(value: Any) -> str:
    return "–" if value is None else f"{value:,}"


def _pct(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value * 100:.2f}%" if value < 0.1 else f"{value * 100:.1f}%"


def _ms(value: Any) -> str:
    if value is None:
        return "–"
    if value >= 60_000:
        return f"{value / 60_000:.1f} min"
    if value >= 1000:
        return f"{value / 1000:.2f} s"
    if value >= 10:
        return f"{value:.0f} ms"
    return f"{value:.2f} ms"


def _rate(value: Any) -> str:
    if value is None:
        return "–"
    if value >= 1:
        return f"{value:,.1f}/s"
    return f"{value * 60:,.1f}/min"


def _e(text: Any) -> str:
    return html.escape("" if text is None else str(text))


def _card(title: str, value: str, sub: str = "", cls: str = "") -> str:
    return (
        f'<div class="card {cls}"><div class="k">{_e(title)}</div>'
        f'<div class="v">{_e(value)}</div><div class="s">{_e(sub)}</div></div>'
    )


def _queue_rows(summary: dict[str, Any]) -> str:
    rows = []
    for q in summary["queues"]:
        st = status(q)
        ql, el = q["queue_latency_ms"], q["e2e_latency_ms"]
        rows.append(
            "<tr>"
            f'<td><span class="dot {st}" title="{st}"></span>{_e(q["queue"])}</td>'
            f'<td class="num">{_n(q["processed"])}</td>'
            f'<td class="num">{_n(q["failed"])}</td>'
            f'<td class="num"><span class="bar"><i class="{st}" '
            f'style="width:{failure_bar(q.get("failure_rate")):.1f}%"></i></span>'
            f"{_pct(q.get('failure_rate'))}</td>"
            f'<td class="num">{_rate(q.get("throughput_per_s"))}</td>'
            f'<td class="num">{_ms(ql["p50"])}</td><td class="num">{_ms(ql["p95"])}</td>'
            f'<td class="num"><b>{_ms(ql["p99"])}</b></td><td class="num">{_ms(ql["max"])}</td>'
            f'<td class="num">{_ms(el["p95"])}</td>'
            f'<td class="spark" data-queue="{_e(q["queue"])}"></td>'
            "</tr>"
        )
    if not rows:
        rows.append('<tr><td colspan="11" class="empty">no queues found</td></tr>')
    return "\n".join(rows)


def _error_rows(summary: dict[str, Any]) -> str:
    rows = []
    for err in summary["top_errors"]:
        rows.append(
            "<tr>"
            f'<td class="err" title="e.g. {_e(err.get("example") or err["error"])}">'
            f"{_e(err['error'])}</td><td>{_e(err['queue'])}</td>"
            f'<td>{_e(err["label"])}</td><td class="num">{_n(err["failed"])}</td>'
            f'<td class="num">{_n(err["recovered"])}</td>'
            f'<td class="num">{_e(err["example_id"])}</td>'
            "</tr>"
        )
    if not rows:
        rows.append('<tr><td colspan="6" class="empty">no errors recorded</td></tr>')
    return "\n".join(rows)


def _version_rows(summary: dict[str, Any]) -> str:
    rows = []
    for q in summary["queues"]:
        for v in q.get("versions", []):
            version = v["version"]
            rows.append(
                "<tr>"
                f"<td>{_e(q['queue'])}</td><td>{_e(v['label'])}</td>"
                f'<td class="num">{_e(version if version is not None else "not a version")}</td>'
                f'<td class="num">{_n(v["processed"])}</td>'
                f'<td class="num">{_n(v["failed"])}</td>'
                "</tr>"
            )
    if not rows:
        rows.append('<tr><td colspan="5" class="empty">no messages</td></tr>')
    return "\n".join(rows)


def _queue_panels(summary: dict[str, Any]) -> str:
    panels = []
    for q in summary["queues"]:
        name = _e(q["queue"])
        panels.append(
            f'<div class="panel"><h3><span class="dot {status(q)}"></span>{name}</h3>'
            f'<div class="chart" data-kind="latency" data-queue="{name}"></div>'
            f'<div class="chart" data-kind="throughput" data-queue="{name}"></div></div>'
        )
    return "\n".join(panels)


def render(summary: dict[str, Any]) -> str:
    """The report page for ``summary`` (the structure written to summary.json)."""
    o = summary["overall"]
    ql, el = o["queue_latency_ms"], o["e2e_latency_ms"]
    st = status(o)
    queues = summary["queues"]
    bad = [q["queue"] for q in queues if status(q) in ("failing", "degraded")]
    # The banner takes the colour of the worst queue: one failing queue is news.
    worst = {status(q) for q in queues}
    banner = next((x for x in ("failing", "degraded") if x in worst), st)
    if not o.get("total"):
        verdict = "No processed or failed messages in this range."
    elif bad:
        verdict = f"{len(bad)} of {len(queues)} queue(s) need attention: {', '.join(bad)}."
    else:
        verdict = f"All {len(queues)} queue(s) healthy."
    top = top_failed_error(summary)
    recovered = sum(e["recovered"] for e in summary["top_errors"])
    ends = [summary.get("since") or o.get("first_time"), summary.get("until")]
    if not summary.get("until"):
        ends[1] = o.get("last_time")
    span = " → ".join(when(x) for x in ends if x)
    span = f"{span} UTC" if span else span
    cards = "".join(
        [
            _card("Processed", _n(o["processed"]), f"{len(queues)} queue(s)"),
            _card(
                "Failed",
                _n(o["failed"]),
                f"failure rate {_pct(o.get('failure_rate'))}",
                failed_card_status(summary),
            ),
            _card("Throughput", _rate(o.get("throughput_per_s")), "processed, whole range"),
            _card(
                "Queue latency p99",
                _ms(ql["p99"]),
                f"p50 {_ms(ql['p50'])} · p95 {_ms(ql['p95'])} · max {_ms(ql['max'])}",
            ),
            _card(
                "End-to-end p99",
                _ms(el["p99"]),
                f"p50 {_ms(el['p50'])} · p95 {_ms(el['p95'])} · mean {_ms(el['mean'])}",
            ),
            _card(
                "Top error",
                f"{_n(top['failed'])} failed" if top else "none",
                top["error"][:70]
                if top
                else (f"{_n(recovered)} errored, all recovered" if recovered else ""),
                "failing" if top else "ok" if o.get("total") else "",
            ),
        ]
    )
    pct = summary.get("percentiles", {})
    data = json.dumps(summary, separators=(",", ":")).replace("</", "<\\/")
    values = {
        "TITLE": _e(summary.get("title", "nmbus report")),
        "STATUS": banner,
        "VERDICT": _e(verdict),
        "RANGE": _e(span or "no data"),
        "WINDOW": _e(window_sentence(summary)),
        "SOURCE": _e(f"{summary['source']['database']} · schema {summary['source']['schema']}"),
        "GENERATED": _e(
            f"{when(summary['generated_at'])} UTC" if summary.get("generated_at") else "–"
        ),
        "THRESHOLDS": _e(thresholds_sentence()),
        "CARDS": cards,
        "QUEUE_ROWS": _queue_rows(summary),
        "PANELS": _queue_panels(summary),
        "ERROR_ROWS": _error_rows(summary),
        "VERSION_ROWS": _version_rows(summary),
        "PCT_NOTE": _e(
            f"Percentiles: Spark percentile_approx, accuracy {pct.get('accuracy')}; "
            f"rank error at most {pct.get('rank_error')} of n values. Latencies over "
            "processed messages; queue latency = last_processed − retry_time, "
            "end-to-end = last_processed − insert_time. Times in UTC."
        ),
        "DATA": data,
        "SCRIPT": report_page.SCRIPT,
    }
    # One pass, so text from the data can never be taken for a placeholder.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], report_page.TEMPLATE)


_PLACEHOLDER = re.compile(r"%([A-Z_]+)%")
