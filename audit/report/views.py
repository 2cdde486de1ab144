"""Human views of the single-object commands: `layout` and `explain`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from audit.layouts import Layout, describe, summarize
from audit.report.inert import inert


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False, width=160)


def print_layouts(layouts: list[Layout], source_of=None) -> None:
    """`source_of(layout)`: the manifest a layout came from (audit.layouts.manifest), or None."""
    console = _console()
    for layout in layouts:
        console.print(summarize(layout), markup=False)
        if source_of is not None and (path := source_of(layout)) is not None:
            console.print(inert(f"from the producer's manifest {path}"))
        table = Table(show_lines=False)
        for column in ("segment", "layer", "region", "kind", "offset", "length", "dtype", "shape"):
            table.add_column(column, justify="right" if column in ("layer", "offset", "length") else "left")
        for row in describe(layout):
            table.add_row(row["segment"], str(row["layer"]), row["region"], row["kind"], f"{row['offset']:,}",
                          f"{row['length']:,}", row["dtype"], "x".join(map(str, row["shape"])))
        console.print(table)


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def print_explain(document: dict) -> None:
    console = _console()
    console.print(inert(document["key"], limit=4096))
    console.print(f"size {document['size']}  xxh3 {document['xxh3']}  zero {document['zero']}  "
                  f"verdicts {', '.join(document['verdicts']) or 'OK'}", markup=False)
    if document.get("layout"):
        console.print(f"layout {document['layout']}", markup=False)
    for row in document.get("layout_inference") or []:
        if row.get("manifest"):
            console.print(inert(f"layout {row['status']}: {row['from']} {row['manifest']}"))
            continue
        chosen = row.get("bytes") or {}
        console.print(inert(f"layout {row['status']}: group {row['group']}, {row['from']}"
                            + (f"; the bytes: {chosen['rule']}" if chosen.get("rule") else "")))
        for candidate in row.get("candidates") or ():
            settings = " ".join(f"{name}={value}" for name, value in candidate["assumed"].items())
            console.print(inert(f"  candidate: {settings}; padding {candidate['padding_bytes']:,} B"))
        if row.get("settle_with"):
            console.print(inert(f"  settle with {' or '.join(row['settle_with'])}"))
    table = Table(show_lines=False)
    for column in ("segment", "region", "dtype", "offset", "length", "zero", "nan", "inf", "xxh3",
                   "min", "max", "mean", "first bytes"):
        table.add_column(column)
    for region in document.get("regions") or []:
        stats = region.get("stats") or {}
        table.add_row(inert(region["segment"]), inert(region["region"]), region["dtype"], str(region["offset"]),
                      str(region["length"]), "yes" if region["zero"] else "no", str(region["nan"]),
                      str(region["inf"]), region["xxh3"], _number(stats.get("min")), _number(stats.get("max")),
                      _number(stats.get("mean")), region.get("hexdump", "")[:47])
    console.print(table)
    records = document.get("block_table_records") or []
    if not records:
        console.print("block tables: no record names this key", markup=False)
    for record in records:
        console.print(f"block table: block_ids {record['block_ids'][:16]} from {', '.join(record['sources'][:3])}",
                      markup=False)
    for name, evidence in document.get("evidence", {}).items():
        console.print(inert(f"evidence {name}: {evidence}", limit=400))
