"""``twin defects`` and ``twin walkthrough``: what the switches are, and the classic wedge."""

from __future__ import annotations

import click

from twin.cli.common import emit_json
from twin.core.defects import CATALOG


@click.command("defects")
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON: the defects (--defect, --scenario-defects), then the fixes (--fix), "
                   "each with its kind.")
def defects_command(as_json: bool) -> None:
    """List the upstream defects the twin can switch back on (--defect) and the proposed
    changes SGLang has not merged that it can switch on (--fix)."""
    from twin.core.fixes import CATALOG as FIXES

    if as_json:
        emit_json([{"kind": "defect", "name": d.name, "side": d.side, "summary": d.summary,
                    "fixed_in": d.fixed_in} for d in CATALOG.values()]
                  + [{"kind": "fix", "name": f.name, "side": f.side, "summary": f.summary,
                      "source": f.source} for f in FIXES.values()])
        return
    click.echo("Defects fixed upstream (--defect NAME switches one back on):")
    for d in CATALOG.values():
        click.echo(f"{d.name}  [{d.side}]")
        click.echo(f"    {d.summary}")
        click.echo(f"    fixed upstream: {d.fixed_in}")
    click.echo("")
    click.echo("Proposed changes SGLang has not merged (--fix NAME switches one on):")
    for f in FIXES.values():
        click.echo(f"{f.name}  [{f.side}]")
        click.echo(f"    {f.summary}")
        click.echo(f"    source: {f.source}")


@click.command("walkthrough")
def walkthrough_command() -> None:
    """The 100-byte ring wedge, step by step, with and without its defect."""
    from twin.core.allocator import StagingAllocator, is_watermark_ready
    from twin.core.defects import STALE_EMPTY_RING_WATERMARK, Defects

    for label, defects in (("pre-fix (stale-empty-ring-watermark on)",
                            Defects.of([STALE_EMPTY_RING_WATERMARK])),
                           ("today's protocol", Defects())):
        ring = StagingAllocator(100, defects)
        click.echo(f"== {label}")
        a, off, rnd = ring.assign(60)  # type: ignore[misc]
        click.echo(f"assign(60) -> alloc {a} at offset {off}, round {rnd}")
        ring.free(a)
        wm = ring.get_watermark()
        click.echo(f"free({a})   -> ring empty, watermark {wm}")
        b, off, rnd = ring.assign(70)  # type: ignore[misc]
        ready = is_watermark_ready(wm, rnd, off + 70)
        click.echo(f"assign(70) -> alloc {b} at offset {off}, round {rnd}, end {off + 70}")
        verdict = "may write" if ready else "waits forever: no live allocation left to free"
        click.echo(f"prefill checks round {rnd} end {off + 70} against {wm}: {verdict}\n")


COMMANDS = [defects_command, walkthrough_command]
