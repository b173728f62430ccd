"""Small inline SVG charts, drawn on the server: no chart library, no script.

Every value that reaches the markup is a number formatted here or text passed
through :func:`markupsafe.escape`, so a chart cannot carry markup of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

from nmbus.ops.admin import HistoryBucket

BLUE = "#3b6fb6"
RED = "#c8423b"
ORANGE = "#d98a1c"


def _fmt(value: float) -> str:
    return f"{value:.1f}"


def sparkline(buckets: Sequence[HistoryBucket], width: int = 120, height: int = 26) -> Markup:
    """X rows per bucket as thin bars, F rows in red on top; the tallest bar fills the height."""
    if not buckets:
        return Markup("")
    top = max(max(b.processed + b.failed for b in buckets), 1)
    step = width / len(buckets)
    bars = []
    for i, b in enumerate(buckets):
        x = i * step
        done = b.processed / top * (height - 1)
        failed = b.failed / top * (height - 1)
        label = escape(f"{b.start:%H:%M}: {b.processed} processed, {b.failed} failed")
        bars.append(
            f'<g><title>{label}</title><rect x="{_fmt(x)}" y="{_fmt(height - done)}" '
            f'width="{_fmt(max(step - 1, 1))}" height="{_fmt(done)}" fill="{BLUE}"/>'
            f'<rect x="{_fmt(x)}" y="{_fmt(height - done - failed)}" '
            f'width="{_fmt(max(step - 1, 1))}" height="{_fmt(failed)}" fill="{RED}"/></g>'
        )
    return Markup(
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="processed per bucket">{"".join(bars)}</svg>'
    )


def history_chart(buckets: Sequence[HistoryBucket], width: int = 760, height: int = 200) -> Markup:
    """Bars of X (blue) and F (red) rows per bucket, and the p95 latency as an orange line."""
    if not buckets:
        return Markup("")
    left, right, top_pad, bottom = 48, 64, 10, 22
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    top = max(max(b.processed + b.failed for b in buckets), 1)
    slowest = max((b.p95_ms or 0.0 for b in buckets), default=0.0) or 1.0
    step = plot_w / len(buckets)
    parts = [
        f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{left + plot_w}" '
        f'y2="{top_pad + plot_h}" stroke="#999"/>',
        f'<text x="{left - 4}" y="{top_pad + 8}" text-anchor="end">{top}</text>',
        f'<text x="{left - 4}" y="{top_pad + plot_h}" text-anchor="end">0</text>',
        f'<text x="{left + plot_w + 4}" y="{top_pad + 8}" fill="{ORANGE}">'
        f"{escape(f'{slowest:,.0f} ms')}</text>",
        f'<text x="{left}" y="{height - 4}">{escape(f"{buckets[0].start:%H:%M}")}</text>',
        f'<text x="{left + plot_w}" y="{height - 4}" text-anchor="end">'
        f"{escape(f'{buckets[-1].start:%H:%M} UTC')}</text>",
    ]
    points = []
    for i, b in enumerate(buckets):
        x = left + i * step
        done = b.processed / top * plot_h
        failed = b.failed / top * plot_h
        base = top_pad + plot_h
        p95 = "-" if b.p95_ms is None else f"{b.p95_ms:,.1f} ms"
        label = escape(f"{b.start:%H:%M}: {b.processed} processed, {b.failed} failed, p95 {p95}")
        parts.append(
            f"<g><title>{label}</title>"
            f'<rect x="{_fmt(x)}" y="{_fmt(base - plot_h)}" width="{_fmt(step)}" '
            f'height="{_fmt(plot_h)}" fill="transparent"/>'
            f'<rect x="{_fmt(x)}" y="{_fmt(base - done)}" width="{_fmt(max(step - 1, 1))}" '
            f'height="{_fmt(done)}" fill="{BLUE}"/>'
            f'<rect x="{_fmt(x)}" y="{_fmt(base - done - failed)}" '
            f'width="{_fmt(max(step - 1, 1))}" height="{_fmt(failed)}" fill="{RED}"/></g>'
        )
        if b.p95_ms is not None:
            y = base - b.p95_ms / slowest * plot_h
            points.append(f"{_fmt(x + step / 2)},{_fmt(y)}")
    if points:
        parts.append(
            f'<polyline points="{" ".join(points)}" fill="none" stroke="{ORANGE}" '
            'stroke-width="2"/>'
        )
    return Markup(
        f'<svg class="history" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="processed and failed per bucket, p95 latency">{"".join(parts)}</svg>'
    )
