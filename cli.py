"""`mooncake-audit`: the command line. Parses options, calls `audit`, picks the output; nothing else."""

from __future__ import annotations

import time as _time

_STARTED = _time.perf_counter()  # the CLI's earliest timestamp: --verbose counts the imports from here

import inspect
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.commands.impact import impact_command
from audit.connection import Settings
from audit.errors import AuditError
from audit.run.collector import tune_for_scanning
from audit.run.progress import ScanProgress
from audit.report import FORMATS, make_sink
from audit.report.inert import printable

app = typer.Typer(help="Byte-level audit of the values published into Mooncake Store.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        from audit import __version__

        typer.echo(f"mooncake-audit {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                   help="Print the version and exit.")] = False) -> None:
    """Byte-level audit of the values published into Mooncake Store."""

# Connection
Master = Annotated[Optional[str], typer.Option("--master", envvar="MOONCAKE_AUDIT_MASTER",
                                              help="Master RPC address HOST:PORT.", show_default="127.0.0.1:50051")]
Metadata = Annotated[Optional[str], typer.Option("--metadata", envvar="MOONCAKE_AUDIT_METADATA",
                                                help="Metadata server URL.",
                                                show_default="http://<master host>:8080/metadata")]
Admin = Annotated[Optional[str], typer.Option("--admin", envvar="MOONCAKE_AUDIT_ADMIN",
                                             help="Master admin HTTP URL.", show_default="http://<master host>:9003")]
Protocol = Annotated[Optional[str], typer.Option("--protocol", envvar="MOONCAKE_AUDIT_PROTOCOL",
                                                help="Transfer protocol: tcp or rdma.", show_default="tcp")]
DeviceName = Annotated[Optional[str], typer.Option("--device-name", envvar="MOONCAKE_AUDIT_DEVICE_NAME",
                                                  help="RDMA device name(s).")]
LocalHostname = Annotated[Optional[str], typer.Option("--local-hostname", envvar="MOONCAKE_AUDIT_LOCAL_HOSTNAME",
                                                     help="This host's address for transfers.",
                                                     show_default="the address that routes to the master")]
Config = Annotated[Optional[Path], typer.Option("--config", envvar="MOONCAKE_CONFIG_PATH",
                                               help="Mooncake JSON config, as vLLM's connector reads it.")]
# Which keys, how
Prefix = Annotated[str, typer.Option("--prefix", envvar="MOONCAKE_AUDIT_PREFIX", help="Only keys starting with this.")]
Match = Annotated[Optional[str], typer.Option("--match", envvar="MOONCAKE_AUDIT_MATCH",
                                             help="Only keys matching this regular expression (search).")]
BufferMb = Annotated[int, typer.Option("--buffer-mb", envvar="MOONCAKE_AUDIT_BUFFER_MB", min=1,
                                      help="Registered read buffer, MiB (two halves, double-buffered).")]
Device = Annotated[str, typer.Option("--device", envvar="MOONCAKE_AUDIT_DEVICE",
                                    help="Where values land: auto, cpu or cuda.")]
Checker = Annotated[Optional[str], typer.Option("--checker", envvar="MOONCAKE_AUDIT_CHECKER",
                                               help="numpy or triton.", show_default="numpy on cpu, triton on cuda")]
VerifyWriterChecksum = Annotated[bool, typer.Option(
    "--verify-writer-checksum", envvar="MOONCAKE_AUDIT_VERIFY_WRITER_CHECKSUM",
    help="Read with Mooncake's checksum verification on (MOONCAKE_STORE_CHECKSUM=1): a value whose writer "
         "stored a CRC-64 that its bytes no longer match is CHECKSUM_MISMATCH. Lease reads only.")]
# Layouts and block tables
ModelConfig = Annotated[Optional[list[Path]], typer.Option(
    "--model-config", envvar="MOONCAKE_AUDIT_MODEL_CONFIG",
    help="HuggingFace config.json (or model directory) whose layout the values follow. Repeatable.")]
ModelName = Annotated[Optional[str], typer.Option(
    "--model", help="Model name as it appears in keys.", show_default="the config's directory name")]
TpSize = Annotated[Optional[int], typer.Option(
    "--tensor-parallel-size", "-tp", "--tp-size", envvar="MOONCAKE_AUDIT_TP_SIZE", min=1,
    help="vLLM --tensor-parallel-size of the producer.", show_default="fitted to the sizes (1 first)")]
ModelDtype = Annotated[Optional[str], typer.Option(
    "--dtype", envvar="MOONCAKE_AUDIT_DTYPE",
    help="vLLM --dtype of the producer (auto, bfloat16, float16, float32).", show_default="auto")]
StateDtype = Annotated[Optional[str], typer.Option(
    "--mamba-cache-dtype", "--state-dtype", envvar="MOONCAKE_AUDIT_STATE_DTYPE",
    help="vLLM --mamba-cache-dtype: the conv state dtype.", show_default="auto")]
SsmDtype = Annotated[Optional[str], typer.Option(
    "--mamba-ssm-cache-dtype", "--ssm-dtype", envvar="MOONCAKE_AUDIT_SSM_DTYPE",
    help="vLLM --mamba-ssm-cache-dtype: the ssm state dtype.", show_default="auto")]
VllmConfig = Annotated[Optional[Path], typer.Option(
    "--vllm-config", envvar="MOONCAKE_AUDIT_VLLM_CONFIG",
    help="The YAML file `vllm serve --config` read: its dtype, block-size and TP flags (flags here win).")]
BlockSize = Annotated[Optional[int], typer.Option("--block-size", envvar="MOONCAKE_AUDIT_BLOCK_SIZE", min=1,
                                                 help="vLLM --block-size (hybrid models).")]
ConvLayout = Annotated[str, typer.Option("--conv-layout", help="Conv state layout: SD or DS.")]
KernelBlockSize = Annotated[Optional[int], typer.Option(
    "--kernel-block-size", envvar="MOONCAKE_AUDIT_KERNEL_BLOCK_SIZE", min=1,
    help="Attention backend's smallest kernel block: a hybrid model's block alignment "
         "(16 CUDA FlashAttention/FlashInfer, 32 CPU, 64 ROCm AITER, >= 128 MLA).", show_default="the platform's")]
KvCacheDtype = Annotated[Optional[str], typer.Option(
    "--kv-cache-dtype", envvar="MOONCAKE_AUDIT_KV_CACHE_DTYPE", help="Attention KV dtype (vLLM --kv-cache-dtype).",
    show_default="the model dtype")]
Platform = Annotated[Optional[str], typer.Option(
    "--platform", envvar="MOONCAKE_AUDIT_PLATFORM",
    help="The producer's platform: cpu (vLLM's CPU build keeps ssm states in float32 and defaults --block-size "
         "to 128), cuda (any NVIDIA GPU), or the GPU: sm90, sm100, sm120 (vLLM 0.33 aligns Qwen GDN blocks to 64 "
         "there).", show_default="any, fitted to the sizes")]
VllmVersion = Annotated[Optional[str], typer.Option(
    "--vllm-version", envvar="MOONCAKE_AUDIT_VLLM_VERSION",
    help="The producer's vLLM release, 0.32 or 0.33 (their rules give some models other bytes; the recorder's "
         "manifest names it).", show_default="either, fitted to the sizes")]
LayoutFile = Annotated[Optional[list[Path]], typer.Option("--layout", envvar="MOONCAKE_AUDIT_LAYOUT",
                                                          help="Explicit JSON layout file. Repeatable.")]
LayoutForAll = Annotated[bool, typer.Option("--layout-for-all",
                                            help="Apply the layouts to every vLLM key, whatever its model name.")]
BlockTablesOpt = Annotated[Optional[list[Path]], typer.Option(
    "--block-tables", envvar="MOONCAKE_AUDIT_BLOCK_TABLES",
    help="Producer block-table JSONL file or directory. Repeatable.")]
Lenient = Annotated[bool, typer.Option("--lenient", help="Skip (and count) malformed block-table lines.")]
# Output
Format = Annotated[str, typer.Option("--format", envvar="MOONCAKE_AUDIT_FORMAT",
                                    help="Report format: human, json or jsonl.")]
Output = Annotated[Optional[Path], typer.Option("--output", "-o", envvar="MOONCAKE_AUDIT_OUTPUT",
                                               help="Write the report here (atomically) instead of stdout.")]
All = Annotated[bool, typer.Option("--all", help="Every key's record (with its regions), not only findings.")]
ShowProgress = Annotated[Optional[bool], typer.Option("--progress/--no-progress", envvar="MOONCAKE_AUDIT_PROGRESS",
                                                     help="Progress on stderr.", show_default="on a terminal")]
Verbose = Annotated[bool, typer.Option("--verbose", help="At the end, the seconds of each phase of the whole "
                                                         "process on stderr (start-up, listing, reading, ...).")]


# Cron, resumption, evidence
ReadMode = Annotated[str, typer.Option("--read-mode", envvar="MOONCAKE_AUDIT_READ_MODE",
                                      help="lease (batch_get_into) or peek (lease-free raw reads of every replica).")]
Sample = Annotated[Optional[str], typer.Option("--sample", envvar="MOONCAKE_AUDIT_SAMPLE",
                                               help="Read N keys, or a fraction (0.05) of them, chosen by --seed.")]
Seed = Annotated[int, typer.Option("--seed", envvar="MOONCAKE_AUDIT_SEED", help="Sampling seed.")]
StateDirOpt = Annotated[Optional[Path], typer.Option("--state-dir", envvar="MOONCAKE_AUDIT_STATE_DIR",
                                                     help="Lock against overlapping runs; remembers keys seen, "
                                                          "so a sampled run also reads every new key.")]
Deadline = Annotated[Optional[float], typer.Option("--deadline", envvar="MOONCAKE_AUDIT_DEADLINE", min=0.001,
                                                   help="Stop cleanly after this many seconds.")]
MaxBandwidth = Annotated[Optional[float], typer.Option("--max-bandwidth", envvar="MOONCAKE_AUDIT_MAX_BANDWIDTH",
                                                       min=1, help="Read at most this many bytes per second.")]
CheckpointOpt = Annotated[Optional[Path], typer.Option("--checkpoint", envvar="MOONCAKE_AUDIT_CHECKPOINT",
                                                       help="Record progress here (JSONL), for --resume.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the scan recorded in --checkpoint.")]
PromFile = Annotated[Optional[Path], typer.Option("--prom-file", envvar="MOONCAKE_AUDIT_PROM_FILE",
                                                  help="node_exporter textfile to write (atomically).")]
EvidenceDir = Annotated[Optional[Path], typer.Option("--evidence", envvar="MOONCAKE_AUDIT_EVIDENCE",
                                                     help="Save flagged keys' bytes and a JSON sidecar here (0700).")]
RayAddress = Annotated[Optional[str], typer.Option(
    "--ray", envvar="MOONCAKE_AUDIT_RAY", metavar="ADDRESS",
    help="Read on a Ray cluster, one task per holder shard: auto, local, ray://HOST:PORT or a GCS HOST:PORT.")]
ShardMb = Annotated[int, typer.Option("--shard-mb", envvar="MOONCAKE_AUDIT_SHARD_MB", min=1,
                                      help="With --ray: MiB of values per Ray task.")]
FailOn = Annotated[str, typer.Option("--fail-on", envvar="MOONCAKE_AUDIT_FAIL_ON",
                                    help="Exit 1 on findings of this severity or worse: error, or warning "
                                         "(docs/verdicts.md#severity).")]
Pushgateway = Annotated[Optional[str], typer.Option("--pushgateway", envvar="MOONCAKE_AUDIT_PUSHGATEWAY",
                                                    help="Prometheus Pushgateway URL.")]
# Other tenants (docs/coverage.md)
TenantOpt = Annotated[Optional[list[str]], typer.Option(
    "--tenant", metavar="NAME", help="Also audit this Mooncake tenant's keys (or all tenants), named by key "
                                     "sources, read through a client of that tenant (lease reads). Repeatable.")]
KeysOpt = Annotated[Optional[list[Path]], typer.Option(
    "--keys", metavar="FILE", help="A key source for --tenant: a key list (one per line), a JSON/JSONL report "
                                   "or a snapshot. The recorder's --block-tables name keys too. Repeatable.")]


# Option groups, each declared once by a signature and given to every command that takes it (`_takes`).
def _connection_options(master: Master = None, metadata: Metadata = None, admin: Admin = None,
                        protocol: Protocol = None, device_name: DeviceName = None,
                        local_hostname: LocalHostname = None, config: Config = None) -> None:
    """The cluster to audit."""


def _key_options(prefix: Prefix = "", match: Match = None) -> None:
    """Which keys."""


def _read_options(buffer_mb: BufferMb = 256, device: Device = "auto", checker: Checker = None,
                  verify_writer_checksum: VerifyWriterChecksum = False) -> None:
    """Where values land and what checks them."""


def _model_options(model_config: ModelConfig = None, model: ModelName = None, tp_size: TpSize = None,
                   dtype: ModelDtype = None, state_dtype: StateDtype = None, ssm_dtype: SsmDtype = None,
                   block_size: BlockSize = None, conv_layout: ConvLayout = "SD", layout: LayoutFile = None,
                   layout_for_all: LayoutForAll = False, kernel_block_size: KernelBlockSize = None,
                   kv_cache_dtype: KvCacheDtype = None, platform: Platform = None,
                   vllm_config: VllmConfig = None, vllm_version: VllmVersion = None) -> None:
    """The layout values follow."""


def _block_table_options(block_tables: BlockTablesOpt = None, lenient: Lenient = False) -> None:
    """The producer's block tables."""


def _report_options(fmt: Format = "human", output: Output = None, include_all: All = False) -> None:
    """The report."""


def _progress_option(progress: ShowProgress = None) -> None:
    """Progress on stderr."""


def _scale_options(ray: RayAddress = None, shard_mb: ShardMb = 1024) -> None:
    """Scale out on Ray (docs/scale-out.md)."""


def _tenant_options(tenants: TenantOpt = None, key_files: KeysOpt = None) -> None:
    """Other tenants' keys, which the admin listing cannot show."""


def _declared(*groups) -> list[inspect.Parameter]:
    return [parameter for group in groups for parameter in inspect.signature(group, eval_str=True).parameters.values()]


def _takes(*groups, after=()):
    """A command's options: its own positional parameters, the `groups`, its own keyword-only
    parameters, then the `after` groups, in that order on --help. The command receives the groups'
    values in `**options`; typer reads the signature built here."""
    def decorate(command):
        own = inspect.signature(command, eval_str=True).parameters.values()
        leading = [p for p in own if p.kind is p.POSITIONAL_OR_KEYWORD]
        trailing = [p.replace(kind=p.POSITIONAL_OR_KEYWORD) for p in own if p.kind is p.KEYWORD_ONLY]
        command.__signature__ = inspect.Signature(leading + _declared(*groups) + trailing + _declared(*after))
        return command
    return decorate


def _pick(options: dict, *groups) -> dict:
    """The values of `groups`, taken out of a command's `options`."""
    return {p.name: options.pop(p.name) for p in _declared(*groups) if p.name in options}


def fail(message: str, code: int = 2) -> typer.Exit:
    """One line on stderr, no traceback."""
    typer.echo(f"mooncake-audit: error: {printable(message, 400)}", err=True)
    return typer.Exit(code)


def _check_choice(name: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise fail(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def _settings(master, metadata, admin, protocol, device_name, local_hostname, config) -> Settings:
    _check_choice("--protocol", protocol, ("tcp", "rdma"))
    return Settings.resolve(master=master, metadata=metadata, admin=admin, protocol=protocol,
                            device_name=device_name, local_hostname=local_hostname, config=config)


def _serve_flags(tp_size=None, dtype=None, state_dtype=None, ssm_dtype=None, block_size=None, kv_cache_dtype=None,
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


def _layouts(model_config, model, conv_layout, layout, kernel_block_size=None, platform=None, vllm_version=None,
             **flags):
    from audit.judge.plan import load_layouts
    from audit.layouts.versions import PLATFORMS

    _check_choice("--conv-layout", conv_layout, ("SD", "DS"))
    _check_choice("--platform", platform, PLATFORMS)
    return load_layouts(model_configs=model_config or (), layout_files=layout or (), model_name=model,
                        conv_layout=conv_layout, kernel_block_size=kernel_block_size, platform=platform,
                        vllm_version=_vllm_version(vllm_version), **_serve_flags(**flags))


def _plan(model_config, model, conv_layout, layout, layout_for_all, block_tables=None, lenient=False,
          include_all=False, **layout_options):
    from audit.blocktables import read_block_tables
    from audit.judge.plan import CheckPlan

    layouts = _layouts(model_config, model, conv_layout, layout, **layout_options)
    tables = read_block_tables(block_tables, lenient=lenient) if block_tables else None
    plan = CheckPlan(layouts=layouts, layout_for_all=layout_for_all, tables=tables, keep_regions=include_all)
    if block_tables:  # the recorder's manifests beside its records: the producer's own layouts
        plan.use_manifests(block_tables)
    return plan


def _scan_report(options: dict, include_all: bool, progress, sink, phases=None, **scan_options):
    """The pipeline every scanning command shares: the connection, model and block-table options in
    `options`, the scan's own in `scan_options`; report out (AuditError on failure). `phases`
    (--verbose): an audit.run.phases.Phases the run adds its seconds to."""
    planning = _time.perf_counter()
    from audit.run.device import resolve_placement
    from audit.run.orchestrator import ScanOptions, run_scan
    from audit.sources.selection import parse_sample

    scan_options["placement"] = resolve_placement(scan_options.pop("device", "cpu"), scan_options.pop("checker", None),
                                                  scan_options.get("read_mode", "lease"))
    scan_options["sample"] = parse_sample(scan_options.get("sample"))
    settings = _settings(**_pick(options, _connection_options))
    plan = _plan(**_pick(options, _model_options, _block_table_options), include_all=include_all)
    tenants = {name: tuple(value or ()) for name, value in _pick(options, _tenant_options).items()}
    if phases is not None:
        phases.add("layouts, block tables, scan imports", _time.perf_counter() - planning)
    return run_scan(settings, ScanOptions(plan=plan, **scan_options, **_pick(options, _scale_options), **tenants),
                    sink(), ScanProgress(progress), phases=phases)


def _run(options: dict, verbose: bool = False, **scan_options):
    """The body `scan` and `check` share: run, exit with the report's code (and with --verbose, the
    seconds of each phase on stderr)."""
    phases = None
    if verbose:
        from audit.run.phases import Phases

        phases = Phases(cli_started=_STARTED)
    report_options = _pick(options, _report_options, _progress_option)
    fmt, output, include_all = report_options["fmt"], report_options["output"], report_options["include_all"]
    _check_choice("--format", fmt, FORMATS)
    _check_choice("--read-mode", scan_options.get("read_mode"), ("lease", "peek"))
    _check_choice("--fail-on", scan_options.get("fail_on"), ("error", "warning"))
    if scan_options.get("resume") and scan_options.get("checkpoint") is None:
        raise fail("--resume needs --checkpoint PATH")
    try:
        report = _scan_report(options, include_all, report_options["progress"],
                              lambda: make_sink(fmt, output, include_all=include_all), phases=phases,
                              **_pick(options, _key_options, _read_options), **scan_options)
    except AuditError as error:
        raise fail(str(error)) from None
    finally:
        if phases is not None:
            typer.echo("\n".join(f"phase: {line}" for line in phases.lines()), err=True)
    raise typer.Exit(report.exit_code)


SCANNING = (_connection_options, _key_options, _tenant_options, _read_options, _model_options, _block_table_options,
            _scale_options)


@app.command()
@_takes(*SCANNING, after=(_report_options, _progress_option))
def scan(*, checkpoint: CheckpointOpt = None, resume: Resume = False, evidence: EvidenceDir = None,
         read_mode: ReadMode = "lease", fail_on: FailOn = "error", verbose: Verbose = False, **options) -> None:
    """List every key, read every value, report digests, zero values, shared content and, with a
    layout or block tables, the vLLM #53084 verdicts.

    Exit codes: 0 clean (warnings allowed unless --fail-on warning), 1 errors, 2 could not run, 3 incomplete.
    """
    _run(options, verbose, checkpoint=checkpoint, resume=resume, evidence_dir=evidence, read_mode=read_mode,
         fail_on=fail_on)


@app.command()
@_takes(*SCANNING, after=(_report_options, _progress_option))
def check(*, sample: Sample = None, seed: Seed = 0, state_dir: StateDirOpt = None, deadline: Deadline = None,
          max_bandwidth: MaxBandwidth = None, checkpoint: CheckpointOpt = None, resume: Resume = False,
          prom_file: PromFile = None, pushgateway: Pushgateway = None, evidence: EvidenceDir = None,
          read_mode: ReadMode = "peek", fail_on: FailOn = "error", verbose: Verbose = False, **options) -> None:
    """The scan tuned for cron: sampling, a deadline, a bandwidth limit, a lock, metrics.

    Exit codes: 0 clean (warnings allowed unless --fail-on warning), 1 errors, 2 could not run (or
    another check holds the lock), 3 incomplete.
    """
    _run(options, verbose, sample=sample, seed=seed, state_dir=state_dir, deadline_s=deadline,
         max_bandwidth=max_bandwidth, checkpoint=checkpoint, resume=resume, prom_file=prom_file, pushgateway=pushgateway, evidence_dir=evidence,
         read_mode=read_mode, fail_on=fail_on)


@app.command()
@_takes(_connection_options, _key_options, _read_options, _model_options, _block_table_options)
def watch(*, state_dir: Annotated[Optional[Path], typer.Option(
              "--state-dir", envvar="MOONCAKE_AUDIT_STATE_DIR",
              help="Its state (SQLite), findings.jsonl and lock. Required.")] = None,
          interval: Annotated[float, typer.Option(
              "--interval", envvar="MOONCAKE_AUDIT_INTERVAL", min=0.1,
              help="Seconds between listings (new keys first); stretched while the listing takes over a "
                   "tenth of it.")] = 5.0,
          period: Annotated[str, typer.Option(
              "--period", envvar="MOONCAKE_AUDIT_PERIOD", help="Re-read every key at least this often "
                                                               "(3600, 30m, 24h, 7d), oldest first.")] = "24h",
          window: Annotated[Optional[str], typer.Option(
              "--window", envvar="MOONCAKE_AUDIT_WINDOW", metavar="HH:MM-HH:MM",
              help="Re-read old keys only inside this local-time window (new keys are read at once).")] = None,
          listen: Annotated[str, typer.Option(
              "--listen", envvar="MOONCAKE_AUDIT_LISTEN", help="HOST:PORT for /metrics and /healthz.")]
          = "127.0.0.1:9310",
          max_bandwidth: MaxBandwidth = None, read_mode: ReadMode = "peek", **options) -> None:
    """Scrub continuously: every new key within seconds of its listing, every key once per period.

    Runs until SIGTERM or SIGINT (exit 0, state flushed); exit 2 if it cannot start.
    """
    from audit.run.device import resolve_placement
    from audit.run.options import ScanOptions
    from audit.run.watch import Watcher, WatchOptions, parse_duration, parse_window

    _check_choice("--read-mode", read_mode, ("lease", "peek"))
    if state_dir is None:
        raise fail("give --state-dir DIR: where watch keeps its state")
    try:
        settings = _settings(**_pick(options, _connection_options))
        block_options = _pick(dict(options), _block_table_options)
        plan = _plan(**_pick(options, _model_options, _block_table_options))
        read = _pick(options, _read_options)
        placement = resolve_placement(read.pop("device"), read.pop("checker"), read_mode)
        scan_options = ScanOptions(plan=plan, placement=placement, read_mode=read_mode, max_bandwidth=max_bandwidth,
                                   **_pick(options, _key_options), **read)
        watch_options = WatchOptions(state_dir=state_dir, interval_s=interval, period_s=parse_duration(period),
                                     window=None if window is None else parse_window(window), listen=listen,
                                     block_tables=tuple(block_options["block_tables"] or ()),
                                     lenient=block_options["lenient"], scan=scan_options)
        stopped_by = Watcher(settings, watch_options, log=lambda line: typer.echo(printable(line, 400), err=True)).run()
    except AuditError as error:
        raise fail(str(error)) from None
    typer.echo(f"watch: stopped ({stopped_by}); state in {printable(str(state_dir))}", err=True)
    raise typer.Exit(0)


@app.command()
@_takes(*SCANNING, after=(_progress_option,))
def snapshot(output: Annotated[Path, typer.Option("--output", "-o", help="The snapshot file (SQLite) to write.")],
             **options) -> None:
    """Digests of every key and region, with parsed fields, sizes and time, streamed into SQLite."""
    from audit.forensics.snapshot import SnapshotSink

    progress = options.pop("progress")
    try:
        with SnapshotSink(output) as sink:
            report = _scan_report(options, True, progress, lambda: sink, **_pick(options, _key_options, _read_options))
    except AuditError as error:
        raise fail(str(error)) from None
    typer.echo(f"snapshot of {report.summary['keys_scanned']} keys written to {printable(str(output))}", err=True)
    raise typer.Exit(report.exit_code)


@app.command()
@_takes(_connection_options, _model_options)
def diff(
    a: Annotated[Path, typer.Argument(help="A snapshot (the earlier one).")],
    b: Annotated[Optional[Path], typer.Argument(help="A later snapshot; omit it with --live.")] = None,
    live: Annotated[bool, typer.Option("--live", help="Compare A with the cluster as it is now.")] = False, *,
    fmt: Annotated[str, typer.Option("--format", help="human or json")] = "human", output: Output = None,
    **options,
) -> None:
    """Keys added, removed and changed between two snapshots, or a snapshot and the live cluster.

    Exit codes: 0 no difference is a finding, 1 differences that are findings, 2 could not run,
    3 a snapshot is incomplete or sampled (some differences may be keys it never read).
    """
    import tempfile

    from rich.console import Console

    from audit.forensics.diff import diff_document, diff_snapshots, print_diff
    from audit.forensics.snapshot import SnapshotSink, open_snapshot
    from audit.report.output import ReportOutput

    _check_choice("--format", fmt, ("human", "json"))
    if (b is None) == (not live):
        raise fail("give two snapshots, or one snapshot and --live")
    try:
        with tempfile.TemporaryDirectory(prefix="mooncake-audit-diff-") as work:
            if live:
                with open_snapshot(a) as earlier:
                    filters = (earlier.meta.get("summary") or {}).get("filters") or {}
                b = Path(work) / "live.db"
                with SnapshotSink(b) as sink:
                    _scan_report(options, True, False, lambda: sink, prefix=filters.get("prefix") or "",
                                 match=filters.get("match"), device="cpu", read_mode="peek")
            result = diff_snapshots(a, b)
            out = ReportOutput(output)
            if fmt == "json":
                out.write(json.dumps(diff_document(result)) + "\n")
            else:
                print_diff(result, Console(file=out.stream, width=160, highlight=False,
                                           force_terminal=None if output is None else False))
            out.close()
    except AuditError as error:
        raise fail(str(error)) from None
    raise typer.Exit(result.exit_code)


@app.command()
@_takes(_connection_options, _key_options, _model_options, _block_table_options)
def purge(
    report_path: Annotated[Optional[Path], typer.Argument(
        metavar="[REPORT]", help="A JSON/JSONL report whose findings to remove; omit it to scan the live cluster.")] = None,
    verdict: Annotated[Optional[list[str]], typer.Option("--verdict", help="Only keys with this verdict. Repeatable.")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Really remove (default: a dry run that lists what would go).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Remove keys a reader holds a lease on, without waiting.")] = False,
    evidence: Annotated[Optional[Path], typer.Option("--evidence", help="Where the removed keys' bytes are saved first.",
                                                     show_default="./mooncake-audit-evidence-<time>")] = None,
    log: Annotated[Optional[Path], typer.Option("--log", help="Append every outcome here (JSONL).",
                                                show_default="purge-log.jsonl beside the evidence")] = None,
    **options,
) -> None:
    """Remove flagged keys: dry run unless --yes; evidence saved first; keys changed since the scan
    are never removed. Exit codes: 0 done, 2 could not run, 3 some keys were not removed."""
    from datetime import datetime, timezone

    from audit.forensics.purge import purge as run_purge
    from audit.forensics.purge import targets_from_report, write_log
    from audit.report.json_report import JsonSink

    if report_path is None and not verdict:
        raise fail("give a REPORT, or --verdict V to purge what a scan of the live cluster flags")
    connection = _pick(dict(options), _connection_options)
    try:
        with tempfile.TemporaryDirectory(prefix="mooncake-audit-purge-") as work:
            if report_path is None:
                report_path = Path(work) / "scan.json"
                _scan_report(options, False, None, lambda: JsonSink(report_path), **_pick(options, _key_options),
                             device="cpu", read_mode="peek")  # no leases: the removals that follow are not refused
            targets = targets_from_report(report_path, verdict or ())
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            evidence = evidence or Path(f"mooncake-audit-evidence-{stamp}")
            log = log or evidence / "purge-log.jsonl"
            outcomes = run_purge(_settings(**connection), targets, execute=yes, force=force,
                                 evidence_dir=evidence if yes else None,
                                 on_outcome=lambda o: typer.echo(f"{o.action:12} {printable(o.key)}"))
            if yes:
                write_log(log, outcomes)
    except AuditError as error:
        raise fail(str(error)) from None
    counts = {action: sum(1 for o in outcomes if o.action == action) for action in sorted({o.action for o in outcomes})}
    summary = ", ".join(f"{action} {n}" for action, n in counts.items()) or "nothing to purge"
    typer.echo(f"{'purge' if yes else 'dry run (add --yes to remove)'}: {summary}"
               + (f"; evidence in {printable(str(evidence))}, log {printable(str(log))}" if yes else ""), err=True)
    raise typer.Exit(0 if set(counts) <= {"would-remove", "removed", "gone"} else 3)


@app.command()
@_takes(_connection_options, _key_options, _model_options, _block_table_options, after=(_report_options,))
def verify(*, reference_prefix: Annotated[Optional[str], typer.Option(
               "--reference-prefix", envvar="MOONCAKE_AUDIT_REFERENCE_PREFIX",
               help="The reference producer's cache_prefix (its keys are '<prefix>@<model>@...'). Required.")] = None,
           rtol: Annotated[Optional[float], typer.Option(
               "--rtol", min=0.0, help="Largest relative L2 error of a region within tolerance.",
               show_default="0.01 (docs/verify.md)")] = None,
           min_cosine: Annotated[Optional[float], typer.Option(
               "--min-cosine", min=-1.0, max=1.0, help="Smallest cosine similarity of a region within tolerance.",
               show_default="0.999")] = None,
           sample: Sample = None, seed: Seed = 0,
           engine: Annotated[Optional[str], typer.Option(
               "--engine", metavar="PYTHON", help="A python with vLLM: run --prompts through it first, publishing "
                                                  "under --reference-prefix (needs --model-config MODEL_DIR).")] = None,
           prompts: Annotated[Optional[Path], typer.Option(
               "--prompts", help="JSONL, one prompt per line as token ids (for --engine).")] = None,
           engine_arg: Annotated[Optional[list[str]], typer.Option(
               "--engine-arg", metavar="NAME=JSON", help="One more vLLM LLM(...) argument for the reference "
                                                         "engine (dtype=\"float32\", block_size=16). Repeatable.")] = None,
           cut_at_boundaries: Annotated[bool, typer.Option(
               "--cut-at-boundaries/--no-cut-at-boundaries",
               help="With --engine: run every prompt cut one token after each block boundary too, so every "
                    "chunk of it has a reference key (cut at --block-size, else the producer's manifest in "
                    "--block-tables, else the engine's own block size).")] = True,
           **options) -> None:
    """Compare production values with a reference producer's recomputation of the same keys.

    Every production key with a twin under --reference-prefix (same model, ranks, group and chunk
    hash) is read with it and compared region by region: DIVERGENT_STATE beyond the tolerances.
    Keys without a twin are counted and named with the reason (summary 'verify'), not flagged. Exit codes: 0 clean,
    1 findings, 2 could not run, 3 incomplete.
    """
    from audit.sources.selection import parse_sample
    from audit.verify import Tolerances
    from audit.verify.compare import DEFAULT_MIN_COSINE, DEFAULT_RTOL
    from audit.verify.run import VerifyOptions
    from audit.verify.run import verify as run_verify

    report_options = _pick(options, _report_options)
    fmt, output, include_all = report_options["fmt"], report_options["output"], report_options["include_all"]
    _check_choice("--format", fmt, FORMATS)
    if not reference_prefix:
        raise fail("give --reference-prefix PREFIX: the reference producer's cache_prefix")
    if (engine is None) != (prompts is None):
        raise fail("--engine and --prompts go together")
    try:
        connection = _pick(options, _connection_options)
        settings = _settings(**connection)
        keys = _pick(options, _key_options)
        model_options = _pick(options, _model_options)
        plan = _plan(**model_options, **_pick(options, _block_table_options), include_all=include_all)
        reference_run = None
        if engine is not None:
            reference_run = _reference_engine(engine, prompts, engine_arg or [], reference_prefix, settings,
                                              connection["config"], model_options, plan,
                                              cut_at_boundaries=cut_at_boundaries)
        report = run_verify(settings, VerifyOptions(
            reference_prefix=reference_prefix, plan=plan, prefix=keys["prefix"], match=keys["match"],
            tolerances=Tolerances(DEFAULT_RTOL if rtol is None else rtol,
                                  DEFAULT_MIN_COSINE if min_cosine is None else min_cosine),
            sample=parse_sample(sample), seed=seed, reference_run=reference_run))
        sink = make_sink(fmt, output, include_all=include_all)
    except AuditError as error:
        raise fail(str(error)) from None
    for record in report.records:
        sink.record(record)
    sink.finish(report)
    summary = report.summary["verify"]
    typer.echo(f"verify: {summary['pairs_compared']} pair(s) compared, {summary['divergent']} divergent; "
               f"{summary['unverified']} production key(s) unverified (no twin), "
               f"{summary['reference_without_twin']} reference key(s) without a production twin", err=True)
    for reason, count in summary["unverified_reasons"].items():
        typer.echo(f"verify: {count} unverified: {reason}", err=True)
    raise typer.Exit(report.exit_code)


def _reference_engine(engine, prompts, engine_args, reference_prefix, settings, config, model_options, plan,
                      cut_at_boundaries=True) -> dict:
    """Run the reference producer (audit/verify/driver.py) with the operator's vLLM python."""
    from audit.verify.engine import cut_block_size, manifest_engine_block_size, read_prompts, run_reference
    from audit.verify.pairing import normalize_prefix

    model_dirs = [path for path in model_options.get("model_config") or () if Path(path).is_dir()]
    if len(model_dirs) != 1:
        raise AuditError("--engine needs exactly one --model-config MODEL_DIR (the weights production serves)")
    model_dir = model_dirs[0].resolve()
    if model_options.get("model") and model_options["model"] != model_dir.name:
        raise AuditError(f"vLLM names keys by the model directory's basename ({model_dir.name!r}), not "
                         f"--model {model_options['model']!r}: serve the reference from a directory of that name")
    flags = _serve_flags(**{name: model_options.get(name) for name in (
        "tp_size", "dtype", "state_dtype", "ssm_dtype", "block_size", "kv_cache_dtype", "vllm_config")})
    spec = {"model": str(model_dir), "prompts": read_prompts(prompts), "cache_prefix": normalize_prefix(reference_prefix),
            "tp": flags["tp_size"]}
    if any(layout.kind != "attention" for layout in plan.layouts):
        spec["mamba_cache_mode"] = "align"
    for name, option in (("block_size", "block_size"), ("dtype", "model_dtype"), ("mamba_cache_dtype", "state_dtype"),
                         ("mamba_ssm_cache_dtype", "ssm_dtype"), ("kv_cache_dtype", "kv_cache_dtype")):
        if flags.get(option):
            spec[name] = flags[option]
    if "block_size" not in spec and (produced := manifest_engine_block_size(plan.manifests, model_dir.name)):
        spec["block_size"] = produced  # the producer's, from its manifest: chunk hashes are per block
    spec["cut_at_boundaries"] = bool(cut_at_boundaries)
    if cut_at_boundaries:
        size, source = cut_block_size(flags.get("block_size"), plan.manifests, model_dir.name)
        if size:  # else the driver cuts at its engine's own block size
            spec.update(cut_block_size=size, cut_block_size_from=source)
    for item in engine_args:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise AuditError(f"--engine-arg {item!r}: give NAME=JSON")
        try:
            spec[name] = json.loads(value)
        except json.JSONDecodeError:
            spec[name] = value
    cuts = "" if not cut_at_boundaries else (f", each cut at every {spec['cut_block_size']} tokens"
                                              if spec.get("cut_block_size") else ", each cut at every block")
    typer.echo(f"verify: running {len(spec['prompts'])} prompt(s) through the reference engine{cuts} ...", err=True)
    return run_reference(engine, spec, settings, config)


@app.command("layout")
def layout_command(
    model_config: ModelConfig = None, model: ModelName = None, tp_size: TpSize = None, dtype: ModelDtype = None,
    state_dtype: StateDtype = None, ssm_dtype: SsmDtype = None, block_size: BlockSize = None,
    conv_layout: ConvLayout = "SD", layout: LayoutFile = None,
    fmt: Annotated[str, typer.Option("--format", help="human, or json (a layout file you can edit)")] = "human",
    kernel_block_size: KernelBlockSize = None, kv_cache_dtype: KvCacheDtype = None, platform: Platform = None,
    vllm_config: VllmConfig = None, block_tables: BlockTablesOpt = None, vllm_version: VllmVersion = None,
) -> None:
    """Print the byte layout of one key's value: segments, regions, offsets, bytes per key; for each
    vLLM release (and GPU) whose rules give other bytes, unless --vllm-version names one."""
    from audit.judge.plan import CheckPlan
    from audit.layouts import dump_layout_file
    from audit.report.views import print_layouts

    _check_choice("--format", fmt, ("human", "json"))
    if not model_config and not layout and not block_tables:
        raise fail("give --model-config PATH, --layout PATH or --block-tables DIR (the recorder's manifests)")
    try:
        layouts = _layouts(model_config, model, conv_layout, layout, kernel_block_size=kernel_block_size,
                           platform=platform, tp_size=tp_size, dtype=dtype, state_dtype=state_dtype,
                           ssm_dtype=ssm_dtype, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                           vllm_config=vllm_config, vllm_version=vllm_version)
        plan = CheckPlan(layouts=layouts)
        if block_tables:  # a manifest's layouts replace those of the models it covers
            plan.use_manifests(block_tables)
    except AuditError as error:
        raise fail(str(error)) from None
    if block_tables and plan.manifests is None and not plan.layouts:
        raise fail(f"no manifest-*.json in {', '.join(map(str, block_tables))}")
    releases = {} if block_tables else {request.name: request.releases() for request in plan.requests}
    if fmt == "json":
        typer.echo(json.dumps(dump_layout_file(plan.layouts), indent=1))
        for name, views in releases.items():
            for who, _ in views[1:]:
                typer.echo(f"layout: {name}: printed for {views[0][0]}; {who} registers others "
                           f"(give --vllm-version and --platform)", err=True)
        return
    shown = [layout for layout in plan.layouts if len(releases.get(layout.model, ())) < 2]
    print_layouts(shown, source_of=plan.manifests.source_of if plan.manifests else None)
    for name, views in releases.items():
        if len(views) < 2:
            continue
        for who, layouts_of_release in views:
            typer.echo(f"{name} as {who}:")
            if isinstance(layouts_of_release, str):
                typer.echo(f"  {layouts_of_release}")
            else:
                print_layouts(layouts_of_release)


@app.command()
def crossref(
    report: Annotated[Path, typer.Argument(help="A JSON (best with --all) or JSONL report of a scan.")],
    block_tables: BlockTablesOpt = None, lenient: Lenient = False,
    fmt: Format = "human", output: Output = None, include_all: All = False,
) -> None:
    """Add NULL_BACKED verdicts to a report written earlier, from producer block tables."""
    from audit.blocktables import read_block_tables
    from audit.judge.crossref import crossref_report

    _check_choice("--format", fmt, FORMATS)
    if not block_tables:
        raise fail("give --block-tables PATH (a JSONL file or a directory of them)")
    try:
        sink = make_sink(fmt, output, include_all=include_all)
        result = crossref_report(report, read_block_tables(block_tables, lenient=lenient))
    except AuditError as error:
        raise fail(str(error)) from None
    for record in result.records:
        sink.record(record)
    sink.finish(result)
    raise typer.Exit(result.exit_code)


app.command("impact")(impact_command)


@app.command()
def report(
    report_path: Annotated[Path, typer.Argument(metavar="REPORT", help="A JSON report (best written with --all).")],
    html: Annotated[Path, typer.Option("--html", help="Write one self-contained HTML page here.")],
) -> None:
    """Render a JSON report as one self-contained HTML page: summary, findings, heat map, charts."""
    from audit.report.html import write_html

    try:
        write_html(report_path, html)
    except AuditError as error:
        raise fail(str(error)) from None


@app.command()
@_takes(_connection_options, _model_options, _block_table_options)
def explain(key: Annotated[str, typer.Argument(help="The exact key name.")], *,
            fmt: Annotated[str, typer.Option("--format", help="human or json")] = "human", **options) -> None:
    """Everything about one key: per region zero, NaN/Inf, digest, min/max/mean, first bytes, and
    the block-table records that name it."""
    from audit.explain import explain_key
    from audit.report.views import print_explain

    _check_choice("--format", fmt, ("human", "json"))
    try:
        settings = _settings(**_pick(options, _connection_options))
        plan = _plan(**_pick(options, _model_options, _block_table_options), include_all=True)
        document = explain_key(settings, key, plan)
    except AuditError as error:
        raise fail(str(error)) from None
    if fmt == "json":
        typer.echo(json.dumps(document, indent=1))
    else:
        print_explain(document)
    findings = any(v not in ("VANISHED", "MOVED", "UNREACHABLE", "READ_ERROR") for v in document["verdicts"])
    raise typer.Exit(1 if findings else 0)


@app.command()
@_takes(_connection_options)
def simulate(
    out: Annotated[Path, typer.Option("--out", help="Directory for block tables, labels and layout.")], *,
    preset: Annotated[str, typer.Option("--preset", help="tiny-mamba1, tiny-mamba2 or mamba-130m.")] = "tiny-mamba1",
    model_config: Annotated[Optional[Path], typer.Option("--model-config", help="A mamba/mamba2 config.json instead of a preset.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Model name in keys.", show_default="the preset's")] = None,
    requests: Annotated[int, typer.Option(min=1)] = 2, tokens: Annotated[int, typer.Option(min=1)] = 3000,
    block_size: Annotated[int, typer.Option("--block-size", min=1)] = 128, tp_size: TpSize = 1,
    seed: Annotated[int, typer.Option(min=0)] = 0, cache_prefix: Annotated[str, typer.Option()] = "",
    state_dtype: StateDtype = "bfloat16", ssm_dtype: SsmDtype = None,
    null_boundary: Annotated[Optional[list[int]], typer.Option("--null-boundary", help="Token count that must be null-backed. Repeatable.")] = None,
    null_block_fill: Annotated[str, typer.Option(help="Bytes of block 0: zero or garbage.")] = "zero",
    inject_nan: Annotated[int, typer.Option(min=0)] = 0, truncate: Annotated[int, typer.Option(min=0)] = 0,
    zero_layers: Annotated[int, typer.Option(min=0)] = 0, tricky_good: Annotated[int, typer.Option(min=0)] = 0,
    **options,
) -> None:
    """Publish a labelled vLLM #53084 workload into a cluster (writes to the store: not for production)."""
    from audit.layouts import load_hf_config
    from audit.simulate import MAMBA_130M, TINY_MAMBA1, TINY_MAMBA2, SimulationOptions
    from audit.simulate import simulate as run_simulation

    presets = {"tiny-mamba1": TINY_MAMBA1, "tiny-mamba2": TINY_MAMBA2, "mamba-130m": MAMBA_130M}
    _check_choice("--preset", preset, tuple(presets))
    _check_choice("--null-block-fill", null_block_fill, ("zero", "garbage"))
    try:
        settings = _settings(**options)
        model_dict = load_hf_config(model_config) if model_config else presets[preset]
        name = model or (model_config.resolve().parent.name if model_config else
                         {"mamba-130m": "mamba-130m-hf"}.get(preset, preset))
        options = SimulationOptions(
            requests=requests, tokens=tokens, block_size=block_size, tp_size=tp_size, seed=seed,
            cache_prefix=cache_prefix, state_dtype=state_dtype, ssm_dtype=ssm_dtype,
            null_boundaries=tuple(null_boundary or ()), null_block_fill=null_block_fill, inject_nan=inject_nan,
            truncate=truncate, zero_layers=zero_layers, tricky_good=tricky_good)
        result = run_simulation(settings, model_config=model_dict, model=name, out_dir=out, options=options)
    except (AuditError, ValueError) as error:
        raise fail(str(error)) from None
    typer.echo(json.dumps({"keys": len(result.labels), "counts": result.counts,
                           "bytes_published": result.bytes_published,
                           "block_tables": str(result.block_tables_path), "labels": str(result.labels_path),
                           "layout": str(result.layout_path)}, indent=1))


@app.command()
def demo(
    fmt: Format = "human", output: Output = None, include_all: All = False, progress: ShowProgress = None,
) -> None:
    """Start an embedded local cluster, publish what vLLM with bug #53084 would, scan it, stop the cluster.

    Exit codes: 0 when the scan flagged exactly the keys the simulated producer made bad, 1 when it
    did not, 2 when the demo could not run.
    """
    from audit.demo import run_demo

    _check_choice("--format", fmt, FORMATS)
    try:
        outcome = run_demo(make_sink(fmt, output, include_all=include_all), ScanProgress(progress),
                           log=lambda line: typer.echo(line, err=True))
    except AuditError as error:
        raise fail(str(error)) from None
    raise typer.Exit(0 if outcome.exact else 1)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def _only_named_command(first: list[str]) -> None:
    """Keep only the command the command line names: typer builds every registered command's
    options when the app starts (about 40 ms for the 14 here), and a scan from cron runs one. The
    top-level help, `--version` and an unknown name still see every command."""
    from typer.main import get_command_name

    named = [info for info in app.registered_commands
             if first and (info.name or get_command_name(info.callback.__name__)) == first[0]]
    if named:
        app.registered_commands = named


def main() -> None:
    # Mooncake's C++ client logs every connection step at INFO on stderr; keep stderr for us.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    # SIGTERM ends a command as Ctrl-C does; scans stop between batches and write their report instead.
    signal.signal(signal.SIGTERM, _terminate)
    tune_for_scanning()
    try:
        _only_named_command(sys.argv[1:2])
        app()
    except KeyboardInterrupt:
        typer.echo("mooncake-audit: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
