"""The options several commands take: each declared once as an Annotated type, gathered into groups
that a command takes whole (`takes`) and reads back out of its `**options` (`pick`)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer

from audit.readers.offload_index import offload_directory

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
# Scanning: resumption, evidence, failure
ReadMode = Annotated[str, typer.Option("--read-mode", envvar="MOONCAKE_AUDIT_READ_MODE",
                                      help="lease (batch_get_into) or peek (lease-free raw reads of every replica).")]
HOLDER_HELP = ("DIR=ENDPOINT names the directory's holder (the offload RPC endpoint the master lists its disk "
               "copies at), which is otherwise learnt from the master.")
OffloadDir = Annotated[Optional[list[Path]], typer.Option(
    "--offload-dir", envvar="MOONCAKE_AUDIT_OFFLOAD_DIR", metavar="DIR[=ENDPOINT]",
    help="A holder's SSD offload directory on this host (its MOONCAKE_OFFLOAD_FILE_STORAGE_PATH): the disk copy "
         "of each key also in memory is read from its offload files (bucket or file-per-key backend) and compared (REPLICA_DIVERGENT), values there "
         "that no master lists are named, and with --read-mode peek the disk-only keys are read from the files, "
         "with no lease and no promotion. " + HOLDER_HELP + " Repeatable.")]
PurgedLog = Annotated[Optional[list[Path]], typer.Option(
    "--purged", envvar="MOONCAKE_AUDIT_PURGED", metavar="LOG",
    help="A purge's log (purge-log.jsonl): a key it removed that is listed again with the same bytes is "
         "PURGED_RETURNED (a restarted holder re-registered its disk copy). Repeatable.")]
Sample = Annotated[Optional[str], typer.Option("--sample", envvar="MOONCAKE_AUDIT_SAMPLE",
                                               help="Read N keys, or a fraction (0.05) of them, chosen by --seed.")]
Seed = Annotated[int, typer.Option("--seed", envvar="MOONCAKE_AUDIT_SEED", help="Sampling seed.")]
MaxBandwidth = Annotated[Optional[float], typer.Option("--max-bandwidth", envvar="MOONCAKE_AUDIT_MAX_BANDWIDTH",
                                                       min=1, help="Read at most this many bytes per second.")]
CheckpointOpt = Annotated[Optional[Path], typer.Option("--checkpoint", envvar="MOONCAKE_AUDIT_CHECKPOINT",
                                                       help="Record progress here (JSONL), for --resume.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the scan recorded in --checkpoint.")]
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
# Other tenants (docs/coverage.md)
TenantOpt = Annotated[Optional[list[str]], typer.Option(
    "--tenant", metavar="NAME", help="Also audit this Mooncake tenant's keys (or all tenants), named by key "
                                     "sources, read through a client of that tenant (lease reads). Repeatable.")]
KeysOpt = Annotated[Optional[list[Path]], typer.Option(
    "--keys", metavar="FILE", help="A key source for --tenant: a key list (one per line), a JSON/JSONL report "
                                   "or a snapshot. The recorder's --block-tables name keys too. Repeatable.")]


# Option groups, each declared once by a signature and given to every command that takes it (`takes`).
def connection_options(master: Master = None, metadata: Metadata = None, admin: Admin = None,
                       protocol: Protocol = None, device_name: DeviceName = None,
                       local_hostname: LocalHostname = None, config: Config = None) -> None:
    """The cluster to audit."""


def key_options(prefix: Prefix = "", match: Match = None) -> None:
    """Which keys."""


def read_options(buffer_mb: BufferMb = 256, device: Device = "auto", checker: Checker = None,
                 verify_writer_checksum: VerifyWriterChecksum = False) -> None:
    """Where values land and what checks them."""


def model_options(model_config: ModelConfig = None, model: ModelName = None, tp_size: TpSize = None,
                  dtype: ModelDtype = None, state_dtype: StateDtype = None, ssm_dtype: SsmDtype = None,
                  block_size: BlockSize = None, conv_layout: ConvLayout = "SD", layout: LayoutFile = None,
                  layout_for_all: LayoutForAll = False, kernel_block_size: KernelBlockSize = None,
                  kv_cache_dtype: KvCacheDtype = None, platform: Platform = None,
                  vllm_config: VllmConfig = None, vllm_version: VllmVersion = None) -> None:
    """The layout values follow."""


def block_table_options(block_tables: BlockTablesOpt = None, lenient: Lenient = False) -> None:
    """The producer's block tables."""


def report_options(fmt: Format = "human", output: Output = None, include_all: All = False) -> None:
    """The report."""


def progress_option(progress: ShowProgress = None) -> None:
    """Progress on stderr."""


def scale_options(ray: RayAddress = None, shard_mb: ShardMb = 1024) -> None:
    """Scale out on Ray (docs/scale-out.md)."""


def tenant_options(tenants: TenantOpt = None, key_files: KeysOpt = None) -> None:
    """Other tenants' keys, which the admin listing cannot show."""


SCANNING = (connection_options, key_options, tenant_options, read_options, model_options, block_table_options,
            scale_options)


def _declared(*groups) -> list[inspect.Parameter]:
    return [parameter for group in groups for parameter in inspect.signature(group, eval_str=True).parameters.values()]


def takes(*groups, after=()):
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


def pick(options: dict, *groups) -> dict:
    """The values of `groups`, taken out of a command's `options`."""
    return {p.name: options.pop(p.name) for p in _declared(*groups) if p.name in options}


def offload_directories(given) -> tuple:
    """`--offload-dir`'s values: each a path, or a path with its holder (`offload_directory`)."""
    return tuple(map(offload_directory, given or ()))
