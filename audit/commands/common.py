"""What the commands share: the one-line error exit, the settings and check plan their options
make, and the scan pipeline behind scan, check, snapshot, diff and purge."""

from __future__ import annotations

import time

import typer

from audit.commands import STARTED
from audit.commands.options import (block_table_options, connection_options, key_options, model_options, pick,
                                    progress_option, read_options, report_options, scale_options, tenant_options)
from audit.connection import Settings
from audit.errors import AuditError
from audit.report import FORMATS, make_sink
from audit.report.inert import printable
from audit.run.progress import ScanProgress


def fail(message: str, code: int = 2) -> typer.Exit:
    """One line on stderr, no traceback."""
    typer.echo(f"mooncake-audit: error: {printable(message, 400)}", err=True)
    return typer.Exit(code)


def check_choice(name: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise fail(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def resolve_settings(master, metadata, admin, protocol, device_name, local_hostname, config) -> Settings:
    check_choice("--protocol", protocol, ("tcp", "rdma"))
    return Settings.resolve(master=master, metadata=metadata, admin=admin, protocol=protocol,
                            device_name=device_name, local_hostname=local_hostname, config=config)


def serve_flags(tp_size=None, dtype=None, state_dtype=None, ssm_dtype=None, block_size=None, kv_cache_dtype=None,
                vllm_config=None) -> dict:
    """The operator's vLLM flags as `load_layouts` takes them: the command line over --vllm-config."""
    from audit.layouts.model import LayoutError
    from audit.layouts.serve_flags import ServeFlags, read_serve_config

    flags = ServeFlags.given(model_dtype=dtype, kv_cache_dtype=kv_cache_dtype, state_dtype=state_dtype,
                             ssm_dtype=ssm_dtype, block_size=block_size, tp_size=tp_size)
    if vllm_config is not None:
        try:
            flags = flags.over(read_serve_config(vllm_config))
        except LayoutError as error:
            raise AuditError(str(error)) from None
    return {"model_dtype": flags.model_dtype, "kv_cache_dtype": flags.kv_cache_dtype,
            "state_dtype": flags.state_dtype, "ssm_dtype": flags.ssm_dtype, "block_size": flags.block_size,
            "tp_size": flags.tp_size or 1, "tp_given": flags.tp_size is not None}


def _vllm_version(value: str | None) -> str | None:
    from audit.layouts.model import LayoutError
    from audit.layouts.versions import vllm_version

    try:
        return vllm_version(value)
    except LayoutError as error:
        raise fail(f"--vllm-version: {error}") from None


def model_layouts(model_config, model, conv_layout, layout, kernel_block_size=None, platform=None, vllm_version=None,
                  **flags):
    from audit.judge.plan import load_layouts
    from audit.layouts.versions import PLATFORMS

    check_choice("--conv-layout", conv_layout, ("SD", "DS"))
    check_choice("--platform", platform, PLATFORMS)
    return load_layouts(model_configs=model_config or (), layout_files=layout or (), model_name=model,
                        conv_layout=conv_layout, kernel_block_size=kernel_block_size, platform=platform,
                        vllm_version=_vllm_version(vllm_version), **serve_flags(**flags))


def check_plan(model_config, model, conv_layout, layout, layout_for_all, block_tables=None, lenient=False,
               include_all=False, **layout_options):
    from audit.blocktables import read_block_tables
    from audit.judge.binding import Bindings
    from audit.judge.plan import CheckPlan

    layouts = model_layouts(model_config, model, conv_layout, layout, **layout_options)
    tables = read_block_tables(block_tables, lenient=lenient) if block_tables else None
    plan = CheckPlan(layouts=layouts, layout_for_all=layout_for_all, tables=tables, keep_regions=include_all,
                     bindings=Bindings.of(model_config or (), model))
    if block_tables:  # the recorder's manifests beside its records: the producer's own layouts
        plan.use_manifests(block_tables)
    if plan.manifests is not None and plan.bindings.directories:  # and the weights each producer loaded
        from audit.judge.fingerprints import ProducerWeights

        plan.bindings.producers = ProducerWeights.compare(plan.manifests, plan.bindings.directories)
    if block_tables and plan.bindings.directories:  # and the tokens each chunk hash names
        from audit.prefixtable import read_prefix_records

        plan.bindings.prefixes = read_prefix_records(block_tables)
    return plan


def scan_report(options: dict, include_all: bool, progress, sink, phases=None, **scan_options):
    """The pipeline every scanning command shares: the connection, model and block-table options in
    `options`, the scan's own in `scan_options`; report out (AuditError on failure). `phases`
    (--verbose): an audit.run.phases.Phases the run adds its seconds to."""
    planning = time.perf_counter()
    from audit.run.device import resolve_placement
    from audit.run.orchestrator import ScanOptions, run_scan
    from audit.sources.selection import parse_sample

    scan_options["placement"] = resolve_placement(scan_options.pop("device", "cpu"), scan_options.pop("checker", None),
                                                  scan_options.get("read_mode", "lease"))
    scan_options["sample"] = parse_sample(scan_options.get("sample"))
    settings = resolve_settings(**pick(options, connection_options))
    plan = check_plan(**pick(options, model_options, block_table_options), include_all=include_all)
    tenants = {name: tuple(value or ()) for name, value in pick(options, tenant_options).items()}
    if phases is not None:
        phases.add("layouts, block tables, scan imports", time.perf_counter() - planning)
    return run_scan(settings, ScanOptions(plan=plan, **scan_options, **pick(options, scale_options), **tenants),
                    sink(), ScanProgress(progress), phases=phases)


def scan_and_exit(options: dict, verbose: bool = False, **scan_options):
    """The body `scan` and `check` share: run, exit with the report's code (and with --verbose, the
    seconds of each phase on stderr)."""
    phases = None
    if verbose:
        from audit.run.phases import Phases

        phases = Phases(cli_started=STARTED)
    report_values = pick(options, report_options, progress_option)
    fmt, output, include_all = report_values["fmt"], report_values["output"], report_values["include_all"]
    check_choice("--format", fmt, FORMATS)
    check_choice("--read-mode", scan_options.get("read_mode"), ("lease", "peek"))
    check_choice("--fail-on", scan_options.get("fail_on"), ("error", "warning"))
    if scan_options.get("resume") and scan_options.get("checkpoint") is None:
        raise fail("--resume needs --checkpoint PATH")
    try:
        report = scan_report(options, include_all, report_values["progress"],
                             lambda: make_sink(fmt, output, include_all=include_all), phases=phases,
                             **pick(options, key_options, read_options), **scan_options)
    except AuditError as error:
        raise fail(str(error)) from None
    finally:
        if phases is not None:
            typer.echo("\n".join(f"phase: {line}" for line in phases.lines()), err=True)
    raise typer.Exit(report.exit_code)
