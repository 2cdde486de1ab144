"""The command line: options, environment, config file, output formats, inert printing."""

from __future__ import annotations

import json

import jsonschema
import pytest

from audit.connection import Settings
from tests.helpers import report_schema, run_cli


def _one_line_error(result) -> str:
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mooncake-audit: error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_bad_format_and_bad_regex_exit_2_with_one_line(cli_args):
    assert "--format" in _one_line_error(run_cli("scan", *cli_args, "--format", "xml"))
    assert "--match" in _one_line_error(run_cli("scan", *cli_args, "--match", "(unclosed"))
    assert "--protocol" in _one_line_error(run_cli("scan", *cli_args, "--protocol", "udp"))


def test_settings_precedence_flags_then_config_then_defaults(tmp_path):
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master_server_address": "10.0.0.5:50051", "protocol": "rdma",
                                  "metadata_server": "http://10.0.0.5:8080/metadata", "device_name": "mlx5_0"}))
    from_file = Settings.resolve(config=config)
    assert (from_file.master, from_file.protocol, from_file.device_name) == ("10.0.0.5:50051", "rdma", "mlx5_0")
    assert from_file.admin == "http://10.0.0.5:9003"
    explicit = Settings.resolve(config=config, master="10.0.0.9:1234", protocol="tcp")
    assert explicit.master == "10.0.0.9:1234" and explicit.protocol == "tcp"
    assert explicit.admin == "http://10.0.0.9:9003"
    assert explicit.metadata == "http://10.0.0.5:8080/metadata"  # still from the file
    bare = Settings.resolve()
    assert bare.master == "127.0.0.1:50051" and bare.metadata == "http://127.0.0.1:8080/metadata"


def test_config_file_and_environment_reach_a_real_cluster(cluster, publisher, namespace, tmp_path):
    publisher.put(namespace + "via-config", b"\x01" * 100)
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master_server_address": cluster.master_address,
                                  "metadata_server": cluster.metadata_url, "protocol": "tcp",
                                  "local_hostname": "127.0.0.1"}))
    env = {"MOONCAKE_CONFIG_PATH": str(config), "MOONCAKE_AUDIT_ADMIN": cluster.admin_url,
           "MOONCAKE_AUDIT_PREFIX": namespace}
    from typer.testing import CliRunner

    from cli import app

    result = CliRunner().invoke(app, ["scan", "--format", "json", "--all", "--no-progress"], env=env)
    assert result.exit_code == 0, result.output
    assert [r["key"] for r in json.loads(result.stdout)["keys"]] == [namespace + "via-config"]


def test_malformed_config_is_a_clean_error(tmp_path):
    config = tmp_path / "broken.json"
    config.write_text("{not json")
    assert "not JSON" in _one_line_error(run_cli("scan", "--config", str(config)))
    assert "cannot read config" in _one_line_error(run_cli("scan", "--config", str(tmp_path / "missing.json")))


HOSTILE = ["\x1b[31mred-escape", "[red]markup[/]", "new\nline", "[link=http://x]click[/link]"]


def test_human_output_prints_hostile_names_inert(publisher, cli_args, namespace):
    for name in HOSTILE:
        publisher.put(namespace + name, bytes(512))  # all zero: each one is a finding in the table
    result = run_cli("scan", *cli_args, "--prefix", namespace, "--no-progress")
    assert result.exit_code == 1
    out = result.stdout
    assert "\x1b" not in out
    assert "\\x1b[31mred-escape" in out
    assert "[red]markup[/]" in out and "[link=http://x]click[/link]" in out
    assert "new\\nline" in out
    assert "FINDINGS: 4 key(s) flagged" in out


def test_jsonl_streams_one_line_per_key_then_summary(publisher, cli_args, namespace):
    for i in range(5):
        publisher.put(f"{namespace}k{i}", bytes([i]) * 300)  # k0 is all zero
    result = run_cli("scan", *cli_args, "--prefix", namespace, "--format", "jsonl", "--no-progress")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0] == {"type": "header", "schema": "mooncake-audit/report-jsonl", "version": 1}
    keys = [line for line in lines if line["type"] == "key"]
    assert sorted(line["key"] for line in keys) == [f"{namespace}k{i}" for i in range(5)]
    record_schema = {**report_schema()["$defs"]["record"], "$defs": report_schema()["$defs"]}
    for line in keys:
        jsonschema.validate({k: v for k, v in line.items() if k != "type"}, record_schema)
    assert lines[-1]["type"] == "summary" and lines[-1]["findings"] == 1 and lines[-1]["exit_code"] == 1
    assert result.exit_code == 1


@pytest.mark.parametrize("fmt", ["json", "jsonl", "human"])
def test_output_file_is_written_whole_and_stdout_stays_empty(publisher, cli_args, namespace, tmp_path, fmt):
    publisher.put(namespace + "x", b"\x03" * 64)
    target = tmp_path / f"report.{fmt}"
    result = run_cli("scan", *cli_args, "--prefix", namespace, "--format", fmt, "--output", str(target),
                     "--no-progress")
    assert result.exit_code == 0 and result.stdout == ""
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary file left behind
    text = target.read_text()
    if fmt == "json":
        jsonschema.validate(json.loads(text), report_schema())
    else:
        assert "CLEAN" in text or '"type": "summary"' in text


def test_progress_goes_to_stderr_only_when_asked(publisher, cli_args, namespace):
    publisher.put(namespace + "p", b"\x04" * 64)
    quiet = run_cli("scan", *cli_args, "--prefix", namespace, "--format", "json")
    assert quiet.stderr == ""
    shown = run_cli("scan", *cli_args, "--prefix", namespace, "--format", "json", "--progress")
    assert "keys" in shown.stderr
    json.loads(shown.stdout)  # stdout is still the report alone


def test_version():
    from audit import __version__

    result = run_cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"mooncake-audit {__version__}"


def test_a_command_line_builds_only_the_command_it_names():
    """The process entry keeps only the named command (typer builds every command's options at
    start-up); the top-level help still lists every command, an unknown name is still an error."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def run(*args: str) -> subprocess.CompletedProcess:
        code = ("import sys, cli; sys.argv = ['mooncake-audit', *sys.argv[1:]]; "
                "import atexit; atexit.register(lambda: print('COMMANDS', len(cli.app.registered_commands), "
                "file=sys.stderr)); cli.main()")
        return subprocess.run([sys.executable, "-c", code, *args], cwd=root, capture_output=True, text=True,
                              timeout=60)

    everything = run("--help")
    named = run("scan", "--help")
    unknown = run("no-such-command")
    assert everything.returncode == 0 and "│ scan" in everything.stdout and "│ impact" in everything.stdout
    total = int(everything.stderr.split("COMMANDS")[1])
    assert total >= 10
    assert named.returncode == 0 and "Usage: mooncake-audit scan [OPTIONS]" in named.stdout
    assert int(named.stderr.split("COMMANDS")[1]) == 1
    assert unknown.returncode == 2 and "No such command 'no-such-command'" in unknown.stderr
    assert int(unknown.stderr.split("COMMANDS")[1]) == total
